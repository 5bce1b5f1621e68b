"""How well does each Stage 1 setting find the head order, against every order and the data's noise?

For each pair of fine-tuned seeds of a first-attention ``lmc run`` folder, every order of the
first layer's ``h`` heads is followed by the full Stage 2 and its interpolation curve is measured
on the test split, sample by sample. Each Stage 1 setting's pick is then ranked among all orders:

- ``rank``: its place by test loss barrier (1 = the lowest);
- ``within noise``: 1 + the orders whose barrier is lower in at least 97.5 % of paired bootstrap
  redraws of the test samples (an order that cannot be told apart from the best is a tie);
- ``L_hat``: ``100 (B(pick) - B(best)) / (B(naive) - B(best))``.

Two measurements bound what any setting can reach on the same data:

- the split-half floor: the order with the lowest barrier on one random half of the test samples,
  ranked on the other half (a method that could see held-out data, with half of it);
- additivity: the share of the variance of the barrier over all orders that a sum of per-pair
  terms explains (least squares, ``(h - 1)^2 + 1`` free terms), which is what a Stage 1 that solves
  one linear assignment can at best capture.

    python -m benchmarks stage1_orders --run runs/mnist_ape --data configs/data/mnist_5k.yaml --name "MNIST, APE"

writes (merging by name) ``benchmarks/stage1/results/stage1_orders.{json,md}``. One thread.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from benchmarks.run_files import datamodule, fine_tuned
from lmc.adapters import model_spec
from lmc.connectivity import training_calibration
from lmc.io import atomic_write_json, atomic_write_text
from lmc.matching import AlignOptions, Calibration, align

RESULTS = Path(__file__).parent / "results" / "stage1_orders"
#: name -> (AlignOptions fields, calibration): ``default`` is lmc's (the first ``calibration_batches``
#: training batches), ``train`` the whole training split, ``val`` the validation split (held out
#: from fine-tuning, unlike the training batches the fine-tunes may have memorized).
SETTINGS = {
    "invariant": ({}, "default"),
    "weight": ({"metric": "weight"}, "default"),
    "correlation": ({"metric": "correlation"}, "default"),
    "weight, objective=data": ({"metric": "weight", "objective": "data"}, "default"),
    "activation": ({"metric": "activation"}, "default"),
    "midpoint": ({"metric": "midpoint"}, "default"),
    "midpoint, whole training split": ({"metric": "midpoint"}, "train"),
    "midpoint, validation split": ({"metric": "midpoint"}, "val"),
}
RESAMPLES, TOLD_APART, SPLITS = 1000, 0.975, 200


@torch.no_grad()
def per_sample_curve(module, target, source, alphas, batches) -> torch.Tensor:
    """Test losses ``(alphas, samples)`` of the models between ``target`` (alpha 0) and ``source``."""
    ours, theirs = target.state_dict(), source.state_dict()
    model = copy.deepcopy(target).eval()
    rows = []
    for alpha in alphas:
        model.load_state_dict(
            {k: torch.lerp(v.double(), theirs[k].double(), alpha).to(v.dtype) for k, v in ours.items()}
        )
        losses = []
        for batch in batches:
            logits = module.adapter.forward(model, module.adapter.model_inputs(model, batch))
            losses.append(F.cross_entropy(logits.double(), batch["labels"], reduction="none"))
        rows.append(torch.cat(losses))
    return torch.stack(rows)


def barriers(curves: torch.Tensor) -> torch.Tensor:
    """Loss barriers of mean curves ``(..., alphas)``."""
    alphas = torch.linspace(0, 1, curves.shape[-1], dtype=torch.float64)
    line = (1 - alphas) * curves[..., :1] + alphas * curves[..., -1:]
    return (curves - line).max(-1).values


def additivity(labels: list[str], values: np.ndarray, heads: int) -> float:
    """R^2 of the best sum of per-pair terms ``sum_i c[i, order[i]]`` over every order's barrier."""
    design = np.array([[float(int(label[i]) == j) for i in range(heads) for j in range(heads)] for label in labels])
    fitted = design @ np.linalg.lstsq(design, values, rcond=None)[0]
    return float(1 - ((values - fitted) ** 2).sum() / ((values - values.mean()) ** 2).sum())


