"""Building blocks adapters use to describe common storage layouts as spec data."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from lmc.adapters.base import UnsupportedModelError
from lmc.symmetry.folds import NormFold, Reader
from lmc.symmetry.scales import UnitScales
from lmc.symmetry.spec import AttentionSpec, AxisPermutation, FeedForwardSpec, HeadSlot, RotaryLayout

Axes = list[tuple[str, int]]


def require_class(module: nn.Module, supported: tuple[type, ...], where: str) -> None:
    """Raise :class:`UnsupportedModelError` unless ``module``'s class is exactly one of ``supported``.

    Exact, not ``isinstance``: a subclass or a drop-in variant (timm's ``DiffAttention`` in a
    ``VisionTransformer``) stores the same parameters but may compute another function, with
    other symmetries.
    """
    if type(module) not in supported:
        names = " or ".join(cls.__name__ for cls in supported)
        raise UnsupportedModelError(
            f"{where} is a {type(module).__module__}.{type(module).__qualname__}, which lmc does not support: "
            f"the adapter knows the symmetries of {names} there; build the model with that class"
        )


class ParameterIndex:
    """The parameter names of one model, to build specs that list only what exists."""

    def __init__(self, model: nn.Module):
        self.shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}

    def optional(self, name: str) -> str | None:
        """``name`` if the model has that parameter (e.g. a bias that may be switched off)."""
        return name if name in self.shapes else None

    def axes(self, *pairs: tuple[str, int]) -> Axes:
        """The ``(name, axis)`` pairs whose parameter exists."""
        return [(name, axis) for name, axis in pairs if name in self.shapes]

    def linear_reads(self, prefix: str) -> Axes:
        """Axes of an ``nn.Linear`` (weight ``out x in``) that reads the permuted space."""
        return self.axes((f"{prefix}.weight", 1))

    def linear_writes(self, prefix: str) -> Axes:
        """Axes of an ``nn.Linear`` that writes the permuted space (weight rows and bias)."""
        return self.axes((f"{prefix}.weight", 0), (f"{prefix}.bias", 0))

    def elementwise(self, prefix: str) -> Axes:
        """Axes of a norm (weight and bias) or any per-coordinate parameter group."""
        return self.axes((f"{prefix}.weight", 0), (f"{prefix}.bias", 0))

    def gains(self, *prefixes: str) -> Axes:
        """Axes of the gains (weights) of the norms ``prefixes``: what a sign flip of their input leaves alone."""
        return self.axes(*((f"{prefix}.weight", 0) for prefix in prefixes))

    def reader(self, prefix: str, axis: int = 1) -> Reader:
        """A linear map reading the stream: ``nn.Linear`` (input axis 1) or, with ``axis=0``, GPT-2's ``Conv1D``."""
        return Reader(f"{prefix}.weight", axis, self.optional(f"{prefix}.bias"))

    def norm_fold(self, norm: str, readers: list[Reader], gain_offset: float = 0.0) -> NormFold:
        """The fold of norm ``norm`` (its ``weight`` and ``bias`` where present) into ``readers``."""
        gain, bias = self.optional(f"{norm}.weight"), self.optional(f"{norm}.bias")
        return NormFold(norm, gain, tuple(readers), bias, gain_offset)

    def bias_slot(self, name: str, offset: int = 0) -> HeadSlot | None:
        return HeadSlot(name, 0, offset) if name in self.shapes else None


def linear_attention(
    index: ParameterIndex,
    name: str,
    projections: tuple[str, str, str, str],
    *,
    width: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    pe: str,
    rotary: RotaryLayout | None = None,
) -> AttentionSpec:
    """Attention with four separate ``nn.Linear`` projections (query, key, value, output prefixes)."""
    query, key, value, out = projections
    return AttentionSpec(
        name=name,
        width=width,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        pe=pe,
        rotary=rotary,
        query=HeadSlot(f"{query}.weight", 0),
        key=HeadSlot(f"{key}.weight", 0),
        value=HeadSlot(f"{value}.weight", 0),
        out=HeadSlot(f"{out}.weight", 1),
        query_bias=index.bias_slot(f"{query}.bias"),
        key_bias=index.bias_slot(f"{key}.bias"),
        value_bias=index.bias_slot(f"{value}.bias"),
        out_bias=index.optional(f"{out}.bias"),
    )


