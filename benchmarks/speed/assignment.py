"""The assignment step of weight matching (issue #21, item 3): exact solvers side by side, on the same costs.

For each size, three costs like those of an FFN step of a ``full_model`` descent (maximized):

- ``random``: a standard normal matrix, an independent pair's first round;
- ``near_permutation``: a dominant entry per row under a random permutation (1 plus noise of 0.1), a
  later round's, where the previous permutations have nearly aligned the units;
- ``independent_ffn``: the FFN correlation of two independently initialized Llama-shaped FFN layers
  (``gate_proj``, ``up_proj`` and ``down_proj`` of ``size`` units and width ``size / 4``, bf16
  ``N(0, 0.02)``, as ``benchmarks/speed/streamed_align.py`` writes them), formed by
  :func:`lmc.matching.permutation.axis_correlation` exactly as a descent round forms it.

Each cost is solved by every solver, the solvers interleaved (each repetition starts with the next
one), in one process with ``--threads`` torch threads (scipy's and ``lap``'s solvers run on one):

- ``scipy``: ``scipy.optimize.linear_sum_assignment`` on the whole matrix
  (:func:`lmc.matching.permutation.dense_assignment`, what lmc called before);
- ``lmc``: :func:`lmc.matching.permutation.best_permutation` (from ``SPARSE_FROM`` units on, 1,024, the
  certified sparse solve, :func:`~lmc.matching.permutation.certified_sparse_assignment`);
- where the pip package ``lap`` (or ``lapx``, which installs the same module) is importable, its
  solvers (``lapjv``; ``lapx``'s ``lapjvh``, ``lapjvr``, ``lapjvs``). Neither is a dependency of lmc.

Every solver's objective is compared with scipy's in float64 (``sum_i S[i, m[i]]``): an exact solver
reaches scipy's optimum; with ties in the optimum its permutation may differ at the same objective.
The run writes ``--output`` (JSON: the machine, thread count, date, command line, every time; its rows
replacing those of the sizes it measured) and its rendering to the Markdown beside it, each atomically;
``--render`` renders the Markdown again from the JSON, measuring nothing. Never edit either by hand.

    OMP_NUM_THREADS=1 python -m benchmarks assignment          # sizes 1024 to 8192, ~5 minutes
    PYTHONPATH=.:/path/to/lapx python -m benchmarks assignment   # with lap's solvers beside
    python -m benchmarks assignment --sizes 14336 --repetitions 1 --solvers lmc lapjvr   # Llama-3-8B's FFN
    python -m benchmarks assignment --render
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.machine import machine

KINDS = ("random", "near_permutation", "independent_ffn")
LAP_SOLVERS = ("lapjv", "lapjvh", "lapjvr", "lapjvs")


def cost(kind: str, size: int, seed: int) -> torch.Tensor:
    """One cost of ``kind`` (see the module docstring), ``(size, size)`` float64, to be maximized."""
    generator = torch.Generator().manual_seed(seed)
    if kind == "random":
        return torch.randn(size, size, generator=generator, dtype=torch.float64)
    if kind == "near_permutation":
        correlation = 0.1 * torch.randn(size, size, generator=generator, dtype=torch.float64)
        correlation[torch.randperm(size, generator=generator), torch.arange(size)] += 1.0
        return correlation
    from lmc.matching.permutation import axis_correlation
    from lmc.symmetry import AxisPermutation

    width = size // 4
    shapes = {"gate_proj": (size, width), "up_proj": (size, width), "down_proj": (width, size)}
    units = AxisPermutation("units", size, (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)))
    source, target = (
        {name: (0.02 * torch.randn(shape, generator=generator)).bfloat16() for name, shape in shapes.items()}
        for _ in range(2)
    )
    return axis_correlation(source, target, units)


def solvers() -> dict[str, Callable[[torch.Tensor], np.ndarray]]:
    """Each solver: ``S`` ``(n, n)`` float64 to ``m`` ``(n,)``, row ``i``'s column, maximizing ``sum S[i, m[i]]``."""
    from lmc.matching.permutation import best_permutation, dense_assignment

    found = {
        "scipy": lambda correlation: torch.argsort(dense_assignment(correlation)).numpy(),
        "lmc": lambda correlation: torch.argsort(best_permutation(correlation)).numpy(),
    }
    try:
        import lap
    except ImportError:
        return found
    for name in LAP_SOLVERS:
        if hasattr(lap, name):
            found[name] = _lap_solver(getattr(lap, name), row_columns=name == "lapjv")
    return found


