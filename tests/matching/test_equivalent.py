"""equivalent(): planted pairs are equivalent in every dtype; independent pairs, near misses outside the group,
changes confined to a few entries, out-of-scope and buffer changes and differing settings are not."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from torch import nn

from lmc.adapters import apply_transform, model_spec, random_symmetry
from lmc.matching import EQUIVALENCE_RTOL, PROBE_RTOL, AlignmentError, AlignOptions, equivalent
from lmc.matching.checks import model_settings
from lmc.matching.equivalence import ROUNDINGS, UNIT_ROUNDOFF
from lmc.models import create_model, randomize_parameters_
from lmc.symmetry import (
    HEAD_ORDER_ONLY,
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
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
# The largest rounding ratio |a_i - b_i| / (u (|b_i| + (1 + n u_c / u) s)) of a computed entry of a
# planted pair (build(key, seed), random_symmetry(.., seed=100 + seed)) over the 13 architectures and
# seeds 0, 1, 2: the measurement behind lmc.matching.equivalence.ROUNDINGS. Seed 0 runs here.
MEASURED_RATIO = {torch.float64: 6.24, torch.float32: 2.18, torch.bfloat16: 1.47, torch.float16: 1.47}


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
    assert f"{name} (outside scope 'first_attention', so never aligned: it must be bitwise equal)" in result.reason
    # A pair planted over the whole model is not equivalent under a narrower scope's group.
    narrow = equivalent(a, planted(a), scope="first_attention")
    assert not narrow.equivalent and "outside scope 'first_attention'" in narrow.reason


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("key", list(ARCHITECTURES))
def test_true_twins_are_equivalent_in_every_dtype_within_the_measured_ratio(key, dtype):
    a = build(key).to(dtype)
    result = equivalent(a, random_symmetry(a, scope="full_model", seed=100))

    assert result.equivalent, result.reason
    assert not any(result.beyond_bound.values()) and not result.buffer_differences and not result.setting_differences
    ratio = max(result.rounding_ratio.values())
    assert 0 < ratio <= MEASURED_RATIO[dtype]  # rounding shows in the computed entries, no more than measured
    # The margin of the bound over what was measured: 41x, 15x and 2.7x.
    assert result.tolerance.roundings == ROUNDINGS[dtype] >= 2.7 * MEASURED_RATIO[dtype]
    assert result.tolerance.weight == EQUIVALENCE_RTOL[dtype] == ROUNDINGS[dtype] * UNIT_ROUNDOFF[dtype]
    # Only the entries the continuous elements compute carry a rounding ratio: every other is bitwise,
    # OLMo-2's gain slices too (the heads' permutation alone moves them).
    layers = model_spec(a).attention
    gains = {getattr(layer, role).parameter for layer in layers for role in HEAD_ORDER_ONLY if getattr(layer, role)}
    assert set(result.rounding_ratio) == {slot.parameter for layer in layers for slot in layer.slots} - gains


@pytest.mark.parametrize(
    ("key", "dtype"),
    [(key, torch.float32) for key in ARCHITECTURES] + [("ref-lm-rope-half-gqa-swiglu-rms-nobias", d) for d in DTYPES],
)
def test_equal_models_are_equivalent_at_any_tolerance(key, dtype):
    # The solves round equal weights (Stage 2 finds C = I to rounding): the identity, no further from b, is judged.
    a = build(key).to(dtype)
    result = equivalent(a, copy.deepcopy(a), rtol=0)

    assert result.equivalent, result.reason
    assert "every entry bitwise equal" in result.reason
    assert result.transform == ModelTransform() and result.weight_residual == {"scope": 0.0, "all": 0.0}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("key", ["ref-lm-rope-half-gqa-swiglu-rms-nobias", "timm-eva02"])
def test_independent_half_precision_pairs_are_not_equivalent(key, dtype):
    result = equivalent(build(key).to(dtype), build(key, seed=1).to(dtype))
    assert not result.equivalent and result.reason.startswith("different functions")


def _entry_moved(model: nn.Module, name: str, fraction: float) -> nn.Module:
    """A copy whose first entry of ``name`` moved by ``fraction`` of the matrix's largest entry."""
    moved = copy.deepcopy(model)
    weight = dict(moved.named_parameters())[name]
    with torch.no_grad():
        weight.view(-1)[0] += fraction * weight.abs().max()
    return moved


def _scaled(model: nn.Module, name: str, factor: float) -> nn.Module:
    scaled = copy.deepcopy(model)
    with torch.no_grad():
        dict(scaled.named_parameters())[name].mul_(factor)
    return scaled


