"""A run's statistics over pairs of fine-tuned seeds: every barrier's mean and spread, per alignment.

Each pair's result is :func:`lmc.connectivity.measure_connectivity`'s output; the spread over
pairs is the error bar of a study (one pair is no evidence). :mod:`lmc.experiments.report.run_summary`
writes them as ``summary.{json,csv,md}``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmc.connectivity import BARRIERS
from lmc.experiments.protocol import Protocol, alignment_labels
from lmc.experiments.stats.records import Record, to_json
from lmc.experiments.stats.spread import Spread, spread
from lmc.experiments.stats.table1 import summarize_head_orders, summarize_refinement
from lmc.experiments.table1 import REFINEMENT
from lmc.matching import AlignOptions

#: Key of a pair's corruption table (lmc.connectivity.robustness.midpoint_robustness) beside its alignments' results.
ROBUSTNESS = "robustness"
#: The metrics of the corruption tables that are summarized.
ROBUSTNESS_METRICS = ("accuracy", "loss")


@dataclass(frozen=True)
class PairBarriers(Record):
    """One pair's barriers of one alignment: its naive and aligned curves' (by name, :data:`~lmc.connectivity.BARRIERS`)
    and each aligned barrier as % of the naive one (NaN without a naive barrier)."""

    naive: dict[str, float] | None = None
    aligned: dict[str, float] | None = None
    barrier_ratio: dict[str, float] | None = None


@dataclass(frozen=True)
class Calibration(Record):
    """What a data-aware alignment's pairs read: their splits and sample counts, each listed once."""

    split: list[str]
    num_samples: list[int]


@dataclass(frozen=True)
class AlignmentSummary(Record):
    """One alignment's statistics over a run's pairs (``None``: not in the summary read).

    Attributes:
        naive: Spread of each naive barrier, by name.
        aligned: Spread of each aligned barrier, by name.
        barrier_ratio: Spread of the aligned loss and accuracy barriers as % of the naive ones.
        no_barrier: Per barrier, the pairs whose naive barrier is below
            :data:`~lmc.connectivity.NO_BARRIER`, left out of its ratios.
        per_pair: Each pair's barriers.
        mean_curves: The naive and aligned curves' points, mean and standard deviation over pairs
            (``alpha``, ``loss``, ``loss_std``, ``accuracy``, ``accuracy_std``).
        calibration: What a data-aware alignment read.
    """

    naive: dict[str, Spread] | None = None
    aligned: dict[str, Spread] | None = None
    barrier_ratio: dict[str, Spread] | None = None
    no_barrier: dict[str, list[str]] | None = None
    per_pair: dict[str, PairBarriers] | None = None
    mean_curves: dict[str, list[dict[str, float]]] | None = None
    calibration: Calibration | None = None


def summarize_alignment(results: dict[str, dict[str, Any]]) -> AlignmentSummary:
    """:class:`AlignmentSummary` of one alignment's results, by pair name (``<i>_<j>``)."""
    ratios = ("loss_barrier", "accuracy_barrier")
    calibrations = [r["settings"]["calibration"] for r in results.values() if "calibration" in r.get("settings", {})]
    return AlignmentSummary(
        **{
            curve: {name: Spread.of([r["curves"][curve][name] for r in results.values()]) for name in BARRIERS}
            for curve in ("naive", "aligned")
        },
        barrier_ratio={name: Spread.of([r["barrier_ratio"][name] for r in results.values()]) for name in ratios},
        no_barrier={
            name: [pair for pair, r in results.items() if not math.isfinite(r["barrier_ratio"][name])]
            for name in ratios
        },
        per_pair={
            pair: PairBarriers(
                naive={name: r["curves"]["naive"][name] for name in BARRIERS},
                aligned={name: r["curves"]["aligned"][name] for name in BARRIERS},
                barrier_ratio=r["barrier_ratio"],
            )
            for pair, r in results.items()
        },
        mean_curves={
            curve: _mean_curve([r["curves"][curve]["points"] for r in results.values()])
            for curve in ("naive", "aligned")
        },
        calibration=Calibration(  # every pair's split and sample count
            split=sorted({c["split"] for c in calibrations}),
            num_samples=sorted({c["num_samples"] for c in calibrations}),
        )
        if calibrations
        else None,
    )


def alignments_of(summary: dict[str, Any]) -> dict[str, AlignmentSummary]:
    """The alignments of a run's ``summary.json`` (or of :func:`summarize`) as records, by label."""
    return {label: AlignmentSummary.from_json(entry) for label, entry in summary["alignments"].items()}


def summarize(pairs: dict[tuple[int, int], dict[str, Any]], labels: list[str]) -> dict[str, Any]:
    """Mean and spread over pairs of every barrier and barrier ratio, per alignment
    (:func:`summarize_alignment`, as ``summary.json`` holds it), and of each alignment's wall time
    (``alignment_seconds``: apart from the results, it varies between runs)."""
    summary: dict[str, Any] = {"pairs": [f"{i}_{j}" for i, j in pairs], "alignments": {}, "alignment_seconds": {}}
    for label in labels:
        results = {f"{i}_{j}": pair[label] for (i, j), pair in pairs.items()}
        summary["alignments"][label] = to_json(summarize_alignment(results))
        # Apart from the results: wall time of the alignment itself (not the sweep) varies between runs.
        summary["alignment_seconds"][label] = spread([r["alignment"]["seconds"] for r in results.values()])
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


def summarize_run(
    pairs: dict[tuple[int, int], dict[str, Any]], folders: dict[tuple[int, int], Path], protocol: Protocol
) -> dict[str, Any]:
    """Every statistic of a run over its pairs, as ``summary.json`` holds them: :func:`summarize` of its
    alignments and, where its protocol measures them, Table 1's head orders
    (:func:`~lmc.experiments.stats.table1.summarize_head_orders`), the refinement's gap to its
    orthogonal start and the robustness tables.

    Args:
        pairs: Each pair's results (:meth:`~lmc.experiments.run.Experiment.finished_pair`).
        folders: Each pair's folder (``pairs/<i>_<j>``): the head-order and refinement measures read
            its recorded sweeps rather than the pair's results, so that a run whose pairs finished
            before such a measure existed gets it too.
        protocol: The run's protocol.
    """
    labels = alignment_labels(protocol.alignment_options)
    summary = summarize(pairs, labels)
    if protocol.head_orders:
        summary["head_orders"] = summarize_head_orders(pairs, labels, folders)
    if {"orthogonal", "full"} <= set(labels):
        # on the orthogonal start's alphas, which the full method's curve holds
        orthogonal = protocol.alphas_of(AlignOptions(method="orthogonal"))
        summary[REFINEMENT] = summarize_refinement({f"{i}_{j}": f for (i, j), f in folders.items()}, orthogonal)
    if protocol.robustness:
        summary[ROBUSTNESS] = summarize_robustness(pairs)
    return summary
