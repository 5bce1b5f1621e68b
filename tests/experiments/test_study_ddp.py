"""``lmc repro`` with DDP fits: on a cluster whose fits span several processes, each fit
(pre-training, each seed's fine-tuning) is one Lightning DDP job of its own, on CPUs with gloo
here, and each pair's alignments and sweeps a one-process job (``lmc run``'s stages).

A tiny study runs with ``--tasks_per_node 2`` on the local executor; the same study on the test
SLURM (tests/slurm.py), with a fine-tuning's 2-task job requeued mid-fit, ends with its summary
byte for byte. GPUs (NCCL) and several nodes are not tested: this machine has neither.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml

from lmc.cli import main
from lmc.experiments.jobs import Cluster
from lmc.experiments.study import Family, Study
from tests.experiments.test_slurm import _pause, _results, cluster  # noqa: F401 (cluster: a fixture)

ROOT = Path(__file__).resolve().parents[2]
#: The family's run folder under a study's output_dir.
RUN = Path("vit_rope") / "first_attention"


def _study_file(folder: Path, configs: list[str] | None = None) -> Path:
    """A tiny study in ``folder``: the digits ViT with RoPE, first_attention, 2 seeds, a few steps
    per fit (the quick form's overlay); ``configs`` are added to the family's."""
    family = {"name": "vit_rope", "title": "ViT, digits, RoPE", "experiment": "configs/study/vit_rope.yaml"}
    study = {
        "families": [{**family, "configs": configs or []}],
        "strategies": ["first_attention"],
        "seeds": 2,
        "overlays": ["configs/study/quick_runs.yaml"],
        "output_dir": str(folder / "runs"),
        "report": str(folder / "r.md"),
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "study.yaml").write_text(yaml.safe_dump({"study": study}))
    return folder / "study.yaml"


def _repro(study: Path, *flags: str) -> None:
    main(["repro", "--study", f'["{study}"]', "--jobs", "1", *flags])


@pytest.fixture(scope="module")
def ddp_study(tmp_path_factory) -> Path:
    """The tiny study with 2-process DDP fits on this machine, finished; returns its folder."""
    folder = tmp_path_factory.mktemp("ddp_study")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(ROOT)  # the study names its configs relative to the repository
        _repro(_study_file(folder), "--executor", "local", "--tasks_per_node", "2")
    return folder


@pytest.mark.slow
def test_a_study_with_ddp_fits_trains_each_fit_as_one_job_of_two_ranks_and_summarizes_every_pair(ddp_study):
    run = ddp_study / "runs" / RUN
    for stage in ("pretrain", "seed0", "seed1"):  # a one-process fit records a world of 1
        assert json.loads((run / stage / "stage.json").read_text())["world_size"] == 2, stage
    # submitit's log of each task: the three fits are jobs of two tasks, the pair and the summary of one.
    tasks = Counter(path.name.split("_")[0] for path in (ddp_study / "runs" / "jobs").glob("*_log.err"))
    assert sorted(tasks.values()) == [1, 1, 2, 2, 2]
    times = json.loads((ddp_study / "runs" / "times.json").read_text())
    assert sorted(times) == sorted(["vit_rope/pretrain", f"{RUN}/seed0", f"{RUN}/seed1", f"{RUN}/pair0_1", str(RUN)])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["pairs"] == ["0_1"]  # 2 seeds: their one pair
    curves = summary["alignments"]["full"]["per_pair"]["0_1"]
    assert all(math.isfinite(curves[curve]["loss_barrier"]) for curve in ("naive", "aligned"))
    assert (ddp_study / "runs" / "vit_rope" / "first_layer_inputs.json").is_file()  # the run's job's own part
    assert "| ViT, digits, RoPE | first_attention | 1 |" in (ddp_study / "r.md").read_text()


def test_ddp_fits_are_lmc_runs_stages_as_jobs_listed_before_any_pretraining(tmp_path, monkeypatch):
    """Every fit its own job after the pre-training, each pair after its seeds, each run's summary
    after its pairs; a strategy that starts from the pre-trained checkpoint is listed before that
    checkpoint exists. With one process per fit a run stays one job."""
    import lmc.experiments.study

    monkeypatch.chdir(ROOT)
    submitted = {}

    def record(jobs, setting, *args, **kwargs):
        submitted[setting.fit_tasks] = jobs
        return {}

    monkeypatch.setattr(lmc.experiments.study, "run_jobs", record)
    family = Family("vit_rope", "ViT, digits, RoPE", "configs/study/vit_rope.yaml")
    study = Study(
        families=[family],
        strategies=["first_attention", "full_model"],
        seeds=2,
        overlays=["configs/study/quick_runs.yaml"],
        output_dir=str(tmp_path / "runs"),
    )
    for setting in (Cluster(executor="slurm", tasks_per_node=2), Cluster(executor="slurm")):
        lmc.experiments.study.run_study(study, jobs=1, cluster=setting)
    ddp = {job.name: (job.after, job.fit) for job in submitted[2]}
    expected = {"vit_rope/pretrain": ((), True)}
    for strategy in study.strategies:
        run = f"vit_rope/{strategy}"
        expected |= {f"{run}/seed{seed}": (("vit_rope/pretrain",), True) for seed in (0, 1)}
        expected[f"{run}/pair0_1"] = ((f"{run}/seed0", f"{run}/seed1"), False)
        expected[run] = (("vit_rope/pretrain", f"{run}/pair0_1"), False)
    assert ddp == expected
    assert not any(job.finished for job in submitted[2])
    for job in submitted[2]:  # each job's output in its run's log
        run = job.name.split("/")[1] if job.name != "vit_rope/pretrain" else "first_attention"
        assert job.log == tmp_path / "runs" / "vit_rope" / run / "log.txt"
    # Every fit of the study is one DDP fit of the job's two processes, on CPUs.
    fine_tune = next(job for job in submitted[2] if job.name == "vit_rope/full_model/seed0").call.call
    trainer = fine_tune.source.config.trainer
    # devices as lmc run --trainer.devices 2 parses it (Lightning reads "2" as two devices)
    assert (trainer.strategy, trainer.accelerator, str(trainer.devices), trainer.num_nodes) == ("ddp", "cpu", "2", 1)
    pretraining = submitted[2][0].call.study
    assert pretraining.fit_trainer == {"strategy": "ddp", "accelerator": "cpu", "devices": 2, "num_nodes": 1}
    one_process = {job.name: job.after for job in submitted[1]}
    assert one_process == {
        "vit_rope/pretrain": (),
        "vit_rope/first_attention": ("vit_rope/pretrain",),
        "vit_rope/full_model": ("vit_rope/pretrain",),
    }
    assert submitted[1][0].call.study.fit_trainer == {}


def test_a_study_refuses_ddp_fits_on_the_inline_executor_before_it_writes_anything(tmp_path):
    from lmc.experiments.study import load_study, run_study

    study = dataclasses.replace(
        load_study([ROOT / "configs/study/repro.yaml", ROOT / "configs/study/quick.yaml"]),
        output_dir=str(tmp_path / "study"),
    )
    with pytest.raises(ValueError, match=r"inline executor .* 1 node\(s\) x 2 process\(es\) .* --executor local"):
        run_study(study, jobs=1, cluster=Cluster(executor="inline", tasks_per_node=2))
    assert not (tmp_path / "study").exists()


def test_a_ddp_launch_in_a_job_keeps_the_jobs_thread_count(monkeypatch):
    """Lightning's DDP launch sets torch's threads to the CPUs over the ranks unless OMP_NUM_THREADS
    is set: a job sets it to its own count, on which its numbers depend."""
    from lightning.fabric.utilities.distributed import _set_num_threads_if_needed, _suggested_max_num_threads

    from lmc.experiments.jobs import _in_job

    if _suggested_max_num_threads(num_processes=1) == 1:
        pytest.skip("one CPU: Lightning's thread count would be the job's own")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()

    def launched() -> int:
        _set_num_threads_if_needed(num_processes=1)  # what Lightning's launcher calls
        return torch.get_num_threads()

    try:
        assert _in_job(launched, threads=1, parent=None) == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_a_ddp_study_on_slurm_with_a_fit_requeued_mid_way_ends_identical_to_it_uninterrupted(
    cluster,  # noqa: F811 (the fixture)
    ddp_study,
    tmp_path,
    monkeypatch,
    capsys,
):
    """seed 1's fine-tuning, a job of 2 tasks, is requeued mid-fit (SLURM kills both and starts both
    again); it trains again from its beginning and the study ends with the summary of the same
    DDP study uninterrupted on the local executor."""
    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the jobs import tests.interruptions
    monkeypatch.chdir(ROOT)
    marker = tmp_path / "paused.json"
    pause = tmp_path / "pause.yaml"
    # at its second and last training batch (configs/study/quick_runs.yaml: limit_train_batches 2)
    pause.write_text(yaml.safe_dump({"trainer": {"callbacks": _pause(marker, "seed1", batch=1)}}))
    study = _study_file(tmp_path / "slurm", [str(pause)])
    requeuer, requeued = cluster.requeue_when_paused(marker, timeout=400)  # after the pre-training and seed 0
    capsys.readouterr()
    on_slurm = ["--executor", "slurm", "--tasks_per_node", "2", "--cpus_per_job", "1", "--time_limit_min", "10"]
    _repro(study, *on_slurm, "--max_jobs", "2")
    requeuer.join()
    output = capsys.readouterr().out
    assert len(requeued) == 1, "seed 1's job never paused: the test did not requeue it"
    assert f"{RUN}/seed1: submitted (slurm job {requeued[0]})" in output  # submitted once, requeued by SLURM
    assert "Restarts=1" in cluster.command("scontrol", "show", "job", requeued[0])
    submitted = json.loads((tmp_path / "slurm" / "runs" / "jobs" / "submitted.json").read_text())
    assert submitted[f"{RUN}/seed1"] == [requeued[0], 2]  # a job of two tasks
    assert json.loads((tmp_path / "slurm" / "runs" / RUN / "seed1" / "stage.json").read_text())["world_size"] == 2
    ours, reference = tmp_path / "slurm" / "runs" / RUN, ddp_study / "runs" / RUN
    for name in ("summary.md", "summary.csv"):
        assert (ours / name).read_bytes() == (reference / name).read_bytes()
    assert _results(ours) == _results(reference)
