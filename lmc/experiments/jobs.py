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

import contextlib
import dataclasses
import functools
import io
import json
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from submitit.helpers import Checkpointable

from lmc.experiments.progress import Progress
from lmc.io import atomic_write_json

#: ``local``: submitit's processes on this machine; ``slurm``: sbatch jobs; ``inline``: each job
#: called in this process, one after another (a debugger sees every job).
Executor = Literal["local", "slurm", "inline"]

#: Seconds between two looks at the running jobs.
POLL_SECONDS = 0.5
#: SLURM states of a job that may still write a result (squeue --states=all).
_SLURM_ALIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"}
_SLURM_ALIVE |= {"RESIZING", "SUSPENDED", "PREEMPTED", "SIGNALING", "STAGE_OUT", "STOPPED"}


@dataclass(frozen=True)
class Cluster:
    """Where the jobs of ``lmc run`` and ``lmc repro`` run: an experiment config's ``cluster`` group
    (``lmc run --cluster.executor slurm``), ``lmc repro``'s flags (``lmc repro --executor slurm``).

    Attributes:
        executor: ``local`` (processes on this machine, the default), ``slurm`` (sbatch through
            submitit) or ``inline`` (every job in the command's own process, one after another).
        max_jobs: Jobs submitted at a time (``None``: ``lmc run`` 1, ``lmc repro`` its ``--jobs``).
        partition: SLURM partition (``None``: the cluster's default).
        gpus_per_job: GPUs of each job (a fit on several GPUs runs Lightning DDP, one task per GPU).
        cpus_per_job: CPUs of each job (of each task of a multi-task fit).
        nodes: Nodes of each fit (DDP across nodes); alignments and sweeps use one node.
        tasks_per_node: Processes of each fit on each node, the ranks of one Lightning DDP fit
            (``trainer.devices``); ``None``: one per GPU, or one without GPUs. Several tasks
            without GPUs train on CPUs (gloo). Alignments and sweeps run one task.
        time_limit_min: Time limit of each job in minutes. On SLURM a job that reaches it is
            requeued (at most three times) and starts again from its stage's resume state: a
            sweep from its finished points, a fit from its beginning (give a fit the time it needs).
        slurm_options: Further sbatch options without the dashes (``account``, ``qos``,
            ``constraint``, ``mem``, ...).
        folder: Where submitit writes the jobs' logs and pickles (``None``: ``<output_dir>/jobs``).
    """

    executor: Executor = "local"
    max_jobs: int | None = None
    partition: str | None = None
    gpus_per_job: int = 0
    cpus_per_job: int = 1
    nodes: int = 1
    tasks_per_node: int | None = None
    time_limit_min: int = 240
    slurm_options: dict[str, str] = field(default_factory=dict)
    folder: str | None = None

    def __post_init__(self):
        if self.executor not in ("local", "slurm", "inline"):
            raise ValueError(f"cluster.executor must be local, slurm or inline, got {self.executor!r}")
        if self.max_jobs is not None and self.max_jobs < 1:
            raise ValueError(f"cluster.max_jobs must be at least 1, got {self.max_jobs}")
        for name in ("cpus_per_job", "nodes", "time_limit_min"):
            if getattr(self, name) < 1:
                raise ValueError(f"cluster.{name} must be at least 1, got {getattr(self, name)}")
        if self.gpus_per_job < 0:
            raise ValueError(f"cluster.gpus_per_job must be 0 or more, got {self.gpus_per_job}")
        if self.tasks_per_node is not None and self.tasks_per_node < 1:
            raise ValueError(f"cluster.tasks_per_node must be at least 1, got {self.tasks_per_node}")
        if self.gpus_per_job and self.tasks_per_node not in (None, self.gpus_per_job):
            raise ValueError(
                f"a fit on GPUs runs one task per GPU, but cluster.tasks_per_node is {self.tasks_per_node} with "
                f"cluster.gpus_per_job {self.gpus_per_job}: drop cluster.tasks_per_node or set it to "
                f"{self.gpus_per_job}"
            )

    @property
    def fit_tasks(self) -> int:
        """Processes of a fit on each node (its DDP ranks there): ``tasks_per_node``, else one per GPU, else one."""
        return self.tasks_per_node or max(1, self.gpus_per_job)

    def fit_trainer(self) -> dict[str, Any]:
        """The trainer settings of a fit that uses every process its job starts: none for one process,
        else one Lightning DDP fit of ``nodes`` x :attr:`fit_tasks` ranks on the job's GPUs, or on CPUs
        (gloo) without GPUs. ``lmc repro`` gives them to its fits; ``lmc run`` asks for them in the
        experiment's trainer (it refuses a trainer without them)."""
        if self.fit_tasks == 1 and self.nodes == 1:
            return {}
        accelerator = "gpu" if self.gpus_per_job else "cpu"
        return {"strategy": "ddp", "accelerator": accelerator, "devices": self.fit_tasks, "num_nodes": self.nodes}


def ignore_srun_hint() -> None:
    """Silence Lightning's hint to start this process with ``srun`` (it warns wherever SLURM is installed):
    ``lmc run`` and ``lmc repro`` only parse and submit here, and sbatch starts their jobs under srun."""
    import warnings

    warnings.filterwarnings("ignore", message="The `srun` command is available on your system but is not used")


class JobFailedError(RuntimeError):
    """A job ended without its result; the message names it and its log."""


