"""timm's register tokens permute among themselves, with their rows of ``pos_embed`` (docs/spec.md, section 2)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from lmc.adapters import apply_transform, model_spec, scope_parameters
from lmc.matching import AlignOptions, align
from lmc.models import create_model, randomize_parameters_
from lmc.symmetry import SCOPES, AxisPermutation, ModelTransform, explain_axes, sample_transform, unexplained_axes
from lmc.symmetry.transforms import permute_axes
from tests.architectures import FLOAT64_RTOL, relative_difference
from tests.matching.test_align import outputs, scoped_distance, scoped_norm
from tests.matching.test_data_aware import calibration
from tests.symmetry.test_invariance import BROKEN

# test id -> (zoo name, config overrides): every place a register token can take in timm's sequence.
CONFIGS: dict[str, tuple[str, dict]] = {
    "rows-after-the-class-token": ("vit-tiny", {"reg_tokens": 3}),  # pos_embed rows [class | registers | patches]
    "no-rows": ("vit-tiny", {"reg_tokens": 3, "no_embed_class": True}),  # pos_embed covers the patches only
    "rows-first": ("vit-tiny", {"reg_tokens": 3, "class_token": False, "global_pool": "avg"}),  # [registers | ...]
    "no-class-token-no-rows": (
        "vit-tiny",
        {"reg_tokens": 3, "class_token": False, "no_embed_class": True, "global_pool": "avgmax"},
    ),
    "max-pool-over-every-token": ("vit-tiny", {"reg_tokens": 3, "global_pool": "max", "pool_include_prefix": True}),
    "eva02-rope": ("eva02-tiny", {"num_reg_tokens": 3}),  # RoPE turns the patches only
}
WITH_ROWS = ["rows-after-the-class-token", "rows-first", "max-pool-over-every-token", "eva02-rope"]
CYCLE = torch.tensor([1, 2, 0])  # no register token stays in place


def build(config: str, seed: int = 0) -> nn.Module:
    name, overrides = CONFIGS[config]
    return randomize_parameters_(create_model(name, dtype=torch.float64, **overrides), seed=seed)


def moved(model: nn.Module, tokens: AxisPermutation) -> nn.Module:
    """A copy of ``model`` with ``tokens`` moved by :data:`CYCLE`."""
    result = copy.deepcopy(model)
    permute_axes(dict(result.named_parameters()), tokens, CYCLE)
    return result


@pytest.mark.parametrize("config", list(CONFIGS))
def test_permuting_the_register_tokens_keeps_the_function(config):
    model = build(config)
    spec = model_spec(model)
    assert spec.tokens is not None and spec.tokens.size == 3
    permuted = apply_transform(model, ModelTransform(tokens=CYCLE), spec)
    # Float64 rounding: at most 2.6e-16 relative (measured).
    assert relative_difference(outputs(model), outputs(permuted)) < FLOAT64_RTOL
    before, after = model.reg_token.detach(), permuted.reg_token.detach()
    assert torch.equal(after, before[:, CYCLE])
    if config in WITH_ROWS:
        first = spec.tokens.span(("pos_embed", 1), model.pos_embed.shape[1])[0]
        assert first == (0 if config == "rows-first" else 1)
        rows = slice(first, first + 3)
        assert torch.equal(permuted.pos_embed[:, rows], model.pos_embed[:, rows][:, CYCLE])
        others = torch.ones(model.pos_embed.shape[1], dtype=torch.bool)
        others[rows] = False
        assert torch.equal(permuted.pos_embed[:, others], model.pos_embed[:, others])


@pytest.mark.parametrize("wrong", ["rows left in place", "the rows one entry off"])
@pytest.mark.parametrize("config", WITH_ROWS)
def test_register_tokens_moved_without_their_own_rows_change_the_function(config, wrong):
    model = build(config)
    tokens = model_spec(model).tokens
    if wrong == "rows left in place":
        tokens = dataclasses.replace(tokens, axes=(("reg_token", 1),), offsets=())
    else:
        tokens = dataclasses.replace(tokens, offsets=((("pos_embed", 1), tokens.offsets[0][1] + 1),))
    assert relative_difference(outputs(model), outputs(moved(model, tokens))) > BROKEN


def test_with_every_token_output_the_register_tokens_keep_their_places():
    model = randomize_parameters_(
        create_model("vit-tiny", dtype=torch.float64, reg_tokens=3, no_embed_class=True, global_pool=""), seed=0
    )
    spec = model_spec(model)
    assert spec.tokens is None
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert explain_axes(spec, "full_model", shapes)[("reg_token", 1)].reason == "positions"
    assert unexplained_axes(spec, "full_model", shapes) == []
    # The output lists every token in its place: permuting the register tokens permutes the output's rows.
    tokens = AxisPermutation("reg_token", 3, (("reg_token", 1),))
    assert relative_difference(outputs(model), outputs(moved(model, tokens))) > BROKEN


@pytest.mark.parametrize("config", list(CONFIGS))
def test_every_axis_of_a_register_token_model_is_explained(config):
    model = build(config)
    spec = model_spec(model)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    for scope in SCOPES:
        assert unexplained_axes(spec, scope, shapes) == [], scope
        role = explain_axes(spec, scope, shapes)[("reg_token", 1)]
        # Outside full_model the register tokens are frozen, like every embedding.
        assert (role.group, role.reason) == (("reg_token", None) if scope == "full_model" else (None, "scope"))
    if config in WITH_ROWS:  # the token permutation moves a sub-range; the class token's and patches' rows stay
        assert explain_axes(spec, "full_model", shapes)[("pos_embed", 1)].reason == "positions"


@pytest.mark.parametrize("unit_matching", ["weight", "activation"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_planted_full_model_pair_with_permuted_register_tokens_is_recovered(config, unit_matching):
    source = build(config)
    spec = model_spec(source)
    planted = sample_transform(spec, "full_model", torch.Generator().manual_seed(5))
    planted.tokens = CYCLE
    target = apply_transform(source, planted, spec)
    names = scope_parameters(source, "full_model")
    options = AlignOptions(unit_matching=unit_matching, calibration_batches=2)

    aligned, report = align(source, target, "full_model", options, calibration(target))

    # Float64 rounding only (measured at most 5e-16 of the norm).
    assert scoped_distance(aligned, target, names) < FLOAT64_RTOL * scoped_norm(target, names)
    assert torch.equal(report.transform.tokens, CYCLE)
    (record,) = [layer for layer in report.layers if layer.kind == "tokens"]
    assert record.name == "reg_token" and record.assignment == torch.argsort(CYCLE).tolist()
    assert record.distance["permutation"] < FLOAT64_RTOL * record.distance["naive"]
