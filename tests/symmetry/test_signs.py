"""The signs of the residual stream and of units behind odd activations (docs/spec.md, section 2, "Signs").

Both ways, in float64: each sign group the spec declares keeps the function exactly; the nearest flips outside it
(a per-coordinate sign where a LayerNorm allows a global one only, a gain flipped with its input, a sign behind an
activation that is not odd, a sign under a max over tokens) break it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from lmc.adapters import adapter_for, apply_transform, model_spec
from lmc.models import create_model, randomize_parameters_
from lmc.symmetry import AxisPermutation, ModelTransform, SymmetrySpec, sample_signs
from tests.architectures import ARCHITECTURES, DECODERS, FLOAT64_RTOL, OUTPUT_RTOL, build, relative_difference

BROKEN = 1e-4  # a broken symmetry moves these outputs by 1e-2 or more; rounding by 1e-15 (1e-7 after HF's RMSNorms)
RMS_NORM = ["ref-lm-rope-half-gqa-swiglu-rms-nobias", *DECODERS]
WITH_RESIDUAL = [key for key in ARCHITECTURES if key != "ref-bert-sinusoidal"]  # a fixed table pins that stream
LAYER_NORM = [key for key in WITH_RESIDUAL if key not in RMS_NORM]


def outputs(model: nn.Module) -> torch.Tensor:
    adapter = adapter_for(model)
    with torch.no_grad():
        return adapter.forward(model, adapter.example_inputs(model, 3, torch.Generator().manual_seed(0)))


def mixed_signs(size: int, seed: int = 3) -> torch.Tensor:
    """Random ``+-1`` signs with both signs present."""
    signs = 1.0 - 2.0 * torch.randint(2, (size,), generator=torch.Generator().manual_seed(seed)).double()
    signs[:2] = torch.tensor([-1.0, 1.0])
    return signs


def change(model: nn.Module, transform: ModelTransform, spec=None) -> float:
    return relative_difference(outputs(model), outputs(apply_transform(model, transform, spec)))


def kept(key: str) -> float:
    return OUTPUT_RTOL.get(key, FLOAT64_RTOL)


@pytest.mark.parametrize("key", WITH_RESIDUAL)
def test_each_family_declares_the_sign_group_its_norms_allow(key):
    assert model_spec(build(key)).residual.signs == ("each" if key in RMS_NORM else "global")


@pytest.mark.parametrize("key", RMS_NORM)
def test_per_coordinate_residual_signs_keep_an_rms_norm_model(key):
    model = build(key)
    width = model_spec(model).residual.size
    perm = torch.randperm(width, generator=torch.Generator().manual_seed(1))
    assert change(model, ModelTransform(residual=perm, residual_signs=mixed_signs(width))) < kept(key)


@pytest.mark.parametrize("key", LAYER_NORM)
def test_the_global_sign_keeps_a_layer_norm_model_and_one_coordinate_flipped_breaks_it(key):
    model = build(key)
    width = model_spec(model).residual.size
    assert change(model, ModelTransform(residual_signs=-torch.ones(width, dtype=torch.float64))) < kept(key)
    one = torch.ones(width, dtype=torch.float64)
    one[0] = -1.0  # the mean a LayerNorm subtracts no longer flips with the stream
    assert change(model, ModelTransform(residual_signs=one)) > BROKEN


@pytest.mark.parametrize("key", WITH_RESIDUAL)
def test_flipping_the_norm_gains_with_their_input_breaks_every_model(key):
    model = build(key)
    spec = model_spec(model)
    assert spec.residual.unsigned, "the stream's norms have gains the signs must leave alone"
    signs_everywhere = dataclasses.replace(spec, residual=dataclasses.replace(spec.residual, unsigned=()))
    flips = -torch.ones(spec.residual.size, dtype=torch.float64)
    assert change(model, ModelTransform(residual_signs=flips), signs_everywhere) > BROKEN


def head_index(model: nn.Module, name: str) -> int:
    return [head.name for head in model_spec(model).task_heads].index(name)


@pytest.mark.parametrize("key", ["bert", "bert-pretraining"])
def test_the_tanh_poolers_units_flip_one_by_one(key):
    model = build(key)
    index = head_index(model, "bert.pooler")
    assert model_spec(model).task_heads[index].signs == "each"
    assert change(model, ModelTransform(task_head_signs={index: mixed_signs(32)})) < FLOAT64_RTOL


@pytest.mark.parametrize(
    ("key", "head"),
    [("roformer", "classifier"), ("bert-mlm-untied", "cls.predictions.transform")],
)
def test_units_behind_an_activation_that_is_not_odd_have_no_signs(key, head):
    model = build(key)
    index = head_index(model, head)
    assert model_spec(model).task_heads[index].signs == "none"
    for signs in (mixed_signs(32), -torch.ones(32, dtype=torch.float64)):
        assert change(model, ModelTransform(task_head_signs={index: signs})) > BROKEN


def test_roformers_embedding_space_has_the_global_sign_of_its_layer_norm_only():
    model = build("roformer-projected")
    index = head_index(model, "roformer.embeddings")
    assert model_spec(model).task_heads[index].signs == "global"
    assert change(model, ModelTransform(task_head_signs={index: -torch.ones(16, dtype=torch.float64)})) < FLOAT64_RTOL
    assert change(model, ModelTransform(task_head_signs={index: mixed_signs(16)})) > BROKEN


def timm_vit(**overrides) -> nn.Module:
    return randomize_parameters_(create_model("vit-tiny", dtype=torch.float64, **overrides), seed=0)


def test_a_timm_vit_with_rms_norms_flips_each_coordinate():
    from timm.layers import RmsNorm

    model = timm_vit(norm_layer=RmsNorm)
    spec = model_spec(model)
    assert spec.residual.signs == "each"
    width = spec.residual.size
    assert change(model, ModelTransform(residual_signs=mixed_signs(width))) < FLOAT64_RTOL


@pytest.mark.parametrize("pool", ["max", "avgmax"])
def test_a_max_over_tokens_leaves_the_stream_no_sign(pool):
    model = timm_vit(global_pool=pool)
    spec = model_spec(model)
    assert spec.residual.signs == "none"
    flips = -torch.ones(spec.residual.size, dtype=torch.float64)
    assert change(model, ModelTransform(residual_signs=flips)) > BROKEN  # max(-x) = -min(x)


def test_sampled_signs_follow_the_group_and_compose():
    each = AxisPermutation("units", 6, (("w", 0),), signs="each")
    generator = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_signs(each, generator) for _ in range(50)])
    assert set(draws.unique().tolist()) == {-1.0, 1.0} and bool((draws.abs() == 1).all())
    one = AxisPermutation("units", 6, (("w", 0),), signs="global")
    assert all(len(sample_signs(one, generator).unique()) == 1 for _ in range(20))
    assert sample_signs(AxisPermutation("units", 6, (("w", 0),)), generator) is None

    # (p1, s1) then (p2, s2) is (p1[p2], s1[p2] * s2), as applying one after the other does.
    weight = torch.randn(6, 3, dtype=torch.float64)
    first = ModelTransform(task_heads={0: torch.tensor([2, 0, 1, 5, 4, 3])}, task_head_signs={0: mixed_signs(6, 1)})
    then = ModelTransform(task_heads={0: torch.tensor([1, 2, 0, 3, 5, 4])}, task_head_signs={0: mixed_signs(6, 2)})
    spec = SymmetrySpec(blocks=(), task_heads=(each,))
    stepwise, composed = {"w": weight.clone()}, {"w": weight.clone()}
    first.apply_(stepwise, spec)
    then.apply_(stepwise, spec)
    first.compose(then, spec).apply_(composed, spec)
    assert torch.equal(stepwise["w"], composed["w"])


def test_unsigned_axes_must_be_among_the_permutations_axes():
    with pytest.raises(ValueError, match=r"unsigned axes \[\('gain', 0\)\] are not among"):
        AxisPermutation("units", 4, (("w", 0),), signs="each", unsigned=(("gain", 0),))
