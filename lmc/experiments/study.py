"""``lmc repro``: the paper's study at small scale from one command (``make repro``).

A study (:class:`~lmc.experiments.study_config.Study`, ``configs/study/repro.yaml``) lists model
families, each an ``lmc run`` experiment config, and the re-initialization strategies to run on
each. Per family it pre-trains once (in the first strategy's run; a family with ``pretrained_by``
reuses another's), then runs every strategy with its fine-tuned seeds from that pre-trained
checkpoint; the first-attention runs of the Table 1 families also score every head order and the
variants of the matcher (``configs/protocol/table1.yaml``). Each run is an
:class:`~lmc.experiments.run.Experiment`, so the study resumes after a kill like ``lmc run`` does.
:mod:`lmc.experiments.report.study` then turns the run folders into ``docs/results.md``.

The pre-trainings and then the runs are jobs (:mod:`lmc.experiments.jobs`: processes on this
machine by default, ``jobs`` at a time, or a SLURM cluster), longest first, each computing with one
thread: the numbers do not depend on where or in which order the jobs run, and the same command on
the same machine prints the same numbers. A rerun submits only the jobs that have not finished.
On a cluster whose fits span several processes (``tasks_per_node``, ``gpus_per_job`` or ``nodes``
above one), every fit is one Lightning DDP run and a job of its own (``lmc run``'s stages:
each seed's fine-tuning, then each pair's alignments and sweeps in one process), and a run's job
only summarizes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmc.experiments.first_layer import first_layer_inputs as first_layer_inputs  # its name here before first_layer
from lmc.experiments.jobs import Cluster, run_jobs
from lmc.experiments.jobs import Job as SubmittedJob
from lmc.experiments.jobs import die_with_parent as die_with_parent  # its public name here before lmc.experiments.jobs
from lmc.experiments.progress import Display, Follower, Progress
from lmc.experiments.report.study import write_report
from lmc.experiments.study_config import FIRST_LAYER_INPUTS, MACHINE, TIMES, recorded
from lmc.experiments.study_config import Family as Family  # their public names here before lmc.experiments.study_config
from lmc.experiments.study_config import Study as Study
from lmc.experiments.study_config import load_study as load_study
from lmc.io import atomic_write_json, folder_lock
from lmc.symmetry import Scope

if TYPE_CHECKING:  # lmc.experiments.run imports Lightning: loaded in the workers only
    pass

#: Threads per worker: a fixed count keeps the floating-point reductions, and so the numbers, fixed.
THREADS = 1


def pretrain(study: Study, family: Family) -> None:
    """Pre-train one family on its half A, in its first strategy's run folder (where that run and
    every other strategy's run find it)."""
    experiment = study.experiment(family, study.strategies[0], pretraining=True)
    experiment.fit(experiment.pretrain_stage())


def run_strategy(study: Study, family: Family, strategy: Scope) -> None:
    """One ``lmc run`` of one family under one strategy, from the family's pre-trained model; the
    first strategy's run also measures the first layer's inputs (:func:`first_layer_inputs`)."""
    experiment = study.experiment(family, strategy)
    experiment.run(Cluster(executor="inline"))  # its stages in this job, one after another
    if strategy == study.strategies[0]:
        inputs = first_layer_inputs(experiment)
        atomic_write_json(Path(study.output_dir) / family.name / FIRST_LAYER_INPUTS, inputs)


@dataclass(frozen=True)
class Job:
    """One unit of a study's schedule: a family's pre-training (``strategy`` ``None``) or one run."""

    family: Family
    strategy: Scope | None = None

    @property
    def name(self) -> str:
        return f"{self.family.name}/{self.strategy or 'pretrain'}"

    def log(self, study: Study) -> Path:
        """Where the task's output goes: its run folder's ``log.txt`` (pre-training: the first run's)."""
        return Path(study.output_dir) / self.family.name / (self.strategy or study.strategies[0]) / "log.txt"


def schedule(study: Study) -> list[Job]:
    """The study's tasks in the order they start: every pre-training, then the runs longest first.

    Runs are ordered by their expected size (Table 1 runs, then runs with extra alignments or the
    robustness table, then the rest, each group from the last family listed to the first), so
    the small runs fill the end and the workers finish together; a run waits for its family's
    pre-training (a family with ``pretrained_by`` has none: its runs wait for the named one's).
    The order changes only the wall time, never a number.
    """

    def size(task: Job) -> tuple[int, int, int]:
        table1 = study.table1_run(task.family, task.strategy)
        extra = (task.strategy in study.methods_strategies) + (task.strategy in study.robustness)
        return table1, extra, study.families.index(task.family)

    runs = [Job(family, strategy) for family in study.families for strategy in study.family_strategies(family)]
    pretrainings = [Job(family) for family in study.families if family.pretrained_by is None]
    return pretrainings + sorted(runs, key=size, reverse=True)


