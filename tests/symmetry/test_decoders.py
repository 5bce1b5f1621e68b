"""Llama-like decoders declared as data (lmc.adapters.decoders): what each family adds to Llama.

The generic tests (test_invariance.py, test_groups.py, test_describe.py, tests/matching) run on
every entry of tests/architectures.DECODERS; these check what is specific to each family.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from lmc.adapters import UnsupportedModelError, adapter_for, apply_transform, describe, model_spec, random_symmetry
from lmc.adapters.decoders import DecoderAdapter, DecoderLayout
from lmc.models import create_model, randomize_parameters_
from lmc.symmetry import SCOPES, ModelTransform, general_linear, qk_group, sample_attention_transform
from tests.architectures import (
    ARCHITECTURES,
    DECODERS,
    build,
    float64_gemma_rms_norm,
    float64_norms,
    float64_rms_norm,
    relative_difference,
)
from tests.symmetry.test_groups import commutant_dimension, rotations

BROKEN = 1e-4


def outputs(model: nn.Module, length: int | None = None) -> torch.Tensor:
    adapter = adapter_for(model)
    inputs = adapter.example_inputs(model, 3, torch.Generator().manual_seed(0))
    if length is not None:
        inputs["input_ids"] = torch.randint(
            model.config.vocab_size, (3, length), generator=torch.Generator().manual_seed(1)
        )
    with torch.no_grad():
        return adapter.forward(model, inputs)


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("key", DECODERS)
def test_random_symmetry_is_exact_when_the_norms_compute_in_float64(key, scope, monkeypatch):
    model = build(key)
    float64_norms(model, monkeypatch)
    transformed = random_symmetry(model, scope=scope, seed=1)
    assert relative_difference(outputs(model), outputs(transformed)) < 1e-12


def test_mistral_window_masks_the_probe_and_leaves_the_group_unchanged():
    model = build("mistral-swa")
    window = model.config.sliding_window
    probe = adapter_for(model).example_inputs(model, 1, torch.Generator().manual_seed(0))["input_ids"]
    assert probe.shape[1] > window  # the mask drops keys: the invariance tests see a windowed model
    unwindowed = build("mistral-swa")
    unwindowed.config.sliding_window = None
    assert relative_difference(outputs(model), outputs(unwindowed)) > BROKEN
    # Same group as Llama's: the window acts on positions, never on head coordinates.
    assert [(layer["qk_group"], layer["qk_group_dim"]) for layer in describe(model)] == [("H", 8), ("H", 8)]
    transformed = random_symmetry(model, scope="all_attention", seed=3)
    assert relative_difference(outputs(model, 24), outputs(transformed, 24)) < 2e-6


def test_qwen2_with_windows_on_some_layers_keeps_the_group(monkeypatch):
    """Qwen2's use_sliding_window masks the layers from max_window_layers on: positions again, not coordinates."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    monkeypatch.setattr(Qwen2RMSNorm, "forward", float64_rms_norm)
    windowed = dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)
    model = randomize_parameters_(create_model("qwen2-tiny", dtype=torch.float64, **windowed), seed=0)
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    full = randomize_parameters_(create_model("qwen2-tiny", dtype=torch.float64), seed=0)
    assert relative_difference(outputs(model), outputs(full)) > BROKEN  # the window masks the 16-token probe
    for scope in SCOPES:
        transformed = random_symmetry(model, scope=scope, seed=1)
        assert relative_difference(outputs(model), outputs(transformed)) < 1e-12, scope


def test_a_window_sees_offsets_whose_commutant_is_the_whole_group():
    """C must commute with R_t for t < w only; for w >= 2 that is the commutant of every offset."""
    model = build("mistral-swa")
    layer = model_spec(model).blocks[0].attention
    window = model.config.sliding_window
    seen = rotations(layer.rotary, layer.head_dim)[:window]  # R_0 .. R_(w-1): the offsets inside the window
    assert commutant_dimension(seen) == commutant_dimension(rotations(layer.rotary, layer.head_dim))
    assert commutant_dimension(seen) == qk_group(layer).num_coordinates == layer.head_dim


def test_a_window_of_one_is_refused():
    model = create_model("mistral-tiny", dtype=torch.float64, sliding_window=1)
    with pytest.raises(UnsupportedModelError, match="sliding_window=1 is not supported"):
        model_spec(model)


