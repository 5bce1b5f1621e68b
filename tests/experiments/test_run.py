"""``lmc run``: the whole protocol from one config, resumable, never reusing another configuration's results."""

from __future__ import annotations

import itertools
import json
import math
import re
import shutil
import statistics
from pathlib import Path

import lightning
import pytest
import torch
import yaml

import lmc.connectivity.results
import lmc.connectivity.robustness
import lmc.experiments.run
import lmc.experiments.stages
import lmc.experiments.stats.table1
import lmc.experiments.table1
from lmc.cli import main
from lmc.connectivity import BARRIERS, barrier_ratios
from lmc.connectivity.interpolation import SweepStore, barriers, evenly_spaced
from lmc.data import Digits
from lmc.experiments.jobs import run_jobs
from lmc.experiments.protocol import Protocol, Schedule, alignment_labels, experiment_cli
from lmc.experiments.report.cells import cell
from lmc.experiments.report.run_summary import summary_table
from lmc.experiments.run import Experiment
from lmc.experiments.stats.spread import spread
from lmc.experiments.stats.summary import summarize
from lmc.experiments.table1 import rank_and_l_hat
from lmc.matching import AlignOptions
from lmc.training.cli import instantiate_data
from tests.path_objective import check_learned_not_above_full, cross_entropy, record_alignments


def _config(tmp_path, cluster: dict | None = None, callbacks: list | None = None, **protocol) -> str:
    """A tiny experiment: the tiny reference ViT on digits, a few steps per stage; its jobs in the
    test's process (monkeypatches reach them) unless ``cluster`` says otherwise."""
    config = {
        "seed_everything": 0,
        "model": {"model": "reference-vit-tiny", "model_config": {"pe": "rope"}, "lr": 3e-3},
        "data": {"class_path": "lmc.data.Digits", "init_args": {"batch_size": 32}},
        "trainer": {
            "accelerator": "cpu",
            "max_epochs": 1,
            "limit_train_batches": 6,
            "limit_val_batches": 1,
            "num_sanity_val_steps": 0,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            **({"callbacks": callbacks} if callbacks else {}),
        },
        "cluster": cluster or {"executor": "inline"},
        "protocol": {
            "output_dir": str(tmp_path / "run"),
            "seeds": 3,
            "num_alphas": 5,
            "alignments": [{"method": "permutation"}, {"method": "full"}],
            **protocol,
        },
    }
    path = tmp_path / "experiment.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _summary(tmp_path) -> dict:
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    summary.pop("protocol")
    return summary


#: Jobs as processes on this machine, two at a time: lmc run's default executor.
LOCAL = {"executor": "local", "max_jobs": 2}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("experiment")
    main(["run", "--config", _config(tmp_path, LOCAL)])
    return tmp_path


def test_run_fits_every_seed_sweeps_every_pair_and_summarizes(finished, capsys):
    root = finished / "run"
    for stage in ("pretrain", "seed0", "seed1", "seed2"):
        assert (root / stage / "final.ckpt").is_file()
        assert json.loads((root / stage / "stage.json").read_text())["world_size"] == 1  # one process
    protocol = json.loads((root / "summary.json").read_text())["protocol"]
    # Where the curves were measured: the whole validation split (digits: 15 % of 1797 images).
    assert (protocol["split"], protocol["curve_samples"], protocol["split_samples"]) == ("val", 269, 269)
    summary = _summary(finished)
    assert summary["pairs"] == ["0_1", "0_2", "1_2"]
    assert set(summary["alignments"]) == {"permutation", "full"}
    for label, entry in summary["alignments"].items():
        for pair in summary["pairs"]:
            result = json.loads((root / "pairs" / pair / label / "lmc_results.json").read_text())
            (reference,) = result["references"].values()
            assert reference["alignment"]["options"]["method"] == label
            assert entry["per_pair"][pair]["aligned"]["loss_barrier"] == reference["curves"]["aligned"]["loss_barrier"]
        per_pair = [entry["per_pair"][pair] for pair in summary["pairs"]]
        # A ratio is NaN exactly when the naive curve has no barrier (these runs are a few steps long),
        # and the summary names those pairs.
        assert all(
            math.isfinite(p["barrier_ratio"]["loss_barrier"]) == (p["naive"]["loss_barrier"] >= 0.01) for p in per_pair
        )
        assert entry["no_barrier"]["loss_barrier"] == [
            pair for pair in summary["pairs"] if entry["per_pair"][pair]["naive"]["loss_barrier"] < 0.01
        ]
        ratios = [
            p["barrier_ratio"]["loss_barrier"] for p in per_pair if math.isfinite(p["barrier_ratio"]["loss_barrier"])
        ]
        assert entry["barrier_ratio"]["loss_barrier"]["mean"] == pytest.approx(statistics.fmean(ratios), rel=1e-12)
        assert entry["barrier_ratio"]["loss_barrier"]["std"] == pytest.approx(statistics.stdev(ratios), rel=1e-12)
        assert len(entry["mean_curves"]["aligned"]) == 5
    # Every pair shares the naive curve: the naive barriers do not depend on the alignment.
    naive = {label: e["naive"]["loss_barrier"]["mean"] for label, e in summary["alignments"].items()}
    assert naive["permutation"] == naive["full"]
    table = (root / "summary.md").read_text()
    assert "| full |" in table and "| permutation |" in table
    assert (root / "summary_full.png").stat().st_size > 0 and (root / "summary.csv").is_file()
    assert list((root / "tensorboard" / "lmc").glob("events.out.tfevents.*"))


def test_a_killed_run_resumes_without_refitting_and_ends_identical(finished, tmp_path, monkeypatch):
    config = _config(tmp_path)
    sweeps = {"count": 0}
    real = lmc.connectivity.results.measure_connectivity

    def killed_during_the_second_pair(*args, **kwargs):
        sweeps["count"] += 1
        if sweeps["count"] == 3:
            raise KeyboardInterrupt  # the kill
        return real(*args, **kwargs)

    monkeypatch.setattr(lmc.connectivity.results, "measure_connectivity", killed_during_the_second_pair)
    with pytest.raises(KeyboardInterrupt):
        main(["run", "--config", config])
    assert not (tmp_path / "run" / "summary.json").exists()
    monkeypatch.setattr(lmc.connectivity.results, "measure_connectivity", real)

    fits = []
    monkeypatch.setattr(lightning.Trainer, "fit", lambda self, *args, **kwargs: fits.append(args))
    main(["run", "--config", config])
    assert fits == []  # every stage had finished before the kill
    assert _summary(tmp_path)["alignments"] == _summary(finished)["alignments"]


def test_a_job_killed_mid_fit_stops_its_pairs_and_a_rerun_submits_only_what_is_missing(
    finished, tmp_path, capsys, monkeypatch
):
    """Local jobs: seed 1's process is killed mid-fit; the run names it with its log, its pairs never
    start, pair 0_2 finishes; the rerun submits seed 1 and its pairs only and ends identical."""
    import os
    import signal
    import threading
    import time

    from tests.cli import fails

    for stage in ("pretrain", "seed0", "seed2"):  # trained: seed 1 and the pairs are left
        shutil.copytree(finished / "run" / stage, tmp_path / "run" / stage)
    marker = tmp_path / "paused.json"
    pause = [{"class_path": "tests.interruptions.PauseOnce", "init_args": {"marker": str(marker), "stage": "seed1"}}]
    config = _config(tmp_path, LOCAL, pause)
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[2]))  # the jobs import tests.interruptions

    def kill_when_paused() -> None:
        deadline = time.monotonic() + 180
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        os.kill(json.loads(marker.read_text())["pid"], signal.SIGKILL)

    killer = threading.Thread(target=kill_when_paused)
    killer.start()
    error = fails(["run", "--config", config], capsys, after_work=True)
    killer.join()
    assert error.startswith("lmc: error: seed1 ended without a result") and "(log: " in error, error
    log = Path(error.split("(log: ")[1].split(")")[0])
    assert log.is_file() and log.parent == tmp_path / "run" / "jobs"
    assert "not run: pair0_1, pair1_2" in error
    assert (tmp_path / "run" / "pairs" / "0_2" / "pair.pkl").is_file()  # a pair without seed 1 finished

    main(["run", "--config", config])
    submitted = [line.split(":")[0] for line in capsys.readouterr().out.splitlines() if ": submitted (" in line]
    assert sorted(submitted) == ["pair0_1", "pair1_2", "seed1"]
    for name in ("summary.md", "summary.csv"):
        assert (tmp_path / "run" / name).read_bytes() == (finished / "run" / name).read_bytes()
    assert _summary(tmp_path)["alignments"] == _summary(finished)["alignments"]


