"""Lightning layer: the experiment module (re-initialization strategies with freezing).

``LMCModule`` is imported on first use, so that ``lmc.training.cli`` (the help formatter of every
command) loads no torch: ``lmc COMMAND --help`` answers at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lmc.training.module import LMCModule

__all__ = ["LMCModule"]


def __getattr__(name: str):
    if name == "LMCModule":
        from lmc.training.module import LMCModule

        return LMCModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
