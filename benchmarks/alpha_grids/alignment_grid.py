"""Alignment curves on fewer alphas: how far does a barrier ratio move when read on every other alpha?

``protocol.alignment_alphas`` sweeps every alignment but the full method on a coarser grid (Table 1's
head-order grid). For every pair of finished runs whose alignments were swept at all 25 alphas, each
alignment's loss-barrier ratio (aligned barrier as % of the naive one) is computed again with both
barriers read on every other alpha (13), and the change is reported per alignment. Pairs without a
naive barrier (``lmc.connectivity.NO_BARRIER``) are left out, as the reports do. Nothing is evaluated:
the runs' stored points are read.

    python -m benchmarks alignment_grid --runs 'runs/sensitivity/*/first_attention'
    # writes benchmarks/alpha_grids/results/alignment_grid.{json,md}
"""

from __future__ import annotations

import argparse
import glob
import statistics
from pathlib import Path
from typing import Any

from benchmarks.run_files import pair_result
from lmc.connectivity import NO_BARRIER
from lmc.connectivity.interpolation import evenly_spaced
from lmc.experiments.table1 import barriers_at
from lmc.io import atomic_write_json, atomic_write_text

RESULTS = Path(__file__).parent / "results" / "alignment_grid"
WHOLE, COARSE = 25, 13


def ratio_changes(run: Path) -> dict[str, list[float]]:
    """Alignment label -> the change of each pair's loss ratio (points of %) from 25 alphas to 13."""
    changes: dict[str, list[float]] = {}
    for result_file in sorted(run.glob("pairs/*/*/lmc_results.json")):
        result = pair_result(result_file.parent)
        if len(result["settings"]["alphas"]) != WHOLE:
            continue
        ratios = []
        for grid in (evenly_spaced(WHOLE), evenly_spaced(COARSE)):
            aligned, naive = (barriers_at(result["curves"][c], grid)["loss_barrier"] for c in ("aligned", "naive"))
            ratios.append(100.0 * aligned / naive if naive >= NO_BARRIER["loss_barrier"] else None)
        if None not in ratios:
            changes.setdefault(result_file.parent.name, []).append(ratios[1] - ratios[0])
    return changes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", required=True, help="a glob of finished run folders (their pairs/)")
    args = parser.parse_args()
    runs = sorted(Path(p) for p in glob.glob(args.runs) if (Path(p) / "pairs").is_dir())
    if not runs:
        raise SystemExit(f"{args.runs} matches no finished run folder (one with pairs/)")
    changes: dict[str, list[float]] = {}
    for run in runs:
        for label, values in ratio_changes(run).items():
            changes.setdefault(label, []).extend(values)
    table: dict[str, Any] = {
        label: {
            "pairs": len(values),
            "mean_change": statistics.fmean(values),
            "mean_abs_change": statistics.fmean(abs(v) for v in values),
            "largest_abs_change": max(abs(v) for v in values),
        }
        for label, values in sorted(changes.items())
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(RESULTS.with_suffix(".json"), {"runs": [str(r) for r in runs], "table": table})
    lines = [
        "# Barrier ratios on 13 alphas instead of 25",
        "",
        f"`python -m benchmarks alignment_grid --runs '{args.runs}'`: {len(runs)} runs, every pair with a naive "
        f"loss barrier; each alignment's loss ratio (aligned barrier as % of the naive one) with both barriers "
        f"read on {COARSE} of the curves' {WHOLE} alphas, minus the ratio on all {WHOLE}, in points of %.",
        "",
        "| alignment | pairs | mean change | mean abs change | largest abs change |",
        "|---|---|---|---|---|",
    ]
    for label, entry in table.items():
        lines.append(
            f"| {label} | {entry['pairs']} | {entry['mean_change']:+.2f} | {entry['mean_abs_change']:.2f} "
            f"| {entry['largest_abs_change']:.2f} |"
        )
    atomic_write_text(RESULTS.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