def test_qwen2_biases_move_with_the_group_and_an_element_that_leaves_them_breaks_it():
    model = build("qwen2-gqa")
    layer = model_spec(model).blocks[0].attention
    assert (layer.query_bias, layer.key_bias, layer.value_bias) != (None, None, None)
    assert layer.out_bias is None  # Qwen2's o_proj has no bias
    element = sample_attention_transform(layer, torch.Generator().manual_seed(2))
    transformed = apply_transform(model, ModelTransform(attention={0: element}))
    assert relative_difference(outputs(model), outputs(transformed)) < 2e-6
    for bias in ("q_proj", "k_proj", "v_proj"):  # the same element with one bias left where it was
        near_miss = apply_transform(model, ModelTransform(attention={0: element}))
        original = model.get_submodule(f"model.layers.0.self_attn.{bias}").bias
        with torch.no_grad():
            near_miss.get_submodule(f"model.layers.0.self_attn.{bias}").bias.copy_(original)
        assert relative_difference(outputs(model), outputs(near_miss)) > BROKEN, bias


def test_a_model_that_differs_from_its_declaration_is_refused():
    model = build("qwen2-gqa")
    model.model.layers[1].self_attn.q_proj = nn.Linear(32, 32, bias=False, dtype=torch.float64)
    with pytest.raises(UnsupportedModelError, match=r"missing: \['model\.layers\.1\.self_attn\.q_proj\.bias'\]"):
        model_spec(model)

    from transformers.models.mistral.modeling_mistral import MistralDecoderLayer

    class ParallelLayer(MistralDecoderLayer):
        """Same parameters, another function."""

    model = build("mistral-swa")
    model.model.layers[0].__class__ = ParallelLayer
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.0 is a .*ParallelLayer"):
        model_spec(model)


def test_a_declared_rotary_fraction_is_checked_against_the_model():
    class HalfRotaryLlama(DecoderAdapter):
        layout = DecoderLayout("Llama", "transformers.models.llama.modeling_llama", rotary_fraction=0.5)

    with pytest.raises(UnsupportedModelError, match=r"Llama rotary width 8 != 4 \(rotary_fraction 0.5"):
        HalfRotaryLlama().spec(create_model("llama-tiny", dtype=torch.float64))  # no biases, as declared


