"""equivalent(): planted pairs are equivalent, independent pairs and near misses outside the group are not."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from torch import nn

from lmc.adapters import apply_transform, model_spec, random_symmetry
from lmc.matching import EQUIVALENCE_RTOL, PROBE_RTOL, AlignmentError, AlignOptions, equivalent
from lmc.symmetry import (
    SCOPES,
    ModelTransform,
    general_linear,
    read_attention,
    sample_attention_transform,
    write_attention,
)
from tests.architectures import APE, ARCHITECTURES, DEFAULT_OUTPUT_RTOL, OUTPUT_RTOL, ROPE, build

# Worst relative residual of one parameter after aligning a float64 planted pair: observed
# 8.6e-16 over the 13 architectures (rounding of the transformed weights), so a few ulps.
PLANTED_FLOAT64 = 3e-15
# The same in float32: observed 1.9e-7.
PLANTED_FLOAT32 = 1e-6


def first_ffn_weight(model: nn.Module) -> str:
    parameters = dict(model.named_parameters())
    names = model_spec(model).blocks[0].feed_forward.parameters
    return next(name for name in names if parameters[name].ndim == 2)


def perturbed(model: nn.Module, name: str, relative: float, seed: int = 0) -> nn.Module:
    """A copy with ``name`` moved by ``relative`` of its norm in a random direction (not a symmetry)."""
    result = copy.deepcopy(model)
    weight = dict(result.named_parameters())[name]
    noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    with torch.no_grad():
        weight.add_((noise * (relative * weight.double().norm() / noise.norm())).to(weight.dtype))
    return result


def planted(model: nn.Module, scope: str = "full_model") -> nn.Module:
    return random_symmetry(model, scope=scope, seed=5)


@pytest.mark.parametrize("key", list(ARCHITECTURES))
def test_planted_pairs_are_equivalent_to_rounding_in_float64(key):
    a = build(key)
    b = planted(a)

    result = equivalent(a, b)

    assert result.equivalent, result.reason
    assert result.reason.startswith("related by the full_model group")
    assert max(result.parameter_residual.values()) < PLANTED_FLOAT64
    assert result.weight_residual["scope"] < PLANTED_FLOAT64 and result.weight_residual["all"] < PLANTED_FLOAT64
    assert result.output_residual < OUTPUT_RTOL.get(key, DEFAULT_OUTPUT_RTOL)
    assert result.tolerance == dataclasses.replace(
        result.tolerance, weight=EQUIVALENCE_RTOL[torch.float64], output=PROBE_RTOL[torch.float64]
    )
    assert (result.tolerance.weight_origin, result.tolerance.output_origin) == ("float64 default", "float64 default")
    spec = model_spec(a)
    assert set(result.transform.attention) == set(range(len(spec.blocks)))
    for index, element in result.transform.attention.items():
        element.validate(spec.blocks[index].attention)  # the element found lies in the group


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("key", ["ref-lm-rope-half-gqa-swiglu-rms-nobias", "bert", "timm-eva02"])
def test_planted_pairs_are_equivalent_at_their_own_scope(key, scope):
    a = build(key)
    result = equivalent(a, planted(a, scope), scope=scope)
    assert result.equivalent, result.reason
    assert max(result.parameter_residual.values()) < PLANTED_FLOAT64


@pytest.mark.parametrize("key", list(ARCHITECTURES))
def test_independent_pairs_are_not_equivalent(key):
    a, b = build(key, seed=0), build(key, seed=1)

    result = equivalent(a, b)

    assert not result.equivalent
    assert result.reason.startswith("different functions")
    assert result.output_residual > 0.1 and result.weight_residual["all"] > 0.1


@pytest.mark.parametrize("key", ROPE)
def test_generic_gl_on_a_rope_layers_queries_and_keys_is_not_equivalent(key):
    """``W_Q -> W_Q C``, ``W_K -> W_K C^{-T}`` keeps ``Q K^T`` but not RoPE's scores unless ``C`` is in ``H``."""
    a = build(key)
    spec = model_spec(a)
    layer = spec.blocks[0].attention
    element = sample_attention_transform(layer, torch.Generator().manual_seed(2), general_linear(layer.head_dim))
    b = apply_transform(a, ModelTransform(attention={0: element}), spec)

    result = equivalent(a, b)

    assert not result.equivalent
    assert result.reason.startswith("different functions")
    assert result.worst_parameter in layer.parameters  # the part outside H stays after alignment
    assert result.parameter_residual[result.worst_parameter] > 0.1  # observed >= 0.31
    assert result.output_residual > 1e-3  # observed >= 1.1e-2


@pytest.mark.parametrize("key", list(ARCHITECTURES))
def test_one_ffn_weight_moved_off_the_group_is_not_equivalent(key):
    a = build(key)
    name = first_ffn_weight(a)
    symmetric = planted(a)
    b = perturbed(symmetric, name, 1e-3)

    result = equivalent(a, b)

    assert not result.equivalent
    assert result.worst_parameter == name
    moved, original = dict(b.named_parameters())[name], dict(symmetric.named_parameters())[name]
    change = float((moved - original).detach().norm() / moved.detach().norm())  # ~1e-3
    assert result.parameter_residual[name] == pytest.approx(change, rel=1e-9)  # alignment undid the symmetry only
    assert result.output_residual > PROBE_RTOL[torch.float64]


