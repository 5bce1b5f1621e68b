"""The one merge recipe of lmc: ``(1 - alpha) a + alpha b``, and the alphas it takes.

Used by the sweeps (:mod:`lmc.connectivity.interpolation`, which re-exports both names), the merges
that ``lmc align`` writes, and the streamed alignment's write pass.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from lmc.symmetry import compute_dtype


def check_alphas(alphas: Iterable[float], what: str = "alphas") -> list[float]:
    """``alphas`` without repeats, refused unless each lies in ``[0, 1]`` (``what`` names them in the error)."""
    alphas = [float(alpha) for alpha in alphas]
    bad = [alpha for alpha in alphas if not (math.isfinite(alpha) and 0 <= alpha <= 1)]
    if bad:
        raise ValueError(f"{what} must lie in [0, 1], got {bad}")
    return list(dict.fromkeys(alphas))


def interpolate(a: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
    """``(1 - alpha) a + alpha b`` in ``a``'s dtype: the one merge recipe of lmc (sweeps, merges, streams).

    Half-precision tensors are interpolated in float32 and rounded once; float32 and float64 in
    their own precision.
    """
    compute = compute_dtype(a.dtype)
    return torch.lerp(a.to(compute), b.to(compute), alpha).to(a.dtype)