def test_gemma2_caps_and_windows_its_scores_and_keeps_llamas_group(monkeypatch):
    """Soft-capping maps each score (and logit) injectively: the group is G_RoPE (spec.md, "Other variants")."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    monkeypatch.setattr(Gemma2RMSNorm, "forward", float64_gemma_rms_norm)
    model = build("gemma2-capped")
    assert model.config.layer_types == ["sliding_attention", "full_attention"]
    assert [(layer["qk_group"], layer["qk_group_dim"]) for layer in describe(model)] == [("H", 8), ("H", 8)]
    without = {"attn_logit_softcapping": None, "final_logit_softcapping": None, "layer_types": ["full_attention"] * 2}
    for field, value in without.items():
        other = create_model("gemma2-tiny", dtype=torch.float64, attention_bias=True, **{field: value})
        randomize_parameters_(other, seed=0)  # the same weights
        assert relative_difference(outputs(model), outputs(other)) > BROKEN, field  # each one acts on the probe
    layer = model_spec(model).blocks[0].attention
    element = sample_attention_transform(layer, torch.Generator().manual_seed(2))
    assert (
        relative_difference(outputs(model), outputs(apply_transform(model, ModelTransform(attention={0: element}))))
        < 1e-12
    )
    too_large = sample_attention_transform(layer, torch.Generator().manual_seed(2), general_linear(8))
    broken = apply_transform(model, ModelTransform(attention={0: too_large}))
    assert relative_difference(outputs(model), outputs(broken)) > BROKEN


def test_phi3_reads_its_fused_rows_as_blocks_and_moves_both_copies_of_each_unit(monkeypatch):
    """[Q | K | V] blocks with GQA (not GPT-NeoX's per-head rows); a unit's gate and up rows move together."""
    from transformers.models.phi3.modeling_phi3 import Phi3RMSNorm

    from lmc.symmetry import HeadSlot, read_attention, transform_attention, write_attention
    from lmc.symmetry.transforms import permute_axes

    monkeypatch.setattr(Phi3RMSNorm, "forward", float64_rms_norm)
    model = build("phi3-partial")
    layer = model_spec(model).blocks[0].attention
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    weights = read_attention(dict(model.named_parameters()), layer)
    assert torch.equal(weights.key[1], qkv[32 + 8 : 32 + 16].T) and torch.equal(weights.value[0], qkv[48:56].T)
    element = sample_attention_transform(layer, torch.Generator().manual_seed(2))
    kept = apply_transform(model, ModelTransform(attention={0: element}))
    assert relative_difference(outputs(model), outputs(kept)) < 1e-12
    # The same element with the key and value blocks read the other way round moves the wrong rows.
    name = f"{layer.name}.qkv_proj.weight"
    wrong = dataclasses.replace(layer, key=HeadSlot(name, 0, 48), value=HeadSlot(name, 0, 32))
    broken = apply_transform(model, ModelTransform())
    parameters = dict(broken.named_parameters())
    write_attention(parameters, wrong, transform_attention(read_attention(parameters, wrong), element))
    assert relative_difference(outputs(model), outputs(broken)) > BROKEN
    shift = torch.roll(torch.arange(64), 1)
    gate_only = apply_transform(model, ModelTransform())
    with torch.no_grad():
        rows = gate_only.model.layers[0].mlp.gate_up_proj.weight
        rows[:64] = rows[:64][shift].clone()  # the gate copy alone
    assert relative_difference(outputs(model), outputs(gate_only)) > BROKEN
    both = apply_transform(model, ModelTransform())
    permute_axes(dict(both.named_parameters()), model_spec(model).blocks[0].feed_forward.hidden, shift)
    assert relative_difference(outputs(model), outputs(both)) < 1e-12


@pytest.mark.parametrize("key", ["llama-gqa", "gemma-gqa"])  # SwiGLU, GeGLU
def test_a_gated_unit_scales_on_up_and_down_exactly_but_not_on_its_gate(key, monkeypatch):
    """An exact symmetry lmc leaves out of its group (docs/spec.md, section 2): up by a, down by 1/a, per unit."""
    model = build(key)
    float64_norms(model, monkeypatch)
    reference = outputs(model)
    scales = torch.linspace(-2.0, 3.0, 64, dtype=torch.float64)  # non-zero, signs included
    scales[scales.abs() < 0.1] = 0.5
    for projection, exact in (("up_proj", True), ("gate_proj", False)):
        scaled = apply_transform(model, ModelTransform())
        mlp = scaled.model.layers[0].mlp
        with torch.no_grad():
            getattr(mlp, projection).weight.mul_(scales[:, None])
            mlp.down_proj.weight.div_(scales[None, :])
        change = relative_difference(reference, outputs(scaled))
        assert change < 1e-12 if exact else change > BROKEN, (projection, change)


def test_a_pre_norm_gain_folds_into_its_linear_readers_exactly(monkeypatch):
    """Also left out of lmc's group (docs/spec.md, section 2): g / c on the norm, c on every reader's input columns."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    monkeypatch.setattr(LlamaRMSNorm, "forward", float64_rms_norm)
    model = build("llama-gqa")
    c = torch.linspace(0.5, 2.0, 32, dtype=torch.float64)
    for readers, exact in ((("q_proj", "k_proj", "v_proj"), True), (("q_proj", "k_proj"), False)):
        folded = apply_transform(model, ModelTransform())
        layer = folded.model.layers[0]
        with torch.no_grad():
            layer.input_layernorm.weight.div_(c)
            for name in readers:
                getattr(layer.self_attn, name).weight.mul_(c[None, :])
        change = relative_difference(outputs(model), outputs(folded))
        assert change < 1e-12 if exact else change > BROKEN, (readers, change)


# Families whose attention adds something to Llama's, and the dimension of lmc's Q/K group of a head
# of 8: H(8) where every coordinate rotates, 2 pairs of H times GL(4) under Phi-3's half rotary.
QK_DIMENSIONS = {"mistral-swa": 8, "qwen2-gqa": 8, "gemma-gqa": 8, "gemma2-capped": 8, "phi3-partial": 4 + 16}


@pytest.mark.parametrize("key", list(QK_DIMENSIONS))
def test_the_group_has_the_dimension_of_the_models_own_symmetries(key, monkeypatch):
    """Windows, q/k/v biases, (1 + w) norms and capping, fused blocks: lmc's group is complete, not a subgroup.

    One query head per KV head, so that head 0's ``(C, C^-T)`` moves nothing else (Qwen3: test_qwen3.py).
    """
    from tests.symmetry.test_gpt_neox import _null_dimension, _qk_tangent, _vo_tangent

    zoo_name, overrides = ARCHITECTURES[key]
    model = randomize_parameters_(create_model(zoo_name, dtype=torch.float64, **overrides, num_key_value_heads=4))
    float64_norms(model, monkeypatch)
    layer = model_spec(model).blocks[0].attention
    assert _null_dimension(model, _qk_tangent) == qk_group(layer).num_coordinates == QK_DIMENSIONS[key]
    assert _null_dimension(model, _vo_tangent) == layer.head_dim**2  # GL(d_h) on V/O