def test_a_pair_sweep_builds_each_model_once_from_its_fine_tuned_checkpoint(finished, tmp_path, monkeypatch):
    """No stage CLI parsed again, no pre-trained weights re-initialized: the checkpoints' models, bit for bit."""
    from lmc.checkpoints import load_weights
    from lmc.connectivity.interpolation import fingerprint
    from lmc.experiments.protocol import experiment_cli
    from lmc.training import LMCModule

    shutil.copytree(finished / "run", tmp_path / "run")  # finished stages and sweep states
    experiment = lmc.experiments.run.Experiment(experiment_cli(["--config", _config(tmp_path)], run=False))
    pretraining = experiment.pretrain_stage()
    pretrained = experiment.fit(pretraining)
    stages = [experiment.finetune_stage(seed, pretrained, pretraining.key) for seed in range(3)]
    checkpoints = [experiment.fit(stage) for stage in stages]
    # What the sweep of pair 0_1 used to build: seed 1's CLI model (pre-trained, re-initialized),
    # overwritten with seed 1's weights, and seed 0's weights in a fresh backbone.
    _, module, _ = experiment.instantiate(stages[1])
    load_weights(module.model, checkpoints[1])
    reference = load_weights(module.build_model(), checkpoints[0])
    expected = [fingerprint(module.model.parameters()), fingerprint(reference.parameters())]

    swept, parsed, reinitialized = [], [], []
    measure, parse = lmc.connectivity.results.measure_connectivity, lmc.experiments.run.experiment_cli

    def measured(model, reference, *args):
        swept.append([fingerprint(model.parameters()), fingerprint(reference.parameters())])
        return measure(model, reference, *args)

    monkeypatch.setattr(lmc.connectivity.results, "measure_connectivity", measured)
    monkeypatch.setattr(lmc.experiments.run, "experiment_cli", lambda *a, **k: parsed.append(a) or parse(*a, **k))
    monkeypatch.setattr(lmc.experiments.stages, "experiment_cli", lambda *a, **k: parsed.append(a) or parse(*a, **k))
    monkeypatch.setattr(LMCModule, "reinitialize", lambda self, *a: reinitialized.append(a) or [])
    results = experiment.sweep_pair(stages, checkpoints, 0, 1)
    assert parsed == reinitialized == []
    assert swept == [expected, expected]  # one sweep per alignment, of the same two models
    for label in ("permutation", "full"):
        (before,) = json.loads((finished / "run" / "pairs" / "0_1" / label / "lmc_results.json").read_text())[
            "references"
        ].values()
        for name in ("key", "model_fingerprint", "reference_fingerprint", "settings", "curves"):
            assert results[label][name] == before[name]


def test_a_changed_config_never_reuses_a_stage(finished, tmp_path, capsys):
    root = tmp_path / "run"
    (root / "seed0").mkdir(parents=True)
    for stage in ("pretrain", "seed0"):
        (root / stage).mkdir(exist_ok=True)
        for name in ("final.ckpt", "stage.json"):
            (root / stage / name).write_bytes((finished / "run" / stage / name).read_bytes())
    changed = _config(tmp_path, finetune={"lr": 1e-2})
    with pytest.raises(SystemExit):
        main(["run", "--config", changed])
    error = capsys.readouterr().err
    assert "seed0" in error and "another configuration" in error and "--protocol.overwrite" in error


class DigitsOfItsOwn(Digits):
    """A DataModule with a constructor of its own that takes no ``train_samples`` (as a user's may)."""

    def __init__(self, batch_size: int = 32):
        super().__init__(batch_size=batch_size)


def test_a_phase_of_fewer_samples_is_another_stage_that_trains_on_that_many(tmp_path):
    def experiment(config: str) -> Experiment:
        return Experiment(experiment_cli(["--config", config], run=False))

    whole = experiment(_config(tmp_path))
    fewer = experiment(_config(tmp_path, finetune={"samples": 100}))
    pretraining = whole.pretrain_stage()
    assert fewer.pretrain_stage().key == pretraining.key  # a fine-tuning's size leaves the pre-training alone
    runs = {"whole": whole, "fewer": fewer}
    seed0 = {name: run.finetune_stage(0, tmp_path / "p.ckpt", pretraining.key) for name, run in runs.items()}
    assert seed0["fewer"].key != seed0["whole"].key
    half_b = instantiate_data(seed0["whole"].config)
    drawn = instantiate_data(seed0["fewer"].config)  # the data the fine-tuning fits and is calibrated on
    assert (drawn.part, len(drawn.split("train"))) == ("B", 100)
    assert len(half_b.split("train")) == len(Digits(part="B").split("train"))
    assert set(drawn.train_set.indices) < set(half_b.train_set.indices)
    assert len(drawn.split("val")) == len(half_b.split("val"))  # the curves' data is the same
    # The pre-training's size: half A's samples.
    smaller = experiment(_config(tmp_path, pretrain={"samples": 50})).pretrain_stage()
    assert smaller.key != pretraining.key
    assert (instantiate_data(smaller.config).part, len(instantiate_data(smaller.config).split("train"))) == ("A", 50)
    # Without samples a stage keeps the key it had before train_samples existed (its finished runs stay valid).
    config = seed0["whole"].config.clone()
    config["model.pretrained"] = None  # the upstream key stands for the checkpoint
    data = config.data.as_dict()
    assert data["init_args"].pop("train_samples") is None
    trainer = {k: v for k, v in config.trainer.as_dict().items() if k not in lmc.experiments.stages.COSMETIC}
    parts = (config.model.as_dict(), trainer, config.seed_everything, pretraining.key)
    assert seed0["whole"].key == lmc.experiments.stages.stage_key(parts[0], data, *parts[1:])


def test_samples_of_a_data_module_without_train_samples_are_refused_with_the_fix(tmp_path):
    path = Path(_config(tmp_path, finetune={"samples": 100}))
    config = yaml.safe_load(path.read_text())
    config["data"] = {"class_path": f"{__name__}.DigitsOfItsOwn", "init_args": {"batch_size": 32}}
    path.write_text(yaml.safe_dump(config))
    experiment = Experiment(experiment_cli(["--config", str(path)], run=False))
    experiment.pretrain_stage()  # the pre-training has no samples setting
    message = (
        f"protocol.finetune.samples needs a DataModule that takes train_samples, which {__name__}.DigitsOfItsOwn "
        "does not: add train_samples to its __init__ and pass it to LMCDataModule"
    )
    with pytest.raises(lmc.experiments.run.RunError, match=re.escape(message)):
        experiment.finetune_stage(0, tmp_path / "p.ckpt", "")
    with pytest.raises(ValueError, match=re.escape("samples must be at least 1 (None: the whole half), got 0")):
        Schedule(samples=0)


