"""Jobs with dependencies on submitit: processes on this machine (``local``) or a SLURM cluster (``slurm``).

``lmc run`` submits its stages (pre-training, each seed's fine-tuning, each pair's alignments and
sweeps) and ``lmc repro`` its runs as :class:`Job` s; :func:`run_jobs` submits each once the jobs it
comes after have finished, at most ``max_jobs`` at a time. A job that finished in an earlier
invocation is not submitted again; a job killed or preempted is requeued by SLURM (or by submitit
on a preemption signal) and starts again from its stage's own resume state; a failed job stops
the jobs after it and the command names it with the path of its log (:class:`JobFailedError`).

Each job computes with the thread count given by its command, so where a job runs never
changes a number: the ``local`` and ``slurm`` executors give the results of one process.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from submitit.helpers import Checkpointable

from lmc.experiments.cluster import (
    SLURM_ALIVE,
    SUBMITTED,
    read_submitted,
    slurm_states,
    still_alive,
    submit,
    tasks_of,
)
from lmc.experiments.cluster import Cluster as Cluster  # their public names here before lmc.experiments.cluster
from lmc.experiments.cluster import Executor as Executor
from lmc.experiments.cluster import SubmissionError as SubmissionError
from lmc.experiments.cluster import ignore_srun_hint as ignore_srun_hint
from lmc.experiments.progress import Progress
from lmc.io import atomic_write_json

#: Seconds between two looks at the running jobs.
POLL_SECONDS = 0.5


class JobFailedError(RuntimeError):
    """A job ended without its result; the message names it and its log."""


class JobExit(Exception):
    """A job's ``SystemExit`` (a parser refused its config), carried back as an exception."""

    def __init__(self, code: object):
        super().__init__(f"stopped with status {code}")
        self.code = code


@dataclass(frozen=True)
class Job:
    """One job of a command.

    Attributes:
        name: Unique within the command (``seed1``, ``pair0_2``, ``vit_rope/full_model``).
        call: What the job computes, with no arguments; picklable (cloudpickle), as it runs in
            another process. Its return value is the job's result.
        after: Names of the jobs it needs finished first.
        finished: It finished in an earlier invocation: not submitted, its dependants may start.
        fit: A training (several GPUs or nodes: one task per GPU, Lightning DDP) rather than a
            one-process alignment or sweep.
        log: The job's own log, where its command writes one (else submitit's).
    """

    name: str
    call: Callable[[], Any]
    after: tuple[str, ...] = ()
    finished: bool = False
    fit: bool = False
    log: Path | None = None


def die_with_parent(parent: int, poll_seconds: float = 0.5) -> None:
    """End this process when process ``parent`` is gone (killed with ``kill -9``, say), instead of
    running on as an orphan that writes into run folders a rerun is using.

    ``parent`` is the command that submitted the job, not necessarily this process's parent
    (submitit's local executor starts a job under a controller process).
    """

    def alive() -> bool:
        try:
            os.kill(parent, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # a process of another user took the number
            return False
        return True

    def watch() -> None:
        while alive():
            time.sleep(poll_seconds)
        os._exit(1)

    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()


def _in_job(call: Callable[[], Any], threads: int, parent: int | None, main_port: int | None = None) -> Any:
    """A job's body in its process: ``threads`` torch threads, ended with ``parent`` if given; with
    ``main_port``, one task of a DDP fit on the local executor."""
    import torch

    if parent is not None:
        die_with_parent(parent)
    if main_port is not None:
        # Lightning finds a SLURM job's ranks in SLURM's variables; submitit's local tasks get theirs
        # from these (its LightningEnvironment), or each would start a DDP group of its own.
        local_rank = os.environ["SUBMITIT_LOCAL_LOCALID"]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(main_port), NODE_RANK="0", LOCAL_RANK=local_rank)
    torch.set_num_threads(threads)
    # Lightning's DDP launch sets a thread count of its own (the CPUs over the ranks) unless this is set.
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        return call()
    except SystemExit as error:  # submitit passes exceptions back, not exits
        if error.code == -1:  # submitit's own exit after requeueing a preempted job: not an end
            raise
        raise JobExit(error.code) from None


