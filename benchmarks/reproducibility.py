"""How far two runs of the study apart are: the strategies table of two ``docs/results.md`` side by side.

Each cell ``mean ± std`` of the first report beside the second's, and the shift of the mean in
units of the larger of the two spreads over pairs (the study's error bar): a shift below 1 is a
difference the spread over pairs already covers.

    python -m benchmarks.reproducibility A.md B.md --names "Intel Xeon" "AMD EPYC"   # Markdown on stdout
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs=2, type=Path)
    parser.add_argument("--names", nargs=2, default=("first", "second"))
    args = parser.parse_args()
    print("\n".join(compare(*(path.read_text() for path in args.reports), tuple(args.names))))


if __name__ == "__main__":
    main()
