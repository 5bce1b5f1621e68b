"""OLMo-2: RMSNorms over the whole query and key rows before RoPE (docs/spec.md, section 2, "Full-width QK-norm").

The generic tests (test_invariance.py, test_describe.py, test_decoders.py, test_axes.py, tests/matching) run on
tests/architectures.QK_NORM; these check what the full width changes from Qwen3's per-head norms: each head's
slices of ``q_norm`` and ``k_norm`` must move with the head permutation (``AttentionSpec.query_gain``/
``key_gain``) and with nothing else, ``C`` is a sign flip of each rotary pair, no head keeps a scale of its
own even without the norms' epsilon, and V/O keeps ``GL(d_h)``.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from lmc.adapters import apply_transform, model_spec
from lmc.symmetry import AttentionTransform, ModelTransform, qk_group, rotary_commutant, sample_attention_transform
from tests.architectures import FLOAT64_RTOL, float64_rms_norm, relative_difference
from tests.symmetry.test_decoders import outputs as decoder_outputs
from tests.symmetry.test_gpt_neox import _null_dimension, _qk_tangent, _vo_tangent
from tests.symmetry.test_qwen3 import _element, _pair_rotation, qk_norm_decoder

BROKEN = 1e-4
PAIRS = 4  # head_dim 8, every coordinate rotates


@pytest.fixture(autouse=True)
def float64_norms(monkeypatch):
    """OLMo-2's RMSNorms without their float32 cast, so that equal functions agree to float64 rounding."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    monkeypatch.setattr(Olmo2RMSNorm, "forward", float64_rms_norm)


def olmo2(equal_gains: bool = False, **overrides) -> nn.Module:
    """:func:`~tests.symmetry.test_qwen3.qk_norm_decoder` of ``olmo2-tiny``."""
    return qk_norm_decoder("olmo2-tiny", equal_gains, **overrides)


