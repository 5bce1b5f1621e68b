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
    REASONS,
    SCOPES,
    ModelTransform,
    Scope,
    SymmetrySpec,
    explain_axes,
    fold_parameters_,
    qk_group,
    sample_transform,
    scope_blocks,
    scope_parameter_names,
    vo_group,
)


def model_spec(model: nn.Module) -> SymmetrySpec:
    """The symmetry spec of ``model``, from its registered adapter."""
    return adapter_for(model).spec(model)


def describe(model: nn.Module, spec: SymmetrySpec | None = None) -> list[dict[str, Any]]:
    """One dict per attention layer (and its block's FFN), input to output.

    Keys: ``name``, ``pe`` (``"none"`` | ``"absolute"`` | ``"rope"``), ``rope_layout``
    (``None`` | ``"half"`` | ``"interleaved"`` | ``"axial"``), ``num_heads``, ``num_kv_heads``,
    ``head_dim``, ``width``, ``rotary_dim`` (rotated coordinates per head, 0 without RoPE),
    ``qk_group`` (``"GL"`` | ``"H"`` | ``"signs"``: sign flips of the rotary pairs under a QK-norm),
    ``qk_group_dim`` (its dimension: ``head_dim**2`` for GL, ``head_dim`` for a full H, 0 for the
    signs), ``vo_group`` (``"GL"``) and ``vo_group_dim`` (``head_dim**2``), each per key/value head;
    ``head_permutations``, the head orders of the group (``h!`` without GQA; with it, the KV heads'
    orders times the orders of the query heads inside each KV group: docs/spec.md) and
    ``group_dim``, the layer's continuous dimension (``num_kv_heads * (qk_group_dim + vo_group_dim)``);
    ``ffn_width``, the hidden units of the block's feed-forward network (0 without one), and
    ``ffn_permutations``, their orders (``ffn_width!``), which ``first_block`` (block 0) and
    ``full_model`` move. The groups beyond the blocks (the residual stream, task heads) are per
    scope (:func:`describe_scopes`). ``spec`` saves re-deriving the model's spec.
    """
    layers = []
    for block in (spec or model_spec(model)).blocks:
        layer, group, values = block.attention, qk_group(block.attention), vo_group(block.attention)
        ffn_width = 0 if block.feed_forward is None else block.feed_forward.hidden.size
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
                "ffn_width": ffn_width,
                "ffn_permutations": math.factorial(ffn_width),
            }
        )
    return layers


def describe_scopes(model: nn.Module) -> dict[Scope, dict[str, Any]]:
    """What each scope's symmetry group holds (docs/spec.md, section 5): per scope of :data:`SCOPES`,

    - ``attention_layers`` and ``feed_forwards``: the indices of the blocks whose attention and
      FFN it moves; ``head_permutations``, the product of those layers' head orders, and
      ``group_dim``, the sum of their continuous dimensions (:func:`describe`);
    - ``ffn_permutations``: the product of those FFNs' hidden-unit orders (``width!`` each);
    - ``residual_width``: the residual coordinates it permutes (``d`` at ``full_model``; 0 at
      the other scopes, and where a fixed tensor added to the stream, a sinusoidal table, leaves
      no permutation of it a symmetry) and ``residual_permutations``, their orders
      (``residual_width!``); ``residual_signs``, the stream's sign group (``"each"``, ``"global"`` or
      ``"none"``: docs/spec.md, section 2, "Signs of the residual stream"; ``"none"`` where the scope does not
      move the stream) and ``residual_sign_flips``, its order (``2**residual_width``, 2 or 1);
    - ``other_permutations``: the orders of the task heads' hidden units and of the learned
      tokens (``full_model`` only; 1 elsewhere), and ``other_sign_flips``, those of the task heads' signs
      (BERT's tanh pooler: ``2**hidden_size``; RoFormer's embedding space: 2);
    - ``permutations``: the order of the scope's discrete group, the product of the four orders above and
      of the sign flips;
    - ``moved_axes``: how many axes of the scope's parameters a group of the scope acts on, and
      ``fixed_axes``: how many no group does, per reason (:data:`~lmc.symmetry.REASONS`; ``scope``
      for an axis only a wider scope's group moves, the residual one of a projection);
    - ``unexplained_axes``: the ``(parameter, axis)`` pairs of the scope's parameters neither
      covers (none, for a supported architecture: :func:`~lmc.symmetry.unexplained_axes`).
    """
    spec = model_spec(model)
    layers = describe(model, spec)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    scopes = {}
    for scope in SCOPES:
        scoped = set(scope_parameter_names(spec, scope, shapes))
        roles = {axis: role for axis, role in explain_axes(spec, scope, shapes).items() if axis[0] in scoped}
        reasons = [role.reason for role in roles.values() if role.reason is not None]
        attention, feed_forward, whole = scope_blocks(spec, scope)
        residual = spec.residual.size if whole and spec.residual is not None else 0
        signs = spec.residual.signs if residual else "none"
        others = [head.size for head in spec.task_heads] + ([] if spec.tokens is None else [spec.tokens.size])
        orders = {
            "head_permutations": math.prod(layers[i]["head_permutations"] for i in attention),
            "ffn_permutations": math.prod(layers[i]["ffn_permutations"] for i in feed_forward),
            "residual_permutations": math.factorial(residual),
            "other_permutations": math.prod(map(math.factorial, others)) if whole else 1,  # full_model only
            "residual_sign_flips": sign_flips(signs, residual),
            "other_sign_flips": math.prod(sign_flips(head.signs, head.size) for head in spec.task_heads)
            if whole
            else 1,
        }
        scopes[scope] = {
            "attention_layers": attention,
            "feed_forwards": feed_forward,
            "group_dim": sum(layers[i]["group_dim"] for i in attention),
            "residual_width": residual,
            "residual_signs": signs,
            **orders,
            "permutations": math.prod(orders.values()),
            "moved_axes": sum(role.group is not None for role in roles.values()),
            "fixed_axes": {reason: reasons.count(reason) for reason in REASONS if reason in reasons},
            "unexplained_axes": [
                (name, i)
                for name, shape in shapes.items()
                if name in scoped
                for i in range(len(shape))
                if (name, i) not in roles
            ],
        }
    return scopes


def sign_flips(signs: str, size: int) -> int:
    """The order of a sign group (:data:`~lmc.symmetry.SignGroup`) on ``size`` units."""
    return {"each": 2**size, "global": 2 if size else 1, "none": 1}[signs]


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


def fold_norms(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` with every foldable norm folded into its readers: the same class and function.

    Each norm on the residual stream that only linear maps read (``SymmetrySpec.folds``: pre-norms, a final norm
    read by an untied head) has its gain, and its LayerNorm bias where every reader has a bias, moved into the
    readers; the norm keeps a unit gain (Gemma: ``w = 0``) and a zero bias (docs/spec.md, section 2, "Folding the
    norms"). Saved with the class's own ``save_pretrained`` or ``state_dict``, it loads as any checkpoint does.
    """
    spec = model_spec(model)
    folded = copy.deepcopy(model)
    fold_parameters_(dict(folded.named_parameters()), spec.folds)
    return folded


def apply_transform(model: nn.Module, transform: ModelTransform, spec: SymmetrySpec | None = None) -> nn.Module:
    """A deep copy of ``model`` with ``transform`` applied (no group-membership check)."""
    transformed = copy.deepcopy(model)
    transform.apply_(dict(transformed.named_parameters()), spec or model_spec(model))
    return transformed
