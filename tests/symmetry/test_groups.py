"""The matrix groups: H is exactly the commutant of the model's rotations; elements compose and invert."""

from __future__ import annotations

import math

import pytest
import torch

from lmc.adapters import model_spec
from lmc.rotary import rotary_pairs
from lmc.symmetry import (
    AttentionTransform,
    RotaryLayout,
    general_linear,
    qk_group,
    read_attention,
    rotary_commutant,
    sample_attention_transform,
    transform_attention,
)
from tests.architectures import QK_NORM, ROPE, build


def rotations(layout: RotaryLayout, head_dim: int) -> torch.Tensor:
    """The matrices ``R_n`` with ``x -> x @ R_n`` at every position, shape (T, head_dim, head_dim)."""
    count = layout.angles.shape[0]
    matrices = torch.eye(head_dim, dtype=torch.float64).repeat(count, 1, 1)
    cos, sin = layout.angles.cos(), layout.angles.sin()
    for j, (first, second) in enumerate(layout.pairs.tolist()):
        matrices[:, first, first] = cos[:, j]
        matrices[:, second, second] = cos[:, j]
        matrices[:, first, second] = sin[:, j]
        matrices[:, second, first] = -sin[:, j]
    return matrices


def commutant_dimension(matrices: torch.Tensor) -> int:
    """Dimension of ``{C : C R = R C for every R}``, by the null space of the stacked linear system."""
    dim = matrices.shape[-1]
    eye = torch.eye(dim, dtype=torch.float64)
    # Row-major vec: vec(C R) = (I kron R^T) vec(C), vec(R C) = (R kron I) vec(C).
    system = torch.cat([torch.kron(eye, r.T.contiguous()) - torch.kron(r, eye) for r in matrices])
    singular = torch.linalg.svdvals(system)
    return dim * dim - int((singular > 1e-8 * singular[0]).sum())


def layout_with(frequencies: list[float], head_dim: int, kind: str = "interleaved") -> RotaryLayout:
    positions = torch.arange(16, dtype=torch.float64)[:, None]
    return RotaryLayout(kind, rotary_pairs(kind, 2 * len(frequencies)), positions * torch.tensor(frequencies)[None])


CASES = {
    "distinct": ([1.0, 0.3, 0.1, 0.01], 8),
    "duplicate": ([1.0, 1.0, 0.1, 0.01], 8),  # pairs 0 and 1 mix under GL(2, C)
    "opposite": ([1.0, -1.0, 0.1, 0.01], 8),  # pair 1 turns backwards: joins pair 0, orientation flipped
    "zero-frequency": ([1.0, 0.0, 0.1, 0.01], 8),  # pair 1 never turns: real GL
    "partial": ([1.0, 0.1], 8),  # coordinates 4..7 never rotate
}


@pytest.mark.parametrize("case", list(CASES))
def test_rotary_group_is_exactly_the_commutant_of_its_rotations(case):
    frequencies, head_dim = CASES[case]
    layout = layout_with(frequencies, head_dim)
    group = rotary_commutant(head_dim, layout)
    rotation = rotations(layout, head_dim)

    assert group.num_coordinates == commutant_dimension(rotation)  # complete, not a subgroup
    elements = group.sample(5, torch.Generator().manual_seed(0))
    assert group.contains(elements)
    for element in elements:
        torch.testing.assert_close(element @ rotation, rotation @ element, rtol=0, atol=1e-12)


def test_h_has_dimension_head_dim_and_scaled_rotation_blocks():
    group = rotary_commutant(8, layout_with([1.0, 0.3, 0.1, 0.01], 8))
    assert (group.name, group.num_coordinates) == ("H", 8)
    element = group.sample(1, torch.Generator().manual_seed(0))[0]
    for first, second in rotary_pairs("interleaved", 8).tolist():
        block = element[[first, second]][:, [first, second]]
        torch.testing.assert_close(block[0, 0], block[1, 1], rtol=0, atol=1e-14)
        torch.testing.assert_close(block[0, 1], -block[1, 0], rtol=0, atol=1e-14)
    mask = torch.block_diag(*[torch.ones(2, 2)] * 4).bool()
    assert torch.all(element[~mask] == 0)


@pytest.mark.parametrize("key", [key for key in ROPE if key not in QK_NORM])  # QK-norms: test_qwen3.py
def test_each_rope_model_gets_the_full_commutant_of_its_own_rotations(key):
    layer = model_spec(build(key)).blocks[0].attention
    group = qk_group(layer)
    assert group.num_coordinates == commutant_dimension(rotations(layer.rotary, layer.head_dim))
    assert group.name == "H"


def test_projection_is_idempotent_and_contains_rejects_outsiders():
    group = rotary_commutant(8, layout_with([1.0, 0.3, 0.1, 0.01], 8))
    noise = torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    projected = group.project(noise)
    torch.testing.assert_close(group.project(projected), projected, rtol=0, atol=1e-15)
    assert group.contains(projected) and not group.contains(noise)
    assert not group.contains(torch.zeros(1, 8, 8, dtype=torch.float64))  # singular
    assert general_linear(8).contains(noise)


def test_samples_are_well_conditioned():
    elements = general_linear(16).sample(20, torch.Generator().manual_seed(0), scale=0.7)
    assert float(torch.linalg.cond(elements).max()) < math.exp(2 * 0.7) + 1e-9


@pytest.mark.parametrize("key", ["llama-gqa", "timm-rope-vit", "gpt2"])
def test_inverse_undoes_and_compose_chains(key):
    layer = model_spec(model := build(key)).blocks[0].attention
    weights = read_attention(dict(model.named_parameters()), layer)
    first = sample_attention_transform(layer, torch.Generator().manual_seed(1))
    second = sample_attention_transform(layer, torch.Generator().manual_seed(2))

    undone = transform_attention(transform_attention(weights, first), first.inverse())
    chained = transform_attention(transform_attention(weights, first), second)
    composed = transform_attention(weights, first.compose(second))

    for name in ("query", "key", "value", "out", "query_bias", "value_bias"):
        if getattr(weights, name) is None:
            continue
        # Entries of at most 1.9; measured differences at most 4.4e-16 (undone) and 6.7e-16 (composed).
        torch.testing.assert_close(getattr(undone, name), getattr(weights, name), rtol=0, atol=1e-12)
        torch.testing.assert_close(getattr(composed, name), getattr(chained, name), rtol=0, atol=1e-12)
    first.compose(second).validate(layer)
    first.inverse().validate(layer)


def test_validate_rejects_elements_outside_the_group():
    layer = model_spec(build("roformer")).blocks[0].attention
    identity = AttentionTransform.identity(layer)
    generic = general_linear(layer.head_dim).sample(layer.num_kv_heads, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"qk is not in the layer's H\(8\) group"):
        AttentionTransform(identity.query_permutation, identity.kv_permutation, generic, identity.vo).validate(layer)
    with pytest.raises(ValueError, match="not a permutation"):
        AttentionTransform(
            torch.zeros(4, dtype=torch.long), identity.kv_permutation, identity.qk, identity.vo
        ).validate(layer)
    with pytest.raises(ValueError, match="must have shape"):
        AttentionTransform(identity.query_permutation, identity.kv_permutation, identity.qk[:1], identity.vo).validate(
            layer
        )
