"""Read and write the uniform per-head view of an attention layer (docs/spec.md, section 1).

The view is in the row-vector convention whatever the storage: per head ``W_Q, W_K, W_V``
are ``d x head_dim`` and ``W_O`` is ``head_dim x d``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from lmc.symmetry.spec import AttentionSpec, HeadSlot


@dataclass(frozen=True)
class AttentionWeights:
    """Per-head parameters of one attention layer.

    Attributes:
        query: ``(num_heads, d, head_dim)``.
        key: ``(num_kv_heads, d, head_dim)``.
        value: ``(num_kv_heads, d, head_dim)``.
        out: ``(num_heads, head_dim, d)``.
        query_bias: ``(num_heads, head_dim)`` or ``None``.
        key_bias: ``(num_kv_heads, head_dim)`` or ``None``.
        value_bias: ``(num_kv_heads, head_dim)`` or ``None``.
        query_gain: ``(num_heads, head_dim)`` or ``None``: each query head's slice of a full-width norm's gain.
        key_gain: ``(num_kv_heads, head_dim)`` or ``None``: the same for key/value heads.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    out: torch.Tensor
    query_bias: torch.Tensor | None = None
    key_bias: torch.Tensor | None = None
    value_bias: torch.Tensor | None = None
    query_gain: torch.Tensor | None = None
    key_gain: torch.Tensor | None = None


# (field, slot attribute, whether the per-head block is stored head_dim x d and must be transposed)
_LAYOUT = (
    ("query", "query", True),
    ("key", "key", True),
    ("value", "value", True),
    ("out", "out", False),
    ("query_bias", "query_bias", False),
    ("key_bias", "key_bias", False),
    ("value_bias", "value_bias", False),
    ("query_gain", "query_gain", False),
    ("key_gain", "key_gain", False),
)


def per_query_head(field_name: str) -> bool:
    """Whether an :class:`AttentionWeights` field holds one entry per query head (else per key/value head)."""
    return field_name.startswith(("query", "out"))


def _head_count(spec: AttentionSpec, field_name: str) -> int:
    return spec.num_heads if per_query_head(field_name) else spec.num_kv_heads


def _slot_view(parameter: torch.Tensor, slot: HeadSlot, count: int, head_dim: int) -> torch.Tensor:
    """A view of the slot's entries, shape ``(count, head_dim, *other_axes)``."""
    moved = parameter.movedim(slot.head_axis, 0)
    stride = head_dim if slot.stride is None else slot.stride
    if stride < head_dim:
        raise ValueError(f"{slot.parameter}: heads {stride} entries apart would overlap; each holds {head_dim}")
    if slot.offset + (count - 1) * stride + head_dim > moved.shape[0]:
        raise ValueError(
            f"{slot.parameter}: axis {slot.head_axis} has {moved.shape[0]} entries, "
            f"fewer than offset {slot.offset} + {count} heads x {head_dim} at stride {stride}"
        )
    if stride == head_dim:
        return moved.narrow(0, slot.offset, count * head_dim).unflatten(0, (count, head_dim))
    # Heads apart (GPT-NeoX's per-head [q | k | v]): windows of head_dim entries, one every stride.
    return moved.narrow(0, slot.offset, (count - 1) * stride + head_dim).unfold(0, head_dim, stride).movedim(-1, 1)


def head_rows(parameters: Mapping[str, torch.Tensor], spec: AttentionSpec, field_name: str) -> torch.Tensor | None:
    """One projection with each head's ``head_dim`` rows stacked: a view (no copy) where heads sit side by side.

    Shape ``(heads * head_dim, d)`` for ``query``/``key``/``value`` (rows are ``W^T``) and for
    ``out`` (rows are ``W_O``), ``(heads * head_dim,)`` for biases; ``None`` if absent. Gram
    matrices of these views are the matcher's GEMMs.
    """
    slot: HeadSlot | None = getattr(spec, field_name)
    if slot is None:
        return None
    view = _slot_view(parameters[slot.parameter].detach(), slot, _head_count(spec, field_name), spec.head_dim)
    return view.flatten(0, 1)


def read_attention(parameters: Mapping[str, torch.Tensor], spec: AttentionSpec) -> AttentionWeights:
    """Gather one layer's per-head weights (copies, detached from the model).

    Args:
        parameters: ``dict(model.named_parameters())`` or a state dict.
        spec: The layer.
    """
    values = {}
    for field_name, slot_name, transpose in _LAYOUT:
        slot: HeadSlot | None = getattr(spec, slot_name)
        if slot is None:
            continue
        block = _slot_view(parameters[slot.parameter].detach(), slot, _head_count(spec, field_name), spec.head_dim)
        values[field_name] = (block.transpose(1, 2) if transpose else block).clone()
    return AttentionWeights(**values)


@torch.no_grad()
def write_attention(parameters: Mapping[str, torch.Tensor], spec: AttentionSpec, weights: AttentionWeights) -> None:
    """Write per-head weights back into the stored parameters, in place."""
    _write(parameters, spec, weights)


def attention_parameters(
    parameters: Mapping[str, torch.Tensor], spec: AttentionSpec, weights: AttentionWeights
) -> dict[str, torch.Tensor]:
    """New stored tensors of the layer's parameters holding ``weights``, differentiable in ``weights``.

    The parameters are copied (never changed); entries outside the layer's head slots keep their
    values. Used where a loss of the written model must be differentiated in the per-head weights.

    Returns:
        Parameter name -> its new tensor, for every parameter the layer's slots live in.
    """
    names = {getattr(spec, slot).parameter for _, slot, _ in _LAYOUT if getattr(spec, slot) is not None}
    copies = {name: parameters[name].detach().clone() for name in names}
    _write(copies, spec, weights)
    return copies


def _write(parameters: Mapping[str, torch.Tensor], spec: AttentionSpec, weights: AttentionWeights) -> None:
    for field_name, slot_name, transpose in _LAYOUT:
        slot: HeadSlot | None = getattr(spec, slot_name)
        value: torch.Tensor | None = getattr(weights, field_name)
        if (slot is None) != (value is None):
            raise ValueError(f"{spec.name}: weights.{field_name} must be given exactly when the layer has it")
        if slot is None:
            continue
        target = _slot_view(parameters[slot.parameter], slot, _head_count(spec, field_name), spec.head_dim)
        target.copy_(value.transpose(1, 2) if transpose else value)
