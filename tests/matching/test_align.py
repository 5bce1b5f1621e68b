"""align(): planted pairs are recovered, independent pairs get closer, bad pairs are refused."""

from __future__ import annotations

import copy
import itertools
import json
from dataclasses import asdict, fields

import pytest
import torch
from torch import nn

from lmc.adapters import adapter_for, model_spec, random_symmetry, scope_parameters
from lmc.matching import METHODS, METRICS, PROBE_RTOL, AlignmentError, AlignOptions, align
from lmc.matching.grams import LayerGrams
from lmc.matching.heads import assign_heads, head_cost
from lmc.matching.stage2 import Stage2Problem, solve_stage2, stage2_problems
from lmc.models import create_model, randomize_parameters_
from lmc.symmetry import SCOPES, qk_group, vo_group
from tests.architectures import ARCHITECTURES, FLOAT64_RTOL, OUTPUT_RTOL, build, relative_difference


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

    # Recovered to float64 rounding: at most 5.2e-16 of the norm and 4.9e-16 of the naive distance (measured).
    assert scoped_distance(aligned, target, names) < FLOAT64_RTOL * scoped_norm(target, names)
    assert report.distance["aligned"] < FLOAT64_RTOL * report.distance["naive"]


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("key", list(ARCHITECTURES))
def test_independent_pairs_keep_the_function_and_get_closer_stage_by_stage(key, scope):
    source = build(key, seed=0)
    target = reinitialized(source, scope, seed=1)
    names = scope_parameters(source, scope)
    reference = outputs(source)
    distances = {}
    for method in (m for m in METHODS if m != "learned"):  # learned needs a calibration: test_learned.py
        aligned, report = align(source, target, scope=scope, options=AlignOptions(method=method))
        # The function is kept to float64 rounding: at most 1.2e-15 relative (llama-gqa: 1.3e-7, its float32 norm).
        assert relative_difference(reference, outputs(aligned)) < OUTPUT_RTOL.get(key, FLOAT64_RTOL)
        distances[method] = scoped_distance(aligned, target, names)
        if method != "naive":
            spec = model_spec(source)
            for index, element in report.transform.attention.items():
                element.validate(spec.blocks[index].attention)  # never a matrix outside the group
    slack = FLOAT64_RTOL * distances["naive"]  # rounding only: no stage ended above the one before it (measured)
    assert distances["orthogonal"] <= distances["permutation"] + slack
    assert distances["full"] <= distances["orthogonal"] + slack
    assert distances["full"] < distances["naive"]


# The two Linears around each task head's own nonlinearity: (writes the hidden units, reads them).
TASK_HEADS = {
    "bert": ("bert.pooler.dense", "classifier"),
    "bert-pretraining": ("bert.pooler.dense", "cls.seq_relationship"),  # the next-sentence head
    "roformer": ("classifier.dense", "classifier.out_proj"),
}