def test_protocol_values_are_checked_while_parsing(tmp_path, capsys):
    for bad, message in (
        ({"seeds": 1}, "at least 2"),
        ({"num_alphas": 1}, "at least 2"),
        ({"alignments": []}, "empty"),
    ):
        with pytest.raises(SystemExit):
            main(["run", "--config", _config(tmp_path, **bad)])
        assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match="the same settings twice"):
        Protocol(alignments=[AlignOptions(), AlignOptions()])
    with pytest.raises(ValueError, match="head_order_alphas=6 alphas are not among the curves. 25"):
        Protocol(head_orders=True, head_order_alphas=6)
    assert Protocol(head_order_alphas=13).order_alphas == evenly_spaced(25)[::2]  # the same floats
    assert Protocol().order_alphas == evenly_spaced(25)
    with pytest.raises(ValueError, match="alignment_alphas=6 alphas are not among the curves. 25"):
        Protocol(alignment_alphas=6)
    with pytest.raises(ValueError, match="alignment_alphas=7 alphas do not hold the head orders. 13"):
        Protocol(head_orders=True, head_order_alphas=13, alignment_alphas=7)
    coarse = Protocol(head_orders=True, head_order_alphas=7, alignment_alphas=13)
    assert coarse.alphas_of(AlignOptions()) == evenly_spaced(25)  # the full method keeps every alpha
    assert coarse.alphas_of(AlignOptions(method="orthogonal")) == evenly_spaced(25)[::2]
    assert Protocol().alphas_of(AlignOptions(method="orthogonal")) == evenly_spaced(25)


def test_labels_name_what_differs_from_the_defaults():
    options = [AlignOptions(), AlignOptions(method="orthogonal"), AlignOptions(metric="weight", steps=5)]
    assert alignment_labels(options) == ["full", "orthogonal", "full-metric=weight-steps=5"]


def test_summary_statistics_by_hand():
    assert spread([1.0, 2.0, 4.0]) == {"mean": 7 / 3, "std": pytest.approx(1.5275252316519468), "min": 1.0,
                                       "max": 4.0, "count": 3}  # fmt: skip
    assert spread([float("nan")])["count"] == 0
    curve = [{"alpha": 0.0, "loss": 1.0, "accuracy": 0.5}, {"alpha": 1.0, "loss": 3.0, "accuracy": 0.7}]
    result = {
        "curves": {c: {"points": curve, **dict.fromkeys(BARRIERS, 1.0)} for c in ("naive", "aligned")},
        "barrier_ratio": {"loss_barrier": 50.0, "accuracy_barrier": 25.0},
    }
    summary = summarize(
        {
            (0, 1): {"full": {**result, "alignment": {"seconds": 1.0}}},
            (0, 2): {"full": {**result, "alignment": {"seconds": 2.0}}},
        },
        ["full"],
    )
    assert summary["alignment_seconds"]["full"]["mean"] == 1.5
    assert summary["alignments"]["full"]["barrier_ratio"]["loss_barrier"]["mean"] == 50.0
    assert summary["alignments"]["full"]["mean_curves"]["naive"][1]["loss"] == 3.0
    assert summary["alignments"]["full"]["no_barrier"] == {"loss_barrier": [], "accuracy_barrier": []}


def test_pairs_without_a_naive_barrier_are_counted_and_excluded_by_name():
    def result(naive: float, aligned: float) -> dict:
        points = [{"alpha": a, "loss": 1.0, "accuracy": 0.5} for a in (0.0, 1.0)]
        curves = {"naive": {"points": points, **dict.fromkeys(BARRIERS, naive)}}
        curves["aligned"] = {"points": points, **dict.fromkeys(BARRIERS, aligned)}
        return {"full": {"curves": curves, "barrier_ratio": barrier_ratios(curves), "alignment": {"seconds": 1.0}}}

    # 0.0099 nats is below lmc.connectivity.NO_BARRIER: no barrier; 0.01 and 0.5 have one.
    pairs = {(0, 1): result(0.5, 0.1), (0, 2): result(0.0099, 0.002), (1, 2): result(0.01, 0.005)}
    entry = summarize(pairs, ["full"])["alignments"]["full"]
    assert entry["no_barrier"]["loss_barrier"] == ["0_2"]
    assert entry["barrier_ratio"]["loss_barrier"]["count"] == 2
    assert entry["barrier_ratio"]["loss_barrier"]["mean"] == pytest.approx((20.0 + 50.0) / 2, rel=1e-12)
    # A table cell says how many of the row's pairs a mean counts, and only when that is fewer.
    assert cell(entry["barrier_ratio"]["loss_barrier"], of=3) == "35.0 ± 21.2 (2 of 3)"
    assert cell(entry["naive"]["loss_barrier"], 2, of=3) == "0.17 ± 0.28"
    assert cell(spread([math.nan]), of=3) == "n/a (0 of 3)"
    table = summary_table(summarize(pairs, ["full"]) | {"pairs": ["0_1", "0_2", "1_2"]})
    assert "- no naive loss barrier (below 0.01), excluded from its ratios: 0_2" in table


def test_rank_and_l_hat_by_hand():
    barriers = {"0123": 0.50, "1023": 0.20, "0132": 0.20, "3210": 0.90}
    # The chosen order ties for the best barrier: rank 1; the method matches L_top1: L_hat 0.
    assert rank_and_l_hat(barriers, "0132", method=0.20, naive=1.0) == (1, 0.0)
    # Two orders are strictly better than 0.50: rank 3; (0.40 - 0.20) / (1.00 - 0.20) = 25 %.
    assert rank_and_l_hat(barriers, "0123", method=0.40, naive=1.0) == (3, pytest.approx(25.0))
    assert rank_and_l_hat(barriers, "3210", method=0.90, naive=0.90)[0] == 4
    assert math.isnan(rank_and_l_hat(barriers, "0123", method=0.3, naive=0.1)[1])  # naive below L_top1


def test_l_hat_leaves_out_a_pair_without_a_naive_barrier_as_the_ratios_do():
    alphas = [0.0, 0.5, 1.0]

    def curve(middle_loss: float, middle_accuracy: float) -> dict:
        points = [{"alpha": a, "loss": 1.0, "accuracy": 0.8} for a in alphas]
        points[1] = {"alpha": 0.5, "loss": middle_loss, "accuracy": middle_accuracy}
        return {"points": points, **barriers(points)}

    def order(loss_barrier: float, accuracy_barrier: float) -> dict:
        return {"settings": {"alphas": alphas}, "curves": {"aligned": {"loss_barrier": loss_barrier,
                "accuracy_barrier": accuracy_barrier}}}  # fmt: skip

    pairs = {}
    # the naive accuracy barrier of pair 0_2 is 0.005, below NO_BARRIER's 0.01 but above the best order's 0.001
    for (i, j), naive_accuracy in (((0, 1), 0.5), ((0, 2), 0.795)):
        full = {
            "alignment": {"layers": [{"kind": "attention", "assignment": [1, 0]}]},
            "curves": {"aligned": curve(1.2, 0.79), "naive": curve(2.0, naive_accuracy)},
        }
        pairs[(i, j)] = {"full": full, "head_orders": {"01": order(0.1, 0.001), "10": order(0.2, 0.01)}}
    study = lmc.experiments.stats.table1.summarize_head_orders(pairs, ["full"])
    per_pair = study["alignments"]["full"]["per_pair"]
    # loss: (0.2 - 0.1) / (1.0 - 0.1) in both pairs; accuracy: (0.01 - 0.001) / (0.3 - 0.001) in 0_1 only
    assert [e["loss_barrier"]["l_hat"] for e in per_pair.values()] == [pytest.approx(100 * 0.1 / 0.9)] * 2
    assert per_pair["0_1"]["accuracy_barrier"]["l_hat"] == pytest.approx(100 * 0.009 / 0.299, rel=1e-12)
    assert math.isnan(per_pair["0_2"]["accuracy_barrier"]["l_hat"])
    assert study["alignments"]["full"]["accuracy_barrier"]["l_hat"]["count"] == 1
    assert [e["accuracy_barrier"]["rank"] for e in per_pair.values()] == [2, 2]  # ranks stay


