"""The benchmark suite's runner: ``python -m benchmarks NAME [ARGS...]`` runs one benchmark.

``python -m benchmarks`` lists the names with the first line of each benchmark's docstring;
``python -m benchmarks NAME --help`` prints what NAME takes. ``benchmarks/README.md`` says what
each one measures, its command, its result file and its last figure. Run it from the repository
root (the folder holding ``lmc/`` and ``benchmarks/``), so that it measures this checkout's lmc.
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

#: Each benchmark's name and the module whose ``main()`` runs it (its topic folder holds its results).
BENCHMARKS: dict[str, str] = {
    "align_scaling": "benchmarks.speed.align_scaling",
    "assignment": "benchmarks.speed.assignment",
    "streamed_align": "benchmarks.speed.streamed_align",
    "extended_group": "benchmarks.speed.extended_group",
    "stage1_orders": "benchmarks.stage1.stage1_orders",
    "stage1_terms": "benchmarks.stage1.stage1_terms",
    "table1_extra": "benchmarks.stage1.table1_extra",
    "reinit_share": "benchmarks.stage1.reinit_share",
    "refinement_objective": "benchmarks.stage2.refinement_objective",
    "refinement_data": "benchmarks.stage2.refinement_data",
    "alignment_grid": "benchmarks.alpha_grids.alignment_grid",
    "head_order_grid": "benchmarks.alpha_grids.head_order_grid",
    "repro_time": "benchmarks.reproduction.repro_time",
    "reproducibility": "benchmarks.reproduction.reproducibility",
    "demo_processors": "benchmarks.reproduction.demo_processors",
    "matcher_quality.checks": "benchmarks.matcher_quality.checks",
    "matcher_quality.pairs": "benchmarks.matcher_quality.pairs",
    "matcher_quality.path": "benchmarks.matcher_quality.path",
    "matcher_quality.data_aware": "benchmarks.matcher_quality.data_aware",
    "matcher_quality.report": "benchmarks.matcher_quality.report",
    "data_aware_ablation": "benchmarks.data_aware_ablation.report",
    "device": "benchmarks.device.device_check",
}
ROOT = Path(__file__).parents[1]


def summary(name: str) -> str:
    """The first line of a benchmark's module docstring, read without importing it (no torch at listing time)."""
    path = ROOT.joinpath(*BENCHMARKS[name].split(".")).with_suffix(".py")
    return (ast.get_docstring(ast.parse(path.read_text())) or "").splitlines()[0]


def listing() -> str:
    """Every benchmark's name and summary, one a line."""
    width = max(map(len, BENCHMARKS))
    lines = [f"  {name:<{width}}  {summary(name)}" for name in BENCHMARKS]
    return "usage: python -m benchmarks NAME [ARGS...]  (NAME --help: its arguments)\n\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark ``argv[0]`` with the arguments after it; list them without a name."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(listing())
        return 0
    name, *arguments = argv
    if name not in BENCHMARKS:
        print(f"python -m benchmarks: no benchmark {name!r}; run `python -m benchmarks` for the list", file=sys.stderr)
        return 2
    module = importlib.import_module(BENCHMARKS[name])
    sys.argv = [f"python -m benchmarks {name}", *arguments]  # argparse names the command as it was typed
    module.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