@pytest.mark.parametrize("key", list(TASK_HEADS))
def test_full_model_recovers_task_head_units_permuted_by_hand(key):
    """A task head's hidden units permute without changing the function; full_model must match them."""
    source = build(key)
    target = random_symmetry(source, scope="full_model", seed=5)
    writer, reader = TASK_HEADS[key]
    parameters = dict(target.named_parameters())
    perm = torch.randperm(parameters[f"{writer}.bias"].numel(), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for name, axis in ((f"{writer}.weight", 0), (f"{writer}.bias", 0), (f"{reader}.weight", 1)):
            parameters[name].copy_(parameters[name].index_select(axis, perm))
    assert relative_difference(outputs(source), outputs(target)) < FLOAT64_RTOL  # a symmetry (4.8e-16 measured)
    names = scope_parameters(source, "full_model")

    aligned, report = align(source, target, scope="full_model")

    assert scoped_distance(aligned, target, names) < FLOAT64_RTOL * scoped_norm(target, names)  # 2.7e-16 measured
    assert [layer.kind for layer in report.layers].count("task_head") == 1


# RoFormer's embedding space before embeddings_project (embedding_size 16 != hidden_size 32).
EMBEDDING_AXES = (
    ("roformer.embeddings.word_embeddings.weight", 1),
    ("roformer.embeddings.token_type_embeddings.weight", 1),
    ("roformer.embeddings.LayerNorm.weight", 0),
    ("roformer.embeddings.LayerNorm.bias", 0),
    ("roformer.embeddings_project.weight", 1),
)


def _permute_embedding_space(model: nn.Module, axes, perm: torch.Tensor) -> None:
    parameters = dict(model.named_parameters())
    with torch.no_grad():
        for name, axis in axes:
            parameters[name].copy_(parameters[name].index_select(axis, perm))


def test_full_model_recovers_the_embedding_space_before_the_projection():
    """The embedding columns, their LayerNorm and the projection's inputs permute on their own (a symmetry)."""
    source = build("roformer-projected")
    target = random_symmetry(source, scope="full_model", seed=5)
    _permute_embedding_space(target, EMBEDDING_AXES, torch.randperm(16, generator=torch.Generator().manual_seed(0)))
    assert relative_difference(outputs(source), outputs(target)) < FLOAT64_RTOL  # 4.3e-16 measured (the random element)
    names = scope_parameters(source, "full_model")

    aligned, report = align(source, target, scope="full_model")

    # 2.1e-16 measured; without the embedding space in the spec: 0.46 of the target's norm.
    assert scoped_distance(aligned, target, names) < FLOAT64_RTOL * scoped_norm(target, names)
    assert [layer.name for layer in report.layers if layer.kind == "task_head"] == [
        "roformer.embeddings",
        "classifier",
    ]


@pytest.mark.parametrize("left_out", range(len(EMBEDDING_AXES)))
def test_the_embedding_space_without_one_of_its_parameters_breaks_the_function(left_out):
    source = build("roformer-projected")
    moved = copy.deepcopy(source)
    axes = EMBEDDING_AXES[:left_out] + EMBEDDING_AXES[left_out + 1 :]
    _permute_embedding_space(moved, axes, torch.roll(torch.arange(16), 1))
    assert relative_difference(outputs(source), outputs(moved)) > 1e-4


@pytest.mark.parametrize("key", ["ref-vit-learned", "ref-vit-rope-interleaved", "gpt2", "roformer", "timm-rope-vit"])
def test_stage1_choice_is_the_best_of_all_24_head_orders(key):
    source = build(key)
    target = random_symmetry(source, scope="first_attention", seed=3)
    layer = model_spec(source).blocks[0].attention
    assert layer.num_heads == 4 and layer.num_kv_heads == 4
    grams = LayerGrams.compute(dict(source.named_parameters()), dict(target.named_parameters()), layer)
    options = AlignOptions()
    chosen, _ = assign_heads(head_cost(grams, layer, options), 1)

    # Stage 2 after each of the 24 head orders, solved as one batch of 24 x 4 problems per group.
    orders = list(itertools.permutations(range(4)))
    per_order = [stage2_problems(grams, layer, torch.tensor(o), torch.tensor(o)) for o in orders]
    distances = torch.zeros(len(orders), dtype=torch.float64)
    for role, group in ((0, qk_group(layer)), (1, vo_group(layer))):
        batch = Stage2Problem(
            *(torch.cat([getattr(p[role], f.name) for p in per_order]) for f in fields(Stage2Problem))
        )
        distances += batch.distance(solve_stage2(batch, group, options)).reshape(len(orders), 4).sum(1)
    ranking = torch.argsort(distances)
    assert orders[ranking[0]] == tuple(chosen.tolist())
    assert distances[ranking[1]] > 1e3 * distances[ranking[0]]  # the optimum is unique


@pytest.mark.parametrize("metric", [m for m in METRICS if m not in ("activation", "midpoint")])  # data-aware: own files
@pytest.mark.parametrize("key", ["ref-lm-rope-half-gqa-swiglu-rms-nobias", "timm-vit"])
def test_every_head_metric_recovers_planted_pairs(key, metric):
    source = build(key)
    target = random_symmetry(source, scope="all_attention", seed=4)
    names = scope_parameters(source, "all_attention")
    aligned, report = align(source, target, scope="all_attention", options=AlignOptions(metric=metric))
    assert report.options.metric == metric
    assert scoped_distance(aligned, target, names) < FLOAT64_RTOL * scoped_norm(target, names)  # 5.2e-16 measured


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
    serialized = json.loads(json.dumps(report.to_dict()))
    assert serialized["scope"] == "first_block" and serialized["options"] == asdict(AlignOptions())
    assert (serialized["dtype"], serialized["check_rtol"]) == ("float64", PROBE_RTOL[torch.float64])


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
    ("options", "message"),
    [
        ({"method": "sinkhorn"}, "unknown method 'sinkhorn'; choose one of naive, permutation, orthogonal, full"),
        ({"metric": "cka"}, "unknown metric 'cka'; choose one of invariant, weight, correlation"),
        ({"steps": -1}, "steps must be an integer >= 0, got -1"),
        ({"steps": 2.5}, "steps must be an integer >= 0, got 2.5"),
        ({"max_iterations": -1}, "max_iterations must be an integer >= 0"),
        ({"probe_batch_size": 0}, "probe_batch_size must be an integer >= 1, got 0"),
        ({"lr": 0.0}, "lr must be a finite number > 0, got 0.0"),
        ({"lr": float("nan")}, "lr must be a finite number > 0, got nan"),
        ({"tolerance": -1e-3}, "tolerance must be a finite number >= 0"),
        ({"check_rtol": -1e-3}, "check_rtol must be None .* or a finite number >= 0, got -0.001"),
    ],
)
def test_bad_options_are_refused_when_built(options, message):
    with pytest.raises(ValueError, match=message):
        AlignOptions(**options)


