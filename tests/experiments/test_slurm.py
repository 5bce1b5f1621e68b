"""``lmc run`` on a real SLURM (a single node on this machine, tests/slurm.py) through submitit.

One job is requeued mid-fit, as a preemption does; the run ends with the summary of an
uninterrupted run in one process, byte for byte (which the local executor's run equals:
tests/experiments/test_run.py). A fit runs as one Lightning DDP job of two tasks on CPUs (gloo)
and trains the model one process trains with the same global batch. ``make test`` installs SLURM
(``make slurm``) and requires these tests to run (``LMC_REQUIRE_SLURM=1``); a bare ``pytest``
without SLURM skips them and says why.
"""

from __future__ import annotations

import json
import os
import pickle
import time
from pathlib import Path

import pytest

from lmc.cli import main
from tests import slurm
from tests.experiments.test_run import _config, fit_as_two_task_ddp_job

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    problems = [f"{', '.join(slurm.missing_binaries())} not installed"] if slurm.missing_binaries() else []
    if os.geteuid() != 0:
        problems.append("the test cluster runs its daemons as root")
    if problems:
        message = f"no SLURM test cluster: {'; '.join(problems)} (make slurm installs slurm-wlm and munge)"
        if os.environ.get("LMC_REQUIRE_SLURM") == "1":
            pytest.fail(message)
        pytest.skip(message)
    running = slurm.start(tmp_path_factory.mktemp("slurm"))
    yield running
    slurm.stop(running)


def _pause(marker: Path, stage: str, batch: int = 2) -> list[dict]:
    init = {"marker": str(marker), "stage": stage, "batch": batch}
    return [{"class_path": "tests.interruptions.PauseOnce", "init_args": init}]


def _results(folder: Path) -> dict:
    """summary.json without what differs between two runs of the same results: the folder, wall times."""
    summary = json.loads((folder / "summary.json").read_text())
    summary["protocol"].pop("output_dir")
    summary.pop("alignment_seconds")
    return summary


@pytest.mark.slow
def test_a_run_on_slurm_with_a_job_requeued_mid_fit_ends_identical_to_one_uninterrupted_process(
    cluster, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the jobs import tests.interruptions
    for name in ("one_process", "slurm"):
        (tmp_path / name).mkdir()
    # The reference: an uninterrupted run in one process (the local executor's numbers, tests/experiments/test_run.py).
    main(["run", "--config", _config(tmp_path / "one_process", seeds=2)])

    marker = tmp_path / "paused.json"
    on_slurm = {"executor": "slurm", "max_jobs": 2, "cpus_per_job": 1, "time_limit_min": 10}
    config = _config(tmp_path / "slurm", on_slurm, _pause(marker, "seed1"), seeds=2)
    requeuer, requeued = cluster.requeue_when_paused(marker)
    capsys.readouterr()
    main(["run", "--config", config])
    requeuer.join()
    output = capsys.readouterr().out
    assert len(requeued) == 1, "seed 1's job never paused: the test did not requeue it"
    assert f"seed1: submitted (slurm job {requeued[0]})" in output  # submitted once, requeued by SLURM
    assert "Restarts=1" in cluster.command("scontrol", "show", "job", requeued[0])
    assert cluster.state(requeued[0]) == "COMPLETED"
    for name in ("summary.md", "summary.csv"):
        assert (tmp_path / "slurm" / "run" / name).read_bytes() == (
            tmp_path / "one_process" / "run" / name
        ).read_bytes()
    assert _results(tmp_path / "slurm" / "run") == _results(tmp_path / "one_process" / "run")


@pytest.mark.slow
def test_a_fit_as_a_two_task_ddp_job_on_slurm_equals_one_process_with_the_same_global_batch(
    cluster, tmp_path, monkeypatch
):
    """``cluster.tasks_per_node 2``: sbatch --ntasks-per-node 2, srun starts both tasks, Lightning
    takes their ranks from SLURM (SLURMEnvironment) and trains one model with gloo on CPUs."""
    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the jobs import this worktree's lmc
    on_slurm = {"executor": "slurm", "tasks_per_node": 2, "cpus_per_job": 1, "time_limit_min": 10}
    start = time.perf_counter()
    ddp = fit_as_two_task_ddp_job(tmp_path, on_slurm)
    print(f"2-task DDP pretrain on SLURM, with its one-process reference: {time.perf_counter() - start:.0f} s")
    (job_id,) = [entry[0] for entry in json.loads((ddp / "jobs" / "submitted.json").read_text()).values()]
    deadline = time.monotonic() + 60  # the command takes rank 0's result; the job ends with rank 1's
    while cluster.state(job_id) in ("RUNNING", "COMPLETING") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert cluster.state(job_id) == "COMPLETED"
    for rank in (0, 1):  # each task ended with its own result: neither waited on a rank that was not there
        outcome, _ = pickle.loads((ddp / "jobs" / f"{job_id}_{rank}_result.pkl").read_bytes())
        assert outcome == "success"
