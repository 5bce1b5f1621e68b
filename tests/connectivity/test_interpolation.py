"""Interpolation sweeps: in place equals copies, barriers follow their definitions, sweeps resume."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from lmc.connectivity.interpolation import (
    CLUSTER_SAMPLES,
    SweepStore,
    barriers,
    bootstrap_barriers,
    evaluate,
    evenly_spaced,
    fingerprint,
    point_metrics,
    recorded_cluster_sums,
    reduce_sums,
    sweep,
    weighted_barriers,
)


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def _batches():
    generator = torch.Generator().manual_seed(0)
    return [
        {
            "inputs": torch.randn(10, 6, generator=generator, dtype=torch.float64),
            "labels": torch.randint(3, (10,), generator=generator),
        }
        for _ in range(3)
    ]


def _sums(model: nn.Module):
    def metric_sums(batch):
        logits = model(batch["inputs"])
        return {
            "count": torch.tensor(len(batch["labels"]), dtype=torch.float64),
            "loss": nn.functional.cross_entropy(logits, batch["labels"], reduction="sum"),
            "accuracy": (logits.argmax(-1) == batch["labels"]).sum().double(),
        }

    return metric_sums


def _point(model: nn.Module) -> dict[str, float]:
    sums = evaluate(_sums(model), _batches(), torch.device("cpu"))
    return point_metrics({name: float(value) for name, value in sums.items()})


def test_in_place_sweep_equals_one_copy_per_alpha():
    a, b, alphas = _model(0), _model(1), evenly_spaced(7)
    model = copy.deepcopy(a)
    endpoint_a = [p.detach().clone() for p in a.parameters()]
    endpoint_b = [p.detach().clone() for p in b.parameters()]
    points = sweep(
        model,
        endpoint_a,
        endpoint_b,
        lambda per_cluster: evaluate(_sums(model), _batches(), torch.device("cpu"), per_cluster),
        alphas,
        SweepStore.open(None, "k"),
        "naive",
    )
    losses = set()
    for point, alpha in zip(points, alphas):
        copy_model = copy.deepcopy(a)
        with torch.no_grad():
            for p, pa, pb in zip(copy_model.parameters(), a.parameters(), b.parameters()):
                p.copy_(torch.lerp(pa, pb, alpha))
        assert point == {"alpha": alpha, **_point(copy_model)}  # float64 throughout: exactly equal
        losses.add(point["loss"])
    assert len(losses) == len(alphas)  # every point was evaluated at its own weights
    for p, pa in zip(model.parameters(), a.parameters()):  # the model ends with end point A
        assert torch.equal(p, pa)


def test_evaluate_sums_every_named_metric_and_a_point_divides_by_the_count():
    def metric_sums(batch):  # a metric the sweep has never heard of travels like the others
        n = len(batch["labels"])
        return {"count": torch.tensor(float(n)), "loss": torch.tensor(2.0 * n), "brier": torch.tensor(0.5)}

    sums = evaluate(metric_sums, _batches(), torch.device("cpu"))
    assert {name: float(value) for name, value in sums.items()} == {"count": 30.0, "loss": 60.0, "brier": 1.5}
    assert all(value.dtype == torch.float64 for value in sums.values())
    assert point_metrics({"count": 30.0, "loss": 60.0, "brier": 1.5}) == {"loss": 2.0, "brier": 0.05}
    with pytest.raises(ValueError, match="nothing was evaluated"):
        evaluate(metric_sums, [], torch.device("cpu"))


def test_reduce_sums_uses_one_collective_in_sorted_name_order():
    calls = []

    def all_reduce(stacked):  # stands for a sum over ranks: adds the position to each entry
        calls.append(stacked.clone())
        return stacked + torch.arange(len(stacked), dtype=stacked.dtype)

    sums = {"loss": torch.tensor(10.0), "count": torch.tensor(20.0), "accuracy": torch.tensor(30.0)}
    reduced = reduce_sums(sums, all_reduce)
    assert len(calls) == 1 and calls[0].tolist() == [30.0, 20.0, 10.0]  # accuracy, count, loss
    assert list(reduced) == ["loss", "count", "accuracy"]  # the caller's order is kept
    assert {name: float(value) for name, value in reduced.items()} == {"accuracy": 30.0, "count": 21.0, "loss": 12.0}


def test_barriers_follow_their_definitions():
    alphas = evenly_spaced(5)
    losses = [1.0, 1.6, 2.0, 1.5, 3.0]
    accuracies = [0.9, 0.7, 0.5, 0.6, 0.7]
    result = barriers([{"alpha": a, "loss": x, "accuracy": y} for a, x, y in zip(alphas, losses, accuracies)])
    line = [1.0 + 2.0 * a for a in alphas]
    assert result["loss_barrier"] == pytest.approx(max(value - s for value, s in zip(losses, line)), abs=1e-15)
    acc_line = [0.9 - 0.2 * a for a in alphas]
    assert result["accuracy_barrier"] == pytest.approx(max(s - x for s, x in zip(acc_line, accuracies)), abs=1e-15)
    assert result["loss_barrier_rebasin"] == pytest.approx(3.0 - 2.0, abs=1e-15)
    assert result["accuracy_barrier_rebasin"] == pytest.approx(0.8 - 0.5, abs=1e-15)
    with pytest.raises(ValueError, match="at least 2 points"):
        evenly_spaced(1)


def test_fingerprint_sees_every_byte_and_a_permutation():
    weight = torch.randn(8, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert fingerprint([weight]) == fingerprint([weight.clone()])
    # Same sums and sums of squares, another function: rows of a layer permuted.
    assert fingerprint([weight[torch.tensor([1, 0, 2, 3, 4, 5, 6, 7])]]) != fingerprint([weight])
    nudged = weight.clone()
    nudged[3, 2] = torch.nextafter(nudged[3, 2], torch.tensor(torch.inf, dtype=torch.float64))
    assert fingerprint([nudged]) != fingerprint([weight])  # one ulp of one entry
    assert fingerprint([weight.float()]) != fingerprint([weight])  # the dtype
    assert fingerprint([weight.reshape(5, 8)]) != fingerprint([weight])  # the shape
    assert fingerprint([weight.T]) == fingerprint([weight.T.contiguous()])  # bytes in logical order
    assert fingerprint([weight], extra={"split": "val"}) != fingerprint([weight], extra={"split": "test"})


def test_a_killed_sweep_resumes_to_the_same_results(tmp_path):
    a, b, alphas = _model(0), _model(1), evenly_spaced(25)
    endpoint_a = [p.detach().clone() for p in a.parameters()]
    endpoint_b = [p.detach().clone() for p in b.parameters()]
    key = fingerprint(endpoint_a, endpoint_b, extra="test")
    model = copy.deepcopy(a)
    evaluated = []

    def dying_after(limit):
        def evaluate_point(per_cluster):
            if len(evaluated) == limit:
                raise KeyboardInterrupt  # the job is killed mid-sweep
            evaluated.append(1)
            return evaluate(_sums(model), _batches(), torch.device("cpu"), per_cluster)

        return evaluate_point

    path = tmp_path / "state.json"
    with pytest.raises(KeyboardInterrupt):
        sweep(model, endpoint_a, endpoint_b, dying_after(10), alphas, SweepStore.open(path, key), "aligned")
    assert len(json.loads(path.read_text())["points"]["aligned"]) == 10
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), endpoint_a))  # restored after the kill

    evaluated.clear()
    resumed = sweep(model, endpoint_a, endpoint_b, dying_after(99), alphas, SweepStore.open(path, key), "aligned")
    assert len(evaluated) == 15  # only the missing points
    fresh_model = copy.deepcopy(a)
    fresh = sweep(
        fresh_model,
        endpoint_a,
        endpoint_b,
        lambda per_cluster: evaluate(_sums(fresh_model), _batches(), torch.device("cpu"), per_cluster),
        alphas,
        SweepStore.open(None, key),
        "aligned",
    )
    assert resumed == fresh
    # The state keeps every point's clusters, the resumed points' too: whole batches for sums of a
    # whole batch, and they add up to the point.
    recorded = recorded_cluster_sums(path)
    assert len(recorded) == len(alphas) and all(len(clusters) == len(_batches()) for clusters in recorded)
    for point, clusters in zip(resumed, recorded):
        total = sum(c["loss"] for c in clusters) / sum(c["count"] for c in clusters)
        assert total == pytest.approx(point["loss"], rel=1e-12)


def _per_sample_sums(model: nn.Module):
    def sample_sums(batch):
        logits = model(batch["inputs"])
        return {
            "count": torch.ones(len(batch["labels"]), dtype=torch.float64),
            "loss": nn.functional.cross_entropy(logits, batch["labels"], reduction="none"),
            "accuracy": (logits.argmax(-1) == batch["labels"]).double(),
        }

    return sample_sums


@pytest.mark.parametrize("batch_size", [1, 7, 8, 30])
def test_per_sample_sums_make_clusters_of_consecutive_samples_whatever_the_batch_size(batch_size):
    model, samples = _model(0), _batches()
    inputs = torch.cat([batch["inputs"] for batch in samples])
    labels = torch.cat([batch["labels"] for batch in samples])
    rebatched = [
        {"inputs": inputs[start : start + batch_size], "labels": labels[start : start + batch_size]}
        for start in range(0, len(labels), batch_size)
    ]
    clusters = []
    sums = evaluate(_per_sample_sums(model), rebatched, torch.device("cpu"), clusters)
    # Computed apart, from the 30 samples' own losses: clusters of 8 consecutive ones, the last of 6.
    with torch.no_grad():
        losses = nn.functional.cross_entropy(model(inputs), labels, reduction="none")
    bounds = list(range(0, len(labels), CLUSTER_SAMPLES)) + [len(labels)]
    assert [c["count"] for c in clusters] == [float(end - start) for start, end in zip(bounds, bounds[1:])]
    assert [c["count"] for c in clusters] == [8.0, 8.0, 8.0, 6.0]
    for cluster, start, end in zip(clusters, bounds, bounds[1:]):
        assert cluster["loss"] == pytest.approx(float(losses[start:end].sum()), rel=1e-14)
    assert float(sums["loss"]) == pytest.approx(float(losses.sum()), rel=1e-14)
    assert float(sums["count"]) == 30.0 and sums["loss"].ndim == 0


def test_sums_that_mix_per_sample_and_per_batch_are_refused():
    scalar, vector = _sums(_model(0)), _per_sample_sums(_model(0))
    mixed = iter([vector, scalar, vector])
    with pytest.raises(ValueError, match="per-sample .B,. vectors in every batch or scalars in every batch"):
        evaluate(lambda batch: next(mixed)(batch), _batches(), torch.device("cpu"), [])

    def uneven(batch):
        sums = vector(batch)
        return {**sums, "count": torch.tensor(float(len(batch["labels"])), dtype=torch.float64)}

    with pytest.raises(ValueError, match="all scalars or all per-sample"):
        evaluate(uneven, _batches(), torch.device("cpu"))


def test_bootstrap_barriers_redraw_the_clusters_the_same_way_for_every_curve():
    alphas = [0.0, 0.5, 1.0]

    def curve(middle: list[float]) -> list[list[dict[str, float]]]:  # 3 clusters of 10 samples, loss sums
        ends = [{"count": 10.0, "loss": 10.0, "accuracy": 9.0} for _ in middle]
        return [ends, [{"count": 10.0, "loss": m, "accuracy": 5.0} for m in middle], ends]

    draws = bootstrap_barriers({"a": curve([20.0, 30.0, 40.0]), "b": curve([25.0, 35.0, 45.0])}, alphas, 200, seed=3)
    a, b = draws["a"]["loss_barrier"], draws["b"]["loss_barrier"]
    # The end points lie at 1.0 and the middle at the drawn clusters' mean: a barrier of mean/10 - 1.
    assert a.shape == (200,) and float(a.min()) >= 1.0 - 1e-12 and float(a.max()) <= 3.0 + 1e-12
    assert torch.allclose(b - a, torch.full_like(a, 0.5), atol=1e-12, rtol=0)  # paired: the same draws
    assert torch.allclose(draws["a"]["accuracy_barrier"], torch.full_like(a, 0.4), atol=1e-12, rtol=0)
    assert torch.equal(
        bootstrap_barriers({"a": curve([20.0, 30.0, 40.0])}, alphas, 200, seed=3)["a"]["loss_barrier"], a
    )
    assert float(a.std()) > 0.1  # the draws differ: clusters of 2.0, 3.0 and 4.0 nats
    with pytest.raises(ValueError, match="same clusters"):
        bootstrap_barriers({"a": curve([20.0, 30.0]), "b": curve([25.0, 35.0, 45.0])}, alphas)


def test_weighted_barriers_of_a_mask_are_the_barriers_of_its_clusters():
    alphas = [0.0, 0.5, 1.0]
    # clusters of 10, 10 and 20 samples: losses at the end points and in the middle, accuracies in the middle
    counts, middle, correct = [10.0, 10.0, 20.0], [20.0, 30.0, 80.0], [5.0, 9.0, 8.0]
    cluster_sums = [
        [{"count": n, "loss": 1.0 * n, "accuracy": 1.0 * n} for n in counts],
        [{"count": n, "loss": m, "accuracy": c} for n, m, c in zip(counts, middle, correct, strict=True)],
        [{"count": n, "loss": 2.0 * n, "accuracy": 1.0 * n} for n in counts],
    ]
    masks = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    found = weighted_barriers(cluster_sums, alphas, masks)
    # clusters 0 and 2: middle loss 100 / 30, line 1.5; cluster 1: 3.0 against 1.5; all: 130 / 40
    expected = [100 / 30 - 1.5, 3.0 - 1.5, 130 / 40 - 1.5]
    assert torch.allclose(found["loss_barrier"], torch.tensor(expected, dtype=torch.float64), atol=1e-12, rtol=0)
    assert torch.allclose(
        found["accuracy_barrier"],
        torch.tensor([1 - 13 / 30, 0.1, 1 - 22 / 40], dtype=torch.float64),
        atol=1e-12,
        rtol=0,
    )
    with pytest.raises(ValueError, match="weights over 2 clusters need a curve with that many clusters"):
        weighted_barriers(cluster_sums, alphas, masks[:, :2])


def test_a_state_file_from_another_sweep_is_ignored(tmp_path):
    path = tmp_path / "state.json"
    store = SweepStore.open(path, "first")
    store.put("naive", 0.0, {"alpha": 0.0, "loss": 1.0, "accuracy": 0.5}, write=True)
    assert SweepStore.open(path, "first").get("naive", 0.0) == {"alpha": 0.0, "loss": 1.0, "accuracy": 0.5}
    assert SweepStore.open(path, "second").get("naive", 0.0) is None
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # atomic writes leave no temporary files
    # a file of the earlier layout (points named by their index in the grid) is another format
    saved = json.loads(path.read_text())
    path.write_text(json.dumps({"key": "first", "points": {"naive": {"0": saved["points"]["naive"]["0.0"]}}}))
    assert SweepStore.open(path, "first").points == {}


@pytest.mark.parametrize("content", ['{"key": "first", "points": {"naive": {"0": {"al', "", "\xff\xfe"])
def test_a_truncated_state_file_is_ignored_with_a_warning_naming_it(tmp_path, content):
    path = tmp_path / "state.json"
    path.write_bytes(content.encode("latin-1"))
    with pytest.warns(UserWarning, match=f"unreadable sweep state {path}"):
        store = SweepStore.open(path, "first")
    assert store.points == {}
    store.put("naive", 0.0, {"alpha": 0.0, "loss": 1.0, "accuracy": 0.5}, write=True)  # and replaced by a good one
    assert SweepStore.open(path, "first").get("naive", 0.0) == {"alpha": 0.0, "loss": 1.0, "accuracy": 0.5}


def test_sweeps_of_one_pair_share_their_naive_curve_and_end_point_a_on_every_grid(tmp_path):
    """The naive curve depends on neither the scope, the alignment options nor the grid, and alpha 0 is
    end point A on every curve: each is evaluated once per pair, and the shared points are the very
    points a sweep of its own evaluates."""
    from torch.utils.data import DataLoader, Subset

    from lmc.adapters import scope_parameters
    from lmc.connectivity import Evaluation, SweepHooks, measure_connectivity
    from lmc.data import Digits
    from lmc.matching import AlignOptions
    from lmc.training import LMCModule

    data = Digits()
    module, other = LMCModule("reference-vit-tiny", data=data.info), LMCModule("reference-vit-tiny", data=data.info)
    free = set(scope_parameters(module.model, "first_attention"))
    with torch.no_grad():
        for name, parameter in other.model.named_parameters():
            if name not in free:
                parameter.copy_(dict(module.model.named_parameters())[name])
    calls = []
    batches = DataLoader(Subset(data.split("val"), range(40)), batch_size=20)
    evaluation = Evaluation(lambda batch: calls.append(1) or module.metric_sums(batch), batches, "val", {}, {})

    def measured(method: str, alphas: list[float], shared: bool = True) -> dict:
        hooks = SweepHooks(tmp_path / method / "state.json", naive_state_path=tmp_path / "naive.json")
        options = AlignOptions(method=method)
        return measure_connectivity(
            module.model, other.model, "first_attention", options, alphas, evaluation, hooks if shared else SweepHooks()
        )

    coarse, fine = evenly_spaced(3), evenly_spaced(5)
    results = [measured(method, coarse) for method in ("orthogonal", "full")]
    # two batches per point: the naive curve's 3, then each aligned curve's 2 beside end point A
    assert len(calls) == 2 * (3 + 2 + 2)
    assert results[0]["curves"]["naive"] == results[1]["curves"]["naive"]
    assert results[0]["key"] != results[1]["key"]
    finer = measured("permutation", fine)
    assert len(calls) == 2 * (3 + 2 + 2) + 2 * (2 + 4)  # the naive curve's 2 new alphas, the aligned 4 past A
    assert finer["curves"]["naive"]["points"][::2] == results[0]["curves"]["naive"]["points"]
    naive_a = finer["curves"]["naive"]["points"][0]
    assert all(r["curves"]["aligned"]["points"][0] == naive_a for r in [*results, finer])
    # what a sweep evaluates alone (no shared records) is the same, bit for bit
    for method, grid, result in (("full", coarse, results[1]), ("permutation", fine, finer)):
        alone = measured(method, grid, shared=False)
        assert alone["curves"] == result["curves"]


def test_an_alignment_made_by_the_caller_is_used_not_made_again(monkeypatch):
    from torch.utils.data import DataLoader, Subset

    import lmc.connectivity.measure
    from lmc.connectivity import Evaluation, measure_connectivity
    from lmc.data import Digits
    from lmc.matching import AlignOptions, align
    from lmc.training import LMCModule

    data = Digits()
    module, other = LMCModule("reference-vit-tiny", data=data.info), LMCModule("reference-vit-tiny", data=data.info)
    batches = DataLoader(Subset(data.split("val"), range(20)), batch_size=20)
    evaluation = Evaluation(module.metric_sums, batches, "val", {}, {})
    options, alphas = AlignOptions(method="orthogonal"), [0.0, 0.5, 1.0]
    expected = measure_connectivity(module.model, other.model, "full_model", options, alphas, evaluation)
    alignment = align(other.model, module.model, "full_model", options)

    def never(*args, **kwargs):
        raise AssertionError("aligned again")

    monkeypatch.setattr(lmc.connectivity.measure, "align", never)
    given = measure_connectivity(
        module.model, other.model, "full_model", options, alphas, evaluation, alignment=alignment
    )
    assert given["key"] == expected["key"] and given["curves"] == expected["curves"]
    with pytest.raises(ValueError, match="pass the alignment of the sweep's settings"):
        measure_connectivity(
            module.model, other.model, "full_model", AlignOptions(), alphas, evaluation, alignment=alignment
        )


def test_a_changed_alignment_of_the_same_settings_never_resumes_its_stale_points(tmp_path):
    """A matcher that changed since a killed sweep (same options, another element): its curve is
    evaluated again, the naive one still resumes."""
    from torch.utils.data import DataLoader, Subset

    from lmc.connectivity import Evaluation, SweepHooks, measure_connectivity
    from lmc.data import Digits
    from lmc.matching import AlignOptions, align
    from lmc.training import LMCModule

    data = Digits()
    module, other = LMCModule("reference-vit-tiny", data=data.info), LMCModule("reference-vit-tiny", data=data.info)
    calls = []
    batches = DataLoader(Subset(data.split("val"), range(20)), batch_size=20)
    evaluation = Evaluation(lambda batch: calls.append(1) or module.metric_sums(batch), batches, "val", {}, {})
    options, alphas = AlignOptions(method="orthogonal"), [0.0, 0.5, 1.0]
    aligned, report = align(other.model, module.model, "full_model", options)
    hooks = SweepHooks(tmp_path / "state.json", naive_state_path=tmp_path / "naive.json")
    first = measure_connectivity(module.model, other.model, "full_model", options, alphas, evaluation, hooks)
    assert len(calls) == 5  # the naive curve, and the aligned one beside end point A
    calls.clear()
    again = measure_connectivity(
        module.model, other.model, "full_model", options, alphas, evaluation, hooks, alignment=(aligned, report)
    )
    assert calls == [] and again["curves"] == first["curves"]  # the same element: everything resumes
    stale = copy.deepcopy(aligned)
    with torch.no_grad():
        next(stale.parameters()).add_(0.5)
    changed = measure_connectivity(
        module.model, other.model, "full_model", options, alphas, evaluation, hooks, alignment=(stale, report)
    )
    assert len(calls) == 2  # the aligned curve again past end point A, not the naive one
    assert changed["curves"]["naive"] == first["curves"]["naive"]
    assert changed["curves"]["aligned"] != first["curves"]["aligned"]


def test_interpolate_is_lerp_in_single_and_double_precision():
    from lmc.connectivity.interpolation import interpolate

    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        a, b = torch.randn(1000, generator=generator, dtype=dtype), torch.randn(1000, generator=generator, dtype=dtype)
        for alpha in (0.0, 0.3, 0.5, 1.0):
            assert torch.equal(interpolate(a, b, alpha), torch.lerp(a, b, alpha))


def test_interpolate_rounds_half_precision_once():
    """Half precision: the exact interpolation (float64) rounded to the dtype once, to half a unit in the last place."""
    from lmc.connectivity.interpolation import interpolate

    generator = torch.Generator().manual_seed(1)
    for dtype, mantissa_bits in ((torch.bfloat16, 8), (torch.float16, 11)):
        a = torch.randn(10_000, generator=generator).to(dtype)
        b = torch.randn(10_000, generator=generator).to(dtype)
        merged = interpolate(a, b, 0.3)
        assert merged.dtype == dtype
        exact = 0.7 * a.double() + 0.3 * b.double()
        half_ulp = exact.abs() * 2.0**-mantissa_bits
        assert bool(((merged.double() - exact).abs() <= half_ulp * (1 + 1e-6) + 1e-12).all())


def test_check_alphas_keeps_the_first_of_repeats_and_names_bad_values():
    from lmc.connectivity.interpolation import check_alphas

    assert check_alphas([0.5, 0, 0.5, 1]) == [0.5, 0.0, 1.0]
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"merge alphas must lie in \[0, 1\]"):
            check_alphas([0.5, bad], "merge alphas")


def test_with_the_extended_group_the_aligned_curve_runs_from_end_point_a_folded():
    """residual='orthogonal' aligns the folded models: the aligned curve starts at A folded (the same function),
    its midpoint is that of A folded and the aligned model, and A gets its own weights back."""
    from torch.utils.data import DataLoader, Subset

    from lmc.adapters import fold_norms
    from lmc.connectivity import Evaluation, measure_connectivity
    from lmc.data import Digits
    from lmc.matching import AlignOptions, align
    from lmc.matching.merge import interpolate
    from lmc.training import LMCModule

    data = Digits()
    module, other = LMCModule("reference-vit-tiny", data=data.info), LMCModule("reference-vit-tiny", data=data.info)
    batches = DataLoader(Subset(data.split("val"), range(20)), batch_size=20)
    evaluation = Evaluation(module.metric_sums, batches, "val", {}, {})
    options, alphas = AlignOptions(method="permutation", residual="orthogonal"), [0.0, 0.5, 1.0]
    own = [p.detach().clone() for p in module.model.parameters()]

    result = measure_connectivity(module.model, other.model, "full_model", options, alphas, evaluation)

    assert all(torch.equal(p, q) for p, q in zip(module.model.parameters(), own))
    naive, aligned = (result["curves"][curve]["points"] for curve in ("naive", "aligned"))
    for end in (0, -1):  # the same functions at both ends, to float32 rounding
        assert aligned[end]["loss"] == pytest.approx(naive[end]["loss"], rel=1e-5)
    aligned_model, _ = align(other.model, module.model, "full_model", options)
    with torch.no_grad():
        for p, a, b in zip(
            module.model.parameters(), fold_norms(module.model).parameters(), aligned_model.parameters()
        ):
            p.copy_(interpolate(a, b, 0.5))
    sums = evaluate(module.metric_sums, batches, torch.device("cpu"))
    assert point_metrics({name: float(value) for name, value in sums.items()})["loss"] == aligned[1]["loss"]
