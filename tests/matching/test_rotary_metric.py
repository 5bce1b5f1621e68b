"""metric="rotary": Stage 1 on the complete Q/K invariants of RoPE heads (docs/spec.md, section 3).

Both ways: an element of the layer's group leaves the cost where it was; a GL element on a RoPE layer's queries and
keys (not a symmetry) moves it, where the paper's ``invariant`` cost, which reads ``Q K^T`` only, does not see it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lmc.adapters import apply_transform, model_spec
from lmc.matching import AlignOptions
from lmc.matching.grams import LayerGrams
from lmc.matching.heads import head_cost, rotary_products
from lmc.symmetry import (
    AttentionTransform,
    ModelTransform,
    RotaryLayout,
    general_linear,
    read_attention,
    rotary_commutant,
    sample_transform,
    transform_attention,
    write_attention,
)
from tests.architectures import APE, ROPE, build

ROTARY, INVARIANT = AlignOptions(metric="rotary"), AlignOptions(metric="invariant")


def first_layer_grams(source, target) -> tuple[LayerGrams, object]:
    layer = model_spec(target).blocks[0].attention
    return LayerGrams.compute(dict(source.named_parameters()), dict(target.named_parameters()), layer), layer


def with_qk(model, layer, qk: torch.Tensor):
    """``model`` with its first layer's queries and keys moved by ``qk`` per KV head (V/O and head order kept)."""
    eye = torch.eye(layer.head_dim, dtype=torch.float64).expand(layer.num_kv_heads, -1, -1).clone()
    element = AttentionTransform(torch.arange(layer.num_heads), torch.arange(layer.num_kv_heads), qk, eye)
    return apply_transform(model, ModelTransform(attention={0: element}))


@pytest.mark.parametrize("key", ROPE)
def test_a_planted_twin_costs_nothing_on_its_own_heads(key):
    target = build(key)
    spec = model_spec(target)
    transform = sample_transform(spec, "first_attention", torch.Generator().manual_seed(1))
    grams, layer = first_layer_grams(apply_transform(target, transform, spec), target)

    cost = head_cost(grams, layer, ROTARY)

    heads = torch.arange(layer.num_heads)
    own = cost[heads, transform.attention[0].query_permutation]  # twin head i is target head perm[i], moved by H
    assert float(own.abs().max()) < 1e-10 * float(cost.abs().max())
    assert float(cost.abs().max()) > 1.0  # other heads are far apart


@pytest.mark.parametrize("key", ROPE)
def test_gl_on_queries_and_keys_is_seen_by_rotary_and_missed_by_invariant(key):
    target = build(key)
    layer = model_spec(target).blocks[0].attention
    outside = general_linear(layer.head_dim).sample(layer.num_kv_heads, torch.Generator().manual_seed(2))
    inside = rotary_commutant(layer.head_dim, layer.rotary).sample(layer.num_kv_heads, torch.Generator().manual_seed(2))
    for qk, seen in ((outside, True), (inside, False)):
        grams, _ = first_layer_grams(with_qk(target, layer, qk), target)
        rotary, invariant = head_cost(grams, layer, ROTARY).diagonal(), head_cost(grams, layer, INVARIANT).diagonal()
        assert float(invariant.abs().max()) < 1e-10  # Q K^T is kept by any GL: the paper's cost is blind
        if seen:
            assert float(rotary.min()) > 1e-3
        else:
            assert float(rotary.abs().max()) < 1e-10


@pytest.mark.parametrize("key", APE)
def test_without_rope_rotary_is_invariant(key):
    target = build(key)
    grams, layer = first_layer_grams(build(key, seed=1), target)
    torch.testing.assert_close(head_cost(grams, layer, ROTARY), head_cost(grams, layer, INVARIANT), rtol=1e-12, atol=0)


def test_pairs_turning_alike_form_one_class_whose_complex_mixing_keeps_the_cost():
    """Two pairs with the same angles: H mixes them (GL(2, C)); the products of each pair alone would change."""
    target = build("ref-lm-rope-half-gqa-swiglu-rms-nobias")
    layer = model_spec(target).blocks[0].attention
    angles = layer.rotary.angles.clone()
    angles[:, 1] = angles[:, 0]
    shared = dataclasses.replace(layer, rotary=RotaryLayout(layer.rotary.kind, layer.rotary.pairs, angles))
    group = rotary_commutant(shared.head_dim, shared.rotary)
    assert sorted(len(members) for members in group.complex_blocks) == [1, 1, 2]
    source = build("ref-lm-rope-half-gqa-swiglu-rms-nobias", seed=1)
    parameters = {name: p.detach().clone() for name, p in source.named_parameters()}
    qk = group.sample(shared.num_kv_heads, torch.Generator().manual_seed(3))
    eye = torch.eye(shared.head_dim, dtype=torch.float64).expand(shared.num_kv_heads, -1, -1).clone()
    element = AttentionTransform(torch.arange(shared.num_heads), torch.arange(shared.num_kv_heads), qk, eye)
    moved = {name: value.clone() for name, value in parameters.items()}
    write_attention(moved, shared, transform_attention(read_attention(parameters, shared), element))
    targets = dict(target.named_parameters())
    before = rotary_products(LayerGrams.compute(parameters, targets, shared), shared)
    after = rotary_products(LayerGrams.compute(moved, targets, shared), shared)
    for name, value in before.items():
        torch.testing.assert_close(after[name], value, rtol=1e-10, atol=1e-10)
    unmoved = rotary_products(LayerGrams.compute(parameters, targets, layer), layer)
    per_pair = rotary_products(LayerGrams.compute(moved, targets, layer), layer)  # each pair apart: not kept
    assert float((per_pair["qk_cross"] - unmoved["qk_cross"]).abs().max()) > 1e-3
