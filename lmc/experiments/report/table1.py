"""The report's Table 1 sections (``docs/results.md``): Stage 1's head order and the matcher's
variants, Appendix K's Stage 1 metrics, the held-out comparison and its verdicts, the refinement.

It renders :mod:`lmc.experiments.stats.table1`'s statistics and
:mod:`lmc.experiments.stats.verdicts`' verdicts of each ``(family, summary)``.
"""

from __future__ import annotations

from typing import Any

from lmc.connectivity.interpolation import CLUSTER_SAMPLES
from lmc.experiments.report.cells import cell, curve_alphas_text
from lmc.experiments.report.run_summary import ties
from lmc.experiments.stats.summary import alignments_of
from lmc.experiments.stats.table1 import OrderStats, RefinementSummary
from lmc.experiments.table1 import REFINEMENT, RESAMPLES, TOLD_APART

#: The matcher variants of Table 1, by their ``lmc run`` labels.
VARIANTS = {"permutation": "Variant 1 (Stage 1 only)", "orthogonal": "Variant 2 (orthogonal start)", "full": "full"}

#: What the paper reports (Table 1; Section 6.2; Appendix J).
PAPER_TABLE1 = {"permutation": "62-91 %", "orthogonal": "10-16 %", "full": "7-12 %"}


def table1_section(runs: list[tuple[Any, dict[str, Any]]]) -> list[str]:
    """The report's Table 1 of the ``(family, summary)`` of each finished Table 1 run (``docs/results.md``).

    A variant no run aligned with (a protocol that lists fewer) has no column.
    """
    variants = {
        label: title
        for label, title in VARIANTS.items()
        if not runs or any(label in summary["alignments"] for _, summary in runs)
    }
    lines = [
        "## Table 1: Stage 1's head order and the matcher's variants (first attention layer)",
        "",
        "Rank of the head order Stage 1 picks among all orders of the first layer's heads that keep each "
        "query head with its key/value head (`orders`: 4! = 24 for 4 heads, 8 for 4 query heads on 2 key/value "
        "heads), each followed by the full Stage 2, on "
        + order_alphas_text(runs)
        + "; `L_hat = (L_method - L_top1) / (L_naive - L_top1) * 100` (a pair without a naive barrier is left "
        "out of it as of the ratios, and a cell over fewer pairs says so), and the "
        "aligned barrier as % of the naive one for each variant (loss barrier; accuracy in the "
        f"second table). Against the noise of the evaluation data (bootstrap draws of its samples, in clusters of "
        f"{CLUSTER_SAMPLES} consecutive ones): `within "
        "noise` counts only the orders told apart as lower, `tied` the pairs whose order the best one is not "
        "told apart from.",
        "",
        "| family | pairs | orders | rank (loss) | within noise | tied | L_hat loss | rank (acc) | L_hat acc | "
        + " | ".join(variants.values())
        + " |",
        "|---|---|---|---|---|---|---|---|---|" + "---|" * len(variants),
    ]
    accuracy = ["", "| family | " + " | ".join(f"{v}, accuracy" for v in variants.values()) + " |"]
    accuracy.append("|---|" + "---|" * len(variants))
    for family, summary in runs:
        orders = summary["head_orders"]["alignments"].get("full", {})
        loss, acc = (OrderStats.from_json(orders.get(name, {})) for name in ("loss_barrier", "accuracy_barrier"))
        alignments = alignments_of(summary)
        ratios = {label: alignments[label].barrier_ratio or {} if label in alignments else {} for label in variants}
        pairs = len(summary["pairs"])
        lines.append(
            f"| {family.title} | {pairs} | {summary['head_orders']['orders']} | {cell(loss.rank, of=pairs)} "
            f"| {cell(loss.rank_within_noise, of=pairs)} | {ties(loss)} "
            f"| {cell(loss.l_hat, of=pairs)} | {cell(acc.rank, of=pairs)} "
            f"| {cell(acc.l_hat, of=pairs)} | "
            + " | ".join(cell(ratios[label].get("loss_barrier"), unit=" %", of=pairs) for label in variants)
            + " |"
        )
        accuracy.append(
            f"| {family.title} | "
            + " | ".join(cell(ratios[label].get("accuracy_barrier"), unit=" %", of=pairs) for label in variants)
            + " |"
        )
    lines.append(
        "| paper (ViT/BERT, 4 data sets) | 10 | 24 | low | n/a | n/a | near 0 | low | near 0 | "
        + " | ".join(PAPER_TABLE1[label] for label in variants)
        + " |"
    )
    grids = curve_alphas_text([{v: e for v, e in alignments_of(s).items() if v in variants} for _, s in runs])
    return lines + accuracy + ([] if not grids else ["", grids]) + ["", *refinement_lines(runs)]


def order_alphas_text(runs: list[tuple[Any, dict[str, Any]]]) -> str:
    """How many alphas the runs' head-order curves have (rank and ``L_hat`` compare barriers on them)."""
    counts = sorted({str(summary["head_orders"].get("order_alphas", "?")) for _, summary in runs})
    return (
        f"{'/'.join(counts) or 'all'} alphas of the curves (the rank and `L_hat` compare the method's and the "
        "naive barrier on the same alphas)"
    )


