"""benchmarks/assignment.py: the two costs it times are what it says, and scipy's optimum is exact on them."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.assignment import costs, solve_scipy


def test_the_near_permutation_cost_is_solved_by_its_planted_permutation():
    generator = np.random.default_rng(0)
    size = 64
    planted = costs(size, seed=3)["near_permutation"]
    rows = np.argmax(planted, axis=0)  # the dominant entry of each column: the planted permutation
    assert sorted(rows) == list(range(size))
    _, optimum = solve_scipy(planted)
    assert optimum == pytest.approx(planted[rows, np.arange(size)].sum(), rel=1e-14)  # summed in another order
    random = costs(size, seed=3)["random"]
    _, best = solve_scipy(random)
    # No random permutation beats the optimum.
    assert all(random[generator.permutation(size), np.arange(size)].sum() <= best for _ in range(200))
