"""Lightning layer: the experiment module (re-initialization strategies with freezing).

``LMCModule`` is imported on first use (lmc.lazy), so that ``lmc.training.cli`` (the help formatter
of every command) loads no torch: ``lmc COMMAND --help`` answers at once.
"""

from lmc.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {"module": ("LMCModule",)})

__all__ = ["LMCModule"]
