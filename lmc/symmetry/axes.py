"""Every parameter axis explained: which group acts on it, or why none does (docs/spec.md, section 2).

A spec says where its groups act (the head slots of each attention layer, the FFN, task-head,
residual and token permutations) and, in ``SymmetrySpec.fixed_axes``, which axes no group acts on and why
(:data:`~lmc.symmetry.spec.FixedReason`). Four more reasons follow from the spec itself:

- ``constant``: every axis of an architectural constant (``SymmetrySpec.fixed``);
- ``head_gain``: the gain of a per-head norm on queries or keys (``AttentionSpec.query_norm``),
  shared by every head: the heads' permutation leaves it, and the Q/K sign flips commute with it;
- ``singleton``: an axis of length 1 (a class token's leading axes) has nothing to permute;
- ``scope``: under a scope narrower than the whole model, a parameter the scope does not
  re-initialize (frozen, equal in both models), or an axis that only groups outside the scope move,
  each of which also moves such a frozen parameter (the residual permutation moves the embeddings).

An axis with no explanation is a symmetry the spec does not know or a reason it does not state:
:func:`unexplained_axes` lists them, and every architecture's test asserts there are none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lmc.symmetry.spec import (
    AttentionSpec,
    AxisPermutation,
    Scope,
    SymmetrySpec,
    scope_blocks,
    scope_parameter_names,
)

Axis = tuple[str, int]
"""A parameter axis: ``(parameter name, axis)``."""

REASONS: dict[str, str] = {
    "inputs": "indexed by the input's own coordinates (image channels and pixels, token types)",
    "vocabulary": "indexed by token ids (embedding rows, the LM head's rows and biases)",
    "classes": "indexed by a task head's outputs (class or next-sentence logits)",
    "positions": "indexed by token positions (learned position tables)",
    "constant": "a constant of the architecture, or coordinates a constant pins (a sinusoidal table on the stream)",
    "head_gain": "a per-head norm's gain shared by every head: head permutations leave it, sign flips commute with it",
    "singleton": "one entry long: nothing to permute",
    "scope": "frozen by the scope, or moved only by groups that also move parameters the scope freezes",
}
"""Every reason an axis may have for being fixed, declared (``FixedReason``) or derived from the spec."""


@dataclass(frozen=True)
class AxisRole:
    """What explains one parameter axis under a scope: a group that acts on it, or a reason none does.

    Attributes:
        group: Name of the acting group (an attention layer's, an FFN's, a task head's,
            ``"residual"`` or the token permutation's), or ``None``.
        reason: Why no group of the scope acts on it, a key of :data:`REASONS`, or ``None``.
    """

    group: str | None = None
    reason: str | None = None


def _length(shapes: Mapping[str, Sequence[int]], axis: Axis) -> int:
    """The axis's length, 0 where the parameter or the axis does not exist."""
    name, index = axis
    shape = shapes.get(name, ())
    return shape[index] if 0 <= index < len(shape) else 0


def _head_axes(layer: AttentionSpec, shapes: Mapping[str, Sequence[int]]) -> set[Axis]:
    """The axes whose every entry lies in one of the layer's head slots (a fused ``qkv`` needs all three)."""
    heads = {role: layer.num_heads for role in ("query", "out", "query_bias", "query_gain")}
    heads |= {role: layer.num_kv_heads for role in ("key", "value", "key_bias", "value_bias", "key_gain")}
    covered: dict[Axis, set[int]] = {}
    for role, count in heads.items():
        slot = getattr(layer, role)
        if slot is None:
            continue
        step = slot.stride or layer.head_dim
        entries = {slot.offset + i * step + j for i in range(count) for j in range(layer.head_dim)}
        covered.setdefault((slot.parameter, slot.head_axis), set()).update(entries)
    return {axis for axis, entries in covered.items() if entries == set(range(_length(shapes, axis)))}


def _permuted_axes(permutation: AxisPermutation, shapes: Mapping[str, Sequence[int]]) -> set[Axis]:
    """The axes the permutation moves whole: ``k`` stacked copies of its ``size`` units, no entry left in place.

    An axis it moves in part (a sub-range, ``AxisPermutation.offsets``) is explained by what fixes the rest.
    """
    moved = set()
    for axis in permutation.axes:
        length = _length(shapes, axis)
        try:
            if permutation.span(axis, length) == (0, length):
                moved.add(axis)
        except ValueError:  # the units do not fit the axis: it stays unexplained
            continue
    return moved


def explain_axes(spec: SymmetrySpec, scope: Scope, shapes: Mapping[str, Sequence[int]]) -> dict[Axis, AxisRole]:
    """What explains each axis of the model's parameters under ``scope``; unexplained axes are absent.

    A group of the scope explains the axes it acts on; otherwise a reason the spec declares or
    implies does (module docstring, :data:`REASONS`).

    Args:
        spec: The model's spec.
        scope: The scope whose group acts.
        shapes: Every parameter of the model, name -> shape, in model order
            (``{name: p.shape for name, p in model.named_parameters()}``; a meta skeleton will do).

    Returns:
        ``(parameter, axis) -> AxisRole``, in the order of ``shapes``.

    Raises:
        ValueError: The spec declares fixed an axis the model does not have, or one a group moves.
    """
    attention, feed_forward, whole = scope_blocks(spec, scope)
    scoped = set(scope_parameter_names(spec, scope, shapes))
    groups: list[tuple[str, bool, set[Axis]]] = []  # (name, in the scope, axes it moves)
    for i, block in enumerate(spec.blocks):
        groups.append((block.attention.name, i in attention, _head_axes(block.attention, shapes)))
        if block.feed_forward is not None:
            hidden = block.feed_forward.hidden
            groups.append((hidden.name, i in feed_forward, _permuted_axes(hidden, shapes)))
    groups += [(head.name, whole, _permuted_axes(head, shapes)) for head in spec.task_heads]
    if spec.residual is not None:
        groups.append((spec.residual.name, whole, _permuted_axes(spec.residual, shapes)))
    if spec.tokens is not None:
        groups.append((spec.tokens.name, whole, _permuted_axes(spec.tokens, shapes)))

    declared = {axis: fixed.reason for fixed in spec.fixed_axes for axis in fixed.axes}
    declared |= {
        (gain, 0): "head_gain" for layer in spec.attention for gain in (layer.query_norm, layer.key_norm) if gain
    }
    declared |= {(name, i): "constant" for name in spec.fixed for i in range(len(shapes.get(name, ())))}
    for axis, reason in declared.items():
        if not _length(shapes, axis):
            raise ValueError(
                f"the spec declares axis {axis[1]} of {axis[0]} fixed ({reason}), but the model has no such axis"
            )
        if moving := [group for group, _, axes in groups if axis in axes]:
            raise ValueError(
                f"the spec declares axis {axis[1]} of {axis[0]} fixed ({reason}), but {moving[0]} moves it: "
                "an axis is either moved by a group or fixed, not both"
            )

    roles: dict[Axis, AxisRole] = {}
    for name, shape in shapes.items():
        for i, length in enumerate(shape):
            axis = (name, i)
            moving = [(group, inside, axes) for group, inside, axes in groups if axis in axes]
            acting = [group for group, inside, _ in moving if inside]
            if acting:
                roles[axis] = AxisRole(group=acting[0])
            elif axis in declared:
                roles[axis] = AxisRole(reason=declared[axis])
            elif length == 1:
                roles[axis] = AxisRole(reason="singleton")
            elif name not in scoped or (moving and all(any(p not in scoped for p, _ in axes) for *_, axes in moving)):
                roles[axis] = AxisRole(reason="scope")
    return roles


def unexplained_axes(spec: SymmetrySpec, scope: Scope, shapes: Mapping[str, Sequence[int]]) -> list[Axis]:
    """The ``(parameter, axis)`` pairs no group of ``scope`` acts on and no reason fixes, in model order.

    Empty for every supported architecture and scope; anything listed is a symmetry the spec
    misses or a fixed axis it does not declare (:func:`explain_axes` takes the same arguments).
    """
    roles = explain_axes(spec, scope, shapes)
    return [(name, i) for name, shape in shapes.items() for i in range(len(shape)) if (name, i) not in roles]