def _logged(log: Path, call: Callable[[], Any]) -> float:
    """``call()`` in a job's process (one thread), its output appended to ``log`` (a run folder's
    ``log.txt``); returns its wall time in seconds."""
    import logging

    import torch

    torch.set_num_threads(THREADS)
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log, "a") as opened:
        sys.stdout.flush(), sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(opened.fileno(), 1), os.dup2(opened.fileno(), 2)
        try:
            for name in ("lightning.pytorch", "lightning.fabric"):
                logging.getLogger(name).setLevel(logging.WARNING)
            call()
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
    return time.perf_counter() - start


def machine() -> dict[str, Any]:
    """The processor and the library the numbers of this process come from.

    Another processor makes torch pick other floating-point kernels (MKL's code path, ATen's vector
    width), whose rounding training turns into other models: the same seeds then give other numbers
    (``benchmarks/reproduction/results/reproducibility.md``).
    """
    import platform

    import torch

    processor = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [
            line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")
        ]
        processor = names[0] if names else processor
    return {
        "processor": processor,
        "kernels": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "threads": THREADS,
    }


def finished(study: Study, task: Job) -> bool:
    """Whether a task finished in an earlier invocation with this configuration (then it is not submitted).

    Raises:
        RunError: A stage folder of the task holds another configuration's results.
    """
    if task.strategy is not None and not study.pretrained(task.family).is_file():
        return False
    try:  # a config its parser refuses is the job's to report, with its log
        with contextlib.redirect_stderr(io.StringIO()):
            experiment = study.experiment(task.family, task.strategy or study.strategies[0], task.strategy is None)
    except SystemExit:
        return False
    if task.strategy is None:
        return experiment._finished(experiment.pretrain_stage())
    if not (experiment.root / "summary.json").is_file():
        return False
    inputs = Path(study.output_dir) / task.family.name / FIRST_LAYER_INPUTS
    if task.strategy == study.strategies[0] and not inputs.is_file():
        return False
    return all(job.finished for job in experiment.jobs())


def check_runs(study: Study) -> None:
    """Refuse, before any job, a run whose settings would fail one of its later stages (what ``lmc run``
    refuses before any training: :meth:`~lmc.experiments.run.Experiment.check_before_work`).

    Raises:
        RunError: One line naming the run, its configs and the setting.
    """
    from lmc.experiments.protocol import RunError

    for task in schedule(study):
        if task.strategy is None:  # a pre-training's settings are its family's first run's
            continue
        try:  # a config its parser refuses is the job's to report, with its log
            with contextlib.redirect_stderr(io.StringIO()):
                experiment = study.experiment(task.family, task.strategy)
        except SystemExit:
            continue
        try:
            experiment.check_before_work()
        except RunError as error:
            configs = ", ".join(study.configs(task.family, task.strategy))
            raise RunError(f"run {task.name} (configs {configs}): {error}") from None


def _task_job(study: Study, task: Job, stages: list[SubmittedJob]) -> SubmittedJob:
    """A task as a job, after its family's pre-training and after ``stages``, the jobs of its run's
    fits and pairs where they are jobs of their own (:func:`_stage_jobs`)."""
    after = () if task.strategy is None else (Job(study.pretraining_family(task.family)).name,)
    after += tuple(stage.name for stage in stages if not stage.fit)  # the pairs, which come after the fits
    call = _StudyTask(study, task)
    return SubmittedJob(task.name, call, after, finished(study, task), fit=task.strategy is None, log=task.log(study))


def _stage_jobs(study: Study, task: Job) -> list[SubmittedJob]:
    """The fine-tunings and pairs of run ``task`` as jobs of their own: ``lmc run``'s
    (:meth:`~lmc.experiments.run.Experiment.jobs`), named ``<family>/<strategy>/seed<k>`` and
    ``.../pair<i>_<j>``, the fine-tunings after the family's pre-training job, each job's output in
    the run's ``log.txt``. The run's own job then only summarizes."""
    experiment = study.experiment(task.family, task.strategy)
    pretraining = Job(study.pretraining_family(task.family)).name
    stages = []
    for job in experiment.jobs(pending_upstream=not study.pretrained(task.family).is_file()):
        if job.name == "pretrain":  # the study's own pre-training job trains it
            continue
        after = tuple(f"{task.name}/{name}" for name in job.after if name != "pretrain")
        after += (pretraining,) if job.fit else ()
        call = _Logged(task.log(study), job.call)
        stages.append(dataclasses.replace(job, name=f"{task.name}/{job.name}", call=call, after=after, log=call.log))
    return stages


@dataclass(frozen=True)
class _StudyTask:
    """A task as a job's callable (picklable): its wall time in seconds."""

    study: Study
    task: Job

    def __call__(self) -> float:
        return _logged(self.task.log(self.study), self.run)

    def run(self) -> None:
        if self.task.strategy is None:
            pretrain(self.study, self.task.family)
        else:
            run_strategy(self.study, self.task.family, self.task.strategy)


