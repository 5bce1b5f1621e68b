"""Public entry points of :mod:`lmc.symmetry`: describe a model, sample a symmetry, name a scope."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from lmc.symmetry.spec import SCOPES, SymmetrySpec
from lmc.symmetry.transforms import ModelTransform, qk_group, sample_attention_transform


def model_spec(model: nn.Module) -> SymmetrySpec:
    """The symmetry spec of ``model``, from its registered adapter."""
    from lmc.adapters import adapter_for

    return adapter_for(model).spec(model)


def describe(model: nn.Module) -> list[dict[str, Any]]:
    """One dict per attention layer, input to output.

    Keys: ``name``, ``pe`` (``"none"`` | ``"absolute"`` | ``"rope"``), ``rope_layout``
    (``None`` | ``"half"`` | ``"interleaved"`` | ``"axial"``), ``num_heads``, ``num_kv_heads``,
    ``head_dim``, ``width``, ``rotary_dim`` (rotated coordinates per head, 0 without RoPE),
    ``qk_group`` (``"GL"`` | ``"H"``), ``qk_group_dim`` (its dimension: ``head_dim**2`` for GL,
    ``head_dim`` for a full H) and ``vo_group`` (``"GL"``).
    """
    layers = []
    for layer in model_spec(model).attention:
        group = qk_group(layer)
        layers.append(
            {
                "name": layer.name,
                "pe": layer.pe,
                "rope_layout": None if layer.rotary is None else layer.rotary.kind,
                "num_heads": layer.num_heads,
                "num_kv_heads": layer.num_kv_heads,
                "head_dim": layer.head_dim,
                "width": layer.width,
                "rotary_dim": 0 if layer.rotary is None else layer.rotary.rotary_dim,
                "qk_group": group.name,
                "qk_group_dim": group.num_coordinates,
                "vo_group": "GL",
            }
        )
    return layers


def check_scope(scope: str) -> None:
    if scope not in SCOPES:
        raise ValueError(f"unknown scope {scope!r}; choose one of {', '.join(SCOPES)}")


def scope_blocks(spec: SymmetrySpec, scope: str) -> tuple[list[int], list[int], bool]:
    """Which attention layers and FFNs a scope covers, and whether the residual stream is in it."""
    check_scope(scope)
    every = list(range(len(spec.blocks)))
    attention = [0] if scope in ("first_attention", "first_block") else every
    feed_forward = {"first_attention": [], "all_attention": [], "first_block": [0], "full_model": every}[scope]
    return attention, [i for i in feed_forward if spec.blocks[i].feed_forward is not None], scope == "full_model"


def scope_parameters(model: nn.Module, scope: str, spec: SymmetrySpec | None = None) -> list[str]:
    """Names of the parameters a scope re-initializes (SPEC section 5), in model order.

    ``full_model`` is every parameter but the architecture's constants (``spec.fixed``); the
    others are the attention layers' projections and biases, plus for ``first_block`` the
    first feed-forward network. ``spec`` saves re-deriving the model's spec when the caller has it.
    """
    spec = spec or model_spec(model)
    attention, feed_forward, whole = scope_blocks(spec, scope)
    owned = {p for i in attention for p in spec.blocks[i].attention.parameters}
    owned |= {p for i in feed_forward for p in spec.blocks[i].feed_forward.parameters}
    fixed = set(spec.fixed)
    return [name for name, _ in model.named_parameters() if (whole and name not in fixed) or name in owned]


def sample_transform(spec: SymmetrySpec, scope: str, generator: torch.Generator) -> ModelTransform:
    """A random element of the scope's symmetry group (float64 matrices)."""
    attention, feed_forward, whole = scope_blocks(spec, scope)
    transform = ModelTransform()
    for i in attention:
        transform.attention[i] = sample_attention_transform(spec.blocks[i].attention, generator)
    for i in feed_forward:
        transform.feed_forward[i] = torch.randperm(spec.blocks[i].feed_forward.hidden.size, generator=generator)
    if whole and spec.residual is not None:
        transform.residual = torch.randperm(spec.residual.size, generator=generator)
    return transform


def random_symmetry(model: nn.Module, scope: str = "all_attention", seed: int = 0) -> nn.Module:
    """A transformed deep copy of ``model`` that computes the same function.

    Args:
        model: Any model with a registered adapter; it is not modified.
        scope: ``"first_attention"``, ``"all_attention"``, ``"first_block"`` (adds the first
            FFN's hidden permutation) or ``"full_model"`` (every attention layer and FFN and the
            residual stream: embeddings, norms, heads, poolers).
        seed: Seed of the random group element.
    """
    spec = model_spec(model)
    return apply_transform(model, sample_transform(spec, scope, torch.Generator().manual_seed(seed)), spec)


def apply_transform(model: nn.Module, transform: ModelTransform, spec: SymmetrySpec | None = None) -> nn.Module:
    """A deep copy of ``model`` with ``transform`` applied (no group-membership check)."""
    transformed = copy.deepcopy(model)
    transform.apply_(dict(transformed.named_parameters()), spec or model_spec(model))
    return transformed
