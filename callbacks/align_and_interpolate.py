"""``AlignAndInterpolate``: after fine-tuning, align to other seeds' runs and measure LMC.

For each reference checkpoint (another seed of the same experiment) the callback aligns the
reference to the model just trained (:func:`lmc.matching.align`, the run's scope by default),
then evaluates the naive and the aligned interpolation at evenly spaced alphas (25 by default)
on the validation or test split (SPEC section 4). It logs to TensorBoard the curves (step =
``round(1000 * alpha)``), the barriers and a figure, and writes ``lmc_results.json``,
``lmc_results.csv`` and figures atomically next to the logs.

Distributed (Lightning DDP, one or many nodes): every rank evaluates its own shard (samples
``rank::world_size``, no padding) and the sums of losses, correct predictions and counts are
all-reduced, so the curve equals the single-process one; only rank 0 writes. Killed during a
sweep, a rerun resumes from the points already in ``lmc_sweep_state.json`` and ends with the
same results.
"""

from __future__ import annotations

import glob
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Subset
from tqdm.auto import tqdm

from lmc.checkpoints import load_weights
from lmc.connectivity import BARRIERS, curve_figure, measure_connectivity, write_results
from lmc.interpolation import evaluate, evenly_spaced
from lmc.matching import METHODS, METRICS
from lmc.symmetry import SCOPES


class AlignAndInterpolate(L.Callback):
    """Align the trained model with reference checkpoints and log interpolation barriers.

    Args:
        references: Checkpoints (paths or glob patterns) of other seeds' runs; the run's own
            checkpoint is skipped if a pattern matches it.
        scope: Alignment scope; ``None`` uses the module's ``strategy`` (``full_model`` when
            pre-training).
        method: ``"naive"``, ``"permutation"``, ``"orthogonal"`` or ``"full"``.
        metric: Stage 1 head metric (see :func:`lmc.matching.align`).
        num_alphas: Points on each curve.
        split: ``"val"`` or ``"test"``.
        batch_size: Evaluation batch size (``None``: the DataModule's).
        output_dir: Where results go (``None``: the trainer's log folder).
    """

    def __init__(
        self,
        references: list[str],
        scope: str | None = None,
        method: str = "full",
        metric: str = "invariant",
        num_alphas: int = 25,
        split: str = "val",
        batch_size: int | None = None,
        output_dir: str | None = None,
    ):
        super().__init__()
        for name, value, allowed in (
            ("scope", scope, (None, *SCOPES)),
            ("method", method, METHODS),
            ("metric", metric, METRICS),
            ("split", split, ("val", "test")),
        ):
            if value not in allowed:
                raise ValueError(f"AlignAndInterpolate {name}={value!r}; choose one of {allowed}")
        self.references, self.scope, self.method, self.metric = references, scope, method, metric
        self.alphas = evenly_spaced(num_alphas)
        self.split, self.batch_size, self.output_dir = split, batch_size, output_dir
        self.results: dict[str, Any] = {}

    def reference_paths(self, trainer: L.Trainer) -> list[Path]:
        paths = sorted({Path(p) for pattern in self.references for p in glob.glob(str(Path(pattern).expanduser()))})
        own = {Path(c.best_model_path).resolve() for c in trainer.checkpoint_callbacks if c.best_model_path}
        paths = [p for p in paths if p.resolve() not in own]
        if not paths:
            raise FileNotFoundError(
                f"AlignAndInterpolate found no reference checkpoint matching {self.references}: "
                "train the other seeds first (their checkpoints are the references)"
            )
        return paths

    def output_folder(self, trainer: L.Trainer) -> Path:
        return Path(self.output_dir or trainer.log_dir or trainer.default_root_dir)

    def shard_loader(self, trainer: L.Trainer) -> DataLoader:
        """This rank's samples ``rank::world_size`` of the split, in order, without padding."""
        datamodule = trainer.datamodule
        dataset = datamodule.split(self.split)
        shard = Subset(dataset, list(range(trainer.global_rank, len(dataset), trainer.world_size)))
        return DataLoader(shard, batch_size=self.batch_size or datamodule.batch_size, shuffle=False)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.results = self.run(trainer, pl_module)

    def run(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        """Align, sweep and report for every reference; returns the results (on every rank)."""
        started = time.perf_counter()
        scope = self.scope or pl_module.hparams.get("strategy") or "full_model"
        folder = self.output_folder(trainer)
        loader = self.shard_loader(trainer)

        def evaluate_point() -> torch.Tensor:
            with trainer.precision_plugin.forward_context():
                sums = evaluate(pl_module.loss_sums, loader, pl_module.device)
            return trainer.strategy.reduce(sums, reduce_op="sum") if trainer.world_size > 1 else sums

        results: dict[str, Any] = {"scope": scope, "method": self.method, "split": self.split, "references": {}}
        was_training = pl_module.training
        pl_module.eval()
        paths = self.reference_paths(trainer)
        show = trainer.is_global_zero and trainer.progress_bar_callback is not None
        bar = tqdm(total=2 * len(self.alphas) * len(paths), desc="Align and interpolate", disable=not show)
        try:
            for index, path in enumerate(paths):
                reference = load_weights(pl_module.build_model(), path).to(pl_module.device).eval()
                results["references"][str(path)] = measure_connectivity(
                    pl_module.model,
                    reference,
                    evaluate_point,
                    self.alphas,
                    scope,
                    self.method,
                    self.metric,
                    state_path=folder / f"lmc_sweep_state_{index}.json",
                    write=trainer.is_global_zero,
                    synchronize=trainer.strategy.barrier,
                    progress=lambda message: bar.update(1),
                )
        finally:
            bar.close()
            pl_module.train(was_training)
        results["seconds"] = time.perf_counter() - started
        if trainer.is_global_zero:
            self.log_results(trainer, results)
            write_results(folder, results)
        return results

    def log_results(self, trainer: L.Trainer, results: dict[str, Any]) -> None:
        experiment = getattr(trainer.logger, "experiment", None)
        if experiment is None or not hasattr(experiment, "add_scalar"):
            return
        for index, (path, result) in enumerate(results["references"].items()):
            tag = f"lmc/reference_{index}"
            for curve, data in result["curves"].items():
                for point in data["points"]:
                    step = round(1000 * point["alpha"])
                    experiment.add_scalar(f"{tag}/{curve}/loss", point["loss"], step)
                    experiment.add_scalar(f"{tag}/{curve}/accuracy", point["accuracy"], step)
                for name in BARRIERS:
                    experiment.add_scalar(f"{tag}/{curve}/{name}", data[name], 0)
            for name, value in result["barrier_ratio"].items():
                experiment.add_scalar(f"{tag}/barrier_ratio/{name}", value, 0)
            experiment.add_figure(f"{tag}/interpolation", curve_figure(result["curves"], Path(path).name), 0)
        experiment.flush()