def test_head_order_noise_tells_orders_apart_only_beyond_the_evaluation_noise(tmp_path):
    alphas = [0.0, 0.5, 1.0]
    middles = {"012": [15.0] * 6, "021": [10.0, 21.0] * 3, "102": [25.0] * 6}  # loss sums of 6 clusters of 10
    orders = {}
    for label, middle in middles.items():
        store = SweepStore(tmp_path / label / "lmc_sweep_state_0.json", "k", {})
        for index, cluster_losses in enumerate([[10.0] * 6, middle, [10.0] * 6]):
            clusters = [{"count": 10.0, "loss": loss, "accuracy": 5.0} for loss in cluster_losses]
            point = {"alpha": alphas[index], "loss": sum(cluster_losses) / 60, "accuracy": 0.5}
            store.put("aligned", alphas[index], point, True, clusters)
        points = [store.get("aligned", alpha) for alpha in alphas]
        orders[label] = {"settings": {"alphas": alphas}, "curves": {"aligned": barriers(points)}}
    noise = lmc.experiments.table1.head_order_noise(orders, {"a": "102", "b": "021"}, tmp_path, alphas)
    # 102's barrier (1.5) is above 012's (0.5) and 021's (at most 1.1) in every draw.
    a = noise["a"]["loss_barrier"]
    assert a["gap"] == pytest.approx(1.0, abs=1e-12) and a["gap_std"] == pytest.approx(0.0, abs=1e-12)
    assert not a["tie"] and a["rank_within_noise"] == 3
    # 021 (0.55) is below 012 (0.5) in the draws with at most two of its 2.1-nat clusters: about a third.
    b = noise["b"]["loss_barrier"]
    assert b["gap"] == pytest.approx(0.05, abs=1e-12) and b["tie"] and b["rank_within_noise"] == 1
    assert 0.2 < b["gap_std"] < 0.3  # 0.55 nats between the clusters, 6 per draw: 0.55 / sqrt(6) = 0.22
    assert noise["b"]["accuracy_barrier"]["tie"]  # flat accuracy: every order ties
    # Without the clusters (a distributed evaluation), no noise is claimed.
    (tmp_path / "012" / "lmc_sweep_state_0.json").unlink()
    assert lmc.experiments.table1.head_order_noise(orders, {"a": "102"}, tmp_path, alphas) == {}


def _write_order_curves(folder: Path, alphas: list[float], middles: dict[str | None, list[float]]) -> dict:
    """Sweep states of head orders (and of the naive curve, key ``None``) whose clusters of 10 samples
    have loss sums 10 at the end points and ``middles[label]`` at 0.5; returns the orders' results."""
    orders = {}
    for label, middle in middles.items():
        path = (
            folder / "naive_sweep_state.json" if label is None else folder / "orders" / label / "lmc_sweep_state_0.json"
        )
        curve = "naive" if label is None else "aligned"
        store = SweepStore(path, "k", {})
        for alpha, cluster_losses in zip(alphas, [[10.0] * len(middle), middle, [10.0] * len(middle)], strict=True):
            clusters = [{"count": 10.0, "loss": loss, "accuracy": 5.0} for loss in cluster_losses]
            point = {"alpha": alpha, "loss": sum(cluster_losses) / (10 * len(middle)), "accuracy": 0.5}
            store.put(curve, alpha, point, True, clusters)
        if label is not None:
            points = [store.get(curve, alpha) for alpha in alphas]
            orders[label] = {"settings": {"alphas": alphas}, "curves": {"aligned": barriers(points)}}
    return orders


def test_held_out_orders_score_stage1_and_the_order_picked_on_the_other_half(tmp_path):
    alphas = [0.0, 0.5, 1.0]
    # Every cluster alike: each half has the whole data's barriers (0.5, 1.0, 1.5; naive 2.5).
    middles = {"012": [15.0] * 6, "021": [20.0] * 6, "102": [25.0] * 6, None: [35.0] * 6}
    orders = _write_order_curves(tmp_path, alphas, middles)
    naive = tmp_path / "naive_sweep_state.json"
    held = lmc.experiments.table1.held_out_orders(orders, {"full": "021"}, tmp_path / "orders", naive, alphas)
    loss = held["loss_barrier"]
    assert loss["held_out"] == {"rank": 1.0, "l_hat": 0.0}
    assert loss["full"]["rank"] == 2.0 and loss["full"]["l_hat"] == pytest.approx(100 * 0.5 / 2.0, abs=1e-12)
    # Two orders tied on the whole data, each better on three clusters: the half that picks one holds
    # two or three of its good clusters, so the other half holds at most one of them: the pick is
    # always the worse order where it is scored (the evaluation's noise, which Stage 1 does not see).
    middles = {"01": [12.0] * 3 + [18.0] * 3, "10": [18.0] * 3 + [12.0] * 3, None: [35.0] * 6}
    orders = _write_order_curves(tmp_path / "tied", alphas, middles)
    naive = tmp_path / "tied" / "naive_sweep_state.json"
    held = lmc.experiments.table1.held_out_orders(orders, {"full": "01"}, tmp_path / "tied" / "orders", naive, alphas)
    assert held["loss_barrier"]["held_out"]["rank"] == 2.0 and held["loss_barrier"]["held_out"]["l_hat"] > 0
    assert 1.0 < held["loss_barrier"]["full"]["rank"] < 2.0  # right on the cuts that favour its good clusters
    # Without a curve's clusters (a distributed evaluation), nothing is claimed.
    naive.unlink()
    assert (
        lmc.experiments.table1.held_out_orders(orders, {"full": "01"}, tmp_path / "tied" / "orders", naive, alphas)
        == {}
    )


def test_an_order_left_at_its_screening_bound_competes_with_that_bound(tmp_path):
    whole, screening = [0.0, 0.25, 0.5, 0.75, 1.0], [0.0, 0.5, 1.0]
    curves = (
        (None, 35.0, whole, tmp_path / "naive_sweep_state.json"),
        ("01", 20.0, whole, tmp_path / "orders" / "01" / "lmc_sweep_state_0.json"),
        ("10", 15.0, screening, tmp_path / "orders" / "screening" / "10" / "lmc_sweep_state_0.json"),
    )
    orders = {}
    for label, middle, alphas, path in curves:
        store, curve = SweepStore(path, "k", {}), "naive" if label is None else "aligned"
        for alpha in alphas:
            loss = 10.0 if alpha in (0.0, 1.0) else middle
            clusters = [{"count": 10.0, "loss": loss, "accuracy": 5.0}] * 4
            store.put(curve, alpha, {"alpha": alpha, "loss": loss / 10, "accuracy": 0.5}, True, clusters)
        if label is not None:
            orders[label] = {"settings": {"alphas": alphas}, "curves": {"aligned": {}}}
    held = lmc.experiments.table1.held_out_orders(
        orders, {"full": "01"}, tmp_path / "orders", tmp_path / "naive_sweep_state.json", whole
    )
    # 10's bound (0.5) undercuts 01's barrier (1.0): it is the pick, and the best order, on every half.
    assert held["loss_barrier"]["held_out"] == {"rank": 1.0, "l_hat": 0.0}
    assert held["loss_barrier"]["full"] == {"rank": 2.0, "l_hat": pytest.approx(100 * 0.5 / 2.0, abs=1e-12)}