@pytest.mark.parametrize("key", ["ref-lm-none", "gpt2", "timm-eva02"])
def test_a_change_too_small_for_the_outputs_is_still_caught_by_the_weights(key):
    a = build(key)
    name = first_ffn_weight(a)

    result = equivalent(a, perturbed(planted(a), name, 1e-8))

    assert not result.equivalent and result.worst_parameter == name
    assert result.output_residual <= PROBE_RTOL[torch.float64]
    assert result.reason.startswith("same outputs on the probe")


@pytest.mark.parametrize("key", APE)
def test_same_function_outside_the_group_is_reported_as_such(key):
    """Without RoPE a shift of the key bias changes no output (softmax ignores it), but no group element makes it."""
    a = build(key)
    layer = model_spec(a).blocks[0].attention
    if layer.key_bias is None:
        pytest.skip(f"{key} has no key bias")
    b = copy.deepcopy(a)
    parameters = dict(b.named_parameters())
    weights = read_attention(parameters, layer)
    shift = torch.randn(weights.key_bias.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.no_grad():
        write_attention(parameters, layer, dataclasses.replace(weights, key_bias=weights.key_bias + shift))

    result = equivalent(a, b)

    assert not result.equivalent
    assert result.output_residual < DEFAULT_OUTPUT_RTOL
    assert result.worst_parameter in layer.parameters  # Stage 2 spreads the shift over the layer
    assert (
        result.reason.startswith("same outputs on the probe") and "not related by the full_model group" in result.reason
    )


def test_a_difference_outside_the_scope_is_not_equivalent_and_named():
    a = build("gpt2")
    name = "transformer.h.1.mlp.c_fc.weight"
    b = perturbed(planted(a, "first_attention"), name, 1e-3)

    result = equivalent(a, b, scope="first_attention")

    assert not result.equivalent
    assert result.weight_residual["scope"] < PLANTED_FLOAT64  # the scope itself was aligned exactly
    assert result.worst_parameter == name
    assert f"{name} (outside scope 'first_attention', so never aligned)" in result.reason
    # A pair planted over the whole model is not equivalent under a narrower scope's group.
    narrow = equivalent(a, planted(a), scope="first_attention")
    assert not narrow.equivalent and "outside scope 'first_attention'" in narrow.reason


@pytest.mark.parametrize("key", list(ARCHITECTURES))
def test_float32_defaults_accept_planted_pairs_and_refuse_near_misses(key):
    a = build(key).float()
    result = equivalent(a, planted(a))
    assert result.equivalent, result.reason
    assert max(result.parameter_residual.values()) < PLANTED_FLOAT32
    assert result.tolerance.weight == EQUIVALENCE_RTOL[torch.float32] == 1e-4
    assert not equivalent(a, perturbed(planted(a), first_ffn_weight(a), 1e-3)).equivalent


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("key", ["ref-lm-rope-half-gqa-swiglu-rms-nobias", "gpt2", "timm-eva02"])
def test_half_precision_planted_pairs_are_equivalent(key, dtype):
    a = build(key).to(dtype)
    result = equivalent(a, planted(a))
    assert result.equivalent, result.reason
    assert max(result.parameter_residual.values()) < EQUIVALENCE_RTOL[dtype] / 5  # observed 2e-4 and 1.7e-3
    assert not equivalent(a, build(key, seed=1).to(dtype)).equivalent


def test_given_tolerances_are_used_and_reported():
    a = build("roformer")
    b = perturbed(planted(a), first_ffn_weight(a), 1e-3)
    loose = equivalent(a, b, rtol=2e-3, options=AlignOptions(check_rtol=1e-2))
    assert loose.equivalent, loose.reason
    assert (loose.tolerance.weight, loose.tolerance.output) == (2e-3, 1e-2)
    assert (loose.tolerance.weight_origin, loose.tolerance.output_origin) == ("given", "given")
    # Weights within rtol but outputs beyond the output tolerance: not equivalent, and said so.
    strict_outputs = equivalent(a, b, rtol=2e-3)
    assert not strict_outputs.equivalent and strict_outputs.reason.startswith("different outputs")


def test_the_report_serializes_with_the_verdict():
    a = build("llama-gqa")
    result = equivalent(a, planted(a))
    serialized = json.loads(json.dumps(result.to_dict()))
    assert serialized["equivalent"] is True and serialized["scope"] == "full_model"
    assert serialized["dtype"] == "float64" and serialized["worst_parameter"] in serialized["parameter_residual"]
    assert serialized["tolerance"] == {
        "weight": 1e-10,
        "output": 1e-6,
        "weight_origin": "float64 default",
        "output_origin": "float64 default",
    }
    assert set(serialized["weight_residual"]) == {"scope", "all"}
    assert serialized["alignment"]["scope"] == "full_model" and serialized["alignment"]["layers"]


def test_bad_input_is_refused_and_inputs_are_never_modified():
    a, b = build("gpt2"), build("gpt2", seed=1)
    states = [{k: v.clone() for k, v in m.state_dict().items()} for m in (a, b)]
    with pytest.raises(ValueError, match=r"rtol must be None \(the dtype's default\) or a finite number >= 0"):
        equivalent(a, b, rtol=-1.0)
    with pytest.raises(ValueError, match="unknown scope 'everything'"):
        equivalent(a, b, scope="everything")
    with pytest.raises(AlignmentError, match="different architectures"):
        equivalent(a, build("bert"))
    with pytest.raises(AlignmentError, match="differ in dtype"):
        equivalent(a, copy.deepcopy(b).float())
    equivalent(a, perturbed(b, "transformer.h.1.mlp.c_fc.weight", 1.0), scope="first_attention")  # frozen differ
    for model, state in zip((a, b), states):
        for name, value in model.state_dict().items():
            assert torch.equal(value, state[name]), f"{name} was modified"
