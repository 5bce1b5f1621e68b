"""Where the jobs of ``lmc run`` and ``lmc repro`` run (:class:`Cluster`), and their submission to
submitit's executors: processes on this machine (``local``) or a SLURM cluster (``slurm``).

:mod:`lmc.experiments.jobs` schedules the jobs and follows them; this module starts each one and
asks SLURM about those it queued.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from lmc.experiments.jobs import Job


#: ``local``: submitit's processes on this machine; ``slurm``: sbatch jobs; ``inline``: each job
#: called in this process, one after another (a debugger sees every job).
Executor = Literal["local", "slurm", "inline"]

#: SLURM states of a job that may still write a result (squeue --states=all).
SLURM_ALIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"}
SLURM_ALIVE |= {"RESIZING", "SUSPENDED", "PREEMPTED", "SIGNALING", "STAGE_OUT", "STOPPED"}


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


class SubmissionError(OSError):
    """A job could not be submitted: the scheduler is not installed, not reachable or refused it."""


def _executor(cluster: Cluster, folder: Path, job: Job):
    import submitit

    tasks = tasks_of(cluster, job)
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


def submit(cluster: Cluster, folder: Path, job: Job, body: Callable[[], Any]) -> Any:
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


def slurm_states(ids: Iterable[str]) -> dict[str, str]:
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


#: The SLURM job id and task count of each job of a command (``<folder>/submitted.json``).
SUBMITTED = "submitted.json"


def read_submitted(folder: Path) -> dict[str, list]:
    """The :data:`SUBMITTED` record of a command's folder (job name -> ``[SLURM job id, tasks]``), empty if none."""
    path = folder / SUBMITTED
    return json.loads(path.read_text()) if path.is_file() else {}


def still_alive(folder: Path, submitted: dict[str, list], names: set[str]) -> dict[str, Any]:
    """submitit handles of the jobs an earlier command submitted that SLURM still queues or runs."""
    import submitit

    wanted = {name: entry for name, entry in submitted.items() if name in names}
    states = slurm_states(job_id for job_id, _ in wanted.values())
    return {
        name: submitit.SlurmJob(folder, job_id, tasks=tuple(range(tasks)))
        for name, (job_id, tasks) in wanted.items()
        if states.get(job_id) in SLURM_ALIVE
    }


def tasks_of(cluster: Cluster, job: Job) -> int:
    """Processes of a job on each node: a fit's DDP ranks (:attr:`Cluster.fit_tasks`), else one."""
    return cluster.fit_tasks if job.fit else 1