def _write_aligned_curve(path: Path, alphas: list[float], middle: list[float], clusters: bool = True) -> dict:
    """An aligned curve of 6 clusters of 10 samples, loss 1 at the end points and ``middle`` (loss sums) at 0.5,
    written as a sweep state; returns its barriers, computed from its points."""
    store = SweepStore(path, "k", {})
    for index, cluster_losses in enumerate([[10.0] * 6, middle, [10.0] * 6]):
        sums = [{"count": 10.0, "loss": loss, "accuracy": 5.0} for loss in cluster_losses]
        point = {"alpha": alphas[index], "loss": sum(cluster_losses) / 60, "accuracy": 0.5}
        store.put("aligned", alphas[index], point, True, sums if clusters else None)
    return barriers([store.get("aligned", alpha) for alpha in alphas])


def test_refinement_noise_tells_a_rise_or_a_fall_from_the_evaluation_noise(tmp_path):
    alphas = [0.0, 0.5, 1.0]
    start = [10.0, 21.0] * 3  # barrier 0.55, 1.1 nats between the clusters
    refined = {
        "higher": [15.0, 26.0] * 3,  # 0.5 nats above the start on every cluster
        "lower": [7.0, 18.0] * 3,  # 0.3 nats below on every cluster
        "within_noise": [22.0, 10.0] * 3,  # 0.05 nats above on average, +-1.15 nats per cluster
    }
    barrier_gaps = {}
    for pair, middle in refined.items():
        orthogonal = _write_aligned_curve(tmp_path / pair / "orthogonal" / "lmc_sweep_state_0.json", alphas, start)
        full = _write_aligned_curve(tmp_path / pair / "full" / "lmc_sweep_state_0.json", alphas, middle)
        barrier_gaps[pair] = {name: full[name] - orthogonal[name] for name in ("loss_barrier", "accuracy_barrier")}
    noise = {pair: lmc.experiments.table1.refinement_noise(tmp_path / pair, alphas) for pair in refined}
    for pair, entry in noise.items():
        for name, gap in barrier_gaps[pair].items():
            assert entry[name]["gap"] == pytest.approx(gap, abs=1e-12), (pair, name)
    higher, lower, tied = (noise[pair]["loss_barrier"] for pair in refined)
    assert higher["gap"] == pytest.approx(0.5, abs=1e-12) and higher["gap_std"] == pytest.approx(0.0, abs=1e-12)
    assert higher["raised"] and not higher["lowered"]
    assert lower["gap"] == pytest.approx(-0.3, abs=1e-12) and lower["lowered"] and not lower["raised"]
    # A rise of 0.05 nats against 1.15 nats between the clusters, 6 per draw: 1.15 / sqrt(6) = 0.47.
    assert tied["gap"] == pytest.approx(0.05, abs=1e-12) and not tied["raised"] and not tied["lowered"]
    assert 0.35 < tied["gap_std"] < 0.6
    flat = noise["higher"]["accuracy_barrier"]  # both accuracy curves are flat: no gap, no noise
    assert flat == {"gap": 0.0, "gap_std": 0.0, "raised": False, "lowered": False}

    # Without a curve's clusters (a distributed evaluation), no noise is claimed; the summary counts the rest.
    _write_aligned_curve(tmp_path / "unrecorded" / "orthogonal" / "lmc_sweep_state_0.json", alphas, start)
    _write_aligned_curve(tmp_path / "unrecorded" / "full" / "lmc_sweep_state_0.json", alphas, start, clusters=False)
    assert lmc.experiments.table1.refinement_noise(tmp_path / "unrecorded", alphas) == {}
    folders = {pair: tmp_path / pair for pair in [*refined, "unrecorded"]}
    summary = lmc.experiments.stats.table1.summarize_refinement(folders, alphas)
    assert summary["per_pair"] == noise
    assert summary["loss_barrier"] == {"pairs": 3, "raised": 2, "raised_beyond_noise": 1, "lowered_beyond_noise": 1}
    assert summary["accuracy_barrier"]["raised_beyond_noise"] == 0 and summary["resamples"] == 1000


@pytest.mark.slow
def test_head_orders_rank_every_order_of_the_first_layer(tmp_path):
    config = _config(tmp_path, seeds=2, num_alphas=2, head_orders=True, alignments=[{"method": "full"}])
    main(["run", "--config", config])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    study = summary["head_orders"]
    assert study["orders"] == 24  # 4 heads
    (entry,) = study["alignments"]["full"]["per_pair"].values()
    orders = sorted(p.name for p in (tmp_path / "run" / "pairs" / "0_1" / "orders").iterdir())
    assert len(orders) == 24 and entry["order"] in orders
    barriers = {}
    for order in orders:
        result = json.loads((tmp_path / "run" / "pairs" / "0_1" / "orders" / order / "lmc_results.json").read_text())
        (reference,) = result["references"].values()
        assert reference["alignment"]["layers"][0]["assignment"] == [int(h) for h in order]  # the imposed order
        barriers[order] = reference["curves"]["aligned"]["loss_barrier"]
    assert entry["loss_barrier"]["top1"] == min(barriers.values())
    assert entry["loss_barrier"]["rank"] == 1 + sum(b < barriers[entry["order"]] for b in barriers.values())
    table = (tmp_path / "run" / "summary.md").read_text().split("Head orders")[1].splitlines()
    header = next(line for line in table if line.startswith("| alignment |"))
    row = next(line for line in table if line.startswith("| full |"))
    assert "| L_hat loss % on a half | held-out pick's |" in header and row.count("|") == header.count("|")
    # The held-out pick, read from the sweep states: on two alphas every barrier is 0, so all orders
    # tie, and without a naive barrier there is no L_hat (NaN, written as null).
    assert entry["loss_barrier"]["halves"]["held_out"] == {"rank": 1.0, "l_hat": None}
    assert study["alignments"]["full"]["loss_barrier"]["halves"]["pairs"] == 1


