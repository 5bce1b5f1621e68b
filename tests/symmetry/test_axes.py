"""Every parameter axis is moved by a group of the scope or fixed for a stated reason (docs/spec.md, section 2)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from lmc.adapters import model_spec
from lmc.models import create_model
from lmc.symmetry import (
    REASONS,
    SCOPES,
    AxisPermutation,
    FixedAxes,
    SymmetrySpec,
    explain_axes,
    unexplained_axes,
)
from tests.architectures import ARCHITECTURES, build


@functools.cache
def spec_and_shapes(key: str) -> tuple[SymmetrySpec, dict[str, tuple[int, ...]]]:
    model = build(key)
    return model_spec(model), {name: tuple(p.shape) for name, p in model.named_parameters()}


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("key", list(ARCHITECTURES))
def test_every_axis_is_moved_or_fixed_for_a_reason(key, scope):
    spec, shapes = spec_and_shapes(key)
    assert unexplained_axes(spec, scope, shapes) == []
    reasons = {role.reason for role in explain_axes(spec, scope, shapes).values()} - {None}
    assert reasons <= set(REASONS)
    if scope == "full_model":  # the whole model freezes nothing: every axis is a group's or declared
        assert "scope" not in reasons


def test_roformer_embedding_space_without_its_permutation_leaves_exactly_its_axes():
    spec, shapes = spec_and_shapes("roformer-projected")
    embedding_space = [head for head in spec.task_heads if head.name == "roformer.embeddings"]
    assert len(embedding_space) == 1
    incomplete = dataclasses.replace(spec, task_heads=tuple(h for h in spec.task_heads if h not in embedding_space))
    e = "roformer.embeddings"
    assert unexplained_axes(incomplete, "full_model", shapes) == [
        (f"{e}.word_embeddings.weight", 1),
        (f"{e}.token_type_embeddings.weight", 1),
        (f"{e}.LayerNorm.weight", 0),
        (f"{e}.LayerNorm.bias", 0),
        ("roformer.embeddings_project.weight", 1),
    ]
    # The narrower scopes freeze the embeddings, so they need no permutation there.
    assert all(unexplained_axes(incomplete, scope, shapes) == [] for scope in SCOPES[:-1])


def test_a_fused_qkv_bias_missing_its_value_slot_is_caught_though_the_others_cover_most_of_it():
    spec, shapes = spec_and_shapes("timm-vit")
    layer = dataclasses.replace(spec.blocks[0].attention, value_bias=None)
    incomplete = dataclasses.replace(
        spec, blocks=(dataclasses.replace(spec.blocks[0], attention=layer),) + spec.blocks[1:]
    )
    for scope in SCOPES:
        assert unexplained_axes(incomplete, scope, shapes) == [("blocks.0.attn.qkv.bias", 0)]


def test_a_group_outside_the_scope_excuses_only_axes_it_shares_with_frozen_parameters():
    # A residual permutation confined to the first attention layer moves no frozen parameter under
    # first_attention, so it does not excuse the axes that scope leaves unmoved.
    spec, shapes = spec_and_shapes("ref-lm-none")
    a = "blocks.0.attn"
    confined = [(f"{a}.{p}_proj.weight", 1) for p in "qkv"] + [(f"{a}.o_proj.weight", 0), (f"{a}.o_proj.bias", 0)]
    incomplete = dataclasses.replace(spec, residual=AxisPermutation("residual", 32, tuple(confined)))
    assert unexplained_axes(incomplete, "first_attention", shapes) == confined
    assert unexplained_axes(spec, "first_attention", shapes) == []


def test_fixed_axes_of_timm_vit_say_what_indexes_them():
    spec, shapes = spec_and_shapes("timm-vit")
    fixed = {axis: role.reason for axis, role in explain_axes(spec, "full_model", shapes).items() if role.reason}
    assert fixed == {
        ("cls_token", 0): "singleton",
        ("cls_token", 1): "singleton",
        ("pos_embed", 0): "singleton",
        ("pos_embed", 1): "positions",
        ("patch_embed.proj.weight", 1): "inputs",  # channels
        ("patch_embed.proj.weight", 2): "inputs",  # patch rows
        ("patch_embed.proj.weight", 3): "inputs",  # patch columns
        ("head.weight", 0): "classes",
        ("head.bias", 0): "classes",
    }


def test_an_axis_declared_fixed_that_a_group_moves_is_refused():
    spec, shapes = spec_and_shapes("ref-lm-none")
    wrong = dataclasses.replace(
        spec, fixed_axes=spec.fixed_axes + (FixedAxes("vocabulary", (("token_embed.weight", 1),)),)
    )
    with pytest.raises(ValueError, match=r"axis 1 of token_embed.weight fixed \(vocabulary\), but residual moves it"):
        explain_axes(wrong, "full_model", shapes)


def test_an_axis_declared_fixed_that_the_model_lacks_is_refused():
    spec, shapes = spec_and_shapes("ref-lm-none")
    wrong = dataclasses.replace(
        spec, fixed_axes=spec.fixed_axes + (FixedAxes("positions", (("token_embed.weight", 2),)),)
    )
    with pytest.raises(
        ValueError, match="axis 2 of token_embed.weight fixed .positions., but the model has no such axis"
    ):
        explain_axes(wrong, "full_model", shapes)


def test_timm_register_tokens_without_their_permutation_leave_exactly_their_axis():
    model = create_model("vit-tiny", dtype=torch.float64, reg_tokens=2, no_embed_class=True)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    spec = model_spec(model)
    assert unexplained_axes(spec, "full_model", shapes) == []
    assert explain_axes(spec, "full_model", shapes)[("reg_token", 1)].group == "reg_token"
    assert unexplained_axes(dataclasses.replace(spec, tokens=None), "full_model", shapes) == [("reg_token", 1)]
