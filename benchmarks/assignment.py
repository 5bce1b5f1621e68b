"""The assignment step of weight matching (issue #21, item 3): scipy's solver against another exact one, same costs.

For each size, two costs like those of an FFN step: an independent pair's first round (a random
correlation) and a later round's (a near-permutation: a dominant diagonal under a random
permutation, plus noise). Each is solved by ``scipy.optimize.linear_sum_assignment`` (what
:func:`lmc.matching.permutation.best_permutation` calls) and, where it is importable, by
``lap.lapjv`` (LAPJV, pip package ``lap``; not a dependency of lmc), and the two objectives are
compared: an exact solver must reach scipy's optimum.

    python benchmarks/assignment.py --sizes 1024 2048 4096      # prints one JSON line per cost

The figures are those of the machine it runs on; run it on a quiet one.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from scipy.optimize import linear_sum_assignment


def costs(size: int, seed: int) -> dict[str, np.ndarray]:
    """A random correlation and a near-permutation one, ``(size, size)`` float64."""
    generator = np.random.default_rng(seed)
    random = generator.standard_normal((size, size))
    near = generator.standard_normal((size, size)) * 0.1
    near[generator.permutation(size), np.arange(size)] += 1.0
    return {"random": random, "near_permutation": near}


def solve_scipy(cost: np.ndarray) -> tuple[float, float]:
    start = time.perf_counter()
    rows, cols = linear_sum_assignment(cost, maximize=True)
    return time.perf_counter() - start, float(cost[rows, cols].sum())


def solve_lapjv(cost: np.ndarray) -> tuple[float, float] | None:
    try:
        import lap
    except ImportError:
        return None
    start = time.perf_counter()
    _, x, _ = lap.lapjv(-cost)  # lapjv minimizes
    seconds = time.perf_counter() - start
    return seconds, float(cost[np.arange(len(x)), x].sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", type=int, default=[1024, 2048, 4096])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for size in args.sizes:
        for kind, cost in costs(size, args.seed).items():
            scipy_seconds, optimum = solve_scipy(cost)
            row = {"size": size, "cost": kind, "scipy_seconds": scipy_seconds}
            other = solve_lapjv(cost)
            if other is not None:
                row |= {"lapjv_seconds": other[0], "lapjv_objective_minus_scipy": other[1] - optimum}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
