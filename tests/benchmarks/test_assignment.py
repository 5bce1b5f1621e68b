"""benchmarks/speed/assignment.py: its costs are what it says, and every solver it times reaches scipy's optimum."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.speed.assignment import cost, solvers
from lmc.matching.permutation import SPARSE_FROM


def _objective(correlation: torch.Tensor, columns: np.ndarray) -> float:
    return float(correlation[torch.arange(len(columns)), torch.as_tensor(columns)].sum())


def test_the_near_permutation_cost_is_solved_by_its_planted_permutation():
    planted = cost("near_permutation", 64, seed=3)
    columns = planted.argmax(dim=1).numpy()  # the dominant entry of each row: the planted permutation
    assert sorted(columns) == list(range(64))
    for name, solve in solvers().items():
        assert solve(planted).tolist() == columns.tolist(), name


@pytest.mark.parametrize("kind", ["random", "independent_ffn"])
def test_every_solver_reaches_scipys_optimum_where_lmc_solves_sparsely(kind):
    correlation = cost(kind, SPARSE_FROM, seed=1)
    found = {name: solve(correlation.clone()) for name, solve in solvers().items()}
    best = _objective(correlation, found["scipy"])
    generator = np.random.default_rng(0)
    assert all(_objective(correlation, generator.permutation(SPARSE_FROM)) < best for _ in range(20))
    for name, columns in found.items():
        assert sorted(columns.tolist()) == list(range(SPARSE_FROM)), name  # a permutation
        assert _objective(correlation, columns) == pytest.approx(best, rel=1e-12), name
