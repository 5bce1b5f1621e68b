"""Weight matching for permutation symmetries (Ainsworth et al. 2023, "Git Re-Basin").

One step: with every other symmetry held fixed, the permutation ``P`` of one axis group that
maximizes ``sum_(W, axis) <P W, W'>`` is a linear assignment on the correlation matrix
``S[a, b] = <W_a, W'_b>`` (slices of the parameters along the permuted axis).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from scipy.optimize import linear_sum_assignment

from lmc.symmetry import AxisPermutation, compute_dtype

#: Entries of a tensor converted to a wider dtype at once (64 MB of float32): an 8B model's
#: embedding is never copied whole in float32 or float64.
CHUNK_ENTRIES = 1 << 24


def squared_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """``sum((a - b) ** 2)``, the difference in the stored dtype and its square in float64, at most
    :data:`CHUNK_ENTRIES` entries at a time (no float64 copy of a large tensor)."""
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    return sum(float((x - y).double().pow(2).sum()) for x, y in zip(a.split(CHUNK_ENTRIES), b.split(CHUNK_ENTRIES)))


def axis_correlation(
    source: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor], permutation: AxisPermutation
) -> torch.Tensor:
    """``S[a, b] = sum over (parameter, axis) of <slice a of source, slice b of target>``, ``(size, size)``.

    Over the permutation's axes and units only (:meth:`~lmc.symmetry.AxisPermutation.span`): an axis
    ``k * size`` long holds ``k`` stacked copies, whose correlations add up, and the entries outside a
    sub-range are left out. Each product runs in :func:`~lmc.symmetry.compute_dtype` of the parameter's
    dtype, over at most :data:`CHUNK_ENTRIES` entries of each at a time, and the products add up in float64.
    """
    size = permutation.size
    correlation = torch.zeros(size, size, dtype=torch.float64)
    for name, axis in permutation.axes:
        units = slice(*permutation.span((name, axis), source[name].shape[axis]))
        a = source[name].detach().movedim(axis, 0)[units]
        b = target[name].detach().movedim(axis, 0)[units]
        copies = a.shape[0] // size
        a = a.reshape(copies, size, -1).transpose(0, 1).reshape(size, -1)
        b = b.reshape(copies, size, -1).transpose(0, 1).reshape(size, -1)
        dtype = compute_dtype(a.dtype)
        step = max(1, CHUNK_ENTRIES // size)
        for start in range(0, a.shape[1], step):
            piece_a, piece_b = a[:, start : start + step].to(dtype), b[:, start : start + step].to(dtype)
            correlation += (piece_a @ piece_b.T).double().cpu()
    return correlation


def best_permutation(correlation: torch.Tensor) -> torch.Tensor:
    """The permutation ``perm`` (``new[i] = old[perm[i]]``) maximizing ``sum_i S[perm[i], i]``."""
    rows, cols = linear_sum_assignment(correlation.numpy(), maximize=True)
    perm = torch.empty(len(rows), dtype=torch.long)
    perm[torch.as_tensor(cols)] = torch.as_tensor(rows)
    return perm
