"""``lmc run``: the paper's protocol end to end from one experiment config (paper Section 6).

1. pre-train on half A of the training split (or reuse ``protocol.pretrained``);
2. fine-tune ``protocol.seeds`` seeds on half B, re-initializing ``protocol.reinit`` and freezing
   everything else (:class:`~lmc.training.LMCModule`);
3. for every pair of seeds ``i < j`` and every listed alignment, align seed ``i`` to seed ``j``
   and sweep the naive and the aligned interpolation (25 points by default);
4. summarize every barrier and barrier ratio over the pairs (mean, spread, extremes).

A run folder holds everything, so a rerun after a kill skips finished fits and finished sweep
points and ends with identical results::

    <output_dir>/
      pretrain/final.ckpt, seed<k>/final.ckpt   each with stage.json (its configuration key)
      pairs/<i>_<j>/<alignment>/                 lmc_results.{json,csv}, figure, sweep state
      pairs/<i>_<j>/robustness.json              with protocol.robustness: accuracy under corruptions
      tensorboard/                               training logs; lmc/ holds the curves
      summary.{json,csv,md}, summary_<alignment>.png

A stage folder made with another configuration is never reused: the run stops and names it
(``protocol.overwrite`` recomputes it and everything after it).
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import logging
import math
import sys
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader, Dataset, Subset

from lmc.adapters import model_spec
from lmc.checkpoints import atomic_write, atomic_write_json, load_weights
from lmc.connectivity import (
    CurveSplit,
    Evaluation,
    SweepHooks,
    check_curve_split,
    data_identity,
    measure_connectivity,
    run_record,
    training_calibration,
    write_results,
)
from lmc.interpolation import evenly_spaced
from lmc.matching import AlignOptions, align
from lmc.robustness import midpoint_robustness
from lmc.summary import (
    HEAD_ORDERS,
    ROBUSTNESS,
    log_curves,
    summarize,
    summarize_head_orders,
    summarize_robustness,
    summary_table,
    write_summary,
)
from lmc.symmetry import Scope
from lmc.tasks import DataInfo

log = logging.getLogger(__name__)

#: Trainer settings that change how a run looks, not what it computes: not part of a stage's key.
_COSMETIC = {"logger", "enable_progress_bar", "enable_model_summary", "log_every_n_steps", "callbacks"}
#: Callbacks that ``lmc run`` replaces by its own checkpointing and sweeps.
_REPLACED_CALLBACKS = ("ModelCheckpoint", "AlignAndInterpolate")


class RunError(ValueError):
    """A run folder or protocol that cannot be used as asked; the message says how to fix it."""


@dataclass(frozen=True)
class Schedule:
    """Length and learning rate of one training phase.

    Attributes:
        max_epochs: Epochs of this phase (``None``: the experiment's ``trainer.max_epochs``).
        lr: AdamW learning rate of this phase (``None``: the experiment's ``model.lr``).
    """

    max_epochs: int | None = None
    lr: float | None = None

    def __post_init__(self):
        if self.max_epochs is not None and self.max_epochs < 1:
            raise ValueError(f"max_epochs must be at least 1, got {self.max_epochs}")
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive number, got {self.lr}")


@dataclass(frozen=True)
class Protocol:
    """The paper's protocol, run by ``lmc run`` (``lmc fit`` and the other single steps ignore it).

    Attributes:
        output_dir: The run folder (checkpoints, sweeps, logs, summary).
        reinit: The re-initialization strategy of the fine-tuning runs.
        seeds: Fine-tuned seeds (``0 .. seeds - 1``); every pair of them is aligned and swept.
        pretrained: A pre-trained checkpoint to start from instead of pre-training.
        pretrain: Schedule of the pre-training on half A.
        finetune: Schedule of each fine-tuning run on half B.
        alignments: Alignment settings to compare, each giving one aligned curve per pair
            (``None``: the default :class:`~lmc.matching.AlignOptions`, the full method).
            Data-aware settings calibrate on the first ``calibration_batches`` batches of a
            seeded shuffle of the fine-tuning half B's training split.
        num_alphas: Points on each interpolation curve.
        split: Where the curves are measured.
        eval_batch_size: Evaluation batch size (``None``: the DataModule's).
        eval_samples: Measure the curves on the first this many samples of ``split`` only
            (``None``: all of it); for smoke runs of a whole study.
        head_orders: Also align every pair with each order of the first attention layer's heads,
            each followed by the full Stage 2, to rank the order each alignment picks and report
            ``L_hat`` (the paper's Table 1; ``h!`` more sweeps per pair, at most 6 heads).
        robustness: Also measure the accuracy of both end points, the naive midpoint and each
            alignment's aligned midpoint on clean and corrupted data, three severities per
            corruption (paper Appendix L; :mod:`lmc.robustness`): ``pairs/<i>_<j>/robustness.json``
            and a section of the summary.
        overwrite: Recompute stages whose folder holds results of another configuration.
    """

    output_dir: str = "runs/experiment"
    reinit: Scope = "first_attention"
    seeds: int = 3
    pretrained: str | None = None
    pretrain: Schedule = field(default_factory=Schedule)
    finetune: Schedule = field(default_factory=Schedule)
    alignments: list[AlignOptions] | None = None
    num_alphas: int = 25
    split: CurveSplit = "val"
    eval_batch_size: int | None = None
    eval_samples: int | None = None
    head_orders: bool = False
    robustness: bool = False
    overwrite: bool = False

    def __post_init__(self):
        if self.seeds < 2:
            raise ValueError(f"protocol.seeds must be at least 2 (a pair of fine-tuned runs), got {self.seeds}")
        if self.num_alphas < 2:
            raise ValueError(f"protocol.num_alphas must be at least 2, got {self.num_alphas}")
        if self.alignments is not None and not self.alignments:
            raise ValueError("protocol.alignments is empty: list at least one, e.g. [{method: full}]")
        labels = alignment_labels(self.alignment_options)
        if len(set(labels)) != len(labels):
            raise ValueError(f"protocol.alignments lists the same settings twice: {labels}")
        check_curve_split(self.split)
        if self.eval_batch_size is not None and self.eval_batch_size < 1:
            raise ValueError(f"protocol.eval_batch_size must be positive, got {self.eval_batch_size}")
        if self.eval_samples is not None and self.eval_samples < 1:
            raise ValueError(f"protocol.eval_samples must be positive, got {self.eval_samples}")

    @property
    def alignment_options(self) -> list[AlignOptions]:
        return self.alignments if self.alignments is not None else [AlignOptions()]


def alignment_labels(alignments: list[AlignOptions]) -> list[str]:
    """Short names of alignment settings: the method, plus every field that differs from the defaults."""
    default = asdict(AlignOptions())
    labels = []
    for options in alignments:
        changed = [f"{k}={v}" for k, v in asdict(options).items() if k != "method" and v != default[k]]
        labels.append("-".join([options.method, *changed]))
    return labels


def head_orders(layer) -> list[tuple[int, ...]]:
    """Every order of a layer's query heads that keeps each with its key/value head (``h!`` without GQA)."""
    if layer.num_heads > 6:
        raise RunError(
            f"protocol.head_orders scores all {layer.num_heads}! head orders of {layer.name}: use at most 6 heads"
        )
    q = layer.queries_per_kv
    return [
        order
        for order in itertools.permutations(range(layer.num_heads))
        if all(len({head // q for head in order[g : g + q]}) == 1 for g in range(0, layer.num_heads, q))
    ]


def _key(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass
class _Stage:
    """One training run of the protocol: its folder, configuration and upstream."""

    name: str
    config: Any  # the jsonargparse namespace of this stage
    key: str

    def folder(self, root: Path) -> Path:
        return root / self.name

    def checkpoint(self, root: Path) -> Path:
        return self.folder(root) / "final.ckpt"


def data_info(data) -> DataInfo:
    """What a DataModule tells the model about itself (linked into ``model.data``)."""
    return data.info


@contextmanager
def _program_arguments_only():
    """Hide the process's own arguments while LightningCLI parses explicit ``args``.

    LightningCLI warns whenever both are present (a guard for notebooks); ``lmc run`` and the
    Python API always pass the arguments explicitly.
    """
    saved = sys.argv
    sys.argv = saved[:1]
    try:
        yield
    finally:
        sys.argv = saved


def lightning_cli(args: list[str] | None = None, run: bool = True):
    """The LightningCLI of lmc: model ``LMCModule``, data any ``LMCDataModule`` subclass.

    ``args`` ``None`` reads the command line. The DataModule's sizing metadata is linked into
    ``model.data`` so a model is always sized to its data; the ``protocol`` group is read by
    ``lmc run`` only. The resolved config is saved into the run's log folder, never elsewhere.
    """
    from lightning.pytorch.cli import LightningCLI, SaveConfigCallback

    from lmc.data import LMCDataModule
    from lmc.training import LMCModule

    class SaveConfigIntoTheRunFolder(SaveConfigCallback):
        """Save the config only where the run keeps its logs, and never over an input file."""

        def setup(self, trainer, pl_module, stage: str) -> None:
            if trainer.logger is None or trainer.logger.log_dir is None:
                return  # no run folder: the working directory is the user's, not ours
            inputs = {Path(str(c)).resolve() for c in self.config.get("config") or []}
            if (Path(trainer.logger.log_dir) / self.config_filename).resolve() in inputs:
                return
            super().setup(trainer, pl_module, stage)

    class LMCLightningCLI(LightningCLI):
        def add_arguments_to_parser(self, parser) -> None:
            parser.link_arguments("data", "model.data", compute_fn=data_info, apply_on="instantiate")
            parser.add_class_arguments(Protocol, "protocol", instantiate=True)

    with _program_arguments_only() if args is not None else nullcontext():
        return LMCLightningCLI(
            LMCModule,
            LMCDataModule,
            subclass_mode_data=True,
            save_config_callback=SaveConfigIntoTheRunFolder,
            save_config_kwargs={"overwrite": True},
            args=args,
            run=run,
            auto_configure_optimizers=False,
            # Without subcommands this parser is lmc run's: say so in its --help.
            parser_kwargs={} if run else {"description": __doc__.splitlines()[0].replace("``", "")},
        )


class Experiment:
    """Runs :class:`Protocol` for one parsed experiment configuration.

    Args:
        cli: A LightningCLI (``run=False``) holding the parsed experiment config and its parser.
    """

    def __init__(self, cli):
        self.parser, self.config = cli.parser, cli.config
        self.protocol: Protocol = cli.config_init.protocol
        self.root = Path(self.protocol.output_dir)

    # -- stages ------------------------------------------------------------------------------

    def _stage_config(self, name: str, overrides: dict[str, Any], schedule: Schedule):
        config = copy.deepcopy(self.config)
        for dotted, value in overrides.items():
            config[dotted] = value
        if schedule.max_epochs is not None:
            config["trainer.max_epochs"] = schedule.max_epochs
        if schedule.lr is not None:
            config["model.lr"] = schedule.lr
        config["trainer.logger"] = {
            "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
            "init_args": {"save_dir": str(self.root / "tensorboard"), "name": name, "version": ""},
        }
        callbacks = config.get("trainer.callbacks") or []
        config["trainer.callbacks"] = [
            c for c in callbacks if str(c.class_path).rsplit(".", 1)[-1] not in _REPLACED_CALLBACKS
        ]
        config["trainer.enable_checkpointing"] = False
        return config

    def _key_of(self, config, upstream: str) -> str:
        trainer = {k: v for k, v in config.trainer.as_dict().items() if k not in _COSMETIC}
        return _key(config.model.as_dict(), config.data.as_dict(), trainer, config.seed_everything, upstream)

    def pretrain_stage(self) -> _Stage:
        config = self._stage_config(
            "pretrain", {"model.reinit": None, "data.init_args.part": "A"}, self.protocol.pretrain
        )
        return _Stage("pretrain", config, self._key_of(config, ""))

    def finetune_stage(self, seed: int, pretrained: Path, upstream: str) -> _Stage:
        base_seed = self.config.seed_everything if isinstance(self.config.seed_everything, int) else 0
        overrides = {
            "model.reinit": self.protocol.reinit,
            "model.reinit_seed": seed,
            "model.pretrained": str(pretrained),
            "data.init_args.part": "B",
            # Data order and dropout differ per seed; 100 apart from pre-training's seed.
            "seed_everything": base_seed + 100 + seed,
        }
        name = f"seed{seed}"
        config = self._stage_config(name, overrides, self.protocol.finetune)
        config_for_key = copy.deepcopy(config)
        config_for_key["model.pretrained"] = None  # the upstream key stands for the checkpoint
        return _Stage(name, config, self._key_of(config_for_key, upstream))

    def instantiate(self, stage: _Stage):
        """``(trainer, module, datamodule)`` of a stage, seeded as its config says.

        Parsed anew from the stage's whole config, so the module's saved hyper-parameters are
        the stage's own (LightningCLI records the config it parsed, not the arguments it got).
        """
        cli = lightning_cli(["--config", self.parser.dump(stage.config)], run=False)
        return cli.trainer, cli.model, cli.datamodule

    def _finished(self, stage: _Stage) -> bool:
        record = stage.folder(self.root) / "stage.json"
        if not record.is_file():
            return False
        saved = json.loads(record.read_text()).get("key")
        if saved == stage.key and stage.checkpoint(self.root).is_file():
            return True
        if saved != stage.key and not self.protocol.overwrite:
            raise RunError(
                f"{stage.folder(self.root)} holds a {stage.name} run of another configuration: rerun with "
                f"--protocol.overwrite true to recompute it (and what depends on it), or choose another "
                f"--protocol.output_dir"
            )
        return False

    def fit(self, stage: _Stage) -> Path:
        """Train a stage unless its checkpoint of the same configuration exists; returns the checkpoint."""
        checkpoint = stage.checkpoint(self.root)
        if self._finished(stage):
            log.info("%s: finished earlier (%s)", stage.name, checkpoint)
            return checkpoint
        (stage.folder(self.root) / "stage.json").unlink(missing_ok=True)
        trainer, module, datamodule = self.instantiate(stage)
        trainer.fit(module, datamodule)
        atomic_write(checkpoint, lambda path: trainer.save_checkpoint(path, weights_only=True))
        atomic_write_json(stage.folder(self.root) / "stage.json", {"key": stage.key, "name": stage.name})
        return checkpoint

    # -- alignment and sweeps ----------------------------------------------------------------

    def curve_data(self, datamodule) -> tuple[Dataset, dict[str, Any]]:
        """The samples the curves are measured on (``protocol.split``, its first ``eval_samples``)
        and their identity in sweep keys and results."""
        dataset, data = datamodule.split(self.protocol.split), data_identity(datamodule)
        if self.protocol.eval_samples is not None:
            dataset = Subset(dataset, range(min(self.protocol.eval_samples, len(dataset))))
            data = {**data, "eval_samples": len(dataset)}
        return dataset, data

    def sweep_pair(self, stages: list[_Stage], checkpoints: list[Path], i: int, j: int) -> dict[str, Any]:
        """Align seed ``i`` to seed ``j`` with every listed alignment and sweep both curves."""
        _, module, datamodule = self.instantiate(stages[j])
        load_weights(module.model, checkpoints[j])
        module.eval()
        reference = load_weights(module.build_model(), checkpoints[i]).eval()
        dataset, data = self.curve_data(datamodule)
        loader = DataLoader(dataset, batch_size=self.protocol.eval_batch_size or datamodule.batch_size)
        alphas = evenly_spaced(self.protocol.num_alphas)
        evaluation = Evaluation(
            module.metric_sums,
            loader,
            self.protocol.split,
            data,
            {k: module.hparams.get(k) for k in ("model", "model_config")},
        )
        pair = self.root / "pairs" / f"{i}_{j}"
        calibrations = {}  # calibration_batches -> batches of the fine-tuning half B's training split

        def calibration_for(options: AlignOptions):
            if not options.data_aware:
                return None
            count = options.calibration_batches
            if count not in calibrations:
                calibrations[count] = training_calibration(datamodule, module.model_loss, count)
            return calibrations[count]

        # Each alignment is computed once: a head order's screening and whole sweeps and the
        # robustness table use the same aligned model.
        aligned: dict[str, tuple[Any, Any]] = {}

        def alignment_for(options: AlignOptions):
            key = repr(options)
            if key not in aligned:
                aligned[key] = align(reference, module.model, self.protocol.reinit, options, calibration_for(options))
            return aligned[key]

        def sweep(
            options: AlignOptions, folder: Path, at: list[float] = alphas, figures: bool = True
        ) -> dict[str, Any]:
            # Every curve of the pair at the same alphas shares one naive curve.
            naive = pair / ("naive_sweep_state.json" if at == alphas else f"naive_sweep_state_{len(at)}.json")
            hooks = SweepHooks(folder / "lmc_sweep_state_0.json", naive_state_path=naive)
            result = measure_connectivity(
                module.model,
                reference,
                self.protocol.reinit,
                options,
                at,
                evaluation,
                hooks,
                calibration_for(options),
                alignment_for(options),
            )
            record = run_record(module.model, str(checkpoints[j]), [checkpoints[i]], result["settings"])
            write_results(folder, {"run": record, "references": {str(checkpoints[i]): result}}, figures)
            return result

        labels, alignments = alignment_labels(self.protocol.alignment_options), self.protocol.alignment_options
        results = {label: sweep(options, pair / label) for label, options in zip(labels, alignments)}
        if self.protocol.head_orders:
            orders = head_orders(model_spec(module.model).attention[0])
            results[HEAD_ORDERS] = self._sweep_head_orders(orders, results, alphas, pair / "orders", sweep)
        if self.protocol.robustness:
            results[ROBUSTNESS] = midpoint_robustness(
                module.model,
                reference,
                {label: alignment_for(options)[0] for label, options in zip(labels, alignments)},
                evaluation,
                datamodule.info,
                pair / "robustness.json",
            )
        return results

    @staticmethod
    def _sweep_head_orders(
        orders: list[tuple[int, ...]],
        results: dict[str, Any],
        alphas: list[float],
        folder: Path,
        sweep: Callable[..., dict[str, Any]],
    ) -> dict[str, dict[str, Any]]:
        """Every head order of the first attention layer followed by the full Stage 2, with exact
        ranks and ``L_top1`` at a fraction of ``h!`` whole curves.

        A barrier is the largest gap over the curve's alphas, so the gap on any of them bounds it from
        below. Each order is first swept at the two end points and the middle alpha (its
        ``screening``); orders picked by a listed alignment's Stage 1 get their whole curve, and so
        does every other order whose screening bound (loss or accuracy) lies below the largest whole-curve
        barrier of the picked ones. An order left at its bound can neither be strictly better than a
        picked order nor be the best one, so ranks and ``L_hat`` are those of all whole curves.
        """
        labels = ["".join(map(str, order)) for order in orders]
        full = {label: AlignOptions(head_orders={0: [int(h) for h in label]}) for label in labels}
        if len(alphas) <= 3:  # nothing to screen out
            return {label: sweep(full[label], folder / label, figures=False) for label in labels}
        screening = [alphas[0], alphas[len(alphas) // 2], alphas[-1]]
        bounds = {label: sweep(full[label], folder / "screening" / label, screening, figures=False) for label in labels}
        picked = {
            "".join(map(str, layers[0]["assignment"]))
            for result in results.values()
            if (layers := [layer for layer in result["alignment"]["layers"] if layer["kind"] == "attention"])
        }
        swept = {label: sweep(full[label], folder / label, figures=False) for label in labels if label in picked}
        worst = {
            name: max((r["curves"]["aligned"][name] for r in swept.values()), default=math.inf)
            for name in ("loss_barrier", "accuracy_barrier")
        }
        for label in labels:
            if label not in swept and any(bounds[label]["curves"]["aligned"][n] < worst[n] for n in worst):
                swept[label] = sweep(full[label], folder / label, figures=False)
        return {label: swept.get(label, bounds[label]) for label in labels}

    def run(self) -> dict[str, Any]:
        """Every stage, every pair, the summary; returns the summary."""
        protocol = self.protocol
        if protocol.pretrained is not None:
            pretrained = Path(protocol.pretrained)
            if not pretrained.is_file():
                raise RunError(f"protocol.pretrained {pretrained} does not exist: train it or drop the setting")
            upstream = _key(str(pretrained.resolve()), pretrained.stat().st_size, pretrained.stat().st_mtime_ns)
        else:
            stage = self.pretrain_stage()
            pretrained, upstream = self.fit(stage), stage.key
        stages = [self.finetune_stage(seed, pretrained, upstream) for seed in range(protocol.seeds)]
        checkpoints = [self.fit(stage) for stage in stages]
        pairs = {}
        for i in range(protocol.seeds):
            for j in range(i + 1, protocol.seeds):
                pairs[(i, j)] = self.sweep_pair(stages, checkpoints, i, j)
        summary = summarize(pairs, alignment_labels(protocol.alignment_options))
        if protocol.head_orders:
            summary["head_orders"] = summarize_head_orders(pairs, alignment_labels(protocol.alignment_options))
        if protocol.robustness:
            summary[ROBUSTNESS] = summarize_robustness(pairs)
        datamodule = self.instantiate(stages[0])[2]
        summary["protocol"] = {
            "output_dir": str(self.root),
            "reinit": protocol.reinit,
            "seeds": protocol.seeds,
            "split": protocol.split,
            "curve_samples": len(self.curve_data(datamodule)[0]),
            "split_samples": len(datamodule.split(protocol.split)),
        }
        write_summary(self.root, summary)
        log_curves(self.root / "tensorboard" / "lmc", pairs, summary)
        return summary


def run(cli, report: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the protocol of a parsed experiment and print its summary table."""
    summary = Experiment(cli).run()
    report(summary_table(summary))
    report(f"Results: {Path(cli.config_init.protocol.output_dir)}/summary.md (.json, .csv, figures, tensorboard/)")
    return summary
