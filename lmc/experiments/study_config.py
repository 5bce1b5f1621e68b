"""A study of ``lmc repro``: its model families, strategies and seeds (:class:`Study`, ``configs/study/*.yaml``),
and the files its runs leave in its output folder beside the run folders.

:mod:`lmc.experiments.study` runs a study as jobs; :mod:`lmc.experiments.report.study` writes its report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmc.configs import config_file
from lmc.experiments.protocol import Protocol, Schedule, alignment_labels, experiment_cli
from lmc.matching import AlignOptions
from lmc.symmetry import SCOPES, Scope, check_scope

if TYPE_CHECKING:  # lmc.experiments.run imports Lightning: loaded in the workers only
    from lightning.pytorch.cli import LightningCLI

    from lmc.experiments.run import Experiment

#: Per family: ``lmc.experiments.study.first_layer_inputs`` of its first strategy's seed 0.
FIRST_LAYER_INPUTS = "first_layer_inputs.json"
#: The processor and library of the study's last run (``lmc.experiments.study.machine``).
MACHINE = "machine.json"
#: Each task's wall time in seconds (``lmc.experiments.study.run_study``).
TIMES = "times.json"


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
            with its Table 1 runs as data (``table1.json``, :mod:`lmc.experiments.report.sensitivity`).
        sensitivity: Another study's ``table1.json`` (the sensitivity study's,
            ``docs/sensitivity/table1.json``) whose points the report lays out by fine-tuning
            samples and length (``None``: this study's own, where its families share
            pre-trainings through ``pretrained_by``; else no such section).
        stage1_picked_on: Stage 1 settings chosen by looking at one family's results (as the report
            names them, e.g. ``metric=midpoint-calibration_batches=all``) -> that family's name: the
            report counts such a setting's verdict as evidence only on the other families and says
            where each was picked (a setting not listed was fixed before the study).
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
    stage1_picked_on: dict[str, str] = field(default_factory=dict)
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


def recorded(output_dir: str | Path, name: str) -> dict[str, Any] | None:
    """A JSON record of a study's output folder (:data:`MACHINE`, :data:`TIMES`), if written."""
    path = Path(output_dir) / name
    return json.loads(path.read_text()) if path.is_file() else None
