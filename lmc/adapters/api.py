"""Model-level entry points: a model's spec, its per-layer groups, scopes and random symmetries.

These read a model through its registered adapter, then hand the spec to the generic code of
:mod:`lmc.symmetry`.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

from lmc.adapters.base import adapter_for
from lmc.symmetry import (
    ModelTransform,
    Scope,
    SymmetrySpec,
    qk_group,
    sample_transform,
    scope_parameter_names,
    vo_group,
)


def model_spec(model: nn.Module) -> SymmetrySpec:
    """The symmetry spec of ``model``, from its registered adapter."""
    return adapter_for(model).spec(model)


def describe(model: nn.Module) -> list[dict[str, Any]]:
    """One dict per attention layer, input to output.

    Keys: ``name``, ``pe`` (``"none"`` | ``"absolute"`` | ``"rope"``), ``rope_layout``
    (``None`` | ``"half"`` | ``"interleaved"`` | ``"axial"``), ``num_heads``, ``num_kv_heads``,
    ``head_dim``, ``width``, ``rotary_dim`` (rotated coordinates per head, 0 without RoPE),
    ``qk_group`` (``"GL"`` | ``"H"`` | ``"signs"``: sign flips of the rotary pairs under a QK-norm),
    ``qk_group_dim`` (its dimension: ``head_dim**2`` for GL, ``head_dim`` for a full H, 0 for the
    signs), ``vo_group`` (``"GL"``) and ``vo_group_dim`` (``head_dim**2``), each per key/value head;
    ``head_permutations``, the head orders of the group (``h!`` without GQA; with it, the KV heads'
    orders times the orders of the query heads inside each KV group: docs/spec.md) and
    ``group_dim``, the layer's continuous dimension (``num_kv_heads * (qk_group_dim + vo_group_dim)``).
    """
    layers = []
    for layer in model_spec(model).attention:
        group, values = qk_group(layer), vo_group(layer)
        queries_per_kv = layer.num_heads // layer.num_kv_heads
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
                "vo_group_dim": values.num_coordinates,
                "head_permutations": math.factorial(layer.num_kv_heads)
                * math.factorial(queries_per_kv) ** layer.num_kv_heads,
                "group_dim": layer.num_kv_heads * (group.num_coordinates + values.num_coordinates),
            }
        )
    return layers


def scope_parameters(model: nn.Module, scope: Scope, spec: SymmetrySpec | None = None) -> list[str]:
    """Names of the parameters a scope re-initializes (docs/spec.md, section 5), in model order.

    ``full_model`` is every parameter but the architecture's constants (``spec.fixed``); the
    others are the attention layers' projections and biases, plus for ``first_block`` the
    first feed-forward network. ``spec`` saves re-deriving the model's spec when the caller has it.
    """
    spec = spec or model_spec(model)
    return scope_parameter_names(spec, scope, (name for name, _ in model.named_parameters()))


def random_symmetry(model: nn.Module, scope: Scope = "all_attention", seed: int = 0) -> nn.Module:
    """A transformed deep copy of ``model`` that computes the same function.

    Args:
        model: Any model with a registered adapter; it is not modified.
        scope: ``"first_attention"``, ``"all_attention"``, ``"first_block"`` (adds the first
            FFN's hidden permutation) or ``"full_model"`` (every attention layer and FFN, the
            task heads' hidden units, the residual stream: embeddings, norms, heads, poolers, and
            the learned tokens: timm's register tokens).
        seed: Seed of the random group element.
    """
    spec = model_spec(model)
    return apply_transform(model, sample_transform(spec, scope, torch.Generator().manual_seed(seed)), spec)


def apply_transform(model: nn.Module, transform: ModelTransform, spec: SymmetrySpec | None = None) -> nn.Module:
    """A deep copy of ``model`` with ``transform`` applied (no group-membership check)."""
    transformed = copy.deepcopy(model)
    transform.apply_(dict(transformed.named_parameters()), spec or model_spec(model))
    return transformed
