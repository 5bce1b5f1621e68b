"""Alignment and equivalence with the signs of the residual stream (docs/spec.md, section 3, "Signs").

A twin made with residual signs the norms allow is recovered to float64 rounding and called equivalent; flips
the norms forbid make a twin that is neither; the signs are part of the residual step's assignment, proven
optimal on small problems by enumerating every signed permutation.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from lmc.adapters import apply_transform, model_spec
from lmc.matching import AlignOptions, align, equivalent
from lmc.matching.layers import signed_units
from lmc.symmetry import AxisPermutation, sample_transform
from tests.architectures import build
from tests.symmetry.test_signs import WITH_RESIDUAL, mixed_signs

RECOVERED = 1e-10  # aligned / naive weight distance of a planted twin (measured: at most 2.3e-16)


def planted(key: str, seed: int = 4):
    """``(model, twin, flips)``: a twin made by a random element of the whole group with non-trivial residual signs."""
    model = build(key)
    spec = model_spec(model)
    transform = sample_transform(spec, "full_model", torch.Generator().manual_seed(seed))
    width = spec.residual.size
    transform.residual_signs = mixed_signs(width) if spec.residual.signs == "each" else -torch.ones(width).double()
    return model, apply_transform(model, transform, spec), int((transform.residual_signs < 0).sum())


@pytest.mark.parametrize("key", WITH_RESIDUAL)
def test_a_twin_with_residual_signs_is_recovered_and_the_report_counts_the_flips(key):
    model, twin, flips = planted(key)

    aligned, report = align(twin, model, "full_model")

    assert report.distance["aligned"] <= RECOVERED * report.distance["naive"]
    (residual,) = [layer for layer in report.layers if layer.kind == "residual"]
    assert residual.flipped == flips > 0
    assert report.transform.residual_flips == flips
    assert report.to_dict()["layers"][report.layers.index(residual)]["flipped"] == flips


@pytest.mark.parametrize("key", ["ref-lm-rope-half-gqa-swiglu-rms-nobias", "llama-gqa", "gpt2", "bert", "timm-vit"])
def test_a_twin_with_residual_signs_is_equivalent(key):
    model, twin, _ = planted(key)
    verdict = equivalent(twin, model, "full_model")
    assert verdict.equivalent, verdict.reason


def test_a_flip_a_layer_norm_forbids_is_neither_recovered_nor_equivalent():
    model = build("gpt2")
    spec = model_spec(model)
    forbidden = dataclasses.replace(spec, residual=dataclasses.replace(spec.residual, signs="each"))
    transform = sample_transform(forbidden, "full_model", torch.Generator().manual_seed(4))
    transform.residual_signs = mixed_signs(spec.residual.size)
    twin = apply_transform(model, transform, spec)

    _, report = align(twin, model, "full_model")
    verdict = equivalent(twin, model, "full_model")

    assert report.distance["aligned"] > 0.1 * report.distance["naive"]
    assert not verdict.equivalent and verdict.reason.startswith("different functions")


@pytest.mark.parametrize("key", ["ref-lm-rope-half-gqa-swiglu-rms-nobias", "llama-gqa"])
def test_gains_flipped_with_the_stream_make_a_twin_that_is_not_equivalent(key):
    model = build(key)
    spec = model_spec(model)
    transform = sample_transform(spec, "full_model", torch.Generator().manual_seed(4))
    transform.residual_signs = mixed_signs(spec.residual.size)
    everything = dataclasses.replace(spec, residual=dataclasses.replace(spec.residual, unsigned=()))
    twin = apply_transform(model, transform, everything)
    assert not equivalent(twin, model, "full_model").equivalent


def brute_force(correlation: torch.Tensor, unsigned: torch.Tensor, global_sign: bool) -> float:
    """The best ``sum_i U[perm[i], i] + s_i S[perm[i], i]`` over every signed permutation."""
    size = correlation.shape[0]
    signed = correlation - unsigned
    sign_choices = [(1.0,) * size, (-1.0,) * size] if global_sign else list(itertools.product((1.0, -1.0), repeat=size))
    best = -float("inf")
    for perm in itertools.permutations(range(size)):
        rows = torch.tensor(perm)
        for signs in sign_choices:
            value = unsigned[rows, torch.arange(size)] + torch.tensor(signs).double() * signed[rows, torch.arange(size)]
            best = max(best, float(value.sum()))
    return best


@pytest.mark.parametrize("group", ["each", "global"])
@pytest.mark.parametrize("seed", range(5))
def test_the_signed_assignment_is_the_best_signed_permutation(group, seed):
    generator = torch.Generator().manual_seed(seed)
    correlation = torch.randn(5, 5, generator=generator, dtype=torch.float64)
    unsigned = torch.randn(5, 5, generator=generator, dtype=torch.float64).abs()  # gains: a positive share
    units = AxisPermutation("units", 5, (("w", 0), ("g", 0)), signs=group, unsigned=(("g", 0),))

    perm, signs = signed_units(correlation, unsigned, units, torch.float64)

    found = unsigned[perm, torch.arange(5)] + signs * (correlation - unsigned)[perm, torch.arange(5)]
    assert float(found.sum()) == pytest.approx(brute_force(correlation, unsigned, group == "global"), abs=1e-12)
    if group == "global":
        assert len(signs.unique()) == 1


@pytest.mark.parametrize("key", ["llama-gqa", "gpt2"])
def test_the_papers_group_leaves_the_signs_out(key):
    """residual='unsigned' aligns with permutations only: a twin with signs stays apart (no residual flip is
    found), a twin without them is recovered."""
    model, twin, flips = planted(key)
    unsigned = AlignOptions(residual="unsigned")

    _, report = align(twin, model, "full_model", unsigned)

    (residual,) = [layer for layer in report.layers if layer.kind == "residual"]
    assert residual.flipped is None and report.transform.residual_signs is None
    assert report.distance["aligned"] > 0.01 * report.distance["naive"]
    spec = model_spec(model)
    transform = sample_transform(spec, "full_model", torch.Generator().manual_seed(4))
    transform.residual_signs = None
    _, plain = align(apply_transform(model, transform, spec), model, "full_model", unsigned)
    assert plain.distance["aligned"] <= RECOVERED * plain.distance["naive"]
