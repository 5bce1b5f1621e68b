"""lmc: weight-space symmetry and linear mode connectivity of Transformers."""

__version__ = "0.1.0"