def refinement_lines(runs: list[tuple[Any, dict[str, Any]]]) -> list[str]:
    """Whether Stage 2's gradient refinement lowered the barrier of its orthogonal start, pair by pair
    (the paper finds it always does: Variant 2 10-16 %, full 7-12 %), and where the summary measured it
    (:func:`summarize_refinement`), whether a rise or a fall exceeds the noise of the evaluation data."""
    lines = []
    for family, summary in runs:
        alignments = alignments_of(summary)
        if "orthogonal" not in alignments or "full" not in alignments:
            continue
        start, refined = alignments["orthogonal"].per_pair, alignments["full"].per_pair
        raised = [
            pair for pair in refined if refined[pair].aligned["loss_barrier"] > start[pair].aligned["loss_barrier"]
        ]
        line = (
            f"- {family.title}: the refinement (full) raised the loss barrier of its orthogonal start (Variant 2) "
            f"in {len(raised)} of {len(refined)} pairs" + (f" ({', '.join(raised)})" if raised else "")
        )
        measured = RefinementSummary.from_json(summary.get(REFINEMENT, {})).per_pair
        if measured:
            noise = {pair: entry["loss_barrier"] for pair, entry in measured.items()}
            beyond = [f"{pair} {e.gap:+.3f} ± {e.gap_std:.3f} nats" for pair, e in noise.items() if e.raised]
            draws = f"in at least {TOLD_APART:.1%} of {RESAMPLES} bootstrap draws of the evaluated samples"
            lowered = f"{sum(e.lowered for e in noise.values())} of {len(noise)}"
            if raised or beyond:
                line += (
                    f", of which {len(beyond)} beyond the evaluation noise (higher {draws}"
                    + (f": {', '.join(beyond)}" if beyond else "")
                    + f"), and lowered it beyond the noise in {lowered}"
                )
            else:
                line += f", and lowered it beyond the evaluation noise (lower {draws}) in {lowered}"
            if len(noise) < len(refined):  # a distributed evaluation records no clusters
                line += f" (noise measured in {len(noise)} of {len(refined)} pairs)"
        lines.append(line + ".")
    return lines


def stage1_losses(summary: dict[str, Any]) -> dict[str, OrderStats]:
    """The loss-barrier statistics of each Stage 1 setting of the full method in a Table 1 run's
    summary, by :func:`stage1_settings`."""
    return {
        stage1_settings(label): OrderStats.from_json(orders["loss_barrier"])
        for label, orders in summary["head_orders"]["alignments"].items()
        if label.startswith("full")
    }


def stage1_settings(label: str) -> str:
    """What a full-method alignment label changes from the paper's Stage 1: ``full`` -> ``invariant``,
    ``full-metric=weight-objective=data`` -> ``metric=weight-objective=data``."""
    return "invariant" if label == "full" else label.removeprefix("full-")


def appendix_k_section(runs: list[tuple[Any, dict[str, Any]]]) -> list[str]:
    """The report's Appendix K: each Stage 1 metric's rank, ``L_hat`` and barrier ratio per Table 1 run."""
    lines = [
        "## Appendix K: Stage 1 metrics",
        "",
        "Each Stage 1 setting of the full method (its metric, and with `objective=data` the activations it "
        "weighs on the calibration batches): the rank of its head order, followed by the full Stage 2, among "
        "the first layer's head orders (Table 1's `orders`), the same against the evaluation noise, `L_hat`, "
        "and the method's aligned loss barrier as % of the naive one.",
        "",
        "| family | metric | rank (loss) | within noise | tied | L_hat loss | loss ratio | rank (acc) | L_hat acc |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for family, summary in runs:
        alignments = alignments_of(summary)
        for label, orders in summary["head_orders"]["alignments"].items():
            entry = alignments.get(label)
            if not label.startswith("full") or not entry:  # Appendix K: the full method's Stage 1 settings
                continue
            metric = stage1_settings(label)
            loss, acc = (OrderStats.from_json(orders[name]) for name in ("loss_barrier", "accuracy_barrier"))
            pairs = len(summary["pairs"])
            ratio = cell(entry.barrier_ratio["loss_barrier"], unit=" %", of=pairs)
            lines.append(
                f"| {family.title} | `{metric}` | {cell(loss.rank, of=pairs)} "
                f"| {cell(loss.rank_within_noise, of=pairs)} | {ties(loss)} | {cell(loss.l_hat, of=pairs)} "
                f"| {ratio} | {cell(acc.rank, of=pairs)} | {cell(acc.l_hat, of=pairs)} |"
            )
    metrics = [{label: e for label, e in alignments_of(s).items() if label.startswith("full")} for _, s in runs]
    if grids := curve_alphas_text(metrics):
        lines += ["", f"Loss ratios: {grids[0].lower()}{grids[1:]}"]
    return lines