def test_bad_scope_and_untyped_options_are_refused():
    source = build("ref-lm-none")
    with pytest.raises(ValueError, match="unknown scope 'everything'; choose one of first_attention, all_attention"):
        align(source, copy.deepcopy(source), scope="everything")
    with pytest.raises(TypeError, match="options must be an lmc.matching.AlignOptions, got dict"):
        align(source, copy.deepcopy(source), options={"method": "full"})


def test_check_rtol_zero_is_honoured_not_replaced_by_the_default():
    source = build("ref-vit-learned")
    target = reinitialized(source, "first_attention", seed=1)
    _, report = align(source, target, options=AlignOptions(method="naive", check_rtol=0.0))  # the same function
    assert report.check_rtol == 0.0 and report.probe_relative_error == 0.0
    # A real transform changes outputs by rounding (~1e-16), which check_rtol=0 must refuse.
    with pytest.raises(AlignmentError, match=r"misses check_rtol=0: relative output change [0-9.e-]+ on the probe"):
        align(source, target, options=AlignOptions(check_rtol=0.0))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("key", ["ref-lm-rope-half-gqa-swiglu-rms-nobias", "gpt2", "timm-eva02"])
def test_half_precision_models_align_and_stay_in_their_dtype(key, dtype):
    source = build(key).to(dtype)
    target = random_symmetry(source, scope="full_model", seed=5)
    assert next(target.parameters()).dtype == dtype

    aligned, report = align(source, target, scope="full_model")

    assert {p.dtype for p in aligned.parameters()} == {dtype}
    assert (report.dtype, report.check_rtol) == (str(dtype).removeprefix("torch."), PROBE_RTOL[dtype])
    assert report.probe_relative_error <= PROBE_RTOL[dtype]
    # Recovered up to the dtype's rounding (observed <= 1e-3 of the naive distance).
    assert report.distance["aligned"] < 1e-2 * report.distance["naive"]