def calibrations(data, forward) -> dict[str, Calibration]:
    """The calibrations :data:`SETTINGS` names, each with its own batch count."""
    default = training_calibration(data, forward, AlignOptions().calibration_batches)
    train = training_calibration(data, forward, len(data.split("train")) // data.batch_size)
    batches = list(DataLoader(data.split("val"), batch_size=data.batch_size))
    val = Calibration(batches, forward, "val", sum(len(b["inputs"]) for b in batches), default.data)
    return {"default": default, "train": train, "val": val}


def measure_pair(module, source, target, calibration, alphas, test, generator) -> dict:
    heads = model_spec(target).attention[0].num_heads
    labels = ["".join(map(str, order)) for order in itertools.permutations(range(heads))]
    picks, seconds = {}, {}
    for name, (settings, data) in SETTINGS.items():
        start = time.perf_counter()
        options = AlignOptions(**settings, calibration_batches=len(calibration[data].batches))
        _, report = align(source, target, "first_attention", options, calibration[data])
        picks[name] = "".join(map(str, report.layers[0].assignment))
        seconds[name] = time.perf_counter() - start
    naive = per_sample_curve(module, target, source, alphas, test)
    curves = []
    for label in labels:
        aligned, _ = align(source, target, "first_attention", AlignOptions(head_orders={0: [int(h) for h in label]}))
        curves.append(per_sample_curve(module, target, aligned, alphas, test))
    losses = torch.stack(curves)  # (orders, alphas, samples)
    samples = losses.shape[-1]
    barrier = barriers(losses.mean(-1))
    naive_barrier = float(barriers(naive.mean(-1)))
    best = int(barrier.argmin())
    draws = torch.randint(0, samples, (RESAMPLES, samples), generator=generator)
    redrawn = barriers(losses[:, :, draws].mean(-1).permute(2, 0, 1))  # (resamples, orders)

    def scored(index: int, on: torch.Tensor, best_value: float, naive_value: float) -> tuple[int, float]:
        return 1 + int((on < on[index]).sum()), 100 * (float(on[index]) - best_value) / (naive_value - best_value)

    result = {"naive_barrier": naive_barrier, "best_barrier": float(barrier[best]), "settings": {}}
    for name, label in picks.items():
        index = labels.index(label)
        rank, l_hat = scored(index, barrier, float(barrier[best]), naive_barrier)
        lower = (redrawn < redrawn[:, index : index + 1]).double().mean(0)
        result["settings"][name] = {
            "order": label,
            "rank": rank,
            "within_noise": 1 + int((lower >= TOLD_APART).sum()),
            "l_hat": l_hat,
            "seconds": seconds[name],
        }
    floor = []
    for _ in range(SPLITS):
        order = torch.randperm(samples, generator=generator)
        first, second = order[: samples // 2], order[samples // 2 :]
        on_first, on_second = barriers(losses[:, :, first].mean(-1)), barriers(losses[:, :, second].mean(-1))
        naive_second = float(barriers(naive[:, second].mean(-1)))
        floor.append(scored(int(on_first.argmin()), on_second, float(on_second.min()), naive_second))
    result["split_half"] = {
        "rank": statistics.fmean(r for r, _ in floor),
        "l_hat": statistics.fmean(v for _, v in floor),
    }
    result["additivity_r2"] = additivity(labels, barrier.numpy(), heads)
    result["test_samples"] = samples
    return result


def mean_std(values: list[float]) -> str:
    return f"{statistics.fmean(values):.2f} ± {statistics.stdev(values):.2f}" if len(values) > 1 else f"{values[0]:.2f}"


def write_report(results: dict) -> None:
    lines = [
        "# Stage 1 against every head order",
        "",
        "Written by `python -m benchmarks stage1_orders` (module docstring: what each column means). Per family:",
        "the mean ± std over pairs; a random order ranks (h! + 1) / 2 = 12.5 of 24 on average.",
        "",
    ]
    for name, family in results.items():
        pairs = family["pairs"]
        lines += [
            f"## {name}",
            "",
            f"Run `{family['run']}`, {len(pairs)} pairs, {family['test_samples']} test samples, "
            f"calibration samples {family['calibration']}, {family['alphas']} alphas. "
            f"Additivity R^2 {mean_std([p['additivity_r2'] for p in pairs.values()])}.",
            "",
            "| Stage 1 | rank | within noise | L_hat (%) | seconds per pair |",
            "|---|---|---|---|---|",
        ]
        for setting in SETTINGS:
            rows = [p["settings"][setting] for p in pairs.values()]
            lines.append(
                f"| {setting} | {mean_std([r['rank'] for r in rows])} | {mean_std([r['within_noise'] for r in rows])} "
                f"| {mean_std([r['l_hat'] for r in rows])} | {statistics.fmean(r['seconds'] for r in rows):.2f} |"
            )
        floor = [p["split_half"] for p in pairs.values()]
        lines += [
            f"| split-half floor (best order of half the test samples, on the other half) "
            f"| {mean_std([f['rank'] for f in floor])} | | {mean_std([f['l_hat'] for f in floor])} | |",
            "",
        ]
    atomic_write_text(RESULTS.with_suffix(".md"), "\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="a finished first_attention lmc run folder")
    parser.add_argument("--data", type=Path, required=True, help="the run's DataModule config (configs/data/...)")
    parser.add_argument("--name", required=True, help="the family's name in the results")
    parser.add_argument("--alphas", type=int, default=13)
    args = parser.parse_args()
    torch.set_num_threads(1)
    modules = fine_tuned(args.run)
    data = datamodule(args.data)
    calibration = calibrations(data, modules[0].model_loss)
    test = list(DataLoader(data.split("test"), batch_size=500))
    alphas = torch.linspace(0, 1, args.alphas, dtype=torch.float64).tolist()
    generator = torch.Generator().manual_seed(0)
    path = RESULTS.with_suffix(".json")
    results = json.loads(path.read_text()) if path.is_file() else {}
    samples = {name: c.num_samples for name, c in calibration.items()}
    family = {"run": str(args.run), "alphas": args.alphas, "calibration": samples, "pairs": {}}
    for i, j in itertools.combinations(range(len(modules)), 2):
        pair = measure_pair(modules[0], modules[i].model, modules[j].model, calibration, alphas, test, generator)
        family["pairs"][f"{i}_{j}"] = pair
        family["test_samples"] = pair["test_samples"]
        picks = {name: s["rank"] for name, s in pair["settings"].items()}
        print(f"{args.name} {i}_{j}: ranks {picks}, split-half floor {pair['split_half']['rank']:.1f}", flush=True)
    results[args.name] = family
    atomic_write_json(path, results)
    write_report(results)


if __name__ == "__main__":
    main()