def _lap_solver(solve: Callable, row_columns: bool) -> Callable[[torch.Tensor], np.ndarray]:
    """A ``lap`` solver as :func:`solvers` gives them: ``lapjv`` returns ``(total, x, y)``, ``x`` row ``i``'s
    column (``row_columns``); the others ``(total, rows, cols)``, index pairs."""

    def solved(correlation: torch.Tensor) -> np.ndarray:
        cost = np.negative(correlation.numpy())  # lap minimizes: a negated copy, as scipy's maximize=True makes
        _, first, second = solve(cost)
        if row_columns:
            return np.asarray(first)
        columns = np.empty(len(cost), dtype=np.int64)
        columns[first] = second
        return columns

    return solved


def measure(sizes: list[int], repetitions: int, seed: int, only: list[str] | None) -> list[dict[str, Any]]:
    """One row per (size, kind, solver): its seconds per repetition and its objective minus scipy's.

    ``only``: the solvers to run (scipy always: the reference); every available one if ``None``."""
    rows, solving = [], solvers()
    if only is not None:
        unknown = sorted(set(only) - set(solving))
        if unknown:
            raise SystemExit(f"--solvers: {', '.join(unknown)} not available here; choose among {', '.join(solving)}")
        solving = {name: solve for name, solve in solving.items() if name == "scipy" or name in only}
    names = list(solving)
    for size in sizes:
        for kind in KINDS:
            correlation = cost(kind, size, seed)
            seconds: dict[str, list[float]] = {name: [] for name in names}
            objective: dict[str, float] = {}
            assignment: dict[str, np.ndarray] = {}
            for repetition in range(repetitions):
                for name in names[repetition % len(names) :] + names[: repetition % len(names)]:
                    start = time.perf_counter()
                    columns = solving[name](correlation)
                    seconds[name].append(time.perf_counter() - start)
                    assignment[name] = columns
                    objective[name] = float(correlation[torch.arange(size), torch.as_tensor(columns)].sum())
            for name in names:
                rows.append(
                    {
                        "size": size,
                        "cost": kind,
                        "solver": name,
                        "seconds": seconds[name],
                        "objective_minus_scipy": objective[name] - objective["scipy"],
                        "same_assignment_as_scipy": bool(np.array_equal(assignment[name], assignment["scipy"])),
                        "is_permutation": bool(np.array_equal(np.sort(assignment[name]), np.arange(size))),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    return rows


def environment(threads: int) -> dict[str, Any]:
    """The machine (:func:`benchmarks.machine.machine`), threads, date, command line and versions."""
    versions = {}
    for package in ("numpy", "scipy", "torch", "lap", "lapx"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    return {
        "machine": machine(),
        "torch_threads": threads,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join(["python", "-m", "benchmarks", "assignment", *sys.argv[1:]]),
        "versions": versions,
    }


def merged(previous: dict[str, Any] | None, run: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``previous`` results with this run's: its rows replace those of the sizes it measured, and a run
    left with no row is dropped."""
    if previous is None:
        return {"runs": [run], "rows": rows}
    sizes = set(run["sizes"])
    kept = [row for row in previous["rows"] if row["size"] not in sizes]
    runs = [{**old, "sizes": [n for n in old["sizes"] if n not in sizes]} for old in previous["runs"]]
    return {"runs": [old for old in runs if old["sizes"]] + [run], "rows": kept + rows}


def render(results: dict[str, Any], json_name: str = "assignment.json") -> str:
    """The Markdown of a results JSON (what :func:`main` writes beside it): its figures and ratios of them."""
    rows = sorted(results["rows"], key=lambda row: row["size"])
    solver_names = list(dict.fromkeys(row["solver"] for row in results["rows"]))
    lines = [
        "# The assignment step (`lmc.matching.permutation.best_permutation`): exact solvers side by side",
        "",
        f"Rendered by `python -m benchmarks assignment` from `{json_name}` beside this file: do not edit either by",
        "hand. Each size's rows come from one run (a later run of a size replaces its rows):",
        "",
    ]
    for run in results["runs"]:
        machine = run["machine"]
        versions = ", ".join(f"{name} {version}" for name, version in run["versions"].items())
        lines += [
            f"- sizes {', '.join(map(str, run['sizes']))}: `{run['command']}` on {run['date']}; {machine['cpu']}, "
            f"{machine['cores']} cores, load average {machine['load_average_before']:.2f} before the run, "
            f"{run['torch_threads']} torch thread(s); {versions}.",
        ]
    lines += [
        "",
        "Costs: see the module docstring (`random`: an independent pair's first round; `near_permutation`: a",
        "later round's; `independent_ffn`: the FFN correlation of two independently initialized Llama-shaped",
        "layers). Each cell: the median seconds over the repetitions, the solvers interleaved; `-`: not run.",
        "`lmc` is the certified sparse solve (scipy's sparse LAPJVsp on each row's best entries, proven",
        "optimal on the whole matrix by dual prices), `scipy` the dense `linear_sum_assignment` lmc called",
        "before; the others are the pip package named in the versions (`lap` or `lapx`).",
        "",
        "| size | cost | " + " | ".join(solver_names) + " | scipy / lmc |",
        "|---|---|" + "---|" * len(solver_names) + "---|",
    ]
    table: dict[tuple[int, str], dict[str, dict]] = {}
    for row in rows:
        table.setdefault((row["size"], row["cost"]), {})[row["solver"]] = row
    for (size, kind), cells in table.items():
        medians = {name: statistics.median(cell["seconds"]) for name, cell in cells.items()}
        text = [f"{medians[name]:.3f}" if name in cells else "-" for name in solver_names]
        ratio = f"{medians['scipy'] / medians['lmc']:.2f}" if "lmc" in medians else "-"
        lines.append(f"| {size} | {kind} | " + " | ".join(text) + f" | {ratio} |")
    worst = max(abs(row["objective_minus_scipy"]) for row in rows)
    differing = [f"{r['solver']} at {r['size']} {r['cost']}" for r in rows if not r["same_assignment_as_scipy"]]
    broken = [f"{r['solver']} at {r['size']} {r['cost']}" for r in rows if not r["is_permutation"]]
    lines += [
        "",
        f"Largest |objective - scipy's| over every solver and cost: {worst:.3g} (float64 sums of `S[i, m[i]]`).",
        "Assignments other than scipy's: " + (", ".join(differing) if differing else "none") + ".",
        "Outputs that are not permutations: " + (", ".join(broken) if broken else "none") + ".",
    ]
    return "\n".join(lines) + "\n"


def write_results(results: dict[str, Any], output: Path) -> None:
    """``results`` to ``output`` and its rendering to the Markdown beside it, each atomically."""
    from lmc.io import atomic_write_text

    atomic_write_text(output, json.dumps(results, indent=2) + "\n")
    atomic_write_text(output.with_suffix(".md"), render(results, output.name))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", type=int, default=[1024, 2048, 4096, 8192])
    parser.add_argument("--repetitions", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (set OMP_NUM_THREADS alike)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=Path(__file__).parent / "results" / "assignment.json")
    parser.add_argument("--solvers", nargs="+", help="only these beside scipy (default: every one available)")
    parser.add_argument("--fresh", action="store_true", help="drop the rows of --output instead of merging")
    parser.add_argument("--render", action="store_true", help="render the Markdown from --output, measure nothing")
    args = parser.parse_args()
    if args.render:
        write_results(json.loads(args.output.read_text()), args.output)
        return
    torch.set_num_threads(args.threads)
    run = environment(args.threads) | {"sizes": sorted(set(args.sizes))}
    rows = measure(run["sizes"], args.repetitions, args.seed, args.solvers)
    previous = json.loads(args.output.read_text()) if args.output.exists() and not args.fresh else None
    write_results(merged(previous, run, rows), args.output)


if __name__ == "__main__":
    main()
