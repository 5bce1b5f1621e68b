"""``lmc repro``: the paper's study at small scale from one command (``make repro``).

A study (``configs/study/repro.yaml``) lists model families, each an ``lmc run`` experiment
config, and the re-initialization strategies to run on each. Per family it pre-trains once
(in the first strategy's run; a family with ``pretrained_by`` reuses another's), then runs every
strategy with its fine-tuned seeds from that pre-trained checkpoint; the first-attention runs of
the Table 1 families also score every head order and the variants of the matcher
(``configs/protocol/table1.yaml``). Each run is an
:class:`~lmc.experiments.run.Experiment`, so the study resumes after a kill like ``lmc run`` does.
:mod:`lmc.experiments.study_report` then turns the run folders into ``docs/results.md``.

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
import copy
import dataclasses
import io
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmc.configs import config_file
from lmc.experiments.jobs import Cluster, run_jobs
from lmc.experiments.jobs import Job as SubmittedJob
from lmc.experiments.jobs import die_with_parent as die_with_parent  # its public name here before lmc.experiments.jobs
from lmc.experiments.progress import Display, Follower, Progress
from lmc.experiments.protocol import Protocol, Schedule, alignment_labels, experiment_cli
from lmc.experiments.study_report import FIRST_LAYER_INPUTS, MACHINE, TIMES, recorded, write_report
from lmc.io import atomic_write_json, folder_lock
from lmc.matching import AlignOptions
from lmc.symmetry import SCOPES, Scope, check_scope

if TYPE_CHECKING:  # lmc.experiments.run imports Lightning: loaded in the workers only
    from lightning.pytorch.cli import LightningCLI

    from lmc.experiments.run import Experiment

#: Threads per worker: a fixed count keeps the floating-point reductions, and so the numbers, fixed.
THREADS = 1


@dataclass(frozen=True)
class Family:
    """One model family of a study.

    Attributes:
        name: Folder name of its runs (``<output_dir>/<name>/<strategy>``).
        title: How the report names it.
        experiment: Its ``lmc run`` experiment config (model, data, trainer, schedules).
        table1: Also score every head order and matcher variant under ``first_attention``.
        configs: Configs added after ``experiment`` (a variant of it, e.g. another width).
        pretrained_by: Another family of the study whose pre-trained model this one starts from
            instead of pre-training its own (a sweep's points that differ only in fine-tuning);
            its pre-training must be this family's own (the same stage key).
        strategies: The study's strategies this family runs (``None``: all of them), e.g. only
            the Table 1 run of a family whose fine-tunes are too long for every strategy; they
            include the study's first strategy, whose run holds the family's pre-training.
    """

    name: str
    title: str
    experiment: str
    table1: bool = False
    configs: list[str] = field(default_factory=list)
    pretrained_by: str | None = None
    strategies: list[Scope] | None = None

    def __post_init__(self) -> None:  # configs/... paths are also read from lmc's packaged configs
        object.__setattr__(self, "experiment", str(_study_config(self.experiment)))
        object.__setattr__(self, "configs", [str(_study_config(path)) for path in self.configs])


@dataclass(frozen=True)
class Study:
    """A set of ``lmc run`` experiments and where their report goes.

    Attributes:
        families: The model families.
        strategies: Re-initialization strategies run on every family; the first one pre-trains.
        seeds: Fine-tuned seeds per strategy run.
        table1: Protocol fragment of the Table 1 runs (alignments, head orders).
        table1_seeds: Fine-tuned seeds of the Table 1 runs (the paper averages over 10 pairs).
        robustness: Strategies whose pairs are also evaluated under input corruptions.
        methods: Alignment settings compared with each run's own on ``methods_strategies``
            (lmc's data-aware and learned alignment beside the paper's weight matcher): each adds
            an aligned curve per pair of those runs.
        methods_strategies: The strategies whose runs also sweep ``methods``.
        overlays: Configs added to every run after the family's own (e.g. the quick form's).
        output_dir: Root of the run folders.
        title: The report's title.
        report: The Markdown report; its figures go into a folder of the same name without ``.md``,
            with its Table 1 runs as data (``table1.json``, :mod:`lmc.experiments.sensitivity`).
        sensitivity: Another study's ``table1.json`` (the sensitivity study's,
            ``docs/sensitivity/table1.json``) whose points the report lays out by fine-tuning
            samples and length (``None``: this study's own, where its families share
            pre-trainings through ``pretrained_by``; else no such section).
        fit_trainer: Trainer settings of every fit over the configs' own: a Lightning DDP fit's
            when the cluster's fits span several processes
            (:meth:`~lmc.experiments.jobs.Cluster.fit_trainer`). :func:`run_study` sets them from
            its cluster; a study config cannot.
    """

    families: list[Family]
    strategies: list[Scope] = field(default_factory=lambda: list(SCOPES))
    seeds: int = 3
    table1: str | None = None
    table1_seeds: int = 5
    robustness: list[Scope] = field(default_factory=list)
    methods: list[AlignOptions] = field(default_factory=list)
    methods_strategies: list[Scope] = field(default_factory=list)
    overlays: list[str] = field(default_factory=list)
    output_dir: str = "runs/repro"
    title: str = "Results: the paper's study at small scale"
    report: str = "docs/results.md"
    sensitivity: str | None = None
    fit_trainer: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.families:
            raise ValueError("a study needs at least one family")
        names = [family.name for family in self.families]
        if len(set(names)) != len(names):
            raise ValueError(f"family names must be unique, got {names}")
        if not self.strategies:
            raise ValueError("a study needs at least one strategy")
        for strategy in [*self.strategies, *self.robustness, *self.methods_strategies]:
            check_scope(strategy)
        for family in self.families:
            self._check_family_strategies(family)
        if min(self.seeds, self.table1_seeds) < 2:
            raise ValueError("seeds and table1_seeds must be at least 2 (a pair of fine-tuned runs)")
        if Path(self.report).suffix != ".md":
            raise ValueError(f"study.report {self.report} must be a Markdown file (.md): it is rewritten on every run")
        object.__setattr__(self, "overlays", [str(_study_config(path)) for path in self.overlays])
        if self.table1 is not None:
            object.__setattr__(self, "table1", str(_study_config(self.table1)))
        self._check_pretrained_by()

    def family(self, name: str) -> Family:
        """The family of this name."""
        return next(family for family in self.families if family.name == name)

    def family_strategies(self, family: Family) -> list[Scope]:
        """The strategies a family runs, in the study's order."""
        chosen = self.strategies if family.strategies is None else family.strategies
        return [strategy for strategy in self.strategies if strategy in chosen]

    def _check_family_strategies(self, family: Family) -> None:
        """Refuse a family's ``strategies`` outside the study's, or without the study's first one."""
        if family.strategies is None:
            return
        unknown = [strategy for strategy in family.strategies if strategy not in self.strategies]
        if unknown:
            raise ValueError(
                f"family {family.name}: strategies {unknown} are not the study's ({', '.join(self.strategies)}): "
                "a family runs a subset of study.strategies"
            )
        if self.strategies[0] not in family.strategies:
            raise ValueError(
                f"family {family.name}: strategies {family.strategies} leave out {self.strategies[0]}, the study's "
                f"first strategy, whose run pre-trains every family: add {self.strategies[0]} to them"
            )

    def pretraining_family(self, family: Family) -> Family:
        """The family whose pre-training ``family`` starts from: the one it names in ``pretrained_by``, else itself."""
        return self.family(family.pretrained_by) if family.pretrained_by is not None else family

    def _check_pretrained_by(self) -> None:
        """Refuse a ``pretrained_by`` that names no family of the study, one that does not pre-train
        itself, or one whose pre-training is another than the family's own (compared by stage key)."""
        names = [family.name for family in self.families]
        for family in self.families:
            source = family.pretrained_by
            if source is None:
                continue
            if source == family.name:
                raise ValueError(
                    f"family {family.name} names itself in pretrained_by: drop the setting to pre-train it"
                )
            if source not in names:
                raise ValueError(
                    f"family {family.name}: pretrained_by {source!r} is not a family of the study; choose one of "
                    f"{', '.join(name for name in names if name != family.name)}"
                )
            named = self.family(source)
            if named.pretrained_by is not None:
                fix = (
                    "one of the two must pre-train: drop its pretrained_by"
                    if named.pretrained_by == family.name
                    else f"name {named.pretrained_by!r} instead"
                )
                raise ValueError(
                    f"family {family.name}: pretrained_by {source!r} names a family that does not pre-train itself "
                    f"(its pretrained_by is {named.pretrained_by!r}): {fix}"
                )
        keys: dict[str, str | None] = {}  # a family named by several is parsed once
        for family in self.families:
            if family.pretrained_by is not None:
                for name in (family.name, family.pretrained_by):
                    if name not in keys:
                        keys[name] = self._pretraining_key(self.family(name))
                own, shared = keys[family.name], keys[family.pretrained_by]
                if None not in (own, shared) and own != shared:
                    raise ValueError(
                        f"family {family.name} reuses the pre-trained model of {family.pretrained_by}, whose "
                        f"pre-training is another than its own (model, data, trainer or protocol.pretrain differ): "
                        f"make the two pre-train alike, or drop pretrained_by to pre-train {family.name}"
                    )

    def _pretraining_key(self, family: Family) -> str | None:
        """The key of the pre-training stage the family's own configs make (``None`` when they do not
        parse: the family's first job reports that, with its log)."""
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                experiment = self.experiment(family, self.strategies[0], pretraining=True)
        except SystemExit:
            return None
        return experiment.pretrain_stage().key

    @property
    def method_labels(self) -> list[str]:
        """The ``lmc run`` labels of the full method and of ``methods``, in that order."""
        return ["full", *(label for label in alignment_labels(self.methods) if label != "full")]

    def pretrained(self, family: Family) -> Path:
        """A family's pre-trained checkpoint, in its first strategy's run folder (of the family it names
        in ``pretrained_by``, if any)."""
        source = self.pretraining_family(family)
        return Path(self.output_dir) / source.name / self.strategies[0] / "pretrain" / "final.ckpt"

    def table1_run(self, family: Family, strategy: Scope) -> bool:
        """Whether the run of ``strategy`` on ``family`` also scores Table 1 (head orders, matcher variants)."""
        return family.table1 and self.table1 is not None and strategy == "first_attention"

    def configs(self, family: Family, strategy: Scope) -> list[str]:
        """The experiment configs of one strategy's run of a family, in the order they apply."""
        table1 = [self.table1] if self.table1_run(family, strategy) else []
        return [family.experiment, *family.configs, *table1, *self.overlays]

    def arguments(self, family: Family, strategy: Scope) -> list[str]:
        """The :meth:`configs` of one strategy's run of a family, as LightningCLI arguments; the
        run's protocol is built from their parse by :meth:`protocol`."""
        fit = [f"--trainer.{name}={value}" for name, value in self.fit_trainer.items()]
        arguments = [part for config in self.configs(family, strategy) for part in ("--config", config)]
        return [*arguments, "--trainer.enable_progress_bar=false", *fit]

    def protocol(self, family: Family, strategy: Scope, cli: LightningCLI, pretraining: bool = False) -> Protocol:
        """The :class:`~lmc.experiments.protocol.Protocol` of one strategy's run of a family.

        The configs' own protocol with the study's settings: the run folder, the strategy, the seeds,
        the family's pre-trained checkpoint (every strategy after the first; every strategy of a
        family that names another in ``pretrained_by``), the robustness table,
        a ``full_model`` fine-tuning as long as the pre-training, and the study's ``methods``.

        Args:
            family: The model family.
            strategy: The re-initialization strategy of the run.
            cli: The LightningCLI of :meth:`arguments` (``run=False``).
            pretraining: The protocol as the family's pre-training (in the first strategy's run)
                sees it: without the fine-tuning schedule and the methods, which do not change it.
        """
        given: Protocol = cli.config_init.protocol
        changes: dict[str, Any] = {
            "output_dir": str(Path(self.output_dir) / family.name / strategy),
            "reinit": strategy,
            "seeds": self.table1_seeds if self.table1_run(family, strategy) else self.seeds,
        }
        if strategy != self.strategies[0] or family.pretrained_by is not None:
            changes["pretrained"] = str(self.pretrained(family))
        if strategy in self.robustness:
            changes["robustness"] = True
        if not pretraining and strategy == "full_model":  # everything re-initialized: as long as pre-training
            epochs = given.pretrain.max_epochs or cli.config.trainer.max_epochs
            changes["finetune"] = Schedule(max_epochs=epochs, lr=given.pretrain.lr or cli.config.model.lr)
        if not pretraining and strategy in self.methods_strategies:
            listed = given.alignment_options
            changes["alignments"] = listed + [options for options in self.methods if options not in listed]
        return dataclasses.replace(given, **changes)

    def experiment(self, family: Family, strategy: Scope, pretraining: bool = False) -> Experiment:
        """The ``lmc run`` of one strategy of one family: its configs parsed once, its
        :meth:`protocol` given to the :class:`~lmc.experiments.run.Experiment` as an object."""
        from lmc.experiments.run import Experiment

        cli = experiment_cli(self.arguments(family, strategy), run=False)
        return Experiment(cli, self.protocol(family, strategy, cli, pretraining))


