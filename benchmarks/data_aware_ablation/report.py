"""The ablation's table from ``lmc run`` summaries (``ablation.yaml``): Markdown on stdout.

Usage: python -m benchmarks data_aware_ablation.report runs/ablation/vit_ape runs/ablation/llama_rope
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from lmc.io import nan_for_null

#: The ablation's alignments, by their ``lmc run`` labels, in the order of ``ablation.yaml``.
LABELS = {
    "full": "weight (`full`)",
    "full-metric=activation": "`metric: activation` alone",
    "full-unit_matching=activation": "`unit_matching: activation` alone",
    "full-objective=data": "`objective: data` alone",
    "full-metric=activation-objective=data-unit_matching=activation": "all three (the study's data-aware)",
}


def table(run: Path) -> list[str]:
    """One run's rows: loss barrier % of naive, mean ± std over pairs, and pairs better than ``full``."""
    summary = nan_for_null(json.loads((run / "summary.json").read_text()))
    pairs, alignments = summary["pairs"], summary["alignments"]
    ratio = {
        label: [alignments[label]["per_pair"][pair]["barrier_ratio"]["loss_barrier"] for pair in pairs]
        for label in LABELS
    }
    lines = [
        f"**{run.name}** ({summary['protocol']['reinit']}, {len(pairs)} pairs)",
        "",
        "| alignment | loss barrier, % of naive | better than `full` | per pair |",
        "|---|---|---|---|",
    ]
    for label, name in LABELS.items():
        values = ratio[label]
        better = sum(value < full for value, full in zip(values, ratio["full"]))
        spread = f"{statistics.fmean(values):.1f} ± {statistics.stdev(values):.1f}"
        per_pair = " ".join(f"{value:.1f}" for value in values)
        lines.append(f"| {name} | {spread} | {better}/{len(pairs)} | {per_pair} |")
    return lines


def main() -> None:
    """Print the table of each run folder named on the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+", help="the ablation's lmc run output folders")
    for run in parser.parse_args().runs:
        print("\n".join(table(run)) + "\n")


if __name__ == "__main__":
    main()
