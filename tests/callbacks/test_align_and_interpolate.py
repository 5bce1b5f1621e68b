"""AlignAndInterpolate: curves, barriers, TensorBoard logs, atomic results, resume, staleness and DDP exactness."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader

import lmc.connectivity.measure
from callbacks import AlignAndInterpolate
from lmc.checkpoints import CheckpointError, load_weights
from lmc.connectivity import Evaluation, SweepHooks, data_identity, measure_connectivity
from lmc.connectivity.interpolation import barriers, evaluate, evenly_spaced, fingerprint, point_metrics
from lmc.io import WriteError
from lmc.matching import AlignOptions, align
from lmc.matching.options import DATA_FIELDS, LEARNED_FIELDS
from tests.path_objective import check_learned_not_above_full, cross_entropy, record_alignments
from tests.runs import CONFIG, MODEL, data, finetuned, pretrain_and_first_seed, trainer


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    pretrained, seed0 = pretrain_and_first_seed(root)
    callback = AlignAndInterpolate(references=[str(seed0)], output_dir=str(root / "results"))
    logger = TensorBoardLogger(str(root / "tb"), name="seed1", version="")
    module = finetuned(pretrained, 1)
    run = trainer(root / "seed1", steps=15, logger=logger, callbacks=[callback])
    run.fit(module, data())
    return {
        "root": root,
        "pretrained": pretrained,
        "seed0": seed0,
        "callback": callback,
        "module": module,
        "trainer": run,
    }


@pytest.fixture
def counted(runs, monkeypatch):
    """Counts (and can interrupt) the fine-tuned module's batch evaluations; reruns log nothing."""
    module, calls = runs["module"], {"count": 0, "limit": None}
    original = module.sample_sums

    def sample_sums(batch):
        if calls["count"] == calls["limit"]:
            raise KeyboardInterrupt  # the job is killed mid-sweep
        calls["count"] += 1
        return original(batch)

    monkeypatch.setattr(module, "sample_sums", sample_sums)
    monkeypatch.setattr(runs["trainer"], "loggers", [])  # keep the fixture's TensorBoard events as they are
    return calls


def _split_point(module, split: str) -> dict[str, float]:
    """Loss and accuracy of the module's current weights on ``split``, by a plain loop."""
    sums = evaluate(module.metric_sums, DataLoader(data().split(split), batch_size=64), torch.device("cpu"))
    return point_metrics({name: float(value) for name, value in sums.items()})


def test_curves_have_25_points_and_consistent_end_points(runs):
    (result,) = runs["callback"].results["references"].values()
    naive, aligned = result["curves"]["naive"]["points"], result["curves"]["aligned"]["points"]
    assert [p["alpha"] for p in naive] == evenly_spaced(25) == [p["alpha"] for p in aligned]
    assert naive[0] == aligned[0]  # both start at the trained model
    # The aligned reference computes the reference's function: same loss and accuracy at alpha = 1.
    assert aligned[-1]["loss"] == pytest.approx(naive[-1]["loss"], rel=1e-5)
    assert aligned[-1]["accuracy"] == pytest.approx(naive[-1]["accuracy"], abs=1e-12)
    for curve in ("naive", "aligned"):
        points = result["curves"][curve]["points"]
        for name, value in barriers(points).items():
            assert result["curves"][curve][name] == value
    assert result["curves"]["naive"]["loss_barrier"] > 0
    assert result["barrier_ratio"]["loss_barrier"] == pytest.approx(
        100 * result["curves"]["aligned"]["loss_barrier"] / result["curves"]["naive"]["loss_barrier"], rel=1e-12
    )
    assert result["alignment"]["scope"] == "first_attention"


def test_the_trained_weights_are_restored_after_the_sweep(runs, tmp_path):
    path = tmp_path / "after.ckpt"
    runs["trainer"].save_checkpoint(path)
    module = finetuned(runs["pretrained"], 1)
    load_weights(module.model, path)
    (result,) = runs["callback"].results["references"].values()
    module.eval()
    assert _split_point(module, "val")["loss"] == pytest.approx(result["curves"]["naive"]["points"][0]["loss"], 1e-6)


