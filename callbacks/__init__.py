"""Lightning callbacks of lmc experiments."""

from callbacks.align_and_interpolate import AlignAndInterpolate

__all__ = ["AlignAndInterpolate"]
