"""How far two runs of the study are apart.

Two reports (``docs/results.md``): each cell ``mean ± std`` of the first report's strategies table
beside the second's, and the shift of the mean in units of the larger of the two spreads over pairs
(the study's error bar): a shift below 1 is a difference the spread over pairs already covers.
Two run folders (``--runs``): whether they hold the same ``summary.json`` and ``first_layer_inputs.json``
files, equal every number to the last bit (wall times, the run folder's path and
the calibration record aside).

    python -m benchmarks reproducibility A.md B.md --names "Intel Xeon" "AMD EPYC"   # Markdown on stdout
    python -m benchmarks reproducibility --runs clone1/runs/repro clone2/runs/repro
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import Any

from lmc.io import nan_for_null

#: The strategies table's columns compared, by their header.
COLUMNS = ("naive loss barrier", "loss ratio", "acc ratio")
SECTION = "## The four re-initialization strategies"
_CELL = re.compile(r"^(-?[\d.]+) ± ([\d.]+)")


def strategy_rows(report: str) -> dict[tuple[str, str], dict[str, str]]:
    """``(family, strategy) -> {column header: cell}`` of the report's strategies table."""
    if SECTION not in report:
        raise ValueError(f"the report has no section {SECTION!r}: is it a docs/results.md of lmc repro?")
    lines = [line for line in report.split(SECTION, 1)[1].split("\n## ", 1)[0].splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = dict(zip(header, (cell.strip() for cell in line.strip("|").split("|"))))
        rows[cells["family"], cells["strategy"]] = cells
    return rows


def parse_cell(cell: str) -> tuple[float, float] | None:
    """``"58.8 ± 15.5 %"`` -> ``(58.8, 15.5)``; ``None`` for ``n/a``."""
    match = _CELL.match(cell)
    return (float(match[1]), float(match[2])) if match else None


def shift(first: str, second: str) -> float | None:
    """The two means' distance in units of the larger spread (``inf`` when both spreads are 0)."""
    a, b = parse_cell(first), parse_cell(second)
    if a is None or b is None:
        return None
    spread = max(a[1], b[1])
    distance = abs(a[0] - b[0])
    return distance / spread if spread > 0 else (0.0 if distance == 0 else float("inf"))


def compare(first: str, second: str, names: tuple[str, str]) -> list[str]:
    """The Markdown comparison of two reports' strategies tables (rows both have)."""
    rows_a, rows_b = strategy_rows(first), strategy_rows(second)
    header = ["family", "strategy", "end points"] + [f"{column}: {name}" for column in COLUMNS for name in names]
    header += [f"{column}: shift / spread" for column in COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    within = total = 0
    for key in (key for key in rows_a if key in rows_b):
        a, b = rows_a[key], rows_b[key]
        shifts = [shift(a[column], b[column]) for column in COLUMNS]
        cells = [*key, f"{a['end points']} / {b['end points']}"]
        cells += [row[column] for column in COLUMNS for row in (a, b)]
        cells += ["n/a" if value is None else f"{value:.2f}" for value in shifts]
        lines.append("| " + " | ".join(cells) + " |")
        counted = [value for value in shifts if value is not None]
        within, total = within + sum(value <= 1 for value in counted), total + len(counted)
    lines += ["", f"{within} of {total} cells moved by at most one spread over pairs."]
    return lines


#: What varies between two runs of the same numbers: wall times, where the run was written, and the
#: calibration record (written by newer summaries only).
_NOT_COMPARED = {"alignment_seconds", "calibration", "output_dir"}
_RUN_FILES = ("summary.json", "first_layer_inputs.json")


def differences(first: Any, second: Any, where: str = "") -> list[str]:
    """Where two JSON values differ (floats exactly, NaN equal to NaN), keys in ``_NOT_COMPARED`` aside."""
    if isinstance(first, dict) and isinstance(second, dict):
        keys = (set(first) | set(second)) - _NOT_COMPARED
        found = [f"{where}/{key}: in one only" for key in sorted(keys - (set(first) & set(second)))]
        for key in sorted(keys & set(first) & set(second)):
            found += differences(first[key], second[key], f"{where}/{key}")
        return found
    if isinstance(first, list) and isinstance(second, list) and len(first) == len(second):
        return [found for i, pair in enumerate(zip(first, second)) for found in differences(*pair, f"{where}[{i}]")]
    both_nan = isinstance(first, float) and isinstance(second, float) and math.isnan(first) and math.isnan(second)
    return (
        [] if both_nan or (type(first) is type(second) and first == second) else [f"{where}: {first!r} != {second!r}"]
    )


def compare_runs(first: Path, second: Path) -> list[str]:
    """One line per result file that one folder lacks or the two hold with other numbers, then a count."""
    files = sorted(path.relative_to(first) for name in _RUN_FILES for path in first.rglob(name))
    if not files:
        raise ValueError(f"{first} holds no {' or '.join(_RUN_FILES)}: is it the output_dir of lmc repro?")
    theirs = sorted(path.relative_to(second) for name in _RUN_FILES for path in second.rglob(name))
    lines = [f"{path}: missing in {first}" for path in theirs if not (first / path).is_file()]
    for path in files:
        if not (second / path).is_file():
            lines.append(f"{path}: missing in {second}")
            continue
        found = differences(*(nan_for_null(json.loads((root / path).read_text())) for root in (first, second)))
        if found:
            lines.append(f"{path}: {len(found)} differences, first {found[0]}")
    return [*lines, f"{len(set(files) | set(theirs))} files compared, {len(lines)} differ"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pair", nargs=2, type=Path, help="two reports, or two run folders with --runs")
    parser.add_argument("--names", nargs=2, default=("first", "second"))
    parser.add_argument("--runs", action="store_true", help="compare two lmc repro output folders exactly")
    args = parser.parse_args()
    try:
        if args.runs:
            lines = compare_runs(*args.pair)
        else:
            lines = compare(*(path.read_text() for path in args.pair), tuple(args.names))
    except (OSError, ValueError) as error:  # a missing file or one that is not the study's: one line
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