class _Body(Checkpointable):
    """A job's callable: on a preemption signal submitit requeues it as it was, and its stage resumes."""

    def __init__(self, call: Callable[[], Any], threads: int, parent: int | None, main_port: int | None = None):
        self.call, self.threads, self.parent, self.main_port = call, threads, parent, main_port

    def __call__(self) -> Any:
        return _in_job(self.call, self.threads, self.parent, self.main_port)


def _free_port() -> int:
    """A TCP port free on this machine now (the rendezvous of a local DDP fit's tasks)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _last_line(path: Path | None) -> str:
    if path is None or not path.is_file():
        return ""
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else ""


@dataclass
class _Running:
    job: Job
    handle: Any  # a submitit Job
    start: float = dataclasses.field(default_factory=time.perf_counter)

    @property
    def first_task(self) -> Any:
        """The submitit Job of task 0 (rank 0 of a DDP fit; the job itself when it has one task)."""
        return self.handle._sub_jobs[0] if self.handle._sub_jobs else self.handle

    @property
    def log(self) -> Path:
        return self.job.log or Path(self.first_task.paths.stderr)

    def failure(self, reason: str, from_log: bool = True) -> str:
        """The job named with ``reason`` and its log, with the log's last line where it tells more."""
        detail = _last_line(self.log) if from_log else ""
        return f"{self.job.name} {reason}{': ' + detail if detail and detail not in reason else ''} (log: {self.log})"