def per_head_fused_attention(
    index: ParameterIndex,
    name: str,
    qkv: str,
    out: str,
    *,
    width: int,
    num_heads: int,
    head_dim: int,
    pe: str,
    rotary: RotaryLayout | None = None,
) -> AttentionSpec:
    """Attention whose one ``nn.Linear`` ``qkv`` stores per head ``[q | k | v]`` (GPT-NeoX's ``query_key_value``).

    Its output rows are a view ``(num_heads, 3, head_dim)``: head ``i``'s query rows start at
    ``3 * head_dim * i``, its key rows ``head_dim`` later, its value rows ``2 * head_dim`` later.
    """
    stride = 3 * head_dim
    slots = [HeadSlot("", 0, k * head_dim, stride) for k in range(3)]
    return _fused_attention(index, name, qkv, out, slots, width, num_heads, num_heads, head_dim, pe, rotary)


def block_fused_attention(
    index: ParameterIndex,
    name: str,
    qkv: str,
    out: str,
    *,
    width: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    pe: str,
    rotary: RotaryLayout | None = None,
) -> AttentionSpec:
    """Attention whose one ``nn.Linear`` ``qkv`` stores ``[Q | K | V]`` row blocks, head-major (Phi-3's ``qkv_proj``).

    With grouped-query attention the blocks have ``num_heads``, ``num_kv_heads`` and
    ``num_kv_heads`` heads: the keys start at row ``num_heads * head_dim``, the values
    ``num_kv_heads * head_dim`` later.
    """
    offsets = (0, num_heads * head_dim, (num_heads + num_kv_heads) * head_dim)
    slots = [HeadSlot("", 0, offset) for offset in offsets]
    return _fused_attention(index, name, qkv, out, slots, width, num_heads, num_kv_heads, head_dim, pe, rotary)


def _fused_attention(
    index: ParameterIndex,
    name: str,
    qkv: str,
    out: str,
    slots: list[HeadSlot],
    width: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    pe: str,
    rotary: RotaryLayout | None,
) -> AttentionSpec:
    """The spec of a fused ``qkv`` Linear whose query, key and value rows sit where ``slots`` say
    (their parameter name is filled in: the weight, and the bias where there is one)."""

    def placed(parameter: str) -> list[HeadSlot | None]:
        present = parameter in index.shapes
        return [dataclasses.replace(slot, parameter=parameter) if present else None for slot in slots]

    query, key, value = placed(f"{qkv}.weight")
    query_bias, key_bias, value_bias = placed(f"{qkv}.bias")
    return AttentionSpec(
        name=name,
        width=width,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        pe=pe,
        rotary=rotary,
        query=query,
        key=key,
        value=value,
        out=HeadSlot(f"{out}.weight", 1),
        query_bias=query_bias,
        key_bias=key_bias,
        value_bias=value_bias,
        out_bias=index.optional(f"{out}.bias"),
    )


def linear_feed_forward(
    index: ParameterIndex,
    name: str,
    inputs: tuple[str, ...],
    output: str,
    hidden: int,
    value: tuple[str, int | None] | None = None,
) -> FeedForwardSpec:
    """An FFN of ``nn.Linear`` layers: ``inputs`` (up, and gate if gated) and ``output`` (down).

    ``value`` names a gated FFN's value branch, ``(input, copy)``: the input Linear whose output the gate's
    activation multiplies (``copy``: which stacked copy of a fused ``[gate | up]`` it is, ``None`` for a Linear
    of its own). Its units then scale by any non-zero number, inversely in ``output`` (:class:`UnitScales`).
    """
    axes = [axis for prefix in inputs for axis in index.linear_writes(prefix)] + index.linear_reads(output)
    owned = [parameter for parameter, _ in axes] + [p for p in [index.optional(f"{output}.bias")] if p]
    permutation = AxisPermutation(name, hidden, tuple(axes), readers=(output,), writers=inputs)
    scales = None
    if value is not None:
        scaled = tuple(index.linear_writes(value[0]))
        copies = () if value[1] is None else tuple((axis, value[1]) for axis in scaled)
        scales = UnitScales("nonzero", scaled, tuple(index.linear_reads(output)), copies)
    return FeedForwardSpec(permutation, tuple(dict.fromkeys(owned)), scales)


def rotary_from_cos_sin(kind: str, pairs: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> RotaryLayout:
    """A rotary layout from the per-pair cosines and sines a model applies, each ``(T, num_pairs)``."""
    return RotaryLayout(kind=kind, pairs=pairs.long().cpu(), angles=torch.atan2(sin.double(), cos.double()).cpu())
