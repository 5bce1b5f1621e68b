"""Rotations of the residual stream after the fold: the group each family allows keeps the function; the nearest
rotation outside it breaks it (docs/spec.md, section 2, "Rotations of the stream").

float64 throughout (HF's RMSNorms computed in float64 for these tests, tests/architectures.float64_norms).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lmc.adapters import apply_transform, fold_norms, model_spec
from lmc.symmetry import (
    ModelTransform,
    ResidualGroup,
    SymmetrySpec,
    centered_basis,
    in_group,
    residual_group,
    sample_rotation,
    sample_transform,
)
from tests.architectures import ARCHITECTURES, FLOAT64_RTOL, build, float64_norms, relative_difference
from tests.symmetry.test_folds import BROKEN, outputs

# test id -> the group derived from its spec (lmc.symmetry.residual_group): O(d) where RMSNorms fold, O(d-1) x Z2
# where LayerNorms fold, the signed permutations where a gain that does not fold scales the stream (post-norms,
# sublayer-output norms, the final norm under a tied head, timm's layer scales), nothing without a residual group.
EXPECTED = {key: "centered_orthogonal" for key in ARCHITECTURES} | {
    "ref-bert-sinusoidal": None,  # a sinusoidal table added to the stream: no residual group at all
    "ref-lm-rope-half-gqa-swiglu-rms-nobias": "orthogonal",
    **dict.fromkeys(["llama-gqa", "mistral-swa", "qwen2-gqa", "qwen3-gqa", "phi3-partial"], "orthogonal"),
    **dict.fromkeys(
        ["gpt2", "gemma-gqa"],
        "signed_permutation",  # the final norm's gain is read by the tied head
    ),
    **dict.fromkeys(["olmo2-gqa", "gemma2-capped"], "signed_permutation"),  # norms on the sublayers' outputs
    **dict.fromkeys(
        ["bert", "bert-mlm", "bert-mlm-untied", "bert-pretraining", "roformer", "roformer-projected"],
        "signed_permutation",  # post-norms: their gains scale the stream itself
    ),
    "timm-rope-vit": "signed_permutation",  # layer scales multiply the sublayers' outputs
}
ROTATING = [key for key, kind in EXPECTED.items() if kind in ("orthogonal", "centered_orthogonal")]
RESTRICTED = [key for key, kind in EXPECTED.items() if kind == "signed_permutation"]


def rotated(model: torch.nn.Module, rotation: torch.Tensor) -> torch.nn.Module:
    return apply_transform(model, ModelTransform(residual_rotation=rotation))


def forced(spec: SymmetrySpec, leave: set[tuple[str, int]]) -> SymmetrySpec:
    """``spec`` with the residual axes ``leave`` out of its stream: a rotation then passes by those gains, as a
    rotation outside the group would have to."""
    kept = [axis for axis in spec.residual.axes if axis not in leave]
    return dataclasses.replace(spec, residual=spec.residual.restricted(kept))


@pytest.mark.parametrize("key", list(ARCHITECTURES))
def test_each_family_has_the_derived_group(key):
    group = residual_group(model_spec(build(key)))
    assert (None if group is None else group.kind) == EXPECTED[key]
    if group is not None:
        width = group.width
        assert (
            group.dimension
            == {
                "orthogonal": width * (width - 1) // 2,
                "centered_orthogonal": (width - 1) * (width - 2) // 2,
                "signed_permutation": 0,
            }[group.kind]
        )


@pytest.mark.parametrize("key", ROTATING)
def test_a_rotation_of_the_group_keeps_the_folded_function(key, monkeypatch):
    model = build(key)
    float64_norms(model, monkeypatch)
    folded = fold_norms(model)
    group = residual_group(model_spec(model))
    rotation = sample_rotation(group, torch.Generator().manual_seed(1))
    assert in_group(rotation, group)
    assert (rotation.abs() > 1e-3).sum() > 4 * group.width  # a dense rotation, not a signed permutation

    assert relative_difference(outputs(model), outputs(rotated(folded, rotation))) < FLOAT64_RTOL


@pytest.mark.parametrize("key", [key for key in ROTATING if EXPECTED[key] == "centered_orthogonal"])
def test_under_a_layernorm_a_rotation_that_moves_the_all_ones_direction_breaks_it(key, monkeypatch):
    model = build(key)
    float64_norms(model, monkeypatch)
    folded = fold_norms(model)
    width = model_spec(model).residual.size
    rotation = sample_rotation(ResidualGroup("orthogonal", width), torch.Generator().manual_seed(1))
    assert not in_group(rotation, ResidualGroup("centered_orthogonal", width))

    assert relative_difference(outputs(model), outputs(rotated(folded, rotation))) > BROKEN


@pytest.mark.parametrize("key", ROTATING)
def test_without_the_fold_a_rotation_breaks_it(key, monkeypatch):
    model = build(key)
    float64_norms(model, monkeypatch)
    spec = model_spec(model)
    group = residual_group(spec)
    rotation = sample_rotation(group, torch.Generator().manual_seed(1))

    with pytest.raises(ValueError, match="fold the norms first"):
        rotated(model, rotation)
    # The same rotation with the gains forced through anyway (unfolded, not constant): another function.
    moved = ModelTransform(residual_rotation=rotation)
    unfolded = apply_transform(model, moved, forced(spec, set(spec.residual.unsigned)))
    assert relative_difference(outputs(model), outputs(unfolded)) > BROKEN


@pytest.mark.parametrize("key", RESTRICTED)
def test_where_a_gain_does_not_fold_a_rotation_breaks_the_folded_function(key, monkeypatch):
    model = build(key)
    float64_norms(model, monkeypatch)
    spec = model_spec(model)
    folded = fold_norms(model)
    width = spec.residual.size
    kind = "orthogonal" if spec.residual.signs == "each" else "centered_orthogonal"
    rotation = sample_rotation(ResidualGroup(kind, width), torch.Generator().manual_seed(1))
    unfolded = {axis for axis in spec.residual.unsigned if axis[0] not in {fold.gain for fold in spec.folds}}

    moved = apply_transform(folded, ModelTransform(residual_rotation=rotation), forced(spec, unfolded))
    assert relative_difference(outputs(model), outputs(moved)) > BROKEN
    # ... while the group's own elements, its signed permutations, keep it.
    signed = sample_transform(spec, "full_model", torch.Generator().manual_seed(2), rotate=True)
    assert signed.residual_rotation is None
    assert relative_difference(outputs(model), outputs(apply_transform(folded, signed))) < FLOAT64_RTOL


def test_the_centered_basis_and_rotations_fix_the_all_ones_direction():
    width = 7
    basis = centered_basis(width)
    torch.testing.assert_close(basis.T @ basis, torch.eye(width, dtype=torch.float64), rtol=0, atol=1e-14)
    torch.testing.assert_close(basis[:, 0], torch.full((width,), width**-0.5, dtype=torch.float64), rtol=0, atol=1e-15)
    group = ResidualGroup("centered_orthogonal", width)
    signs = set()
    for seed in range(8):
        rotation = sample_rotation(group, torch.Generator().manual_seed(seed))
        image = rotation @ torch.ones(width, dtype=torch.float64)
        sign = float(image[0])
        torch.testing.assert_close(image, torch.full((width,), sign, dtype=torch.float64), rtol=0, atol=1e-13)
        signs.add(round(sign))
    assert signs == {-1, 1}  # both components of O(d-1) x Z2 are sampled


def test_composition_with_permutations_and_signs_is_the_product_of_the_matrices():
    model = build("llama-gqa")
    spec = model_spec(model)
    generator = torch.Generator().manual_seed(3)
    first = sample_transform(spec, "full_model", generator, rotate=True)
    then = sample_transform(spec, "full_model", generator, rotate=True)
    width = spec.residual.size
    composed = first.compose(then, spec)
    torch.testing.assert_close(
        composed.residual_matrix(width), then.residual_matrix(width) @ first.residual_matrix(width), rtol=0, atol=0
    )
    folded = fold_norms(model)
    one_by_one = apply_transform(apply_transform(folded, first, spec), then, spec)
    at_once = apply_transform(folded, composed, spec)
    for (name, a), b in zip(one_by_one.named_parameters(), at_once.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13, msg=name)
