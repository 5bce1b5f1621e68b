"""A run's statistics over pairs of fine-tuned seeds: every barrier's mean and spread, per alignment.

Each pair's result is :func:`lmc.connectivity.measure_connectivity`'s output; the spread over
pairs is the error bar of a study (one pair is no evidence). :mod:`lmc.experiments.report.run_summary`
writes them as ``summary.{json,csv,md}``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from lmc.connectivity import BARRIERS
from lmc.experiments.protocol import Protocol, alignment_labels
from lmc.experiments.stats.spread import spread
from lmc.experiments.stats.table1 import summarize_head_orders, summarize_refinement
from lmc.experiments.table1 import REFINEMENT
from lmc.matching import AlignOptions

#: Key of a pair's corruption table (lmc.connectivity.robustness.midpoint_robustness) beside its alignments' results.
ROBUSTNESS = "robustness"
#: The metrics of the corruption tables that are summarized.
ROBUSTNESS_METRICS = ("accuracy", "loss")


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