@pytest.mark.parametrize("key", ["ref-vit-learned", "gpt2", "llama-gqa", "timm-eva02"])
def test_one_entry_of_a_float32_ffn_weight_moved_by_1e_3_of_the_largest_is_not_equivalent(key):
    a = build(key).float()
    name = first_ffn_weight(a)
    b = _entry_moved(planted(a), name, 1e-3)

    result = equivalent(a, b)

    assert not result.equivalent and result.worst_parameter == name
    assert result.beyond_bound == {n: int(n == name) for n in result.beyond_bound}  # that one entry, nothing else
    assert f"{name} (moved by permutations only, so bitwise equal in a twin) has 1 of" in result.reason
    assert result.parameter_residual[name] < 1e-4  # what a tolerance relative to the norm let through


@pytest.mark.parametrize(("dtype", "factor", "old_rtol"), [(torch.bfloat16, 1.04, 5e-2), (torch.float16, 1.008, 1e-2)])
@pytest.mark.parametrize("key", ["ref-lm-rope-half-gqa-swiglu-rms-nobias", "gpt2", "timm-vit"])
def test_a_half_precision_ffn_matrix_scaled_by_a_few_roundings_is_not_equivalent(key, dtype, factor, old_rtol):
    a = build(key).to(dtype)
    name = first_ffn_weight(a)
    symmetric = planted(a)
    b = _scaled(symmetric, name, factor)
    changed = int((dict(b.named_parameters())[name] != dict(symmetric.named_parameters())[name]).sum())

    result = equivalent(a, b)

    assert not result.equivalent and result.worst_parameter == name
    assert result.beyond_bound[name] == changed > 0.9 * dict(b.named_parameters())[name].numel()
    assert sum(result.beyond_bound.values()) == changed
    assert result.parameter_residual[name] < old_rtol  # what a tolerance relative to the norm let through


def test_an_out_of_scope_matrix_times_1_plus_5e_5_is_not_equivalent_in_float32():
    a = build("gpt2").float()
    name = "transformer.h.1.mlp.c_fc.weight"
    b = _scaled(planted(a, "first_attention"), name, 1 + 5e-5)

    result = equivalent(a, b, scope="first_attention")

    assert not result.equivalent and result.worst_parameter == name
    assert result.beyond_bound[name] == int(
        (dict(b.named_parameters())[name] != dict(a.named_parameters())[name]).sum()
    )
    assert f"{name} (outside scope 'first_attention', so never aligned: it must be bitwise equal)" in result.reason
    assert result.parameter_residual[name] < 1e-4  # what a tolerance relative to the norm let through


def test_a_differing_buffer_is_not_equivalent_even_where_the_outputs_cannot_tell():
    a = build("ref-bert-sinusoidal")
    b = planted(a)
    with torch.no_grad():
        dict(b.named_buffers())["pos_table"][3, 5] += 1e-12

    result = equivalent(a, b)

    assert not result.equivalent and result.buffer_differences == {"pos_table": 1}
    assert result.output_residual <= PROBE_RTOL[torch.float64]  # the probe alone cannot tell
    assert not any(result.beyond_bound.values())
    assert "buffers differ (the group moves no buffer, so they must be bitwise equal): pos_table (1 entries)" in (
        result.reason
    )


def _hf_pair(**settings) -> tuple[nn.Module, nn.Module]:
    """A float64 gpt2-tiny and a model with the other ``settings`` holding the same weights."""
    a = randomize_parameters_(create_model("gpt2-tiny", dtype=torch.float64), seed=0)
    b = create_model("gpt2-tiny", dtype=torch.float64, **settings)
    b.load_state_dict(a.state_dict())
    return a, b


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        (
            {"layer_norm_epsilon": 1e-3},
            ["config.layer_norm_epsilon (1e-05 in a, 0.001 in b)", "transformer.h.0.ln_1.eps"],
        ),
        ({"activation_function": "gelu"}, ["config.activation_function ('gelu_new' in a, 'gelu' in b)"]),
    ],
)
def test_equal_weights_with_another_setting_name_it_and_no_tolerance(settings, named):
    a, b = _hf_pair(**settings)
    for other in (b, planted(b)):  # equal weights, and weights related by the group
        result = equivalent(a, other)

        assert not result.equivalent
        assert not any(result.beyond_bound.values())
        field = next(iter(settings))
        assert result.setting_differences[f"config.{field}"] == (getattr(a.config, field), settings[field])
        assert result.reason.startswith("different models: the settings differ: config.")
        assert all(name in result.reason or name in result.setting_differences for name in named)
        assert (
            "no tolerance makes them equivalent" in result.reason and "every entry is within its bound" in result.reason
        )
        assert "lower" not in result.reason and "raise" not in result.reason
    if "activation_function" in settings:
        assert result.setting_differences["transformer.h.0.mlp.act: class"][1].endswith("GELUActivation")