def test_head_orders_on_every_other_alpha_rank_every_barrier_on_those_alphas(tmp_path):
    config = _config(
        tmp_path,
        seeds=2,
        num_alphas=5,
        head_orders=True,
        head_order_alphas=3,
        alignment_alphas=3,
        alignments=[{"method": "orthogonal"}, {"method": "full"}],
    )
    main(["run", "--config", config])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    (entry,) = summary["head_orders"]["alignments"]["full"]["per_pair"].values()
    pair = tmp_path / "run" / "pairs" / "0_1"
    # alignment_alphas: the orthogonal start on the head orders' 3 alphas, the full method on all 5; the
    # refinement is measured on the 3 both hold, from the full method's recorded points there
    (start,) = json.loads((pair / "orthogonal" / "lmc_results.json").read_text())["references"].values()
    assert [p["alpha"] for p in start["curves"]["aligned"]["points"]] == [0.0, 0.5, 1.0]
    (refined,) = json.loads((pair / "full" / "lmc_results.json").read_text())["references"].values()
    refinement = summary["refinement"]["per_pair"]["0_1"]["loss_barrier"]
    on_three = barriers(refined["curves"]["aligned"]["points"][::2])["loss_barrier"]
    assert refinement["gap"] == pytest.approx(on_three - start["curves"]["aligned"]["loss_barrier"], abs=1e-12)
    assert "Curves on 3 alphas: `orthogonal`; 5 alphas: `full`" in (tmp_path / "run" / "summary.md").read_text()

    def loss_gap(points):  # the loss barrier of points, by hand
        (start, end) = points[0], points[-1]
        return max(p["loss"] - ((1 - p["alpha"]) * start["loss"] + p["alpha"] * end["loss"]) for p in points)

    orders = {}
    for folder in (pair / "orders").iterdir():
        (reference,) = json.loads((folder / "lmc_results.json").read_text())["references"].values()
        assert [p["alpha"] for p in reference["curves"]["aligned"]["points"]] == [0.0, 0.5, 1.0]
        orders[folder.name] = loss_gap(reference["curves"]["aligned"]["points"])
    (method,) = json.loads((pair / "full" / "lmc_results.json").read_text())["references"].values()
    assert len(method["curves"]["aligned"]["points"]) == 5
    on_grid = {c: loss_gap(method["curves"][c]["points"][::2]) for c in ("aligned", "naive")}
    top1 = min(orders.values())
    assert entry["loss_barrier"]["top1"] == pytest.approx(top1, abs=1e-12)
    assert entry["loss_barrier"]["rank"] == 1 + sum(b < orders[entry["order"]] for b in orders.values())
    l_hat = 100 * (on_grid["aligned"] - top1) / (on_grid["naive"] - top1)
    assert entry["loss_barrier"]["l_hat"] == pytest.approx(l_hat, rel=1e-12)
    assert "each order's curve on 3 alphas" in (tmp_path / "run" / "summary.md").read_text()


def test_screened_head_orders_give_the_ranks_and_l_hat_of_all_whole_curves(tmp_path):
    """Orders whose three-alpha bound cannot beat a picked order keep the bound; the rest get whole curves."""
    orders = list(itertools.permutations(range(3)))  # 6 orders of 3 heads
    gaps = {"012": 0.27, "021": 0.10, "102": 0.50, "120": 0.20, "201": 0.42, "210": 0.60}  # whole-curve barriers

    def curve(label, alphas):
        # Loss is 0 at both ends and peaks at alpha 0.25, so the middle alpha sees 2/3 of the barrier.
        peak = gaps.get(label, 1.0)
        loss = [peak * (a / 0.25 if a <= 0.25 else (1 - a) / 0.75) for a in alphas]
        points = [{"alpha": a, "loss": value, "accuracy": 1 - value} for a, value in zip(alphas, loss)]
        return {"points": points, **barriers(points)}

    swept = []

    def sweep(options, folder, at=None, figures=True):
        at = at or evenly_spaced(5)
        label = "".join(map(str, options.head_orders[0]))
        swept.append((label, len(at)))
        return {"settings": {"alphas": at}, "curves": {"aligned": curve(label, at), "naive": curve("naive", at)}}

    picked = {"full": {"alignment": {"layers": [{"kind": "attention", "assignment": [1, 2, 0]}]}}}
    result = lmc.experiments.table1.sweep_head_orders(orders, picked, evenly_spaced(5), tmp_path, sweep)
    whole = {label for label, count in swept if count == 5}
    # 120 is picked (0.20); only 021 (0.10 < 0.20) must be known exactly, but the bound (2/3 of the
    # barrier) of 012 (0.18) is below 0.20 too, so it is swept whole; 102, 201, 210 keep their bounds.
    assert whole == {"120", "021", "012"}
    exact = {label: curve(label, evenly_spaced(5))["loss_barrier"] for label in gaps}
    loss = {label: r["curves"]["aligned"]["loss_barrier"] for label, r in result.items()}
    assert (
        rank_and_l_hat(loss, "120", 0.2, 1.0) == rank_and_l_hat(exact, "120", 0.2, 1.0) == (2, pytest.approx(100 / 9))
    )


def test_robustness_tables_agree_with_the_curves_and_are_reused(finished, tmp_path, monkeypatch):
    shutil.copytree(finished / "run", tmp_path / "run")  # the same stages: nothing is trained again
    config = _config(tmp_path, robustness=True, seeds=2)
    main(["run", "--config", config])
    root, pair = tmp_path / "run", tmp_path / "run" / "pairs" / "0_1"
    study = json.loads((root / "summary.json").read_text())["robustness"]
    models = ["target", "source", "naive_midpoint", "aligned_midpoint:permutation", "aligned_midpoint:full"]
    assert study["models"] == models and list(study["severities"]) == ["gaussian_noise", "gaussian_blur"]
    table = json.loads((pair / "robustness.json").read_text())["models"]
    assert study["per_pair"] == {"0_1": table} and list(table) == models
    # Clean data: the end points and midpoints are points of the curves (alphas 0, 0.5 and 1 of 5).
    for label in ("permutation", "full"):
        (result,) = json.loads((pair / label / "lmc_results.json").read_text())["references"].values()
        naive, aligned = result["curves"]["naive"]["points"], result["curves"]["aligned"]["points"]
        assert table["target"]["clean"]["accuracy"] == naive[0]["accuracy"] == aligned[0]["accuracy"]
        assert table["source"]["clean"]["accuracy"] == naive[4]["accuracy"]
        assert table["naive_midpoint"]["clean"] == {k: v for k, v in naive[2].items() if k != "alpha"}
        assert table[f"aligned_midpoint:{label}"]["clean"] == {k: v for k, v in aligned[2].items() if k != "alpha"}
    for model in models:
        for corruption in ("gaussian_noise", "gaussian_blur"):
            cells = study["accuracy"][model][corruption]
            assert [c["mean"] for c in cells] == [level["accuracy"] for level in table[model][corruption]]
    section = (root / "summary.md").read_text().split("input corruptions")[1]
    assert "| aligned_midpoint:full |" in section and "gaussian_blur 3" in section

    # A rerun reuses the table; a deleted one is measured again, to the same numbers.
    first = json.loads((root / "summary.json").read_text())["robustness"]
    measured = []
    real = lmc.connectivity.robustness.corruption_table
    monkeypatch.setattr(
        lmc.connectivity.robustness, "corruption_table", lambda *a, **k: measured.append(1) or real(*a, **k)
    )
    main(["run", "--config", config])
    assert measured == []
    (pair / "robustness.json").unlink()
    main(["run", "--config", config])
    assert measured == [1]
    assert json.loads((root / "summary.json").read_text())["robustness"] == first


@pytest.mark.slow
def test_run_with_a_data_aware_alignment_records_its_calibration(tmp_path):
    alignments = [{"method": "full"}, {"objective": "data", "metric": "activation", "calibration_batches": 2}]
    main(["run", "--config", _config(tmp_path, seeds=2, alignments=alignments)])
    folder = tmp_path / "run" / "pairs" / "0_1" / "full-metric=activation-objective=data-calibration_batches=2"
    (result,) = json.loads((folder / "lmc_results.json").read_text())["references"].values()
    calibration = result["settings"]["calibration"]
    assert calibration["split"] == "train" and calibration["num_samples"] == 64
    assert calibration["data"]["part"] == "B"  # the fine-tuning half, never the curves' split
    assert result["alignment"]["calibration"]["batches"] == 2
    (plain,) = json.loads((tmp_path / "run" / "pairs" / "0_1" / "full" / "lmc_results.json").read_text())[
        "references"
    ].values()
    assert "calibration" not in plain["settings"] and "objective" not in plain["settings"]["options"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())["alignments"]
    assert summary["full-metric=activation-objective=data-calibration_batches=2"]["calibration"] == {
        "split": ["train"],
        "num_samples": [64],
    }
    assert "calibration" not in summary["full"]


