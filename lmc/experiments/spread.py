"""The old home of the study's spreads and table cells, kept for the names scripts import from it:
the statistics are :mod:`lmc.experiments.stats.spread`'s, the cells :mod:`lmc.experiments.report.cells`'."""

from lmc.experiments.report.cells import cell, curve_alphas_text
from lmc.experiments.stats.spread import spread

__all__ = ["cell", "curve_alphas_text", "spread"]
