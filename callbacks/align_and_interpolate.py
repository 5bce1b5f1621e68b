"""``AlignAndInterpolate``: after fine-tuning, align to other seeds' runs and measure LMC.

For each reference checkpoint (another seed of the same experiment) the callback aligns the
reference to the model just trained (:func:`lmc.matching.align`, the run's scope by default),
then evaluates the naive and the aligned interpolation at evenly spaced alphas (25 by default)
on the validation or test split (docs/spec.md, section 4). It logs to TensorBoard the curves (step =
``round(1000 * alpha)``), the barriers and a figure, and writes ``lmc_results.json``,
``lmc_results.csv`` and ``lmc_interpolation_<i>.png`` atomically next to the logs. The results
record which run they belong to (the model's checkpoint and weight fingerprint, each
reference's, every setting); results of another run found in the folder when a run starts are
first moved to ``stale/`` (one log line says so).

The references and the output folder are checked when fitting starts, not after training.

Distributed (Lightning DDP, one or many nodes): every rank evaluates its own shard (samples
``rank::world_size``, no padding) and the metric sums (``LMCModule.sample_sums``, added up) are
all-reduced, so the curve equals the single-process one; only rank 0 writes. Killed during a
sweep, a rerun resumes from the points already in ``lmc_sweep_state_<i>.json`` (one per
reference) and ends with the same results; a state of another sweep (other weights, split,
data or settings) is never reused.
"""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Any

import lightning as L
from torch.utils.data import DataLoader, Subset

from lmc.checkpoints import checkpoint_file, load_weights
from lmc.connectivity import (
    CurveSplit,
    Evaluation,
    ResultsOutput,
    SweepHooks,
    check_curve_split,
    data_identity,
    sweep_and_write,
    training_calibration,
)
from lmc.connectivity.interpolation import evenly_spaced
from lmc.io import check_output_folder
from lmc.matching import AlignOptions
from lmc.symmetry import Scope, check_scope


class AlignAndInterpolate(L.Callback):
    """Align the trained model with reference checkpoints and log interpolation barriers.

    Args:
        references: Checkpoints (paths or glob patterns) of other seeds' runs; each must match
            a file. The run's own checkpoint is skipped if a pattern matches it.
        scope: Alignment scope; ``None`` uses the module's ``reinit`` (``full_model`` when
            pre-training).
        options: Alignment options, passed unchanged to :func:`lmc.matching.align`
            (``None``: the defaults). Data-aware options calibrate on the first
            ``calibration_batches`` batches of a seeded shuffle of the training split the run
            trained on.
        num_alphas: Points on each curve (at least 2).
        split: ``"val"`` or ``"test"``.
        batch_size: Evaluation batch size (``None``: the DataModule's).
        output_dir: Where results go (``None``: the trainer's log folder).
    """

    def __init__(
        self,
        references: list[str],
        scope: Scope | None = None,
        options: AlignOptions | None = None,
        num_alphas: int = 25,
        split: CurveSplit = "val",
        batch_size: int | None = None,
        output_dir: str | None = None,
    ):
        super().__init__()
        if not references:
            raise ValueError("AlignAndInterpolate needs at least one reference checkpoint (a path or glob pattern)")
        if scope is not None:
            check_scope(scope)
        check_curve_split(split)
        if num_alphas < 2:
            raise ValueError(f"AlignAndInterpolate num_alphas={num_alphas}; an interpolation needs at least 2 points")
        self.references, self.scope, self.options = references, scope, options or AlignOptions()
        self.alphas = evenly_spaced(num_alphas)
        self.split, self.batch_size, self.output_dir = split, batch_size, output_dir
        self.results: dict[str, Any] = {}

    def reference_paths(self, trainer: L.Trainer) -> list[Path]:
        """The readable reference checkpoints, without the run's own."""
        paths = set()
        for pattern in self.references:
            matches = glob.glob(str(Path(pattern).expanduser()))
            if not matches:
                raise FileNotFoundError(
                    f"AlignAndInterpolate reference {pattern!r} matches no file: fix the path, or train that "
                    "seed first (its checkpoint is the reference)"
                )
            paths.update(checkpoint_file(match) for match in matches)
        own = {Path(c.best_model_path).resolve() for c in trainer.checkpoint_callbacks if c.best_model_path}
        paths = sorted(p for p in paths if p.resolve() not in own)
        if not paths:
            raise FileNotFoundError(f"AlignAndInterpolate references {self.references} match only this run's own")
        return paths

    def output_folder(self, trainer: L.Trainer) -> Path:
        return Path(self.output_dir or trainer.log_dir or trainer.default_root_dir)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":  # a typo must cost seconds, not a whole training run
            self.reference_paths(trainer)
            check_output_folder(self.output_folder(trainer))

    def shard_loader(self, trainer: L.Trainer) -> DataLoader:
        """This rank's samples ``rank::world_size`` of the split, in order, without padding."""
        datamodule = trainer.datamodule
        dataset = datamodule.split(self.split)
        shard = Subset(dataset, list(range(trainer.global_rank, len(dataset), trainer.world_size)))
        return DataLoader(shard, batch_size=self.batch_size or datamodule.batch_size, shuffle=False)

    def evaluation(self, trainer: L.Trainer, pl_module: L.LightningModule) -> Evaluation:
        """This rank's shard, evaluated under the trainer's precision and summed over ranks."""

        def metric_sums(batch):
            with trainer.precision_plugin.forward_context():
                return pl_module.sample_sums(batch)

        distributed = trainer.world_size > 1
        return Evaluation(
            metric_sums,
            self.shard_loader(trainer),
            self.split,
            data=data_identity(trainer.datamodule),
            architecture={key: pl_module.hparams.get(key) for key in ("model", "model_config")},
            all_reduce=(lambda sums: trainer.strategy.reduce(sums, reduce_op="sum")) if distributed else None,
        )

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.results = self.run(trainer, pl_module)

    def run(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        """Align, sweep and report for every reference; returns the results (on every rank)."""
        scope = self.scope or pl_module.hparams.get("reinit") or "full_model"
        paths = self.reference_paths(trainer)
        evaluation = self.evaluation(trainer, pl_module)
        calibration = None
        if self.options.data_aware:  # the same seeded batches on every rank: the same alignment
            calibration = training_calibration(
                trainer.datamodule, pl_module.model_loss, self.options.calibration_batches
            )
        experiment = getattr(trainer.logger, "experiment", None) if trainer.is_global_zero else None
        output = ResultsOutput(
            self.output_folder(trainer),
            checkpoint=getattr(trainer.checkpoint_callback, "best_model_path", None) or None,
            tensorboard=experiment if hasattr(experiment, "add_scalar") else None,
            progress="Align and interpolate" if trainer.progress_bar_callback is not None else None,
            timed=True,
        )
        hooks = SweepHooks(write=trainer.is_global_zero, barrier=trainer.strategy.barrier)

        def load(path: Path):
            return lambda: load_weights(pl_module.build_model(), path).to(pl_module.device).eval()

        was_training = pl_module.training
        pl_module.eval()
        try:
            return sweep_and_write(
                output,
                pl_module.model,
                {path: load(path) for path in paths},
                scope,
                self.options,
                self.alphas,
                evaluation,
                hooks,
                calibration,
            )
        finally:
            pl_module.train(was_training)
