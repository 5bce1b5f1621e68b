"""The FFN units' scales in the coordinate descent (docs/spec.md, section 3, "Unit scales").

A gated unit scales by any ``a != 0``: its value branch's row (and bias) times ``a``, the down projection's column
over ``a``. With the permutation fixed, each unit's best ``a`` minimizes
``f(a) = A a^2 - 2 B a + D / a^2 - 2 C / a`` (``A = |u|^2``, ``B = <u, u_t>`` over the value branch's entries,
``C = <v, v_t>``, ``D = |v|^2`` over the down column's), a stationary point of which is a real root of
``A a^4 - B a^3 + C a - D``: the quartic is solved for every unit at once (the eigenvalues of its companion
matrix) and the root of least ``f`` kept. The sign part of the scales joins the units' assignment instead
(:func:`signed_parts`), as the residual stream's signs do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from lmc.symmetry import AxisPermutation
from lmc.symmetry.spec import FeedForwardSpec

SCALE_GAIN = 1e-6
"""A scale step that lowers the units' distance by less than this fraction of their squared norms changes nothing
(as :data:`~lmc.matching.descent.ROTATION_GAIN` for the rotations)."""


def signed_parts(feed_forward: FeedForwardSpec) -> tuple[AxisPermutation, AxisPermutation]:
    """The FFN's units over the entries a scale's sign flips (the value branch's and the down projection's), and
    over the others (the gate's), each as an :class:`AxisPermutation` whose correlation covers those entries only."""
    hidden, scales = feed_forward.hidden, feed_forward.scales
    moved = set(scales.scaled) | set(scales.inverse)
    copies = dict(scales.copies)
    flipped = dataclasses.replace(
        hidden,
        axes=tuple(axis for axis in hidden.axes if axis in moved),
        offsets=tuple((axis, copy * hidden.size) for axis, copy in copies.items()),
        signs="each",
        unsigned=(),
    )
    # A fused [gate | up] axis is in both: its other copy, the gate's, in the fixed part.
    fixed_axes = tuple(axis for axis in hidden.axes if axis not in moved or axis in copies)
    gates = tuple((axis, (1 - copy) * hidden.size) for axis, copy in copies.items())
    fixed = dataclasses.replace(hidden, axes=fixed_axes, offsets=gates, signs="none", unsigned=())
    return flipped, fixed


def _unit_products(
    first: Mapping[str, torch.Tensor], second: Mapping[str, torch.Tensor], permutation: AxisPermutation, copy: dict
) -> torch.Tensor:
    """``(size,)`` sums over each unit's entries on ``permutation``'s axes of ``first * second`` (float64); an axis in
    ``copy`` reads its one stacked copy."""
    size = permutation.size
    total = torch.zeros(size, dtype=torch.float64)
    for name, axis in permutation.axes:
        a, b = (tensors[name].detach().double().movedim(axis, 0) for tensors in (first, second))
        start, stop = permutation.span((name, axis), a.shape[0])
        if (name, axis) in copy:
            start, stop = start + copy[(name, axis)] * size, start + (copy[(name, axis)] + 1) * size
        product = (a[start:stop] * b[start:stop]).reshape((stop - start) // size, size, -1)
        total += product.sum(dim=(0, 2)).cpu()
    return total


def best_scales(
    source: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor], feed_forward: FeedForwardSpec
) -> tuple[torch.Tensor, float]:
    """Each unit's scale ``(size,)`` (float64) minimizing its distance to the target's unit in place, and the
    fraction of the units' squared norms by which it lowers their summed distance (0: the identity is best)."""
    hidden, scales = feed_forward.hidden, feed_forward.scales
    copy = dict(scales.copies)
    value = dataclasses.replace(hidden, axes=scales.scaled, offsets=(), signs="none", unsigned=())
    down = dataclasses.replace(hidden, axes=scales.inverse, offsets=(), signs="none", unsigned=())
    a2, b = _unit_products(source, source, value, copy), _unit_products(source, target, value, copy)
    d2, c = _unit_products(source, source, down, copy), _unit_products(source, target, down, copy)
    solvable = (a2 > 0) & (d2 > 0)
    safe = torch.where(solvable, a2, torch.ones_like(a2))
    companion = torch.zeros(hidden.size, 4, 4, dtype=torch.float64)
    companion[:, 0, 0], companion[:, 0, 2], companion[:, 0, 3] = b / safe, -c / safe, d2 / safe
    companion[:, 1, 0] = companion[:, 2, 1] = companion[:, 3, 2] = 1.0
    roots = torch.linalg.eigvals(companion)
    real = roots.real
    allowed = (roots.imag.abs() <= 1e-9 * (1 + real.abs())) & (real != 0)
    if scales.group == "positive":
        allowed &= real > 0

    def distance(x: torch.Tensor) -> torch.Tensor:  # f(a) up to the terms no scale changes
        return a2[:, None] * x**2 - 2 * b[:, None] * x + d2[:, None] / x**2 - 2 * c[:, None] / x

    candidates = torch.cat([torch.ones(hidden.size, 1, dtype=torch.float64), torch.where(allowed, real, 1.0)], 1)
    values = distance(candidates)
    best = values.argmin(dim=1)
    factors = torch.where(solvable, candidates.gather(1, best[:, None])[:, 0], torch.ones_like(a2))
    kept = distance(torch.ones(hidden.size, 1, dtype=torch.float64))[:, 0]
    gain = float((kept - distance(factors[:, None])[:, 0]).sum()) / max(float((a2 + d2).sum()), 1e-300)
    return factors, max(gain, 0.0)