def _gains(model: nn.Module, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    attention = model.model.layers[layer].self_attn
    return attention.q_norm.weight, attention.k_norm.weight


def test_the_spec_gives_each_head_its_gain_slices_and_no_shared_gain():
    layer = model_spec(olmo2()).blocks[0].attention
    assert (layer.query_norm, layer.key_norm) == (None, None)
    assert (layer.query_gain.parameter, layer.key_gain.parameter) == (
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.0.self_attn.k_norm.weight",
    )
    assert qk_group(layer).name == "signs" and qk_group(layer).num_blocks == PAIRS


def test_a_head_permutation_moves_the_gain_slices_and_breaks_the_function_without_them():
    """Heads 0 and 1 (and so KV heads 0 and 1) swapped: exact with their slices of q_norm and k_norm, not without."""
    model = olmo2()
    layer = model_spec(model).blocks[0].attention
    identity = AttentionTransform.identity(layer)
    swap = AttentionTransform(torch.tensor([2, 3, 0, 1]), torch.tensor([1, 0]), identity.qk, identity.vo)
    swap.validate(layer)
    reference = decoder_outputs(model)
    moved = apply_transform(model, ModelTransform(attention={0: swap}))
    (query_gain, key_gain), (moved_query, moved_key) = _gains(model), _gains(moved)
    assert torch.equal(moved_query, query_gain.view(4, 8)[[2, 3, 0, 1]].flatten())
    assert torch.equal(moved_key, key_gain.view(2, 8)[[1, 0]].flatten())
    assert relative_difference(reference, decoder_outputs(moved)) < FLOAT64_RTOL
    for name, gain in (("q_norm", query_gain), ("k_norm", key_gain)):
        left = apply_transform(model, ModelTransform(attention={0: swap}))
        with torch.no_grad():
            getattr(left.model.layers[0].self_attn, name).weight.copy_(gain)  # the slices left where they were
        assert relative_difference(reference, decoder_outputs(left)) > BROKEN, name


def test_random_elements_keep_the_function_and_near_misses_break_it():
    model = olmo2()
    layer = model_spec(model).blocks[0].attention
    reference = decoder_outputs(model)
    for seed in range(3):
        element = sample_attention_transform(layer, torch.Generator().manual_seed(seed))
        kept = apply_transform(model, ModelTransform(attention={0: element}))
        assert relative_difference(reference, decoder_outputs(kept)) < FLOAT64_RTOL, seed
    group, pairs = qk_group(layer), layer.rotary.pairs.tolist()
    for signs in itertools.product((1.0, -1.0), repeat=PAIRS):
        c = group.elements(torch.tensor(signs, dtype=torch.float64)).expand(layer.num_kv_heads, -1, -1)
        kept = apply_transform(model, ModelTransform(attention={0: _element(layer, c)}))
        assert relative_difference(reference, decoder_outputs(kept)) < FLOAT64_RTOL, signs
    one_coordinate = torch.eye(8, dtype=torch.float64).repeat(layer.num_kv_heads, 1, 1)
    one_coordinate[:, pairs[0][0], pairs[0][0]] = -1.0
    one_head_scaled = torch.eye(8, dtype=torch.float64).repeat(layer.num_kv_heads, 1, 1)
    one_head_scaled[0] *= 2.0  # KV group 0's heads alone: the full row's rms changes
    near_misses = {
        "half a pair": one_coordinate,
        "a rotation of one pair": _pair_rotation(0.3, pairs[1], layer.num_kv_heads),
        "RoPE's H": rotary_commutant(8, layer.rotary).sample(layer.num_kv_heads, torch.Generator().manual_seed(3)),
        "one group's scale": one_head_scaled,
    }
    for name, c in near_misses.items():
        broken = apply_transform(model, ModelTransform(attention={0: _element(layer, c)}))
        assert relative_difference(reference, decoder_outputs(broken)) > BROKEN, name


# (gains equal on every pair, the norms' epsilon) -> first-order Q/K symmetries of head 0 (measured). Unlike
# Qwen3's per-head norm, no head keeps a scale of its own at eps = 0: the rms runs over every head's coordinates.
QK_DIMENSIONS = {(False, 1e-3): 0, (True, 1e-3): PAIRS, (False, 0.0): 0}


@pytest.mark.parametrize(("equal_gains", "eps"), list(QK_DIMENSIONS))
def test_the_group_has_the_dimension_of_the_models_own_symmetries(equal_gains, eps):
    """Generic gains: no first-order Q/K symmetry (the signs are discrete); equal gains: a rotation per pair.

    One query head per KV head, so that head 0's ``(C, C^-T)`` moves nothing else.
    """
    model = olmo2(equal_gains, num_key_value_heads=4, rms_norm_eps=eps)
    layer = model_spec(model).blocks[0].attention
    assert _null_dimension(model, _qk_tangent) == QK_DIMENSIONS[equal_gains, eps]
    assert qk_group(layer).num_coordinates == 0  # lmc's group: the signs, exact for every gain
    if not equal_gains and eps:
        assert _null_dimension(model, _vo_tangent) == layer.head_dim**2  # GL(d_h) on V/O


def test_rescaling_each_heads_gain_slices_pair_by_pair_is_exact_and_near_misses_are_not():
    """Left out of lmc's group (spec.md): KV head g's slices g_q^i c_g (every query head i of its group), g_k^g / c_g.

    ``c_g`` is equal on each rotary pair; scaling one coordinate alone, or two query heads of one KV
    group by different ``c``, breaks the function.
    """
    model = olmo2()
    layer = model_spec(model).blocks[0].attention
    pairs = layer.rotary.pairs
    queries_per_kv = layer.num_heads // layer.num_kv_heads
    c = torch.tensor([[0.5, -2.0, 3.0, 1.5], [-1.5, 2.5, 0.25, -3.0]], dtype=torch.float64)  # (h_kv, pairs)
    key_scale = torch.ones(layer.num_kv_heads, layer.head_dim, dtype=torch.float64)  # (h_kv, d_h)
    key_scale[:, pairs[:, 0]] = key_scale[:, pairs[:, 1]] = c
    query_scale = key_scale.repeat_interleave(queries_per_kv, dim=0)  # (h, d_h)
    one_coordinate = query_scale.clone()
    one_coordinate[0, 0] *= 2.0
    unequal_in_a_group = query_scale.clone()
    unequal_in_a_group[1] = 1.0  # query head 1 shares KV head 0 with query head 0 but keeps its slice
    query_gain, key_gain = _gains(model)
    reference = decoder_outputs(model)
    for scale, exact in ((query_scale, True), (one_coordinate, False), (unequal_in_a_group, False)):
        moved = apply_transform(model, ModelTransform())
        norms = moved.model.layers[0].self_attn
        with torch.no_grad():
            norms.q_norm.weight.copy_(query_gain * scale.flatten())
            norms.k_norm.weight.copy_(key_gain / key_scale.flatten())
        change = relative_difference(reference, decoder_outputs(moved))
        assert change < FLOAT64_RTOL if exact else change > BROKEN, (change, exact)
