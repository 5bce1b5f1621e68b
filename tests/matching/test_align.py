"""align(): planted pairs are recovered, independent pairs get closer, bad pairs are refused."""

from __future__ import annotations

import copy
import itertools
import json
from dataclasses import fields

import pytest
import torch
from torch import nn

from lmc.adapters import adapter_for
from lmc.matching import METHODS, METRICS, AlignmentError, align
from lmc.matching.attention import (
    LayerGrams,
    Stage2Options,
    Stage2Problem,
    assign_heads,
    head_cost,
    solve_stage2,
    stage2_problems,
)
from lmc.models import create_model, randomize_parameters_
from lmc.symmetry import SCOPES, model_spec, qk_group, random_symmetry, scope_parameters, vo_group
from tests.architectures import ARCHITECTURES, DEFAULT_OUTPUT_RTOL, OUTPUT_RTOL, build, relative_difference


def scoped_distance(a: nn.Module, b: nn.Module, names: list[str]) -> float:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return sum(float((pa[n] - pb[n]).detach().pow(2).sum()) for n in names) ** 0.5


def scoped_norm(model: nn.Module, names: list[str]) -> float:
    parameters = dict(model.named_parameters())
    return sum(float(parameters[n].detach().pow(2).sum()) for n in names) ** 0.5


def reinitialized(model: nn.Module, scope: str, seed: int) -> nn.Module:
    """A copy whose scope parameters are freshly randomized (an independent fine-tuning run)."""
    fresh = randomize_parameters_(copy.deepcopy(model), seed=seed)
    result = copy.deepcopy(model)
    fresh_parameters, parameters = dict(fresh.named_parameters()), dict(result.named_parameters())
    with torch.no_grad():
        for name in scope_parameters(model, scope):
            parameters[name].copy_(fresh_parameters[name])
    return result


def outputs(model: nn.Module) -> torch.Tensor:
    adapter = adapter_for(model)
    with torch.no_grad():
        return adapter.forward(model, adapter.example_inputs(model, 3, torch.Generator().manual_seed(7)))


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("key", list(ARCHITECTURES))
def test_planted_pairs_are_recovered(key, scope):
    source = build(key)
    target = random_symmetry(source, scope=scope, seed=5)
    names = scope_parameters(source, scope)

    aligned, report = align(source, target, scope=scope)

    assert scoped_distance(aligned, target, names) < 1e-6 * scoped_norm(target, names)
    assert report.distance["aligned"] < 1e-6 * report.distance["naive"]


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("key", list(ARCHITECTURES))
def test_independent_pairs_keep_the_function_and_get_closer_stage_by_stage(key, scope):
    source = build(key, seed=0)
    target = reinitialized(source, scope, seed=1)
    names = scope_parameters(source, scope)
    reference = outputs(source)
    distances = {}
    for method in METHODS:
        aligned, report = align(source, target, scope=scope, method=method)
        assert relative_difference(reference, outputs(aligned)) < OUTPUT_RTOL.get(key, DEFAULT_OUTPUT_RTOL) * 100
        distances[method] = scoped_distance(aligned, target, names)
        if method != "naive":
            spec = model_spec(source)
            for index, element in report.transform.attention.items():
                element.validate(spec.blocks[index].attention)  # never a matrix outside the group
    slack = 1e-9 * distances["naive"]
    assert distances["orthogonal"] <= distances["permutation"] + slack
    assert distances["full"] <= distances["orthogonal"] + slack
    assert distances["full"] < distances["naive"]


@pytest.mark.parametrize("key", ["ref-vit-learned", "ref-vit-rope-interleaved", "gpt2", "roformer", "timm-rope-vit"])
def test_stage1_choice_is_the_best_of_all_24_head_orders(key):
    source = build(key)
    target = random_symmetry(source, scope="first_attention", seed=3)
    layer = model_spec(source).blocks[0].attention
    assert layer.num_heads == 4 and layer.num_kv_heads == 4
    grams = LayerGrams.compute(dict(source.named_parameters()), dict(target.named_parameters()), layer)
    options = Stage2Options()
    chosen, _ = assign_heads(head_cost(grams, layer, "invariant", True, options), 1)

    # Stage 2 after each of the 24 head orders, solved as one batch of 24 x 4 problems per group.
    orders = list(itertools.permutations(range(4)))
    per_order = [stage2_problems(grams, layer, torch.tensor(o), torch.tensor(o)) for o in orders]
    distances = torch.zeros(len(orders), dtype=torch.float64)
    for role, group in ((0, qk_group(layer)), (1, vo_group(layer))):
        batch = Stage2Problem(
            *(torch.cat([getattr(p[role], f.name) for p in per_order]) for f in fields(Stage2Problem))
        )
        distances += batch.distance(solve_stage2(batch, group, True, options)).reshape(len(orders), 4).sum(1)
    ranking = torch.argsort(distances)
    assert orders[ranking[0]] == tuple(chosen.tolist())
    assert distances[ranking[1]] > 1e3 * distances[ranking[0]]  # the optimum is unique


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("key", ["ref-lm-rope-half-gqa-swiglu-rms-nobias", "timm-vit"])
def test_every_head_metric_recovers_planted_pairs(key, metric):
    source = build(key)
    target = random_symmetry(source, scope="all_attention", seed=4)
    names = scope_parameters(source, "all_attention")
    aligned, report = align(source, target, scope="all_attention", metric=metric)
    assert report.metric == metric
    assert scoped_distance(aligned, target, names) < 1e-6 * scoped_norm(target, names)