def test_results_are_written_atomically_and_agree(runs):
    folder = runs["root"] / "results"
    results = json.loads((folder / "lmc_results.json").read_text())
    rows = (folder / "lmc_results.csv").read_text().strip().splitlines()
    assert rows[0] == "reference,curve,alpha,loss,accuracy" and len(rows) == 1 + 2 * 25
    (result,) = results["references"].values()
    reference, curve, alpha, loss, accuracy = rows[-1].split(",")
    assert curve == "aligned" and float(alpha) == 1.0
    assert float(loss) == pytest.approx(result["curves"]["aligned"]["points"][-1]["loss"], rel=1e-7)
    assert (folder / "lmc_interpolation_0.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == []  # no temporary files


def test_results_say_which_run_and_checkpoints_they_belong_to(runs):
    results = json.loads((runs["root"] / "results" / "lmc_results.json").read_text())
    run, module = results["run"], runs["module"]
    assert run["model"]["fingerprint"] == fingerprint(module.model.parameters())
    assert run["model"]["checkpoint"] is None  # the fixture's trainer keeps no checkpoint
    assert list(run["references"]) == [str(runs["seed0"])]
    # No calibration read, no learned descent: their settings are not part of the sweep.
    weight_only = {k: v for k, v in vars(AlignOptions()).items() if k not in DATA_FIELDS + LEARNED_FIELDS}
    assert run["settings"]["split"] == "val" and run["settings"]["options"] == weight_only
    assert run["settings"]["data"] == data_identity(data()) and run["settings"]["alphas"] == evenly_spaced(25)
    reference = load_weights(module.build_model(), runs["seed0"])
    assert results["references"][str(runs["seed0"])]["reference_fingerprint"] == fingerprint(reference.parameters())


def test_tensorboard_has_curves_barriers_and_a_figure(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(runs["root"] / "tb" / "seed1"), size_guidance={"scalars": 0, "images": 0}).Reload()
    scalars = events.Tags()["scalars"]
    loss = events.Scalars("lmc/reference_0/aligned/loss")
    assert [e.step for e in loss] == [round(1000 * a) for a in evenly_spaced(25)]
    (result,) = runs["callback"].results["references"].values()
    assert loss[-1].value == pytest.approx(result["curves"]["aligned"]["points"][-1]["loss"], rel=1e-6)
    for name in ("loss_barrier", "accuracy_barrier", "loss_barrier_rebasin", "accuracy_barrier_rebasin"):
        assert f"lmc/reference_0/naive/{name}" in scalars
    assert "lmc/reference_0/barrier_ratio/loss_barrier" in scalars
    assert "lmc/reference_0/interpolation" in events.Tags()["images"]


def test_a_rerun_resumes_from_the_saved_points(runs, counted):
    callback, run, module = runs["callback"], runs["trainer"], runs["module"]
    folder = runs["root"] / "results"
    state = folder / "lmc_sweep_state_0.json"
    saved = json.loads(state.read_text())
    for curve in saved["points"]:  # as if killed after 10 points of each curve
        kept = sorted(saved["points"][curve], key=float)[:10]
        saved["points"][curve] = {k: v for k, v in saved["points"][curve].items() if k in kept}
    state.write_text(json.dumps(saved))

    rerun = callback.run(run, module)

    batches = len(callback.shard_loader(run))
    assert counted["count"] == 2 * 15 * batches  # only the missing points were evaluated
    (before,), (after,) = callback.results["references"].values(), rerun["references"].values()
    assert after["curves"] == before["curves"] and after["barrier_ratio"] == before["barrier_ratio"]
    assert not (folder / "stale").exists()  # the same run: its results stay in place


def test_a_sweep_state_of_another_split_or_data_is_not_reused(runs, counted, tmp_path):
    module, alphas = runs["module"], evenly_spaced(3)
    reference = load_weights(module.build_model(), runs["seed0"]).eval()
    module.eval()
    hooks = SweepHooks(state_path=tmp_path / "state.json")
    architecture = {"model": MODEL, "model_config": CONFIG}
    batches = {split: DataLoader(data().split(split), batch_size=64) for split in ("val", "test")}

    def measure(split: str, data_settings: dict) -> dict:
        counted["count"] = 0
        evaluation = Evaluation(module.metric_sums, batches[split], split, data_settings, architecture)
        options = AlignOptions()
        return measure_connectivity(module.model, reference, "first_attention", options, alphas, evaluation, hooks)

    digits = data_identity(data())
    points = 3 + 2  # the naive curve, and the aligned one beside end point A (the naive curve's first point)
    measure("val", digits)
    assert counted["count"] == points * len(batches["val"])
    measure("val", digits)
    assert counted["count"] == 0  # the same sweep is resumed, not repeated
    test = measure("test", digits)
    assert counted["count"] == points * len(batches["test"])  # the validation points are not reused
    assert test["curves"]["naive"]["points"][0] == {"alpha": 0.0, **_split_point(module, "test")}
    measure("test", {**digits, "seed": 1})  # other samples in the split
    assert counted["count"] == points * len(batches["test"])
    measure("test", digits)  # the state now holds the seed-1 sweep
    assert counted["count"] == points * len(batches["test"])


def test_a_new_run_moves_the_previous_results_aside_before_writing(runs, counted, tmp_path, caplog):
    folder = tmp_path / "results"
    shutil.copytree(runs["root"] / "results", folder)  # the validation run's results and sweep state
    previous = (folder / "lmc_results.json").read_text()
    callback = AlignAndInterpolate(references=[str(runs["seed0"])], split="test", output_dir=str(folder))
    counted["limit"] = 5
    with caplog.at_level(logging.INFO), pytest.raises(KeyboardInterrupt):
        callback.run(runs["trainer"], runs["module"])  # killed mid-sweep
    (line,) = [r.getMessage() for r in caplog.records if "another run" in r.getMessage()]
    assert line == f"moved 3 results file(s) of another run from {folder} to {folder / 'stale'}"
    assert sorted(p.name for p in folder.glob("lmc_*")) == ["lmc_sweep_state_0.json"]
    assert (folder / "stale" / "lmc_results.json").read_text() == previous
    stale = {p.name for p in (folder / "stale").iterdir()}
    assert stale == {"lmc_results.json", "lmc_results.csv", "lmc_interpolation_0.png"}

    counted["limit"] = None
    results = callback.run(runs["trainer"], runs["module"])  # the rerun finishes on the test split
    written = json.loads((folder / "lmc_results.json").read_text())
    assert written["run"]["key"] == results["run"]["key"] and written["run"]["settings"]["split"] == "test"
    (result,) = written["references"].values()
    runs["module"].eval()
    # Batches of 32 here, 64 there: equal up to float32 rounding, far from the validation loss.
    expected = {"alpha": 0.0, **_split_point(runs["module"], "test")}
    assert result["curves"]["naive"]["points"][0] == pytest.approx(expected, rel=1e-6)
    assert (folder / "stale" / "lmc_results.json").read_text() == previous  # nothing moved twice


def test_a_metric_added_to_sample_sums_reaches_the_points_and_the_csv(runs, counted, monkeypatch, tmp_path):
    module = runs["module"]
    original = module.sample_sums

    def with_confidence(batch):
        sums = original(batch)
        probabilities = module(batch).float().softmax(-1)
        return {**sums, "confidence": probabilities.max(-1).values.double()}

    monkeypatch.setattr(module, "sample_sums", with_confidence)
    callback = AlignAndInterpolate(references=[str(runs["seed0"])], num_alphas=2, output_dir=str(tmp_path))
    (result,) = callback.run(runs["trainer"], module)["references"].values()
    for point in result["curves"]["naive"]["points"] + result["curves"]["aligned"]["points"]:
        assert set(point) == {"alpha", "loss", "accuracy", "confidence"} and 0 < point["confidence"] <= 1
    header = (tmp_path / "lmc_results.csv").read_text().splitlines()[0]
    assert header == "reference,curve,alpha,loss,accuracy,confidence"


def test_a_learned_alignment_calibrates_on_the_training_split(runs, counted, tmp_path, monkeypatch):
    calls = record_alignments(monkeypatch, lmc.connectivity.measure)
    options = AlignOptions(method="learned", learned_steps=2, calibration_batches=2)
    callback = AlignAndInterpolate([str(runs["seed0"])], options=options, num_alphas=3, output_dir=str(tmp_path))
    (result,) = callback.run(runs["trainer"], runs["module"])["references"].values()
    assert result["settings"]["calibration"]["split"] == "train"
    assert result["settings"]["options"]["learned_steps"] == 2
    learned = result["alignment"]["learned"]
    assert learned["steps"] == 2
    # Never above full: the calibration loss of the paths of the model the callback aligned and of
    # full's alignment of the same pair, recomputed on the callback's calibration batches (float32).
    (call,) = calls
    full, _ = align(call["source"], call["target"], call["scope"], AlignOptions(method="full"))
    batches = call["calibration"].batches
    assert len(batches) == 2 and call["report"].learned == learned
    check_learned_not_above_full(
        call["target"], full, call["aligned"], batches, cross_entropy, learned["objective"], 1e-5
    )


def test_bad_references_and_outputs_fail_before_any_training_step(runs, tmp_path):
    module = finetuned(runs["pretrained"], 1)
    steps = []
    training_step = module.training_step
    module.training_step = lambda *args: steps.append(1) or training_step(*args)
    typo = str(runs["root"] / "seed0.ckp")
    blocker = tmp_path / "file"
    blocker.write_text("")
    (tmp_path / "folder.ckpt").mkdir()
    for callback, error, message in (
        (AlignAndInterpolate(references=[typo]), FileNotFoundError, f"reference '{typo}' matches no file"),
        (
            AlignAndInterpolate(references=[str(runs["seed0"]), str(tmp_path / "seed9-*.ckpt")]),
            FileNotFoundError,
            "seed9-\\*.ckpt' matches no file",
        ),
        (AlignAndInterpolate(references=[str(tmp_path / "folder.ckpt")]), CheckpointError, "is a folder"),
        (
            AlignAndInterpolate(references=[str(runs["seed0"])], output_dir=str(blocker / "results")),
            WriteError,
            f"{blocker} is a file, not a folder",
        ),
    ):
        with pytest.raises(error, match=message):
            trainer(tmp_path, steps=2, callbacks=[callback]).fit(module, data())
    assert steps == []


def test_bad_settings_are_refused_at_construction():
    with pytest.raises(ValueError, match="unknown split 'train' for interpolation curves"):
        AlignAndInterpolate(references=["a.ckpt"], split="train")
    with pytest.raises(ValueError, match="num_alphas=1; an interpolation needs at least 2 points"):
        AlignAndInterpolate(references=["a.ckpt"], num_alphas=1)
    with pytest.raises(ValueError, match="unknown scope 'first_layer'; choose one of first_attention"):
        AlignAndInterpolate(references=["a.ckpt"], scope="first_layer")
    with pytest.raises(ValueError, match="at least one reference"):
        AlignAndInterpolate(references=[])


@pytest.mark.slow
def test_ddp_curve_equals_the_single_process_curve(runs, tmp_path):
    """2 CPU processes (gloo) each evaluate a shard; the reduced curve equals one process's curve."""
    job = Path(__file__).with_name("ddp_job.py")
    environment = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    result = subprocess.run(
        [sys.executable, str(job), str(tmp_path), str(runs["pretrained"]), str(runs["seed0"])],
        capture_output=True, text=True, timeout=600, env=environment,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (ddp,) = json.loads((tmp_path / "results" / "lmc_results.json").read_text())["references"].values()

    module = finetuned(runs["pretrained"], 1)
    load_weights(module.model, tmp_path / "seed1_ddp.ckpt")
    module.eval()
    reference = load_weights(module.build_model(), runs["seed0"]).eval()
    loader = DataLoader(data().split("val"), batch_size=32)
    evaluation = Evaluation(module.metric_sums, loader, "val", data_identity(data()), {"model": MODEL})
    single = measure_connectivity(
        module.model, reference, "first_attention", AlignOptions(), evenly_spaced(5), evaluation
    )
    for curve in ("naive", "aligned"):
        for a, b in zip(ddp["curves"][curve]["points"], single["curves"][curve]["points"]):
            assert a["alpha"] == b["alpha"]
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
            assert a["accuracy"] == pytest.approx(b["accuracy"], abs=1e-9)
