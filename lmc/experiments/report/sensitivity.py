"""The sensitivity tables: Table 1 of the first attention layer against the fine-tuning data and length.

Every study's report writes its Table 1 runs as data beside its Markdown (:func:`table1_data`,
``<report>/table1.json``). The sensitivity study (``configs/study/sensitivity.yaml``,
docs/reproduction.md) fine-tunes each family's points from one pre-trained model on fewer samples
or for other lengths; a study that names its data file (``Study.sensitivity``) lays the points out
by family, size and length in its own report (:func:`sensitivity_section`), so ``docs/results.md``
holds those tables without the sensitivity study's run folders.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from lmc.configs import spelled
from lmc.experiments.report.cells import cell
from lmc.experiments.report.run_summary import ties
from lmc.experiments.stats.records import to_json
from lmc.experiments.stats.summary import alignments_of
from lmc.experiments.stats.table1 import OrderStats
from lmc.io import nan_for_null

#: The file of :func:`table1_data` in a report's figures folder.
TABLE1_DATA = "table1.json"
#: What :func:`table1_data` writes at the top level.
_KEYS = ("study", "machine", "work_seconds", "tasks", "families")
#: The Table 1 variants the tables show, by their ``lmc run`` labels.
_VARIANTS = {"orthogonal": "Variant 2", "full": "full"}


def table1_data(
    runs: list[tuple[Any, dict[str, Any]]],
    sources: list[str],
    machine: dict[str, Any] | None,
    task_seconds: dict[str, float],
) -> dict[str, Any]:
    """What :func:`sensitivity_section` reads of a study's Table 1 runs.

    Args:
        runs: ``(family, summary.json)`` of each finished Table 1 run; those without the full method
            are left out.
        sources: The study config files.
        machine: Where the numbers were computed (``lmc.experiments.study.machine``), if recorded.
        task_seconds: Wall time of each of the study's tasks (its ``times.json``).
    """
    families = []
    for family, summary in runs:
        protocol, alignments = summary["protocol"], alignments_of(summary)
        if "full" not in summary["head_orders"]["alignments"]:  # a protocol without the full method
            continue
        full = alignments["full"]
        curve = full.mean_curves["naive"]
        stage1 = OrderStats.from_json(summary["head_orders"]["alignments"]["full"]["loss_barrier"])
        families.append(
            {
                "name": family.name,
                "title": family.title,
                "group": family.pretrained_by or family.name,
                "finetune_samples": protocol.get("finetune_samples"),
                "finetune_epochs": protocol.get("finetune_epochs"),
                "pairs": len(summary["pairs"]),
                "orders": summary["head_orders"]["orders"],
                "end_points": [curve[0]["accuracy"], curve[-1]["accuracy"]],
                "naive_loss_barrier": to_json(full.naive["loss_barrier"]),
                "ratios": {
                    label: to_json(alignments[label].barrier_ratio["loss_barrier"])
                    for label in _VARIANTS
                    if label in alignments
                },
                "stage1": {
                    key: to_json(getattr(stage1, key))
                    for key in ("rank", "rank_within_noise", "l_hat", "ties", "noise_pairs")
                },
            }
        )
    return {
        "study": [spelled(source) for source in sources],
        "machine": machine,
        "work_seconds": sum(task_seconds.values()),
        "tasks": len(task_seconds),
        "families": families,
    }


def sensitivity_section(path: str | Path) -> list[str]:
    """The report's sensitivity tables from a sensitivity study's :func:`table1_data` file.

    Per family (the points that share one pre-trained model), one table against the fine-tuning
    samples at the default length and one against the length at the full size, with the full
    method's barrier ratio, Stage 1's rank among the head orders (also within the evaluation
    noise) and ``L_hat``, and a line that states how far each moves across the points. A missing
    file gives one line saying so (a fresh working folder has not run that study).

    Raises:
        ValueError: ``path`` holds no such data (not JSON, or without its keys).
    """
    lines = ["## Sensitivity: fine-tuning data and length (first attention layer)", ""]
    path = Path(path)
    if not path.is_file():
        return lines + [
            f"Not measured here: `{spelled(path)}` does not exist. The sensitivity study writes it "
            "(`lmc repro --study configs/study/sensitivity.yaml`, docs/reproduction.md)."
        ]
    try:
        data = nan_for_null(json.loads(path.read_text()))
        whole = isinstance(data, dict) and all(key in data for key in _KEYS)
        problem = "" if whole else f"it lacks some of {', '.join(_KEYS)}"
    except ValueError as error:
        problem = f"not JSON: {error}"
    if problem:
        raise ValueError(
            f"study.sensitivity {spelled(path)} is not the {TABLE1_DATA} a study's report writes ({problem}): "
            "name the sensitivity study's docs/sensitivity/table1.json, or run that study again to write it"
        )
    machine = data["machine"]  # a dict, or NaN where the study recorded none (nan_for_null)
    where = f" on {machine['processor']}, {machine['threads']} thread per task" if isinstance(machine, dict) else ""
    lines += [
        f"From `{spelled(path)}`, written by the sensitivity study ({', '.join(f'`{s}`' for s in data['study'])}; "
        f"{data['tasks']} tasks, {data['work_seconds']:.0f} s of work{where}). Each point fine-tunes the family's "
        "pre-trained model on a subset of the fine-tuning half or for another number of epochs, re-initializing "
        "the first attention layer, and runs Table 1's variants and every head order on its pairs. `rank` is "
        "the rank of Stage 1's head order (the full method's, `invariant`) among all orders, `within noise` "
        "the same counting only orders told apart as lower, `L_hat` as in Table 1; Variant 2 and full are the "
        "aligned loss barrier as % of the naive one.",
    ]
    groups: dict[str, list[dict[str, Any]]] = {}
    for point in data["families"]:
        groups.setdefault(point["group"], []).append(point)
    for name, points in groups.items():
        default = next((p for p in points if p["name"] == name), points[0])
        samples, epochs = default["finetune_samples"], default["finetune_epochs"]
        by_size = sorted((p for p in points if p["finetune_epochs"] == epochs), key=lambda p: p["finetune_samples"])
        by_length = sorted((p for p in points if p["finetune_samples"] == samples), key=lambda p: p["finetune_epochs"])
        lines += ["", f"### {default['title']} (the default point) and its other points", ""]
        lines += _points_table(
            f"fine-tuning samples (at {epochs} epoch{'s' * (epochs != 1)})", "finetune_samples", by_size
        )
        lines += [""] + _points_table(f"epochs (on {samples:,} samples)", "finetune_epochs", by_length)
        lines += [
            "",
            *_movement(by_size, "finetune_samples", "samples"),
            *_movement(by_length, "finetune_epochs", "epochs"),
        ]
    return lines


def _points_table(axis: str, key: str, points: list[dict[str, Any]]) -> list[str]:
    lines = [
        f"| {axis} | pairs | end points | naive loss barrier | "
        + " | ".join(_VARIANTS.values())
        + " | rank (loss) | within noise | tied | L_hat loss |",
        "|---|---|---|---|" + "---|" * len(_VARIANTS) + "---|---|---|---|",
    ]
    for point in points:
        pairs, stage1 = point["pairs"], OrderStats.from_json(point["stage1"])
        ratios = " | ".join(cell(point["ratios"].get(label), unit=" %", of=pairs) for label in _VARIANTS)
        lines.append(
            f"| {point[key]:,} | {pairs} | {point['end_points'][0]:.3f}, {point['end_points'][1]:.3f} "
            f"| {cell(point['naive_loss_barrier'], 3)} | {ratios} | {cell(stage1.rank, of=pairs)} "
            f"| {cell(stage1.rank_within_noise, of=pairs)} | {ties(stage1)} | {cell(stage1.l_hat, of=pairs)} |"
        )
    return lines


def _movement(points: list[dict[str, Any]], key: str, unit: str) -> list[str]:
    """One line: the full method's ratio, Stage 1's rank within noise and ``L_hat`` at the smallest
    and largest point of an axis, and their range over all its points."""
    if len(points) < 2:
        return []
    measures = {
        "ratio": [_mean(p["ratios"].get("full")) for p in points],
        "within": [_mean(p["stage1"]["rank_within_noise"]) for p in points],
        "l_hat": [_mean(p["stage1"]["l_hat"]) for p in points],
    }

    def moved(name: str, unit: str = "") -> str:
        values = measures[name]
        finite = [v for v in values if math.isfinite(v)]
        extent = f"{min(finite):.1f}-{max(finite):.1f}{unit}" if finite else "n/a"
        return f"{_number(values[0], unit)} then {_number(values[-1], unit)} (range {extent})"

    return [
        f"- From {points[0][key]:,} to {points[-1][key]:,} {unit} ({len(points)} points): the full method leaves "
        f"{moved('ratio', ' %')} of the naive loss barrier; Stage 1's rank within noise is {moved('within')}, "
        f"and `L_hat` {moved('l_hat')}."
    ]


def _mean(stats: dict[str, float] | None) -> float:
    return stats["mean"] if stats else math.nan


def _number(value: float, unit: str) -> str:
    return f"{value:.1f}{unit}" if math.isfinite(value) else "n/a"