def run_jobs(
    jobs: list[Job],
    cluster: Cluster,
    folder: Path,
    threads: int,
    default_max_jobs: int = 1,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Run ``jobs`` in dependency order on ``cluster``; returns each submitted job's result by name.

    Args:
        jobs: The jobs; every name in an ``after`` must be one of them.
        cluster: The executor and its settings.
        folder: submitit's folder unless ``cluster.folder`` is given (logs, pickles).
        threads: torch threads of each job.
        default_max_jobs: Jobs at a time when ``cluster.max_jobs`` is ``None``.
        progress: Told the running jobs and the count of finished ones as each starts and ends;
            the lines on each job's submission and end go to its display (``None``: printed).

    Raises:
        JobFailedError: A job failed; its dependants were not submitted, the others ran to the end.
    """
    names = {job.name for job in jobs}
    for job in jobs:
        unknown = set(job.after) - names
        if unknown:
            raise ValueError(f"job {job.name} comes after unknown jobs {sorted(unknown)}")
    if cluster.executor == "inline":
        return _run_inline(jobs, threads, progress)
    folder = Path(cluster.folder) if cluster.folder else folder
    limit = cluster.max_jobs or default_max_jobs
    parent = os.getpid() if cluster.executor == "local" else None  # SLURM jobs belong to the cluster
    done = {job.name for job in jobs if job.finished}
    waiting = [job for job in jobs if not job.finished]
    running: list[_Running] = []
    failed: dict[str, str] = {}  # name -> message
    # SLURM jobs outlive a killed command: a rerun waits for those still queued or running instead
    # of submitting a second writer of the same stage.
    submitted = read_submitted(folder) if cluster.executor == "slurm" else {}
    alive = still_alive(folder, submitted, {job.name for job in waiting})
    results: dict[str, Any] = {}
    say = progress.display.say if progress is not None else functools.partial(print, flush=True)
    try:
        while waiting or running:
            blocked = [job for job in waiting if set(job.after) & (set(failed) | _blocked(jobs, failed))]
            waiting = [job for job in waiting if job not in blocked]
            for job in [job for job in waiting if set(job.after) <= done][: limit - len(running)]:
                waiting.remove(job)
                if job.log is not None:
                    job.log.parent.mkdir(parents=True, exist_ok=True)
                handle = alive.pop(job.name, None)
                if handle is not None:
                    say(f"{job.name}: still queued or running on SLURM (job {handle.job_id}): waiting for it")
                else:
                    ddp_on_this_machine = cluster.executor == "local" and tasks_of(cluster, job) > 1
                    body = _Body(job.call, threads, parent, _free_port() if ddp_on_this_machine else None)
                    handle = submit(cluster, folder, job, body)
                    say(f"{job.name}: submitted ({cluster.executor} job {handle.job_id})")
                running.append(_Running(job, handle))
                if cluster.executor == "slurm":
                    submitted[job.name] = [str(handle.job_id), tasks_of(cluster, job)]
                    atomic_write_json(folder / SUBMITTED, submitted)
            if not running:
                break
            if progress is not None:
                progress.update([entry.job.name for entry in running], len(done))
            time.sleep(POLL_SECONDS)
            states = slurm_states(r.handle.job_id for r in running) if cluster.executor == "slurm" else {}
            for entry in list(running):
                outcome = _outcome(entry, cluster, states)
                if outcome is None:
                    continue
                running.remove(entry)
                name = entry.job.name
                if outcome == "result":
                    results[name] = entry.handle.results()[0]  # task 0's (every DDP rank returns)
                    done.add(name)
                    seconds = time.perf_counter() - entry.start
                    say(f"{name}: done in {seconds:.0f} s (log: {entry.log})")
                else:
                    failed[name] = outcome
                    say(f"{name}: FAILED (log: {entry.log})")
    except BaseException:  # interrupted: no job of this command runs on unseen
        for entry in running:
            entry.handle.cancel(check=False)
        raise
    if waiting and not failed:
        raise ValueError(f"jobs {[job.name for job in waiting]} wait on each other: their after lists form a cycle")
    if failed:
        stopped = sorted(names - done - set(failed))
        after = f"; not run: {', '.join(stopped)}" if stopped else ""
        raise JobFailedError("; ".join(failed.values()) + after + " (rerun the command to submit only these)")
    return results


def _blocked(jobs: list[Job], failed: dict[str, str]) -> set[str]:
    """The jobs that come after a failed one, at any depth."""
    blocked: set[str] = set()
    grew = True
    while grew:
        grew = False
        for job in jobs:
            if job.name not in blocked and set(job.after) & (set(failed) | blocked):
                blocked.add(job.name)
                grew = True
    return blocked


def _outcome(entry: _Running, cluster: Cluster, states: dict[str, str]) -> str | None:
    """``"result"``, a failure message, or ``None`` while the job may still end with a result."""
    handle = entry.first_task
    if handle.paths.result_pickle.exists():
        outcome, value = handle._get_outcome_and_result()  # the pickle holds the outcome: no sacct call
        if outcome == "success":
            return "result"
        reason = _reason(handle)  # an exception's own line; an exit's reason is in the log
        return entry.failure(reason, from_log=reason.startswith("stopped with status"))
    if cluster.executor == "local":
        state = entry.handle.state
        if state in ("RUNNING", "UNKNOWN"):
            return None
        return entry.failure(f"ended without a result (its process {state.lower()})")
    state = states.get(str(handle.job_id))
    if state in SLURM_ALIVE:
        return None
    if state == "COMPLETED" or state is None:
        # The result file can lag the state on a shared file system: look again before calling it lost.
        time.sleep(POLL_SECONDS)
        if handle.paths.result_pickle.exists():
            return _outcome(entry, cluster, states)
    return entry.failure(f"ended without a result (SLURM state {state or 'unknown: no longer in squeue'})")


def _reason(handle) -> str:
    """What a job's exception says, in one line."""
    _, error = handle._get_outcome_and_result()
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    exit_line = next((line for line in reversed(lines) if "JobExit" in line), None)
    if exit_line is not None:
        return exit_line.split("JobExit:", 1)[-1].strip()
    return f"failed: {lines[-1].strip()}" if lines else "failed"


def _run_inline(jobs: list[Job], threads: int, progress: Progress | None = None) -> dict[str, Any]:
    """Every job in this process, in dependency order; an exception stops the command as it would a script."""
    import torch

    previous, done, results = torch.get_num_threads(), {job.name for job in jobs if job.finished}, {}
    waiting = [job for job in jobs if not job.finished]
    torch.set_num_threads(threads)
    try:
        while waiting:
            job = next(job for job in waiting if set(job.after) <= done)
            waiting.remove(job)
            if progress is not None:
                progress.update([job.name], len(done))
            results[job.name] = job.call()
            done.add(job.name)
    finally:
        torch.set_num_threads(previous)
    return results
