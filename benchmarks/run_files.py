"""What the benchmarks read from the folders an ``lmc run`` leaves, and the barrier they measure on its models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from lmc.cli.inputs import data_module
from lmc.connectivity.interpolation import barriers, evaluate, evenly_spaced, point_metrics
from lmc.training.module import load_trained


def pair_result(folder: Path) -> dict[str, Any]:
    """The result of the one reference in a sweep folder's ``lmc_results.json`` (a pair's alignment or head order)."""
    (reference,) = json.loads((folder / "lmc_results.json").read_text())["references"].values()
    return reference


def datamodule(config: Path):
    """The fine-tuning half (``part="B"``) of the DataModule a ``configs/data/*.yaml`` file describes."""
    data = data_module(config, ["--data.init_args.part=B"])
    data.setup("fit")
    return data


def fine_tuned(run: Path) -> list:
    """The fine-tuned seeds of an ``lmc run`` folder (``seed<k>/final.ckpt``, in seed order), in eval mode."""
    seeds = sorted(run.glob("seed*/final.ckpt"), key=lambda p: int(p.parent.name[4:]))
    if len(seeds) < 2:
        raise SystemExit(f"{run} holds fewer than two fine-tuned seeds (seed<k>/final.ckpt)")
    return [load_trained(path)[0].eval() for path in seeds]


@torch.no_grad()
def loss_barrier(module, source: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> float:
    """The loss barrier from ``source`` (alpha 0) to ``module``'s model (alpha 1) at 25 alphas."""
    target = [p.detach().clone() for p in module.model.parameters()]
    start = [p.detach().clone() for p in source.parameters()]
    points = []
    try:
        for alpha in evenly_spaced(25):
            for parameter, a, b in zip(module.model.parameters(), start, target):
                parameter.copy_((1 - alpha) * a + alpha * b)
            sums = evaluate(module.metric_sums, batches, torch.device("cpu"))
            points.append({"alpha": alpha, **point_metrics({k: float(v) for k, v in sums.items()})})
    finally:
        for parameter, b in zip(module.model.parameters(), target):
            parameter.copy_(b)
    return barriers(points)["loss_barrier"]
