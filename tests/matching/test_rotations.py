"""Alignment with the extended group (``residual="orthogonal"``): both models folded, the stream rotated by
orthogonal Procrustes inside the coordinate descent (docs/spec.md, section 3, "Rotations").

A twin made by a rotation of the folded model (with the fold's scales put back, so that the fold itself is part of
what is recovered) comes back to the folded target to float64 rounding; where the family allows no rotation the
option aligns with the signed permutations and says why.
"""

from __future__ import annotations

import pytest
import torch

from lmc.adapters import apply_transform, fold_norms, model_spec
from lmc.matching import AlignOptions, align, equivalent
from lmc.matching.layers import best_rotation
from lmc.symmetry import ModelTransform, ResidualGroup, in_group, residual_group, sample_rotation, sample_transform
from tests.architectures import build
from tests.matching.test_signs import RECOVERED
from tests.symmetry.test_rotations import RESTRICTED, ROTATING

ORTHOGONAL = AlignOptions(residual="orthogonal")


@torch.no_grad()
def unfolded(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """``model`` (folded) with random positive gains put back on its foldable norms and divided out of their
    readers: the same function, weights in another frame of the fold's orbit."""
    parameters = dict(model.named_parameters())
    generator = torch.Generator().manual_seed(seed)
    for fold in model_spec(model).folds:
        if fold.gain is None:
            continue
        gain = 0.5 + torch.rand(parameters[fold.gain].shape, generator=generator, dtype=torch.float64)
        parameters[fold.gain].copy_(gain - fold.gain_offset)
        if fold.bias is not None and not fold.folds_bias:  # a bias no reader takes stays, times the gain
            parameters[fold.bias].mul_(gain)
        for reader in fold.readers:
            shape = [1, 1]
            shape[reader.axis] = -1
            parameters[reader.weight].div_(gain.view(shape))
    return model


def rotated_twin(key: str, seed: int = 5) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(model, twin)``: the twin is the folded model moved by a random element of the whole extended group (heads,
    FFN units, signed permutation and a dense rotation of the stream), then unfolded with other gains."""
    model = build(key)
    spec = model_spec(model)
    transform = sample_transform(spec, "full_model", torch.Generator().manual_seed(seed), rotate=True)
    assert transform.residual_rotation is not None
    return model, unfolded(apply_transform(fold_norms(model), transform, spec), seed)


@pytest.mark.parametrize("key", ROTATING)
def test_a_rotated_twin_is_recovered_in_the_folded_frame(key):
    model, twin = rotated_twin(key)

    aligned, report = align(twin, model, "full_model", ORTHOGONAL)

    group = residual_group(model_spec(model))
    assert report.residual_group == group.name
    assert report.folded == [fold.norm for fold in model_spec(model).folds]
    assert report.distance["aligned"] <= RECOVERED * report.distance["naive"]
    target = dict(fold_norms(model).named_parameters())
    for name, parameter in aligned.named_parameters():
        torch.testing.assert_close(
            parameter, target[name], rtol=0, atol=1e-10 * float(target[name].detach().abs().max())
        )
    assert in_group(report.transform.residual_matrix(group.width), group)
    (residual,) = [layer for layer in report.layers if layer.kind == "residual"]
    assert residual.rotation > 0.1  # the element found is a rotation, far from every signed permutation
    assert report.to_dict()["residual_group"] == group.name


@pytest.mark.parametrize("key", ["llama-gqa", "gpt-neox-parallel", "timm-vit"])
def test_the_permutation_group_cannot_recover_a_rotated_twin(key):
    model, twin = rotated_twin(key)
    folded_twin = fold_norms(twin)

    _, report = align(folded_twin, fold_norms(model), "full_model", AlignOptions(method="permutation"))

    assert report.distance["aligned"] > 0.1 * report.distance["naive"]


@pytest.mark.parametrize("key", RESTRICTED)
def test_where_no_rotation_is_allowed_the_signed_permutations_recover_a_signed_twin(key):
    model = build(key)
    spec = model_spec(model)
    twin = apply_transform(model, sample_transform(spec, "full_model", torch.Generator().manual_seed(6)), spec)

    aligned, report = align(twin, model, "full_model", ORTHOGONAL)

    assert report.residual_group.startswith(f"signed permutations of {spec.residual.size} (")
    assert "does not fold" in report.residual_group
    assert report.distance["aligned"] <= RECOVERED * report.distance["naive"]
    assert report.transform.residual_rotation is None


def test_outside_full_model_or_with_activation_matching_the_option_is_refused():
    model = build("llama-gqa")
    with pytest.raises(ValueError, match="residual='orthogonal' rotates the residual stream by weight, which scope"):
        align(model, model, "all_attention", ORTHOGONAL)
    with pytest.raises(
        ValueError,
        match="residual='orthogonal' rotates the residual stream by weight, which unit_matching='activation'",
    ):
        AlignOptions(residual="orthogonal", unit_matching="activation")
    with pytest.raises(ValueError, match="unknown residual 'rotation'"):
        AlignOptions(residual="rotation")


@pytest.mark.parametrize("kind", ["orthogonal", "centered_orthogonal"])
def test_the_rotation_step_is_the_best_rotation_of_its_group(kind):
    """Procrustes against random rotations of the group: none scores higher; the identity's gain is 0 on a
    correlation whose best rotation is the identity."""
    width = 6
    group = ResidualGroup(kind, width)
    generator = torch.Generator().manual_seed(7)
    correlation = torch.randn(width, width, generator=generator, dtype=torch.float64)
    rotation, gain = best_rotation(correlation, group, torch.float64)
    assert in_group(rotation, group)
    best = float((rotation * correlation.T).sum())
    for _ in range(200):
        other = sample_rotation(group, generator)
        assert float((other * correlation.T).sum()) <= best + 1e-12
    assert gain > 0
    symmetric = correlation @ correlation.T + torch.eye(width, dtype=torch.float64)  # positive definite
    if kind == "centered_orthogonal":
        basis = torch.linalg.qr(torch.cat([torch.ones(width, 1, dtype=torch.float64), symmetric], dim=1))[0]
        symmetric = basis[:, :width] @ torch.diag(torch.arange(1.0, width + 1).double()) @ basis[:, :width].T
    identity, gain = best_rotation(symmetric, group, torch.float64)
    torch.testing.assert_close(identity, torch.eye(width, dtype=torch.float64), rtol=0, atol=1e-12)
    assert gain < 1e-14


@pytest.mark.parametrize("key", ["llama-gqa", "gpt-neox-parallel", "timm-vit"])
def test_a_rotated_twin_is_equivalent_under_the_extended_group_only(key):
    model, twin = rotated_twin(key)

    verdict = equivalent(twin, model, "full_model", ORTHOGONAL)
    assert verdict.equivalent, verdict.reason
    assert f"related by the full_model (folded, residual {residual_group(model_spec(model)).name}) group" in (
        verdict.reason
    )
    stored = equivalent(twin, model, "full_model")
    assert not stored.equivalent
    assert stored.reason.startswith("same outputs on the probe")


def test_a_rotation_a_layernorm_forbids_is_not_equivalent():
    """Under GPT-NeoX's LayerNorms a rotation must fix the all-ones direction: one that does not changes the
    function, and the extended group does not relate the pair."""
    model = build("gpt-neox-parallel")
    spec = model_spec(model)
    rotation = sample_rotation(ResidualGroup("orthogonal", spec.residual.size), torch.Generator().manual_seed(8))
    twin = apply_transform(fold_norms(model), ModelTransform(residual_rotation=rotation), spec)

    verdict = equivalent(twin, model, "full_model", ORTHOGONAL)

    assert not verdict.equivalent
    assert verdict.reason.startswith("different functions")


def test_identical_models_are_equivalent_under_the_extended_group_at_any_tolerance():
    model = build("llama-gqa")
    verdict = equivalent(model, model, "full_model", ORTHOGONAL, rtol=0)
    assert verdict.equivalent, verdict.reason