def _study_config(path: str | Path) -> Path:
    """A config a study names: the working folder's file, else lmc's packaged one (:func:`lmc.configs.config_file`)."""
    try:
        return config_file(path)
    except FileNotFoundError as error:
        raise FileNotFoundError(f"study {error}") from None


def load_study(paths: list[str | Path]) -> Study:
    """A study from YAML files, later ones overriding earlier ones (e.g. ``configs/study/quick.yaml``)."""
    from jsonargparse import ArgumentError, ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--config", action="config")
    parser.add_class_arguments(Study, "study", skip={"fit_trainer"})  # the cluster's, not the study's
    args = [part for path in paths for part in ("--config", str(_study_config(path)))]
    try:
        config = parser.parse_args(args)
    except ArgumentError as error:  # one line naming the key or file, as every lmc error
        raise ValueError(f"study {', '.join(map(str, paths))}: {' '.join(str(error).split())}") from None
    return parser.instantiate_classes(config).study


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


def first_layer_inputs(experiment: Experiment, batches: int = 8) -> dict[str, Any]:
    """How much of the width the first attention layer's inputs span, and how much of its Q/K/V
    weights they reach, in seed 0 of a finished ``lmc run`` (a fine-tuned model).

    A weight-space cost counts every direction of ``W_Q, W_K, W_V``, but the function only
    depends on their action on the inputs the layer receives: with inputs confined to a subspace,
    the rest of the weights is the untouched initialization and weighs on the matcher without
    bearing on the barrier. Measured on ``batches`` training batches of the fine-tuning half (all
    of them where it holds fewer: a run fine-tuned on a few samples).

    Args:
        experiment: The finished run (its folder holds ``seed0/final.ckpt``).
        batches: Calibration batches.

    Returns:
        ``{"width", "rank", "tokens", "visible": {"query", "key", "value"}}``: the numerical rank of
        the inputs' second moment ``E[x x^T]`` (float64, eigenvalues above 1e-10 of the largest)
        and each projection's squared norm share on that span.
    """
    import torch

    from lmc.adapters import adapter_for, model_spec
    from lmc.connectivity import training_calibration
    from lmc.matching.calibration import paired_moments
    from lmc.symmetry import head_rows

    folder = experiment.root
    pretrained = experiment.protocol.pretrained or folder / "pretrain" / "final.ckpt"
    stage = experiment.finetune_stage(0, Path(pretrained), "")
    module, datamodule = experiment.trained(stage, folder / "seed0" / "final.ckpt")
    model = module.model
    layer = model_spec(model).attention[0]
    twin = copy.deepcopy(model)  # paired moments read two models; both are this one
    adapter = adapter_for(model)
    watched = {"input": (adapter.attention_input_module(model, layer), adapter.attention_input_module(twin, layer))}
    held = math.ceil(len(datamodule.split("train")) / datamodule.batch_size)
    calibration = training_calibration(datamodule, module.model_loss, min(batches, held))
    moment = paired_moments(model, twin, watched, calibration)["input"]
    values, vectors = torch.linalg.eigh(moment.source)
    span = vectors[:, values > 1e-10 * values[-1]]
    parameters = dict(model.named_parameters())
    visible = {}
    for name in ("query", "key", "value"):
        rows = head_rows(parameters, layer, name).double()
        visible[name] = float((rows @ span).square().sum() / rows.square().sum())
    return {"width": layer.width, "rank": span.shape[1], "tokens": moment.tokens, "visible": visible}


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
    (``benchmarks/results/reproducibility.md``).
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
