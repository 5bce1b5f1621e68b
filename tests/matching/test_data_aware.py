"""Data-aware alignment (issue #8): exact on every family, as tight as weight matching on planted pairs."""

from __future__ import annotations

import pytest
import torch

from lmc.adapters import adapter_for, model_spec, random_symmetry
from lmc.matching import AlignOptions, Calibration, align
from lmc.matching.calibration import PairedMoment, paired_correlations, paired_moments
from lmc.matching.grams import WEIGHT_SHARE, LayerGrams
from lmc.matching.results import AlignmentError
from tests.architectures import ARCHITECTURES, OUTPUT_RTOL, build, float64_norms

DATA_AWARE = {
    "objective=data": AlignOptions(objective="data", calibration_batches=2),
    "metric=activation": AlignOptions(metric="activation", calibration_batches=2),
    "both": AlignOptions(metric="activation", objective="data", calibration_batches=2),
}


def _forward(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    adapter = adapter_for(model)
    return adapter.forward(model, adapter.model_inputs(model, batch))


def calibration(model: torch.nn.Module, batches: int = 2, size: int = 3, seed: int = 1) -> Calibration:
    """lmc batches of random inputs; token batches pad the end of their first sequence."""
    adapter, generator = adapter_for(model), torch.Generator().manual_seed(seed)
    chosen = []
    for _ in range(batches):
        inputs = next(iter(adapter.example_inputs(model, size, generator).values()))
        batch = {"inputs": inputs}
        if not inputs.is_floating_point():
            batch["attention_mask"] = torch.ones_like(inputs)
            batch["attention_mask"][0, -3:] = 0
        chosen.append(batch)
    return Calibration(chosen, _forward, "train", batches * size)


def _relative_residual(aligned: torch.nn.Module, target: torch.nn.Module) -> float:
    pairs = zip(aligned.parameters(), target.parameters())
    squared = sum(float((p - q).detach().pow(2).sum()) for p, q in pairs)
    return (squared / sum(float(q.detach().pow(2).sum()) for q in target.parameters())) ** 0.5


@pytest.mark.parametrize("key", list(ARCHITECTURES))
def test_data_aware_methods_keep_the_function_and_recover_a_planted_element(key, monkeypatch):
    target = build(key)
    # HF's RMSNorms compute in float32, and OLMo-2's over whole query and key rows, where the planted
    # head order sums in another order: the two models' activations would differ by float32 rounding,
    # which the data objective fits (a V/O element off by ~1e-8 on an AMD EPYC).
    float64_norms(target, monkeypatch)
    source = random_symmetry(target, "all_attention", seed=3)
    data = calibration(target)
    _, weight_report = align(source, target, "all_attention")
    assert weight_report.calibration is None
    baseline = _relative_residual(align(source, target, "all_attention")[0], target)
    assert baseline < 1e-13
    for name, options in DATA_AWARE.items():
        aligned, report = align(source, target, "all_attention", options, data)
        assert report.probe_relative_error < OUTPUT_RTOL.get(key, 1e-12), name
        # Observed up to 4e-13 (the data objective's weight share conditions the solve at ~1e3).
        assert _relative_residual(aligned, target) < max(100 * baseline, 1e-11), name
        assert report.calibration == {"split": "train", "num_samples": 6, "data": {}, "batches": 2}


ACTIVATION_UNITS = AlignOptions(unit_matching="activation", calibration_batches=2)


@pytest.mark.parametrize("scope", ["first_block", "full_model"])
@pytest.mark.parametrize("key", list(ARCHITECTURES))
def test_activation_unit_matching_keeps_the_function_and_recovers_a_planted_element(key, scope):
    target = build(key)
    source = random_symmetry(target, scope, seed=3)
    aligned, report = align(source, target, scope, ACTIVATION_UNITS, calibration(target))
    assert report.probe_relative_error < OUTPUT_RTOL.get(key, 1e-12)
    # Every unit correlates exactly 1 with its planted twin: the whole element comes back.
    assert _relative_residual(aligned, target) < 1e-11
    kinds = {layer.kind for layer in report.layers}
    spec = model_spec(target)
    expected = {"attention", "feed_forward"}
    if scope == "full_model":
        expected |= {"task_head"} if spec.task_heads else set()
        expected |= {"residual"} if spec.residual is not None else set()
        expected |= {"tokens"} if spec.tokens is not None else set()  # matched by weight, in either mode
    assert kinds == expected
    units = [layer for layer in report.layers if layer.kind in ("feed_forward", "task_head")]
    assert units and all(layer.distance["permutation"] < 1e-12 for layer in units)


def _unit_signals(source, target, hidden, data) -> torch.Tensor:
    """The summed correlations activation matching maximizes: the readers' inputs and the writers' outputs."""
    named = {f"reads {m}": m for m in hidden.readers} | {f"writes {m}": m for m in hidden.writers}
    modules = {key: (source.get_submodule(m), target.get_submodule(m)) for key, m in named.items()}
    writers = frozenset(key for key in named if key.startswith("writes"))
    return sum(paired_correlations(source, target, modules, data, writers).values())


def test_activation_matching_of_an_independent_pair_maximizes_the_units_correlation():
    source, target = (
        build("ref-lm-rope-half-gqa-swiglu-rms-nobias", seed=0),
        build("ref-lm-rope-half-gqa-swiglu-rms-nobias", seed=1),
    )
    data = calibration(source, batches=3)
    aligned, report = align(source, target, "full_model", ACTIVATION_UNITS, data)
    hidden = model_spec(source).blocks[1].feed_forward.hidden
    # A gated unit carries three signals: gate and up (written) and their product (read).
    assert len(hidden.readers) == 1 and len(hidden.writers) == 2
    before = _unit_signals(source, target, hidden, data.take(2))
    after = _unit_signals(aligned, target, hidden, data.take(2))
    # The aligned units are the source's, permuted: the permutation found is the best one.
    perm = report.transform.feed_forward[1]
    torch.testing.assert_close(after, before[perm], rtol=0, atol=1e-13)
    best = float(after.diagonal().sum())
    assert best > float(before.diagonal().sum()) + 1.0
    generator = torch.Generator().manual_seed(0)
    others = [float(after[torch.randperm(hidden.size, generator=generator)].diagonal().sum()) for _ in range(200)]
    assert best > max(others)


@pytest.mark.parametrize("key", list(ARCHITECTURES))
def test_every_ffn_names_the_modules_that_write_and_read_its_units(key):
    model, twin = build(key), build(key)
    hidden = model_spec(model).blocks[0].feed_forward.hidden
    assert hidden.readers and hidden.writers
    modules = {m: (model.get_submodule(m), twin.get_submodule(m)) for m in hidden.writers + hidden.readers}
    correlations = paired_correlations(model, twin, modules, calibration(model), frozenset(hidden.writers))
    for name, correlation in correlations.items():
        # Each signal holds the units (a fused [up | gate] projection: two stacked copies); a model
        # paired with its twin correlates 1 with itself wherever a unit varies.
        copies = correlation.shape[0] // hidden.size
        assert copies * hidden.size == correlation.shape[0] and copies in (1, 2), name
        torch.testing.assert_close(correlation.diagonal(), torch.ones_like(correlation.diagonal()), atol=1e-12, rtol=0)


def test_paired_correlations_are_pearson_correlations_over_unpadded_tokens():
    source, target = build("bert", seed=0), build("bert", seed=1)
    hidden = model_spec(source).blocks[0].feed_forward.hidden
    data = calibration(source, batches=2)
    mask = torch.cat([b["attention_mask"].reshape(-1) for b in data.batches]) != 0
    # The reader's input (the GELU of the hidden units) and the writer's output (before the GELU).
    for name, output in ((hidden.readers[0], False), (hidden.writers[0], True)):
        modules = {"units": tuple(m.get_submodule(name) for m in (source, target))}
        correlation = paired_correlations(source, target, modules, data, frozenset(modules if output else ()))
        rows = []
        for model in (source, target):
            captured, module = [], model.get_submodule(name)
            if output:
                handle = module.register_forward_hook(lambda module, args, out: captured.append(out))
            else:
                handle = module.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
            with torch.no_grad():
                for batch in data.batches:
                    _forward(model.eval(), batch)
            handle.remove()
            rows.append(torch.cat([x.reshape(-1, x.shape[-1]) for x in captured])[mask].double())
        n = rows[0].shape[1]
        expected = torch.corrcoef(torch.cat(rows, dim=1).T)[:n, n:]
        torch.testing.assert_close(correlation["units"], expected, rtol=1e-12, atol=1e-12)


def test_a_constant_unit_correlates_zero_with_every_unit():
    source, target = build("ref-vit-learned", seed=0), build("ref-vit-learned", seed=1)
    reader = model_spec(source).blocks[0].feed_forward.hidden.readers[0]
    with torch.no_grad():  # hidden unit 2 of the source is a constant: weights 0, bias 3
        up = source.get_submodule(reader.replace("down_proj", "up_proj"))
        up.weight[2] = 0
        up.bias[2] = 3.0
    modules = {"hidden": tuple(m.get_submodule(reader) for m in (source, target))}
    correlation = paired_correlations(source, target, modules, calibration(source))["hidden"]
    assert bool((correlation[2] == 0).all()) and bool((correlation[3].abs() > 0).all())


def test_units_without_readers_are_refused_with_the_fix(monkeypatch):
    import dataclasses

    import lmc.matching.checks as alignment

    model = build("gpt2")
    spec = model_spec(model)
    blocks = list(spec.blocks)
    hidden = dataclasses.replace(blocks[0].feed_forward.hidden, readers=(), writers=())
    blocks[0] = dataclasses.replace(blocks[0], feed_forward=dataclasses.replace(blocks[0].feed_forward, hidden=hidden))
    monkeypatch.setattr(alignment, "model_spec", lambda m: dataclasses.replace(spec, blocks=tuple(blocks)))
    with pytest.raises(
        AlignmentError, match="names no module that reads or writes these units.*unit_matching='weight'"
    ):
        align(model, build("gpt2", seed=1), "full_model", ACTIVATION_UNITS, calibration(model))


def test_missing_or_short_calibration_is_refused_with_the_fix():
    model = build("ref-vit-learned")
    for options in [*DATA_AWARE.values(), ACTIVATION_UNITS]:
        with pytest.raises(ValueError, match="pass calibration=lmc.matching.Calibration"):
            align(model, model, "first_attention", options)
    with pytest.raises(ValueError, match="calibration_batches=5 but the calibration holds 2 batches"):
        align(
            model, model, "first_attention", AlignOptions(objective="data", calibration_batches=5), calibration(model)
        )


def test_options_refuse_unknown_data_settings():
    with pytest.raises(ValueError, match="unknown objective 'activations'"):
        AlignOptions(objective="activations")
    for batches in (0, "some", True, 2.0):
        with pytest.raises(ValueError, match=f"calibration_batches must be an integer >= 1 or 'all', got {batches!r}"):
            AlignOptions(calibration_batches=batches)
    assert AlignOptions(metric="midpoint", calibration_batches="all").data_aware
    with pytest.raises(ValueError, match="unknown unit_matching 'activations'; choose one of weight, activation"):
        AlignOptions(unit_matching="activations")
    assert not AlignOptions().data_aware and AlignOptions(metric="activation").data_aware
    assert ACTIVATION_UNITS.data_aware and ACTIVATION_UNITS.data_settings == "unit_matching=activation"


def _moment(matrix: torch.Tensor) -> PairedMoment:
    return PairedMoment(matrix, matrix, matrix, 1)


def test_an_identity_moment_gives_the_weight_grams():
    source, target = build("gpt2", seed=0), build("gpt2", seed=1)
    layer = model_spec(source).attention[0]
    ps, pt = dict(source.named_parameters()), dict(target.named_parameters())
    weights = LayerGrams.compute(ps, pt, layer)
    data = LayerGrams.compute(ps, pt, layer, _moment(torch.eye(layer.width + 1, dtype=torch.float64)))
    for name in ("query", "key", "value"):
        for side in ("cross", "source", "target"):
            expected = (1 + WEIGHT_SHARE) * getattr(weights, f"{name}_{side}")
            torch.testing.assert_close(getattr(data, f"{name}_{side}"), expected, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(data.out_cross, weights.out_cross, rtol=0, atol=0)


def test_weights_outside_the_input_span_change_only_the_weight_share():
    model = build("ref-lm-none")
    layer = model_spec(model).attention[0]
    generator = torch.Generator().manual_seed(0)
    d = layer.width
    basis = torch.linalg.qr(torch.randn(d, d, generator=generator, dtype=torch.float64))[0]
    seen, unseen = basis[:, : d // 2], basis[:, d // 2 :]
    inputs = torch.randn(50, d // 2, generator=generator, dtype=torch.float64) @ seen.T + 0.3 * seen[:, 0]  # mean too
    augmented = torch.cat([inputs, torch.ones(50, 1, dtype=torch.float64)], dim=1)
    moment = _moment(augmented.T @ augmented / 50)
    parameters = dict(model.named_parameters())
    moved = dict(parameters)
    name = layer.query.parameter  # nn.Linear weight (out, in): rows of the input space are columns
    moved[name] = parameters[name] + torch.randn(d, d // 2, generator=generator, dtype=torch.float64) @ unseen.T
    # Data Grams are X^T S X' + lambda X^T X' (lambda from S alone): X^T S X' ignores unseen directions.
    ridge = WEIGHT_SHARE * float(2 * moment.source.trace()) / (2 * (d + 1))
    before, after = (LayerGrams.compute(p, p, layer, moment) for p in (parameters, moved))
    weight_before, weight_after = (LayerGrams.compute(p, p, layer) for p in (parameters, moved))
    data_part = [g.query_cross - ridge * w.query_cross for g, w in ((before, weight_before), (after, weight_after))]
    torch.testing.assert_close(data_part[0], data_part[1], rtol=0, atol=1e-12)
    assert float((after.query_cross - before.query_cross).abs().max()) > 1e-4  # the weight share did move


def test_padding_never_enters_the_moments():
    model, twin = build("bert"), build("bert")
    layer = model_spec(model).attention[0]
    modules = {"x": tuple(adapter_for(model).attention_input_module(m, layer) for m in (model, twin))}
    data = calibration(model, batches=1)
    batch = data.batches[0]
    changed = {**batch, "inputs": batch["inputs"].clone()}
    changed["inputs"][0, -3:] = (batch["inputs"][0, -3:] + 1) % model.config.vocab_size
    moments = [
        paired_moments(model, twin, modules, Calibration([b], _forward, "train", 3))["x"] for b in (batch, changed)
    ]
    torch.testing.assert_close(moments[0].source, moments[1].source, rtol=0, atol=1e-14)
    assert moments[0].tokens == 3 * batch["inputs"].shape[1] - 3
    unmasked = [{**b, "attention_mask": torch.ones_like(b["inputs"])} for b in (batch, changed)]
    different = [paired_moments(model, twin, modules, Calibration([b], _forward, "train", 3))["x"] for b in unmasked]
    assert float((different[0].source - different[1].source).abs().max()) > 1e-6


def test_the_moments_are_float64_sums_over_paired_tokens():
    source, target = build("ref-vit-learned", seed=0), build("ref-vit-learned", seed=1)
    layer = model_spec(source).attention[0]
    adapter = adapter_for(source)
    modules = {"x": tuple(adapter.attention_input_module(m, layer) for m in (source, target))}
    data = calibration(source, batches=2)
    moment = paired_moments(source, target, modules, data, frozenset({"x"}))["x"]
    rows = []
    for model in (source, target):
        captured = []
        handle = adapter.attention_input_module(model, layer).register_forward_pre_hook(
            lambda module, args: captured.append(args[0].reshape(-1, args[0].shape[-1]))
        )
        with torch.no_grad():
            for batch in data.batches:
                _forward(model.eval(), batch)
        handle.remove()
        x = torch.cat(captured)
        rows.append(torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1))
    expected = rows[0].T @ rows[1] / len(rows[0])
    assert moment.cross.dtype == torch.float64 and moment.tokens == len(rows[0])
    torch.testing.assert_close(moment.cross, expected, rtol=1e-13, atol=1e-14)
    torch.testing.assert_close(moment.source[-1, -1], torch.tensor(1.0, dtype=torch.float64))