def test_a_module_setting_changed_in_memory_is_named():
    a = build("ref-lm-none")
    b = planted(a)
    norm = next(name for name, module in b.named_modules() if isinstance(module, nn.LayerNorm))
    b.get_submodule(norm).eps = 1e-3

    result = equivalent(a, b)

    assert not result.equivalent and result.setting_differences == {f"{norm}.eps": (1e-5, 1e-3)}
    assert f"{norm}.eps (1e-05 in a, 0.001 in b)" in result.reason


def test_bookkeeping_is_not_a_setting():
    a = build("gpt2")
    b = copy.deepcopy(a)
    b.config.id2label, b.config.label2id = {0: "neg", 1: "pos"}, {"neg": 0, "pos": 1}
    b.config._name_or_path, b.name_or_path, b.config.use_cache = "elsewhere", "elsewhere", False
    b.transformer.h[0].attn.attn_dropout.p = 0.3  # eval applies no dropout
    b.transformer.h[1].attn.resid_dropout = nn.Identity()
    assert model_settings(a) == model_settings(b)
    assert "config.layer_norm_epsilon" in model_settings(a) and "transformer.h.0.ln_1.eps" in model_settings(a)


def test_given_tolerances_loosen_the_computed_entries_only():
    a = build("roformer")
    query = model_spec(a).blocks[0].attention.query.parameter
    b = _scaled(planted(a), query, 1 + 1e-9)
    strict = equivalent(a, b)
    key = model_spec(a).blocks[0].attention.key.parameter
    assert not strict.equivalent and strict.worst_parameter in (query, key)  # Stage 2 shares the change with K
    assert "(computed by the group's continuous elements: largest rounding ratio" in strict.reason
    loose = equivalent(a, b, rtol=2e-9, options=AlignOptions(check_rtol=1e-2))
    assert loose.equivalent, loose.reason
    assert (loose.tolerance.weight, loose.tolerance.output) == (2e-9, 1e-2)
    assert loose.tolerance.roundings == 2e-9 / UNIT_ROUNDOFF[torch.float64]
    assert (loose.tolerance.weight_origin, loose.tolerance.output_origin) == ("given", "given")
    # Entries only a permutation moves stay bitwise whatever rtol says.
    moved = equivalent(a, perturbed(planted(a), first_ffn_weight(a), 1e-12), rtol=1.0)
    assert not moved.equivalent and moved.worst_parameter == first_ffn_weight(a)
    # rtol 0 demands bitwise equality, which the rounding of the planted symmetry denies.
    assert not equivalent(a, planted(a), rtol=0).equivalent
    # Weights within rtol but outputs beyond the output tolerance: not equivalent, and no advice to lower rtol.
    far = equivalent(a, _scaled(planted(a), query, 1.01), rtol=1e-1)
    assert not far.equivalent and far.reason.startswith("different outputs") and "lower" not in far.reason


def test_the_report_serializes_with_the_verdict():
    a = build("llama-gqa")
    result = equivalent(a, planted(a))
    serialized = json.loads(json.dumps(result.to_dict(), allow_nan=False))
    assert serialized["equivalent"] is True and serialized["scope"] == "full_model"
    assert serialized["dtype"] == "float64" and serialized["worst_parameter"] in serialized["parameter_residual"]
    assert serialized["tolerance"] == {
        "weight": EQUIVALENCE_RTOL[torch.float64],
        "output": 1e-6,
        "weight_origin": "float64 default",
        "output_origin": "float64 default",
        "roundings": 256.0,
    }
    assert set(serialized["weight_residual"]) == {"scope", "all"}
    assert serialized["alignment"]["scope"] == "full_model" and serialized["alignment"]["layers"]
    assert set(serialized["beyond_bound"]) == set(serialized["parameter_residual"])
    assert serialized["buffer_differences"] == {} and serialized["setting_differences"] == {}
    other = equivalent(*_hf_pair(layer_norm_epsilon=1e-3)).to_dict()
    assert json.loads(json.dumps(other, allow_nan=False))["setting_differences"]["config.layer_norm_epsilon"] == [
        "1e-05",
        "0.001",
    ]


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