class SubmissionError(OSError):
    """A job could not be submitted: the scheduler is not installed, not reachable or refused it."""


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


def _executor(cluster: Cluster, folder: Path, job: Job):
    import submitit

    tasks = _tasks(cluster, job)
    common = {
        "timeout_min": cluster.time_limit_min,
        "gpus_per_node": cluster.gpus_per_job,
        "tasks_per_node": tasks,
        "cpus_per_task": cluster.cpus_per_job,
        "nodes": cluster.nodes if job.fit else 1,
    }
    if cluster.executor == "local":
        executor = submitit.LocalExecutor(folder)
        executor.update_parameters(**{k: v for k, v in common.items() if k != "nodes"})
        return executor
    executor = submitit.SlurmExecutor(folder, max_num_timeout=3)
    # --requeue: SLURM requeues the job after a preemption or a node failure, not only submitit.
    options = {"requeue": True, **cluster.slurm_options}
    executor.update_parameters(
        time=common["timeout_min"],
        gpus_per_node=common["gpus_per_node"],
        ntasks_per_node=common["tasks_per_node"],
        cpus_per_task=common["cpus_per_task"],
        nodes=common["nodes"],
        job_name=job.name.replace("/", "-"),
        additional_parameters=options,
        **({"partition": cluster.partition} if cluster.partition else {}),
    )
    return executor


def _submit(cluster: Cluster, folder: Path, job: Job, body: _Body) -> Any:
    """Submit ``body`` as ``job``; the submitit handle.

    Raises:
        SubmissionError: A SLURM submission failed (``sbatch`` missing, SLURM installed but not
            configured or not reachable, a setting it refuses): one line with sbatch's own last line,
            and nothing of the submission (its pickle, its sbatch script) left in ``folder``.
    """
    if cluster.executor != "slurm":
        return _executor(cluster, folder, job).submit(body)
    from submitit.core.utils import FailedJobError

    fix = "check that this machine can submit jobs (sinfo; sbatch --test-only --wrap true), or run with "
    fix += "--cluster.executor local"
    missing = [command for command in ("sbatch", "srun") if shutil.which(command) is None]
    if missing:
        raise SubmissionError(
            f"cannot submit {job.name} to SLURM: {' and '.join(missing)} not on PATH (SLURM is not installed here); "
            f"{fix}"
        )
    existed = folder.is_dir()
    before = set(folder.iterdir()) if existed else set()
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # submitit prints sbatch's error lines as well
            return _executor(cluster, folder, job).submit(body)
    except (FailedJobError, OSError) as error:
        for path in set(folder.iterdir()) - before if existed else [folder]:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        reason = lines[-1] if lines else type(error).__name__
        raise SubmissionError(f"cannot submit {job.name} to SLURM: sbatch failed: {reason}; {fix}") from None


def _slurm_states(ids: Iterable[str]) -> dict[str, str]:
    """The SLURM state of each job id squeue still knows (it needs no accounting storage, unlike sacct)."""
    ids = list(ids)
    if not ids:
        return {}
    listed = subprocess.run(
        ["squeue", "--noheader", "--states=all", "--format=%i %T", "--jobs", ",".join(ids)],
        capture_output=True,
        text=True,
    )
    states = {}
    for line in listed.stdout.splitlines():
        job_id, _, state = line.strip().partition(" ")
        states[job_id] = state.split("+")[0]
    return states


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
    submitted = _read_submitted(folder) if cluster.executor == "slurm" else {}
    alive = _still_alive(folder, submitted, {job.name for job in waiting})
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
                    ddp_on_this_machine = cluster.executor == "local" and _tasks(cluster, job) > 1
                    body = _Body(job.call, threads, parent, _free_port() if ddp_on_this_machine else None)
                    handle = _submit(cluster, folder, job, body)
                    say(f"{job.name}: submitted ({cluster.executor} job {handle.job_id})")
                running.append(_Running(job, handle))
                if cluster.executor == "slurm":
                    submitted[job.name] = [str(handle.job_id), _tasks(cluster, job)]
                    atomic_write_json(folder / SUBMITTED, submitted)
            if not running:
                break
            if progress is not None:
                progress.update([entry.job.name for entry in running], len(done))
            time.sleep(POLL_SECONDS)
            states = _slurm_states(r.handle.job_id for r in running) if cluster.executor == "slurm" else {}
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


#: The SLURM job id and task count of each job of a command (``<folder>/submitted.json``).
SUBMITTED = "submitted.json"


def _read_submitted(folder: Path) -> dict[str, list]:
    path = folder / SUBMITTED
    return json.loads(path.read_text()) if path.is_file() else {}


def _still_alive(folder: Path, submitted: dict[str, list], names: set[str]) -> dict[str, Any]:
    """submitit handles of the jobs an earlier command submitted that SLURM still queues or runs."""
    import submitit

    wanted = {name: entry for name, entry in submitted.items() if name in names}
    states = _slurm_states(job_id for job_id, _ in wanted.values())
    return {
        name: submitit.SlurmJob(folder, job_id, tasks=tuple(range(tasks)))
        for name, (job_id, tasks) in wanted.items()
        if states.get(job_id) in _SLURM_ALIVE
    }


def _tasks(cluster: Cluster, job: Job) -> int:
    """Processes of a job on each node: a fit's DDP ranks (:attr:`Cluster.fit_tasks`), else one."""
    return cluster.fit_tasks if job.fit else 1


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
    if state in _SLURM_ALIVE:
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
