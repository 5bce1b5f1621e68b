"""A run's summary as files: ``summary.json``, ``summary.csv``, ``summary.md``, figures and TensorBoard curves.

The statistics are :mod:`lmc.experiments.stats.summary`'s and :mod:`lmc.experiments.stats.table1`'s.
"""

from __future__ import annotations

import csv
import io
import shutil
from pathlib import Path
from typing import Any

from lmc.connectivity import BARRIERS, NO_BARRIER, curve_figure
from lmc.connectivity.interpolation import CLUSTER_SAMPLES
from lmc.experiments.report.cells import cell, curve_alphas_text
from lmc.experiments.stats.summary import ROBUSTNESS, AlignmentSummary, alignments_of
from lmc.experiments.stats.table1 import OrderStats
from lmc.experiments.table1 import HALVES, HEAD_ORDERS, RESAMPLES
from lmc.io import atomic_write, atomic_write_json, atomic_write_text


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
    pairs, alignments = len(summary["pairs"]), alignments_of(summary)
    for label, entry in alignments.items():
        naive, aligned, ratio = entry.naive, entry.aligned, entry.barrier_ratio
        lines.append(
            f"| {label} | {cell(naive['loss_barrier'], 3)} | {cell(aligned['loss_barrier'], 3)} "
            f"| {cell(ratio['loss_barrier'], 1, of=pairs)} | {cell(naive['accuracy_barrier'], 3)} "
            f"| {cell(aligned['accuracy_barrier'], 3)} | {cell(ratio['accuracy_barrier'], 1, of=pairs)} |"
        )
    if grids := curve_alphas_text([alignments]):
        lines += ["", grids]
    lines += no_barrier_lines(alignments.get("full") or next(iter(alignments.values())))
    if summary.get(HEAD_ORDERS):
        lines += ["", *head_order_table(summary[HEAD_ORDERS])]
    if summary.get(ROBUSTNESS):
        lines += ["", *robustness_table(summary[ROBUSTNESS])]
    return "\n".join(lines) + "\n"


def no_barrier_lines(entry: AlignmentSummary, prefix: str = "") -> list[str]:
    """One line per barrier naming the pairs an alignment's ratios exclude for lack of a naive barrier."""
    return [
        f"- {prefix}no naive {name.replace('_', ' ')} (below {NO_BARRIER[name]:g}), excluded from its ratios: "
        + ", ".join(pairs)
        for name, pairs in (entry.no_barrier or {}).items()
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


def head_order_table(study: dict[str, Any]) -> list[str]:
    """The lines of the head-order section of ``summary.md`` (:func:`summarize_head_orders`'s ``study``)."""
    lines = [
        f"Head orders of the first attention layer: all {study['orders']}, each followed by the full Stage 2, "
        f"each order's curve on {study.get('order_alphas', 'all the')} alphas, and the ranks and L_hat compare "
        "the methods' and the naive barriers on those alphas. "
        "Rank 1 is the order with the lowest barrier; L_hat = (L_method - L_top1) / (L_naive - L_top1) * 100. "
        "Orders that cannot change a rank or L_top1 are swept at three alphas only (see lmc.experiments.table1). "
        f"Against the noise of the evaluation data ({RESAMPLES} bootstrap draws of the evaluated samples, in "
        f"clusters of {CLUSTER_SAMPLES} consecutive ones): "
        "`rank within noise` counts only the orders told apart as lower, and `tied with best` the pairs "
        "whose order the best one is not told apart from. On halves of the evaluated samples "
        f"({HALVES} random cuts): the L_hat of the alignment's order on one half, and of the order with the "
        "lowest barrier on the other half (the held-out pick, what the evaluation data itself would choose).",
        "",
        "| alignment | rank (loss) | rank within noise (loss) | tied with best (loss) | L_hat loss % "
        "| L_hat loss % on a half | held-out pick's | rank (accuracy) | L_hat accuracy % |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, entry in study["alignments"].items():
        loss, accuracy = (OrderStats.from_json(entry[name]) for name in ("loss_barrier", "accuracy_barrier"))
        halves, pairs = loss.halves.l_hat if loss.halves else None, len(entry["per_pair"])
        lines.append(
            f"| {label} | {cell(loss.rank, 1)} | {cell(loss.rank_within_noise, 1, of=pairs)} "
            f"| {ties(loss)} | {cell(loss.l_hat, 1, of=pairs)} | {cell(halves and halves.stage1, 1, of=pairs)} "
            f"| {cell(halves and halves.held_out, 1, of=pairs)} "
            f"| {cell(accuracy.rank, 1)} | {cell(accuracy.l_hat, 1, of=pairs)} |"
        )
    return lines


def ties(stats: OrderStats) -> str:
    """``k of n`` pairs whose order is tied with the best one, ``n/a`` where no noise was measured."""
    return f"{stats.ties} of {stats.noise_pairs}" if stats.noise_pairs else "n/a"


def write_summary(root: Path, summary: dict[str, Any]) -> None:
    """``summary.json``, ``summary.csv`` (one row per pair and alignment), ``summary.md`` and figures."""
    import matplotlib.pyplot as plt

    atomic_write_json(root / "summary.json", summary)
    rows = io.StringIO()
    writer = csv.writer(rows)
    writer.writerow(["alignment", "pair", "curve", *BARRIERS])
    alignments = alignments_of(summary)
    for label, entry in alignments.items():
        for pair, values in entry.per_pair.items():
            for curve, barriers in (("naive", values.naive), ("aligned", values.aligned)):
                writer.writerow([label, pair, curve, *(f"{barriers[name]:.8f}" for name in BARRIERS)])
    atomic_write_text(root / "summary.csv", rows.getvalue())
    atomic_write_text(root / "summary.md", summary_table(summary))
    for label, entry in alignments.items():
        figure = band_figure(entry.mean_curves, f"{label}: mean ± std over {len(summary['pairs'])} pairs")
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
        for label, entry in alignments_of(summary).items():
            series = {f"pair_{i}_{j}": pair[label]["curves"] for (i, j), pair in pairs.items()}
            series["mean"] = {curve: {"points": points} for curve, points in entry.mean_curves.items()}
            for name, curves in series.items():
                for curve, data in curves.items():
                    for point in data["points"]:
                        for metric in ("loss", "accuracy", "loss_std", "accuracy_std"):
                            if metric in point:
                                step = round(1000 * point["alpha"])
                                writer.add_scalar(f"{label}/{name}/{curve}/{metric}", point[metric], step)
            for name, stats in entry.barrier_ratio.items():
                writer.add_scalar(f"{label}/barrier_ratio/{name}_mean", stats.mean, 0)
                writer.add_scalar(f"{label}/barrier_ratio/{name}_std", stats.std, 0)
    finally:
        writer.close()