def _one_layer_in_float32(model: nn.Module) -> nn.Module:
    model.blocks[0].attn.qkv.float()
    return model


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (nn.Module.float, "source and target differ in dtype: source is torch.float64, target is torch.float32"),
        (lambda m: m.to("meta"), "source and target differ in device: source is cpu, target is meta"),
        (_one_layer_in_float32, r"the target model's parameters mix dtypes \(torch.float32, torch.float64\)"),
    ],
)
def test_mixed_dtypes_or_devices_are_refused(change, message):
    source = build("timm-vit")
    target = change(reinitialized(source, "first_attention", seed=1))
    with pytest.raises(AlignmentError, match=message):
        align(source, target)


@pytest.mark.parametrize("scope", ["first_attention", "full_model"])
def test_weights_too_large_for_the_dtype_are_refused_with_the_fix(scope):
    source = build("ref-vit-learned").float()
    target = reinitialized(source, scope, seed=1)
    with torch.no_grad():
        target.blocks[0].attn.q_proj.weight[0, 0] = 1e30  # finite, but its square overflows float32
    with pytest.raises(AlignmentError, match=r"overflows: the weights are too large to align in float32; cast both"):
        align(source, target, scope=scope)


def test_a_model_whose_outputs_overflow_is_refused_before_the_check():
    source = build("ref-vit-learned").half()
    target = reinitialized(source, "first_attention", seed=1)
    with torch.no_grad():
        for model in (source, target):
            model.norm.weight.fill_(6e4)  # the logits exceed float16's range
    with pytest.raises(AlignmentError, match="source model's outputs on the probe input are not finite in float16"):
        align(source, target)


def test_an_alignment_that_is_not_a_symmetry_raises(monkeypatch):
    """The built-in probe check catches a broken transform instead of returning it."""
    import lmc.matching.layers as module

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


def test_head_orders_for_layers_outside_the_scope_are_refused():
    """An order for layer 7 of a 2-layer model (or for a layer first_attention leaves alone) used to be ignored,
    yet recorded in the report as applied."""
    source = build("roformer")
    target = reinitialized(source, "first_attention", seed=1)
    for layer in (1, 7):
        with pytest.raises(AlignmentError, match=rf"head_orders names attention layer\(s\) \[{layer}\], but scope"):
            align(source, target, "first_attention", AlignOptions(head_orders={layer: [1, 0, 2, 3]}))
    _, report = align(source, target, "first_attention", AlignOptions(head_orders={0: [1, 0, 2, 3]}))
    assert report.layers[-1].assignment == [1, 0, 2, 3]


def test_rope_models_with_other_position_tables_are_refused_by_name():
    """Two RoPE models differing only in their positions used to end in a raw size-mismatch RuntimeError."""
    from lmc.models import create_model

    short = create_model("reference-tiny", pe="rope", max_positions=32, dtype=torch.float64)
    long = create_model("reference-tiny", pe="rope", max_positions=48, dtype=torch.float64)
    with pytest.raises(AlignmentError, match="use different rotary positional encodings"):
        align(short, long, "full_model")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_unit_correlations_add_up_in_the_compute_dtype_and_the_residual_one_in_float64(monkeypatch, dtype):
    # An FFN's correlation sums three tensors' products, computed in float32 for float32 and bf16 weights
    # already: kept in float32 it takes half the memory (an 8B model's 14,336 units: 822 MB, not 1.64 GB).
    # The residual stream's sums products over most of the model, in float64.
    import lmc.matching.descent

    made, correlate = [], lmc.matching.descent.axis_correlation

    def recorded(source, target, permutation, *dtype_given):
        correlation = correlate(source, target, permutation, *dtype_given)
        made.append((permutation.name, correlation.dtype))
        return correlation

    monkeypatch.setattr(lmc.matching.descent, "axis_correlation", recorded)
    source, target = (randomize_parameters_(create_model("llama-tiny"), seed=seed).to(dtype) for seed in (0, 1))
    align(source, target, scope="full_model", options=AlignOptions(method="orthogonal"))
    spec = model_spec(source)
    units = {block.feed_forward.hidden.name for block in spec.blocks}
    unit_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert {name for name, _ in made} == units | {spec.residual.name}
    assert all(made_dtype == (unit_dtype if name in units else torch.float64) for name, made_dtype in made), made
