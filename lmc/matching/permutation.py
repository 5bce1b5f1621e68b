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
    dtype, over at most :data:`CHUNK_ENTRIES` entries of each at a time, and each product is added into the
    float64 matrix a block of rows at a time, so that no temporary of the matrix's size is made beside it
    (the float64 matrix of an 8B model's 14,336 FFN units is 1.6 GB).
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
        step = max(1, CHUNK_ENTRIES // size)  # columns of a piece, and rows of a block of the product
        for start in range(0, a.shape[1], step):
            piece_a, piece_b = a[:, start : start + step].to(dtype), b[:, start : start + step].to(dtype)
            for row in range(0, size, step):
                correlation[row : row + step] += (piece_a[row : row + step] @ piece_b.T).cpu()
    return correlation


def best_permutation(correlation: torch.Tensor) -> torch.Tensor:
    """The permutation ``perm`` (``new[i] = old[perm[i]]``) maximizing ``sum_i S[perm[i], i]``.

    scipy's ``linear_sum_assignment(maximize=True)`` would negate a copy of ``S``, as large as it; instead a
    float64 contiguous CPU ``correlation`` is negated in place while scipy minimizes ``-S``, and negated back
    before this returns, even on an error: negation is exact, so the caller's matrix ends bit for bit as it
    was (no other thread may read it meanwhile). Any other ``correlation`` is negated in a float64 copy.

    Args:
        correlation: ``S`` ``(n, n)``, finite.

    Returns:
        ``perm`` ``(n,)``.
    """
    in_place = correlation.dtype == torch.float64 and correlation.device.type == "cpu" and correlation.is_contiguous()
    cost = correlation.neg_() if in_place else correlation.to("cpu", torch.float64, copy=True).neg_()
    try:
        rows, cols = linear_sum_assignment(cost.numpy())
    finally:
        if in_place:
            correlation.neg_()
    perm = torch.empty(len(rows), dtype=torch.long)
    perm[torch.as_tensor(cols)] = torch.as_tensor(rows)
    return perm
