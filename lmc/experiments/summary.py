"""Summaries of a study over pairs of fine-tuned seeds: every barrier's mean and spread, tables, figures.

Each pair's result is :func:`lmc.connectivity.measure_connectivity`'s output; the spread over
pairs is the error bar of a study (one pair is no evidence).
"""

from __future__ import annotations

import csv
import io
import math
import shutil
from pathlib import Path
from typing import Any

from lmc.connectivity import BARRIERS, NO_BARRIER, curve_figure
from lmc.experiments.spread import cell, curve_alphas_text, spread
from lmc.experiments.table1 import HEAD_ORDERS, head_order_table
from lmc.io import atomic_write, atomic_write_json, atomic_write_text

#: Key of a pair's corruption table (lmc.connectivity.robustness.midpoint_robustness) beside its alignments' results.
ROBUSTNESS = "robustness"
#: The metrics of the corruption tables that are summarized.
ROBUSTNESS_METRICS = ("accuracy", "loss")


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
        # The pairs whose naive barrier is below lmc.connectivity.NO_BARRIER, excluded from the ratios by name.
        entry["no_barrier"] = {
            name: [
                f"{i}_{j}" for (i, j), pair in pairs.items() if not math.isfinite(pair[label]["barrier_ratio"][name])
            ]
            for name in ("loss_barrier", "accuracy_barrier")
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


def summary_table(summary: dict[str, Any]) -> str:
    """The summary as a Markdown table: mean ± standard deviation over pairs."""
    lines = [
        f"Pairs of fine-tuned seeds: {len(summary['pairs'])}. Cells: mean ± standard deviation over pairs; "
        "a ratio counts only the pairs with a naive barrier (lmc.connectivity.NO_BARRIER) and says so when "
        "that is fewer, `(k of n)`.",
        "",
        "| alignment | naive loss barrier | aligned loss barrier | loss ratio % | naive acc barrier "
        "| aligned acc barrier | acc ratio % |",
        "|---|---|---|---|---|---|---|",
    ]
    pairs = len(summary["pairs"])
    for label, entry in summary["alignments"].items():
        naive, aligned, ratio = entry["naive"], entry["aligned"], entry["barrier_ratio"]
        lines.append(
            f"| {label} | {cell(naive['loss_barrier'], 3)} | {cell(aligned['loss_barrier'], 3)} "
            f"| {cell(ratio['loss_barrier'], 1, of=pairs)} | {cell(naive['accuracy_barrier'], 3)} "
            f"| {cell(aligned['accuracy_barrier'], 3)} | {cell(ratio['accuracy_barrier'], 1, of=pairs)} |"
        )
    if grids := curve_alphas_text([summary["alignments"]]):
        lines += ["", grids]
    lines += no_barrier_lines(summary["alignments"].get("full") or next(iter(summary["alignments"].values())))
    if summary.get(HEAD_ORDERS):
        lines += ["", *head_order_table(summary[HEAD_ORDERS])]
    if summary.get(ROBUSTNESS):
        lines += ["", *robustness_table(summary[ROBUSTNESS])]
    return "\n".join(lines) + "\n"


def no_barrier_lines(entry: dict[str, Any], prefix: str = "") -> list[str]:
    """One line per barrier naming the pairs an alignment's ratios exclude for lack of a naive barrier."""
    return [
        f"- {prefix}no naive {name.replace('_', ' ')} (below {NO_BARRIER[name]:g}), excluded from its ratios: "
        + ", ".join(pairs)
        for name, pairs in entry.get("no_barrier", {}).items()
        if pairs
    ]


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
        cells = [cell(row["clean"], 3), *(cell(row[c][level], 3) for c, level in columns)]
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