@dataclass(frozen=True)
class _Logged:
    """A job's callable (picklable) with its output appended to ``log``: its wall time in seconds."""

    log: Path
    call: Callable[[], Any]

    def __call__(self) -> float:
        return _logged(self.log, self.call)


def run_study(
    study: Study, jobs: int = 2, cluster: Cluster | None = None, display: Display | None = None
) -> dict[str, float]:
    """Run every task of :func:`schedule` not finished earlier as a job on ``cluster`` (``None``:
    processes on this machine), ``jobs`` at a time unless ``cluster.max_jobs`` says otherwise, one
    thread each; returns each job's wall time in seconds, also written to
    ``<output_dir>/times.json``, and records the :func:`machine` in ``<output_dir>/machine.json``.

    A run is one job (its fits, alignments and sweeps in one process, one after another), unless
    the cluster's fits span several processes: then each fit is a Lightning DDP job of its own
    (:meth:`~lmc.experiments.jobs.Cluster.fit_trainer`), each pair a one-process job, and the run's
    job summarizes.

    The study's running jobs and each run's stage (from its ``progress.json``) go to ``display``
    (``None``: plain lines on standard error).

    Raises:
        ValueError: ``jobs`` below 1, or fits of several processes on the ``inline`` executor.
        RunError: A run's settings would fail one of its later stages (:func:`check_runs`), before any job.
        JobFailedError: A task failed (named with its log); the tasks after it were not run.
    """
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    cluster = cluster or Cluster()
    ddp = cluster.fit_trainer()
    if ddp and cluster.executor == "inline":
        raise ValueError(
            f"the inline executor runs every job in this one process, so its fits cannot be DDP fits of "
            f"{cluster.nodes} node(s) x {cluster.fit_tasks} process(es) (--nodes, --tasks_per_node, --gpus_per_job): "
            "use --executor local or slurm, or give each fit one process"
        )
    if ddp:
        study = dataclasses.replace(study, fit_trainer=ddp)
    check_runs(study)
    with folder_lock(study.output_dir, "lmc repro"):  # two studies never write one folder at once
        atomic_write_json(Path(study.output_dir) / MACHINE, machine())
        submitted = []
        for task in schedule(study):
            # One process per job: a run's stages in its one job, which saves each stage's start-up.
            stages = _stage_jobs(study, task) if ddp and task.strategy is not None else []
            submitted += [*stages, _task_job(study, task, stages)]
        folder = Path(study.output_dir) / "jobs"
        display = display or Display("plain")
        progress = Progress("study", len(submitted), None, display)
        runs = {task.name: task.log(study).parent for task in schedule(study) if task.strategy is not None}
        with Follower(runs, display):
            times = run_jobs(submitted, cluster, folder, THREADS, default_max_jobs=jobs, progress=progress)
        progress.update([], len(submitted))
        # A rerun runs only what had not finished: the tasks it skips keep the times recorded earlier,
        # and a task it runs again (resumed, or given a new alignment) adds its time to theirs.
        earlier = recorded(study.output_dir, TIMES) or {}
        times = {**earlier, **{name: earlier.get(name, 0.0) + seconds for name, seconds in times.items()}}
        atomic_write_json(Path(study.output_dir) / TIMES, times)
    return times


def repro(
    paths: list[str | Path],
    jobs: int = 2,
    overrides: dict[str, Any] | None = None,
    cluster: Cluster | None = None,
    summarize: bool = False,
    quiet: bool = False,
) -> dict[str, Any]:
    """Run a study and write its report; returns the report's data.

    Args:
        paths: Study configs, later ones overriding earlier ones.
        jobs: Runs at a time (unless ``cluster.max_jobs`` is given).
        overrides: :class:`Study` fields set over the configs' (``output_dir``, ``report``).
        cluster: Where the jobs run (``None``: processes on this machine).
        summarize: Run nothing: summarize every finished run again
            (:meth:`~lmc.experiments.run.Experiment.summarize`) and write the report; the recorded
            times of the runs are kept.
        quiet: Show no progress (else the running jobs and each run's stage on standard error).

    Raises:
        RunError: With ``summarize``, a run has not finished.
    """
    study = load_study(paths)
    if overrides:
        study = dataclasses.replace(study, **overrides)
    if summarize:
        for task in schedule(study):
            if task.strategy is not None:
                study.experiment(task.family, task.strategy).summarize()
        data = write_report(study, [str(path) for path in paths])
        print(f"summarized the finished runs again and wrote {study.report}")
        return data
    start = time.perf_counter()
    with Display("quiet" if quiet else "auto") as display:
        times = run_study(study, jobs, cluster, display)
    data = write_report(study, [str(path) for path in paths])
    wall, work = time.perf_counter() - start, sum(times.values())
    at_once = (cluster.max_jobs if cluster and cluster.max_jobs else None) or jobs
    print(f"study finished in {wall:.0f} s ({work:.0f} s of work) with {at_once} jobs at a time x {THREADS} thread")
    print(f"wrote {study.report}")
    return {"times": times, **data}