def test_run_with_a_learned_alignment_starts_from_full_and_never_ends_above_it(tmp_path, monkeypatch):
    alignments = [{"method": "full"}, {"method": "learned", "learned_steps": 4, "calibration_batches": 2}]
    calls = record_alignments(monkeypatch, lmc.experiments.run)
    main(["run", "--config", _config(tmp_path, seeds=2, alignments=alignments)])
    pair = tmp_path / "run" / "pairs" / "0_1"
    (result,) = json.loads((pair / "learned-calibration_batches=2-learned_steps=4" / "lmc_results.json").read_text())[
        "references"
    ].values()
    assert result["settings"]["calibration"]["data"]["part"] == "B"
    learned = result["alignment"]["learned"]
    assert learned["steps"] == 4
    # Never above full: the calibration loss of the two aligned models' paths (pair 0_1, float32),
    # recomputed from the models the run aligned, on the batches it calibrated on.
    (full_call,) = [call for call in calls if call["options"] == AlignOptions(method="full")]
    (learned_call,) = [call for call in calls if call["options"].method == "learned"]
    batches = learned_call["calibration"].batches
    assert len(batches) == 2 and learned_call["report"].learned == learned
    check_learned_not_above_full(
        learned_call["target"], full_call["aligned"], learned_call["aligned"], batches, cross_entropy,
        learned["objective"], 1e-5,
    )  # fmt: skip
    (full,) = json.loads((pair / "full" / "lmc_results.json").read_text())["references"].values()
    assert "learned_steps" not in full["settings"]["options"] and full["alignment"]["learned"] is None
    # Both share the naive curve; the learned path's end points are full's (the same functions).
    assert result["curves"]["naive"] == full["curves"]["naive"]
    for end in (0, -1):
        learned_end, full_end = result["curves"]["aligned"]["points"][end], full["curves"]["aligned"]["points"][end]
        assert learned_end["loss"] == pytest.approx(full_end["loss"], rel=1e-5)


def test_a_run_folder_is_written_by_one_run_at_a_time(tmp_path, capsys):
    """Two runs into one folder used to mix their stages; the second is now refused, naming the first."""
    from lmc.io import folder_lock
    from tests.cli import fails

    with folder_lock(tmp_path / "run", "lmc run"):  # the lock a first, still running lmc run holds
        error = fails(["run", "--config", _config(tmp_path)], capsys)
    assert f"{tmp_path / 'run'} is in use by another lmc run (process " in error
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".lmc.lock"]  # nothing trained


def test_a_pretrained_checkpoint_of_another_model_is_refused_before_fine_tuning(finished, tmp_path, capsys):
    """Same shapes, another rotary layout: it used to fine-tune from it without a word."""
    import torch

    from tests.cli import fails

    other = tmp_path / "interleaved.ckpt"
    checkpoint = torch.load(finished / "run" / "pretrain" / "final.ckpt", weights_only=True)
    checkpoint["hyper_parameters"]["model_config"] = {"pe": "rope", "rope_layout": "interleaved"}
    torch.save(checkpoint, other)
    error = fails(["run", "--config", _config(tmp_path), f"--protocol.pretrained={other}"], capsys)
    assert f"protocol.pretrained {other} is another model than this one (model_config" in error
    assert "interleaved" in error
    assert not (tmp_path / "run" / "seed0").exists()
    from lmc.experiments.protocol import experiment_cli

    experiment = lmc.experiments.run.Experiment(experiment_cli(["--config", _config(tmp_path)], run=False))
    experiment._check_pretrained(finished / "run" / "pretrain" / "final.ckpt")  # its own model passes


def test_head_orders_of_a_wide_layer_are_refused_before_any_training(tmp_path, capsys):
    from tests.cli import fails

    config = yaml.safe_load(Path(_config(tmp_path, head_orders=True)).read_text())
    config["model"]["model_config"] = {"pe": "rope", "num_heads": 8}
    path = tmp_path / "wide.yaml"
    path.write_text(yaml.safe_dump(config))
    assert "use at most 6 heads" in fails(["run", "--config", str(path)], capsys)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("protocol", "expected"),
    [
        (  # the tiny ViT has 2 layers: an order for a third used to fail the first pair, after all the training
            {"reinit": "all_attention", "alignments": [{"method": "full", "head_orders": {2: [0, 1, 2, 3]}}]},
            "protocol.alignments (full-head_orders={2: [0, 1, 2, 3]}): head_orders names attention layer(s) [2], "
            "but scope 'all_attention' aligns layers [0, 1]",
        ),
        (
            {"alignments": [{"method": "full", "head_orders": {0: [1, 0]}}]},
            "a head order needs 4 entries, got 2",
        ),
        (  # a half of digits' training split holds some 630 images
            {"finetune": {"samples": 5000}},
            "protocol.finetune.samples: train_samples=5000 is more than the ",
        ),
        ({"pretrain": {"samples": 5000}}, "protocol.pretrain.samples: train_samples=5000 is more than the "),
    ],
    ids=["head-order-of-a-missing-layer", "head-order-of-another-width", "finetune-samples", "pretrain-samples"],
)
def test_settings_that_would_fail_a_later_stage_are_refused_before_any_training(tmp_path, capsys, protocol, expected):
    from tests.cli import fails

    error = fails(["run", "--config", _config(tmp_path, **protocol)], capsys)
    assert expected in error
    if "samples" in expected:  # the phase's own half
        assert f"of part '{'B' if 'finetune' in expected else 'A'}'" in error
    assert not (tmp_path / "run").exists()


def test_a_refusal_before_any_training_is_one_line_in_a_fresh_process(tmp_path):
    """Lightning's "GPU available: False" lines of the parsed trainer came before it. The tests' own process
    did not show them: Lightning's log handler writes to the standard error of its first import."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    argv = [sys.executable, "-m", "lmc", "run", "--config", _config(tmp_path, finetune={"samples": 5000})]
    environment = {**os.environ, "PYTHONPATH": str(root)}
    result = subprocess.run(argv, capture_output=True, text=True, env=environment, timeout=600)
    assert result.returncode == 2
    assert result.stderr.startswith("lmc: error: protocol.finetune.samples: ") and result.stderr.count("\n") == 1


#: What sbatch says where SLURM is installed but not configured (no slurm.conf, no DNS SRV record).
UNCONFIGURED_SBATCH = """#!/bin/sh
echo "sbatch: error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host" >&2
echo "sbatch: error: fetch_config: DNS SRV lookup failed" >&2
echo "sbatch: error: _establish_config_source: failed to fetch config" >&2
echo "sbatch: fatal: Could not establish a configuration source" >&2
exit 1
"""


@pytest.mark.parametrize("installed", [True, False], ids=["unconfigured", "not-installed"])
def test_slurm_that_cannot_take_jobs_is_one_line_and_leaves_nothing_behind(tmp_path, monkeypatch, capsys, installed):
    """It used to end in a 25-57 line traceback and leave the job's pickle in the jobs folder."""
    from tests.cli import fails

    bin_folder = tmp_path / "bin"
    bin_folder.mkdir()
    if installed:
        for command, script in (("sbatch", UNCONFIGURED_SBATCH), ("srun", "#!/bin/sh\nexit 1\n")):
            (bin_folder / command).write_text(script)
            (bin_folder / command).chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_folder))  # nothing else: a SLURM of the machine would not be found
    error = fails(["run", "--config", _config(tmp_path, {"executor": "slurm"})], capsys)
    if installed:
        expected = "sbatch failed: sbatch: fatal: Could not establish a configuration source"
    else:
        expected = "sbatch and srun not on PATH (SLURM is not installed here)"
    assert error.startswith(f"lmc: error: cannot submit pretrain to SLURM: {expected}; ")
    assert "--cluster.executor local" in error
    left = sorted(str(p.relative_to(tmp_path / "run")) for p in (tmp_path / "run").rglob("*"))
    assert left == [".lmc.lock"]  # no pickle, no sbatch script, no jobs folder


