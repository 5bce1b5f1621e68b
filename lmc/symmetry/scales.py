"""The scales of an FFN's hidden units: which exist, and their action on weights (docs/spec.md, section 2, "FFN unit
scales").

A gated unit computes ``act(x w_g) (x w_u)`` and writes it through ``w_d``: its value branch times ``a`` and its down
column over ``a`` keep the function for any ``a != 0``; a positively homogeneous activation allows ``a > 0`` on its
input. ``FeedForwardSpec.scales`` declares them per FFN; ``ModelTransform.feed_forward_scales`` carries an element.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from lmc.symmetry.spec import FeedForwardSpec

UnitScaleGroup = Literal["nonzero", "positive"]
"""The scales of an FFN's hidden units (docs/spec.md, section 2, "FFN unit scales"): any non-zero number (a gated
unit's value branch, ``act(x w_g) (a x w_u) (w_d / a)``) or a positive one (a positively homogeneous activation)."""


@dataclass(frozen=True)
class UnitScales:
    """Per-unit scales of an FFN: unit ``i``'s entries on :attr:`scaled` times ``a_i``, on :attr:`inverse` over it.

    Attributes:
        group: Which scales keep the function (:data:`UnitScaleGroup`).
        scaled: ``(parameter name, axis)`` pairs multiplied by ``a`` (the value branch's rows and bias).
        inverse: ``(parameter name, axis)`` pairs divided by ``a`` (the down projection's columns).
        copies: ``((parameter name, axis), copy)`` for a stacked axis of :attr:`scaled` (a fused
            ``[gate | up]``) whose one copy ``copy`` scales; the others keep their entries.
    """

    group: UnitScaleGroup
    scaled: tuple[tuple[str, int], ...]
    inverse: tuple[tuple[str, int], ...]
    copies: tuple[tuple[tuple[str, int], int], ...] = ()


@torch.no_grad()
def scale_units(
    parameters: Mapping[str, torch.Tensor], feed_forward: FeedForwardSpec, factors: torch.Tensor, partial: bool = False
) -> None:
    """Multiply each unit's entries on the FFN's scaled axes by ``factors`` ``(size,)`` and those on its inverse
    axes by ``1 / factors``, in place (with ``partial``, the tensors present), computed in float64 and stored in
    each parameter's dtype (docs/spec.md, section 2, "FFN unit scales")."""
    hidden, scales = feed_forward.hidden, feed_forward.scales
    if scales is None:
        raise ValueError(f"{hidden.name}: these units have no scale that keeps the function")
    if factors.shape != (hidden.size,):
        raise ValueError(f"{hidden.name}: the scales must have shape ({hidden.size},), got {tuple(factors.shape)}")
    copies = dict(scales.copies)
    for axes, power in ((scales.scaled, 1.0), (scales.inverse, -1.0)):
        for name, axis in axes:
            if partial and name not in parameters:
                continue
            parameter = parameters[name]
            length = parameter.shape[axis]
            start, stop = hidden.span((name, axis), length)
            factor = torch.ones(length, dtype=torch.float64)
            chosen = factors.double().cpu().pow(power)
            if (name, axis) in copies:
                first = start + copies[(name, axis)] * hidden.size
                factor[first : first + hidden.size] = chosen
            else:
                factor[start:stop] = chosen.repeat((stop - start) // hidden.size)
            shape = [1] * parameter.dim()
            shape[axis] = -1
            parameter.copy_((parameter.double() * factor.to(parameter.device).view(shape)).to(parameter.dtype))


def sample_scales(scales: UnitScales, size: int, generator: torch.Generator) -> torch.Tensor:
    """Random scales ``(size,)`` (float64) of the group: magnitudes ``exp(u)``, ``u`` uniform in ``[-1, 1]``, with
    random signs where the group allows them."""
    magnitude = torch.exp(2 * torch.rand(size, generator=generator, dtype=torch.float64) - 1)
    if scales.group == "positive":
        return magnitude
    return magnitude * (1.0 - 2.0 * torch.randint(2, (size,), generator=generator).double())
