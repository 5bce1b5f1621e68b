"""Lightning layer: the experiment module (re-initialization strategies with freezing)."""

from lmc.training.module import LMCModule

__all__ = ["LMCModule"]