def test_report_describes_every_stage_and_serializes():
    source = build("llama-gqa")
    target = reinitialized(source, "first_block", seed=1)
    _, report = align(source, target, scope="first_block")
    kinds = [layer.kind for layer in report.layers]
    assert kinds == ["feed_forward", "attention"]
    attention = report.layers[1]
    assert sorted(attention.assignment) == list(range(4)) and sorted(attention.kv_assignment) == [0, 1]
    assert len(attention.stage1_cost) == 4 and len(attention.stage1_cost[0]) == 4
    assert set(attention.distance) == {"naive", "permutation", "orthogonal", "full"}
    assert set(attention.seconds) == {"grams", "stage1", "stage2"}
    assert report.probe_relative_error < 2e-6
    assert json.loads(json.dumps(report.to_dict()))["scope"] == "first_block"


def _unchanged(*models: nn.Module):
    states = [{k: v.clone() for k, v in m.state_dict().items()} for m in models]

    def check() -> None:
        for model, state in zip(models, states):
            for name, value in model.state_dict().items():
                assert torch.equal(value, state[name]), f"{name} was modified"

    return check


@pytest.mark.parametrize(
    ("make_target", "message"),
    [
        (
            lambda s: build("bert"),
            "different architectures: source is GPT2LMHeadModel, target is BertForSequenceClassification",
        ),
        (
            lambda s: randomize_parameters_(create_model("gpt2-tiny", dtype=torch.float64, n_embd=48)),
            "parameters differ in name or shape",
        ),
        (lambda s: randomize_parameters_(create_model("gpt2-tiny", dtype=torch.float64, n_head=2)), "num_heads"),
    ],
)
def test_mismatched_architectures_are_refused(make_target, message):
    source = build("gpt2")
    target = make_target(source)
    check = _unchanged(source, target)
    with pytest.raises(AlignmentError, match=message):
        align(source, target, scope="full_model")
    check()


def test_a_frozen_part_that_differs_is_refused_with_the_parameter_named():
    source = build("gpt2")
    target = reinitialized(source, "first_block", seed=1)  # the first FFN differs too
    check = _unchanged(source, target)
    with pytest.raises(AlignmentError, match=r"scope 'first_attention'.*transformer\.h\.0\.mlp\.c_fc\.weight differs"):
        align(source, target, scope="first_attention")
    check()
    align(source, target, scope="first_block")  # the matching scope is accepted


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused(bad):
    source = build("timm-vit")
    target = reinitialized(source, "first_attention", seed=1)
    with torch.no_grad():
        target.blocks[0].attn.qkv.weight[0, 0] = bad
    with pytest.raises(AlignmentError, match=r"target model's blocks\.0\.attn\.qkv\.weight holds NaN or Inf"):
        align(source, target)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"method": "sinkhorn"}, "unknown method 'sinkhorn'"),
        ({"metric": "cka"}, "unknown metric 'cka'"),
        ({"scope": "everything"}, "unknown scope 'everything'"),
        ({"stepz": 3}, r"unknown option\(s\) \['stepz'\]"),
    ],
)
def test_bad_arguments_are_refused(kwargs, message):
    source = build("ref-lm-none")
    with pytest.raises(AlignmentError, match=message):
        align(source, copy.deepcopy(source), **kwargs)


def test_an_alignment_that_is_not_a_symmetry_raises(monkeypatch):
    """The built-in probe check catches a broken transform instead of returning it."""
    import lmc.matching.alignment as module

    source = build("roformer")
    target = reinitialized(source, "first_attention", seed=1)
    original = module.attention_stages

    def broken(*args, **kwargs):
        stages = original(*args, **kwargs)
        element = stages["full"]
        stages["full"] = type(element)(element.query_permutation, element.kv_permutation, element.vo, element.vo)
        return stages

    monkeypatch.setattr(module, "attention_stages", broken)
    with pytest.raises(AlignmentError, match="does not compute the source's function"):
        align(source, target)
