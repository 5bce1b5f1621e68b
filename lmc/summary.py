"""Summaries of a study over pairs of fine-tuned seeds: every barrier's mean and spread, tables, figures.

Each pair's result is :func:`lmc.connectivity.measure_connectivity`'s output; the spread over
pairs is the error bar of a study (one pair is no evidence).
"""

from __future__ import annotations

import csv
import io
import math
import shutil
import statistics
from pathlib import Path
from typing import Any

from lmc.checkpoints import atomic_write, atomic_write_json, atomic_write_text
from lmc.connectivity import BARRIERS, curve_figure

#: Key of a pair's head-order sweeps (order label -> result) beside its alignments' results.
HEAD_ORDERS = "head_orders"
#: Key of a pair's corruption table (:func:`lmc.robustness.midpoint_robustness`) beside its alignments' results.
ROBUSTNESS = "robustness"
#: The metrics of the corruption tables that are summarized.
ROBUSTNESS_METRICS = ("accuracy", "loss")


def spread(values: list[float]) -> dict[str, float]:
    """Mean, sample standard deviation (0 for one value), min and max."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return {"mean": math.nan, "std": math.nan, "min": math.nan, "max": math.nan, "count": 0}
    return {
        "mean": statistics.fmean(finite),
        "std": statistics.stdev(finite) if len(finite) > 1 else 0.0,
        "min": min(finite),
        "max": max(finite),
        "count": len(finite),
    }


def rank_and_l_hat(order_barriers: dict[str, float], chosen: str, method: float, naive: float) -> tuple[int, float]:
    """The rank of the chosen head order among all orders, and ``L_hat`` of a method (SPEC section 4).

    Args:
        order_barriers: Barrier of each head order, each followed by the full Stage 2.
        chosen: The order the method's Stage 1 picked (a key of ``order_barriers``).
        method: The method's own barrier.
        naive: The naive barrier.

    Returns:
        ``(rank, L_hat)``: 1 for the best order (ties share the better rank), and
        ``(method - L_top1) / (naive - L_top1) * 100`` with ``L_top1`` the best order's barrier
        (NaN when the naive barrier is no worse than the best order's).
    """
    rank = 1 + sum(barrier < order_barriers[chosen] for barrier in order_barriers.values())
    top1 = min(order_barriers.values())
    l_hat = 100.0 * (method - top1) / (naive - top1) if naive > top1 else math.nan
    return rank, l_hat


def summarize_head_orders(pairs: dict[tuple[int, int], dict[str, Any]], labels: list[str]) -> dict[str, Any]:
    """Per alignment: its Stage 1 order's rank among all head orders of the first attention layer,
    ``L_hat`` for the loss and accuracy barriers, mean and spread over pairs (the paper's Table 1)."""
    study: dict[str, Any] = {"orders": len(next(iter(pairs.values()))[HEAD_ORDERS]), "alignments": {}}
    for label in labels:
        per_pair = {}
        for (i, j), pair in pairs.items():
            result, orders = pair[label], pair[HEAD_ORDERS]
            attention = [layer for layer in result["alignment"]["layers"] if layer["kind"] == "attention"]
            if not attention:  # naive: no head order
                continue
            chosen = "".join(map(str, attention[0]["assignment"]))
            alphas = len(result["settings"]["alphas"])
            whole = sum(len(r["settings"]["alphas"]) == alphas for r in orders.values())
            entry = {"order": chosen, "whole_curves": whole}
            for name in ("loss_barrier", "accuracy_barrier"):
                barriers = {order: r["curves"]["aligned"][name] for order, r in orders.items()}
                rank, l_hat = rank_and_l_hat(
                    barriers, chosen, result["curves"]["aligned"][name], result["curves"]["naive"][name]
                )
                entry[name] = {
                    "rank": rank,
                    "l_hat": l_hat,
                    "top1": min(barriers.values()),
                    "best_order": min(barriers, key=barriers.get),
                }
            per_pair[f"{i}_{j}"] = entry
        if per_pair:
            study["alignments"][label] = {
                "per_pair": per_pair,
                **{
                    name: {
                        "rank": spread([float(e[name]["rank"]) for e in per_pair.values()]),
                        "l_hat": spread([e[name]["l_hat"] for e in per_pair.values()]),
                    }
                    for name in ("loss_barrier", "accuracy_barrier")
                },
            }
    return study


def summarize_robustness(pairs: dict[tuple[int, int], dict[str, Any]]) -> dict[str, Any]:
    """Mean and spread over pairs of each model's accuracy and loss, clean and per corruption and severity.

    Returns:
        ``{"models": [name, ...], "midpoint": alpha, "severities": {corruption: [strength at severity 1, 2, 3]},
        "accuracy": {model: {"clean": spread, <corruption>: [spread at severity 1, 2, 3]}},
        "loss": (the same), "per_pair": {"<i>_<j>": {model: {"clean": metrics, <corruption>:
        [metrics, ...]}}}}`` with :func:`spread`'s statistics.
    """
    tables = {f"{i}_{j}": pair[ROBUSTNESS] for (i, j), pair in pairs.items()}
    first = next(iter(tables.values()))
    models, severities = list(first["models"]), first["settings"]["severities"]
    study: dict[str, Any] = {"models": models, "severities": severities, "midpoint": first["settings"]["midpoint"]}
    for metric in ROBUSTNESS_METRICS:
        study[metric] = {
            model: {
                "clean": spread([t["models"][model]["clean"][metric] for t in tables.values()]),
                **{
                    corruption: [
                        spread([t["models"][model][corruption][level][metric] for t in tables.values()])
                        for level in range(len(strengths))
                    ]
                    for corruption, strengths in severities.items()
                },
            }
            for model in models
        }
    study["per_pair"] = {pair: table["models"] for pair, table in tables.items()}
    return study


def summarize(pairs: dict[tuple[int, int], dict[str, Any]], labels: list[str]) -> dict[str, Any]:
    """Mean and spread over pairs of every barrier and barrier ratio, per alignment, and of each
    alignment's wall time (``alignment_seconds``: apart from the results, it varies between runs).
    A data-aware alignment's entry also names the ``calibration`` its pairs read (splits and sample
    counts, each listed once)."""
    summary: dict[str, Any] = {"pairs": [f"{i}_{j}" for i, j in pairs], "alignments": {}, "alignment_seconds": {}}
    for label in labels:
        results = [pair[label] for pair in pairs.values()]
        entry = {
            curve: {name: spread([r["curves"][curve][name] for r in results]) for name in BARRIERS}
            for curve in ("naive", "aligned")
        }
        entry["barrier_ratio"] = {
            name: spread([r["barrier_ratio"][name] for r in results]) for name in ("loss_barrier", "accuracy_barrier")
        }
        entry["per_pair"] = {
            f"{i}_{j}": {
                "naive": {name: pair[label]["curves"]["naive"][name] for name in BARRIERS},
                "aligned": {name: pair[label]["curves"]["aligned"][name] for name in BARRIERS},
                "barrier_ratio": pair[label]["barrier_ratio"],
            }
            for (i, j), pair in pairs.items()
        }
        entry["mean_curves"] = {
            curve: _mean_curve([r["curves"][curve]["points"] for r in results]) for curve in ("naive", "aligned")
        }
        calibrations = [r["settings"]["calibration"] for r in results if "calibration" in r.get("settings", {})]
        if calibrations:  # what a data-aware alignment read: every pair's split and sample count
            entry["calibration"] = {
                "split": sorted({c["split"] for c in calibrations}),
                "num_samples": sorted({c["num_samples"] for c in calibrations}),
            }
        summary["alignments"][label] = entry
        # Apart from the results: wall time of the alignment itself (not the sweep) varies between runs.
        summary["alignment_seconds"][label] = spread([r["alignment"]["seconds"] for r in results])
    return summary


def _mean_curve(curves: list[list[dict[str, float]]]) -> list[dict[str, float]]:
    points = []
    for index, point in enumerate(curves[0]):
        row = {"alpha": point["alpha"]}
        for name in ("loss", "accuracy"):
            stats = spread([curve[index][name] for curve in curves])
            row[name], row[f"{name}_std"] = stats["mean"], stats["std"]
        points.append(row)
    return points


def _cell(stats: dict[str, float], digits: int = 3) -> str:
    return f"{stats['mean']:.{digits}f} ± {stats['std']:.{digits}f}"


def summary_table(summary: dict[str, Any]) -> str:
    """The summary as a Markdown table: mean ± standard deviation over pairs."""
    lines = [
        f"Pairs of fine-tuned seeds: {len(summary['pairs'])}. Cells: mean ± standard deviation over pairs.",
        "",
        "| alignment | naive loss barrier | aligned loss barrier | loss ratio % | naive acc barrier "
        "| aligned acc barrier | acc ratio % |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, entry in summary["alignments"].items():
        naive, aligned, ratio = entry["naive"], entry["aligned"], entry["barrier_ratio"]
        lines.append(
            f"| {label} | {_cell(naive['loss_barrier'])} | {_cell(aligned['loss_barrier'])} "
            f"| {_cell(ratio['loss_barrier'], 1)} | {_cell(naive['accuracy_barrier'])} "
            f"| {_cell(aligned['accuracy_barrier'])} | {_cell(ratio['accuracy_barrier'], 1)} |"
        )
    study = summary.get(HEAD_ORDERS)
    if study:
        lines += [
            "",
            f"Head orders of the first attention layer: all {study['orders']}, each followed by the full Stage 2. "
            "Rank 1 is the order with the lowest barrier; L_hat = (L_method - L_top1) / (L_naive - L_top1) * 100. "
            "Orders that cannot change a rank or L_top1 are swept at three alphas only (see lmc.experiment).",
            "",
            "| alignment | rank (loss) | L_hat loss % | rank (accuracy) | L_hat accuracy % |",
            "|---|---|---|---|---|",
        ]
        for label, entry in study["alignments"].items():
            loss, accuracy = entry["loss_barrier"], entry["accuracy_barrier"]
            lines.append(
                f"| {label} | {_cell(loss['rank'], 1)} | {_cell(loss['l_hat'], 1)} "
                f"| {_cell(accuracy['rank'], 1)} | {_cell(accuracy['l_hat'], 1)} |"
            )
    if summary.get(ROBUSTNESS):
        lines += ["", *robustness_table(summary[ROBUSTNESS])]
    return "\n".join(lines) + "\n"


def robustness_table(study: dict[str, Any]) -> list[str]:
    """The lines of the robustness section of ``summary.md``: accuracy, mean ± std over pairs."""
    severities = study["severities"]
    columns = [(corruption, level) for corruption, strengths in severities.items() for level in range(len(strengths))]
    strengths = "; ".join(f"{name} {', '.join(f'{s:g}' for s in values)}" for name, values in severities.items())
    lines = [
        f"Accuracy under input corruptions at severities 1, 2, 3 ({strengths}). Midpoints are alpha "
        f"{study['midpoint']:g} between the target (alpha 0) and the source (alpha 1), naive or aligned.",
        "",
        "| model | clean | " + " | ".join(f"{c} {level + 1}" for c, level in columns) + " |",
        "|---|---|" + "---|" * len(columns),
    ]
    for model, row in study["accuracy"].items():
        cells = [_cell(row["clean"]), *(_cell(row[c][level]) for c, level in columns)]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return lines


def write_summary(root: Path, summary: dict[str, Any]) -> None:
    """``summary.json``, ``summary.csv`` (one row per pair and alignment), ``summary.md`` and figures."""
    import matplotlib.pyplot as plt

    atomic_write_json(root / "summary.json", summary)
    rows = io.StringIO()
    writer = csv.writer(rows)
    writer.writerow(["alignment", "pair", "curve", *BARRIERS])
    for label, entry in summary["alignments"].items():
        for pair, values in entry["per_pair"].items():
            for curve in ("naive", "aligned"):
                writer.writerow([label, pair, curve, *(f"{values[curve][name]:.8f}" for name in BARRIERS)])
    atomic_write_text(root / "summary.csv", rows.getvalue())
    atomic_write_text(root / "summary.md", summary_table(summary))
    for label, entry in summary["alignments"].items():
        figure = band_figure(entry["mean_curves"], f"{label}: mean ± std over {len(summary['pairs'])} pairs")
        atomic_write(root / f"summary_{label}.png", lambda p: figure.savefig(p, format="png", dpi=100))
        plt.close(figure)


def band_figure(mean_curves: dict[str, list[dict[str, float]]], title: str):
    """Mean interpolation curves with a ±1 standard deviation band (a matplotlib figure)."""
    figure = curve_figure({curve: {"points": points} for curve, points in mean_curves.items()}, title)
    for axis, name in zip(figure.axes, ("loss", "accuracy")):
        for curve, points in mean_curves.items():
            alphas = [p["alpha"] for p in points]
            low = [p[name] - p[f"{name}_std"] for p in points]
            high = [p[name] + p[f"{name}_std"] for p in points]
            axis.fill_between(alphas, low, high, alpha=0.2)
    return figure


def log_curves(folder: Path, pairs: dict[tuple[int, int], dict[str, Any]], summary: dict[str, Any]) -> None:
    """TensorBoard scalars (step ``= 1000 * alpha``): every pair's curves, the mean curves with their
    standard deviation, and the mean barrier ratios."""
    from torch.utils.tensorboard import SummaryWriter

    shutil.rmtree(folder, ignore_errors=True)  # lmc's own folder: a rerun must not stack copies
    writer = SummaryWriter(str(folder))
    try:
        for label, entry in summary["alignments"].items():
            series = {f"pair_{i}_{j}": pair[label]["curves"] for (i, j), pair in pairs.items()}
            series["mean"] = {curve: {"points": points} for curve, points in entry["mean_curves"].items()}
            for name, curves in series.items():
                for curve, data in curves.items():
                    for point in data["points"]:
                        for metric in ("loss", "accuracy", "loss_std", "accuracy_std"):
                            if metric in point:
                                step = round(1000 * point["alpha"])
                                writer.add_scalar(f"{label}/{name}/{curve}/{metric}", point[metric], step)
            for name, stats in entry["barrier_ratio"].items():
                writer.add_scalar(f"{label}/barrier_ratio/{name}_mean", stats["mean"], 0)
                writer.add_scalar(f"{label}/barrier_ratio/{name}_std", stats["std"], 0)
    finally:
        writer.close()
