"""AlignAndInterpolate: curves, barriers, TensorBoard logs, atomic results, resume and DDP exactness."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader

from callbacks import AlignAndInterpolate
from lmc.checkpoints import load_weights
from lmc.connectivity import measure_connectivity
from lmc.interpolation import barriers, evaluate, evenly_spaced
from tests.runs import data, finetuned, pretrain_and_first_seed, trainer


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
        expected = barriers([p["alpha"] for p in points], [p["loss"] for p in points], [p["accuracy"] for p in points])
        for name, value in expected.items():
            assert result["curves"][curve][name] == pytest.approx(value)
    assert result["barrier_ratio"]["loss_barrier"] == pytest.approx(
        100 * result["curves"]["aligned"]["loss_barrier"] / result["curves"]["naive"]["loss_barrier"]
    )
    assert result["alignment"]["scope"] == "first_attention"


def test_the_trained_weights_are_restored_after_the_sweep(runs, tmp_path):
    path = tmp_path / "after.ckpt"
    runs["trainer"].save_checkpoint(path)
    module = finetuned(runs["pretrained"], 1)
    load_weights(module.model, path)
    (result,) = runs["callback"].results["references"].values()
    loader = DataLoader(data().split("val"), batch_size=64)
    module.eval()
    loss_sum, correct, count = evaluate(module.loss_sums, loader, torch.device("cpu")).tolist()
    assert loss_sum / count == pytest.approx(result["curves"]["naive"]["points"][0]["loss"], rel=1e-6)


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
    assert not list(folder.glob("*.tmp"))


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


def test_a_rerun_resumes_from_the_saved_points(runs, monkeypatch):
    callback, run, module = runs["callback"], runs["trainer"], runs["module"]
    state = runs["root"] / "results" / "lmc_sweep_state_0.json"
    saved = json.loads(state.read_text())
    for curve in saved["points"]:  # as if killed after 10 points of each curve
        saved["points"][curve] = {k: v for k, v in saved["points"][curve].items() if int(k) < 10}
    state.write_text(json.dumps(saved))
    evaluated = []
    original = module.loss_sums
    monkeypatch.setattr(module, "loss_sums", lambda batch: evaluated.append(1) or original(batch))

    rerun = callback.run(run, module)

    batches = len(callback.shard_loader(run))
    assert len(evaluated) == 2 * 15 * batches  # only the missing points were evaluated
    (before,), (after,) = callback.results["references"].values(), rerun["references"].values()
    assert after["curves"] == before["curves"] and after["barrier_ratio"] == before["barrier_ratio"]


def test_missing_references_give_a_clear_error(runs):
    callback = AlignAndInterpolate(references=[str(runs["root"] / "nothing-*.ckpt")])
    with pytest.raises(FileNotFoundError, match="no reference checkpoint matching"):
        callback.run(runs["trainer"], runs["module"])
    with pytest.raises(ValueError, match="split='train'"):
        AlignAndInterpolate(references=[], split="train")


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
    single = measure_connectivity(
        module.model, reference, lambda: evaluate(module.loss_sums, loader, torch.device("cpu")),
        evenly_spaced(5), "first_attention",
    )  # fmt: skip
    for curve in ("naive", "aligned"):
        for a, b in zip(ddp["curves"][curve]["points"], single["curves"][curve]["points"]):
            assert a["alpha"] == b["alpha"]
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
            assert a["accuracy"] == pytest.approx(b["accuracy"], abs=1e-9)