def test_a_fit_job_whose_processes_the_trainer_would_not_use_is_refused_before_any_job(tmp_path, capsys):
    """Two GPUs (or tasks_per_node 2) per job start two DDP processes: a trainer on one device would
    leave one waiting."""
    from tests.cli import fails

    config = _config(tmp_path, {"executor": "local", "gpus_per_job": 2})
    error = fails(["run", "--config", config, "--trainer.devices", "1"], capsys)
    assert "starts 1 node(s) x 2 process(es)" in error and "--trainer.devices 2 (or -1)" in error
    error = fails(["run", "--config", config, "--cluster.gpus_per_job", "0", "--cluster.nodes", "2"], capsys)
    assert "num_nodes 1" in error and "--trainer.num_nodes 2" in error
    # Two tasks on CPUs: devices 2 (gloo); -1 means every GPU, which they do not have.
    on_cpus = ["--cluster.gpus_per_job", "0", "--cluster.tasks_per_node", "2"]
    error = fails(["run", "--config", config, *on_cpus, "--trainer.devices", "1"], capsys)
    assert "starts 1 node(s) x 2 process(es)" in error and "--trainer.devices 2 (LMC_DEBUG" in error
    error = fails(["run", "--config", config, "--cluster.tasks_per_node", "3"], capsys)
    assert "one task per GPU" in error and "drop cluster.tasks_per_node or set it to 2" in error
    assert not (tmp_path / "run").exists()  # refused before the folder is taken


def _ddp_config(folder: Path, cluster: dict, batch_size: int, devices: int) -> str:
    """The tiny experiment with a DDP trainer of ``devices`` ranks on CPUs, ``batch_size`` samples each."""
    config = yaml.safe_load(Path(_config(folder, cluster)).read_text())
    config["data"]["init_args"]["batch_size"] = batch_size
    config["trainer"].update(strategy="ddp", devices=devices)
    path = folder / "ddp.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _pretrain_job(config: str) -> Path:
    """The ``pretrain`` stage of ``config`` as ``lmc run`` submits it, one job; returns the run folder."""
    experiment = Experiment(experiment_cli(["--config", config], run=False))
    experiment._check_fit_tasks(experiment.cluster)
    (job,) = [job for job in experiment.jobs() if job.name == "pretrain"]
    run_jobs([job], experiment.cluster, experiment.root / "jobs", threads=1)
    return experiment.root


#: Float32 rounding: DDP averages the two ranks' mean gradients where one process takes the mean of
#: all 32 samples, a sum in another order at each of 6 AdamW steps (measured 5.4e-7; the same
#: samples drawn in another order move the weights by 2e-2).
DDP_ATOL = 5e-6


def fit_as_two_task_ddp_job(tmp_path: Path, cluster: dict) -> Path:
    """Pre-train as a 2-task DDP job on ``cluster`` (16 samples per rank) and check it against one
    process with the global batch of 32; returns the DDP run's folder.

    Checks that Lightning saw both ranks in a world of 2 (each task's log), that only rank 0 wrote
    the stage (its two files, one TensorBoard log) and that the weights are the one process's.
    """
    for name in ("one_process", "ddp"):
        (tmp_path / name).mkdir()
    # The reference: one process, the global batch in the order DDP's sampler draws it (Lightning's
    # DistributedSampler, here of one replica: DDP on one device), in a process of its own.
    one_process = _pretrain_job(_ddp_config(tmp_path / "one_process", {"executor": "local"}, 32, 1))
    ddp = _pretrain_job(_ddp_config(tmp_path / "ddp", cluster, 16, 2))
    logs = sorted((ddp / "jobs").glob("*_log.err"))
    assert [path.name.split("_")[1] for path in logs] == ["0", "1"]  # one job, two tasks
    for rank, log in enumerate(logs):
        assert f"GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/2" in log.read_text(), log.read_text()
    assert sorted(path.name for path in (ddp / "pretrain").iterdir()) == ["final.ckpt", "stage.json"]
    assert len(list((ddp / "tensorboard" / "pretrain").glob("events.out.tfevents.*"))) == 1
    weights = {
        name: torch.load(root / "pretrain" / "final.ckpt", weights_only=True)["state_dict"]
        for name, root in (("ddp", ddp), ("one_process", one_process))
    }
    assert weights["ddp"].keys() == weights["one_process"].keys()
    worst = max((weights["ddp"][k] - weights["one_process"][k]).abs().max().item() for k in weights["ddp"])
    print(f"2-task DDP fit: largest weight difference to one process {worst:.1e}")
    assert worst < DDP_ATOL
    return ddp


@pytest.mark.slow
def test_a_fit_as_a_two_task_ddp_job_on_this_machine_equals_one_process_with_the_same_global_batch(tmp_path):
    """``cluster.tasks_per_node 2`` on the local executor: submitit starts two tasks, which Lightning
    joins into one DDP fit (gloo on CPUs)."""
    fit_as_two_task_ddp_job(tmp_path, {"executor": "local", "tasks_per_node": 2})


def test_eval_samples_are_spread_over_the_split_so_an_ordered_split_keeps_every_class(tmp_path):
    # The Bible's verses are stored in canonical order, so each split is sorted by division: its
    # first 250 validation verses are all of the Law. Evenly spaced ones hold each division in proportion.
    from lmc.data import BibleDivisions

    datamodule = BibleDivisions(batch_size=64, part="B")
    experiment = Experiment(experiment_cli(["--config", _config(tmp_path, eval_samples=250)], run=False))
    dataset, data = experiment.curve_data(datamodule)
    whole = [int(sample["labels"]) for sample in datamodule.split("val")]
    assert len({*whole[:250]}) == 1  # what the first 250 would be
    used = [int(sample["labels"]) for sample in dataset]
    assert len(used) == 250 and (data["eval_samples"], data["eval_spacing"]) == (250, "even")
    for label in set(whole):
        assert abs(used.count(label) - 250 * whole.count(label) / len(whole)) <= 1, label
    assert dataset.indices == sorted(set(dataset.indices))  # distinct samples, in the split's order


def test_run_prints_its_stages_to_standard_error_and_quiet_prints_none(tmp_path, capsys):
    """lmc run's stages on standard error when it is not a terminal (a log, a pipe); lmc demo and
    lmc repro show them from progress.json. --quiet: no progress lines."""
    config = _config(tmp_path, seeds=2, num_alphas=3, alignments=[{"method": "permutation"}])
    main(["run", "--config", config])
    root = tmp_path / "run"
    shown = re.compile(rf"^{re.escape(str(root))}: (.+) \[(\d)/5\] \d+:\d\d elapsed(, about \d+:\d\d left)?$")
    lines = [shown.match(line) for line in capsys.readouterr().err.splitlines() if line.startswith(f"{root}: ")]
    assert all(lines)
    stages = [(line[1], int(line[2]), line[3] is not None) for line in lines]
    assert stages == [
        ("pre-train", 0, False),  # no estimate before a stage has finished
        ("fine-tune seed 0", 1, True),
        ("fine-tune seed 1", 2, True),
        ("align and sweep pair 0_1", 3, True),
        ("summarize", 4, True),
        ("done", 5, False),
    ]
    assert json.loads((root / "progress.json").read_text())["stage"] == "done"
    main(["run", "--config", config, "--quiet"])  # every stage finished: it summarizes again
    captured = capsys.readouterr()
    assert str(root) not in captured.err and "Results:" in captured.out
