"""sweep_and_write: the one pipeline (record, sweep, write, log) of the callback, lmc interpolate and lmc run."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import DataLoader, Subset

from lmc.connectivity import (
    Evaluation,
    OtherResultsError,
    ResultsOutput,
    SweepHooks,
    measure_connectivity,
    run_record,
    sweep_and_write,
    sweep_settings,
    write_results,
)
from lmc.data import Digits
from lmc.io import strict_json
from lmc.matching import AlignOptions
from lmc.training import LMCModule

OPTIONS = AlignOptions(method="orthogonal")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A model, two reference checkpoints of its architecture, and an evaluation on 20 samples."""
    data = Digits()
    torch.manual_seed(0)
    module = LMCModule("reference-vit-tiny", data=data.info).eval()
    root = tmp_path_factory.mktemp("references")
    references = {}
    for seed in (1, 2):
        torch.manual_seed(seed)
        reference = LMCModule("reference-vit-tiny", data=data.info).model.eval()
        references[root / f"seed{seed}.pt"] = reference
        torch.save(reference.state_dict(), root / f"seed{seed}.pt")
    batches = DataLoader(Subset(data.split("val"), range(20)), batch_size=10)
    evaluation = Evaluation(module.metric_sums, batches, "val", {"class": "digits"}, {"model": "tiny"})
    return module.model, references, evaluation


def _sweep(models, output: ResultsOutput, alphas=(0.0, 0.5, 1.0), hooks=SweepHooks()):
    model, references, evaluation = models
    loaders = {path: (lambda reference=reference: reference) for path, reference in references.items()}
    return sweep_and_write(output, model, loaders, "full_model", OPTIONS, list(alphas), evaluation, hooks)


def _without_start(results) -> str:
    """Results as strict JSON (as written), without the times (when the run started, how long each alignment took)."""

    def timeless(value):
        if isinstance(value, dict):
            return {k: timeless(v) for k, v in value.items() if k != "started" and not k.endswith("seconds")}
        return [timeless(v) for v in value] if isinstance(value, list) else value

    return json.dumps(strict_json(timeless(results)))


def test_the_pipeline_is_the_run_record_each_references_sweep_and_the_results_files(models, tmp_path):
    model, references, evaluation = models
    results = _sweep(models, ResultsOutput(tmp_path / "one", checkpoint="a.ckpt"))
    # The same steps, assembled by hand as each caller used to.
    alphas = [0.0, 0.5, 1.0]
    settings = sweep_settings("full_model", OPTIONS, alphas, evaluation)
    expected = {"run": run_record(model, "a.ckpt", list(references), settings), "references": {}}
    for index, (path, reference) in enumerate(references.items()):
        hooks = SweepHooks(state_path=tmp_path / "two" / f"lmc_sweep_state_{index}.json")
        expected["references"][str(path)] = measure_connectivity(
            model, reference, "full_model", OPTIONS, alphas, evaluation, hooks
        )
    write_results(tmp_path / "two", expected)
    assert _without_start(results) == _without_start(expected)
    written = json.loads((tmp_path / "one" / "lmc_results.json").read_text())
    assert list(written) == ["run", "references"] and _without_start(written) == _without_start(results)
    for name in ("lmc_results.csv", "lmc_sweep_state_0.json", "lmc_sweep_state_1.json"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    assert sorted(p.name for p in (tmp_path / "one").glob("*.png")) == [
        "lmc_interpolation_0.png",
        "lmc_interpolation_1.png",
    ]


def test_results_of_another_run_are_refused_retired_or_replaced(models, tmp_path):
    folder = tmp_path / "results"
    first = _sweep(models, ResultsOutput(folder), alphas=(0.0, 1.0))
    previous = (folder / "lmc_results.json").read_text()
    with pytest.raises(OtherResultsError, match="holds the results of another run"):
        _sweep(models, ResultsOutput(folder, other_results="refuse"))  # other alphas: another run
    assert (folder / "lmc_results.json").read_text() == previous and not (folder / "stale").exists()
    again = _sweep(models, ResultsOutput(folder, other_results="refuse"), alphas=(0.0, 1.0))  # the same run
    assert again["run"]["key"] == first["run"]["key"] and not (folder / "stale").exists()
    _sweep(models, ResultsOutput(folder, other_results="replace", figures=False))
    assert not (folder / "stale").exists()
    replaced = (folder / "lmc_results.json").read_text()
    _sweep(models, ResultsOutput(folder), alphas=(0.0, 1.0))
    assert (folder / "stale" / "lmc_results.json").read_text() == replaced


def test_perplexity_timing_tensorboard_and_the_writing_process(models, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = tmp_path / "tensorboard"
    output = ResultsOutput(tmp_path / "o", perplexity=True, tensorboard=board, figures=False, timed=True)
    for _ in range(2):  # a rerun replaces the scalars, it does not stack a second copy
        results = _sweep(models, output)
    assert len(list(board.glob("events.out.tfevents.*"))) == 1
    events = EventAccumulator(str(board))
    events.Reload()
    assert "lmc/reference_1/aligned/perplexity" in events.Tags()["scalars"]
    assert results["seconds"] > 0 and list(results) == ["run", "references", "seconds"]
    for result in results["references"].values():
        assert all(
            p["perplexity"] == pytest.approx(torch.tensor(p["loss"]).exp().item())
            for p in result["curves"]["naive"]["points"]
        )
    silent = _sweep(models, ResultsOutput(tmp_path / "rank1"), hooks=SweepHooks(write=False))
    assert not (tmp_path / "rank1").exists() and set(silent["references"]) == set(results["references"])


def test_a_given_alignment_belongs_to_one_reference(models, tmp_path):
    model, references, evaluation = models
    loaders = {path: (lambda reference=reference: reference) for path, reference in references.items()}
    with pytest.raises(ValueError, match="alignment of one reference"):
        sweep_and_write(
            ResultsOutput(tmp_path), model, loaders, "full_model", OPTIONS, [0.0, 1.0], evaluation,
            alignment=(model, None),
        )  # fmt: skip


def test_a_sweep_without_a_naive_barrier_writes_strict_json(tmp_path):
    """Its barrier ratio is NaN; lmc_results.json holds null there, and the sweep state reads it back as NaN."""
    import json
    import math

    from lmc.connectivity.interpolation import SweepStore
    from lmc.connectivity.results import write_results

    points = [{"alpha": 0.0, "loss": 1.0, "accuracy": 0.5}, {"alpha": 1.0, "loss": 1.0, "accuracy": 0.5}]
    curve = {"points": points, "loss_barrier": 0.0, "accuracy_barrier": 0.0}
    result = {"curves": {"naive": curve, "aligned": curve}, "barrier_ratio": {"loss_barrier": math.nan}}
    write_results(tmp_path, {"run": {"key": "k"}, "references": {"b.ckpt": result}}, figures=False)

    def refuse(constant):
        raise ValueError(constant)

    written = json.loads((tmp_path / "lmc_results.json").read_text(), parse_constant=refuse)
    assert written["references"]["b.ckpt"]["barrier_ratio"] == {"loss_barrier": None}
    store = SweepStore.open(tmp_path / "state.json", "key")
    store.put("naive", 0.5, {"alpha": 0.5, "loss": math.nan}, write=True)
    assert math.isnan(SweepStore.open(tmp_path / "state.json", "key").get("naive", 0.5)["loss"])
