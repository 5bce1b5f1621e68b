"""lmc.matching.permutation: the weight correlation summed in blocks, and the assignment without a copy of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from scipy.optimize import linear_sum_assignment

import lmc.matching.permutation
from lmc.matching.permutation import axis_correlation, best_permutation
from lmc.symmetry import AxisPermutation

ROOT = Path(__file__).parents[2]
SIZE = 300
# Two stacked copies on the first axis ([gate | up]) and one on a second axis, as an FFN's units.
UNITS = AxisPermutation("units", SIZE, (("gate_up", 0), ("down", 1)))


def weights(generator: torch.Generator, integers: bool) -> dict[str, torch.Tensor]:
    shapes = {"gate_up": (2 * SIZE, 70), "down": (50, SIZE)}
    if integers:
        return {n: torch.randint(-4, 5, s, generator=generator).to(torch.bfloat16) for n, s in shapes.items()}
    return {n: torch.randn(s, generator=generator) for n, s in shapes.items()}


def float64_correlation(source: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> torch.Tensor:
    """``S`` of :data:`UNITS` from its definition (docs/spec.md, section 3), every product in float64 at once."""
    correlation = torch.zeros(SIZE, SIZE, dtype=torch.float64)
    for name, axis in UNITS.axes:
        a, b = (t[name].movedim(axis, 0).double() for t in (source, target))
        a, b = (x.reshape(-1, SIZE, x.shape[-1]) for x in (a, b))  # (copies, SIZE, entries)
        correlation += torch.einsum("cik,cjk->ij", a, b)
    return correlation


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])  # added by blocks of rows / in place (bf16)
@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])
def test_the_blocked_correlation_equals_the_float64_sum_exactly_on_integer_weights(monkeypatch, dtype, stored):
    # Integer weights in [-4, 4]: every float32 product and partial sum is an integer below 2^24, so
    # exact in any order; any block of rows or columns misplaced, dropped or added twice shows.
    generator = torch.Generator().manual_seed(0)
    source, target = ({n: t.to(stored) for n, t in weights(generator, True).items()} for _ in range(2))
    monkeypatch.setattr(lmc.matching.permutation, "CHUNK_ENTRIES", 7 * SIZE + 5)  # 7 rows, 7 columns: uneven
    correlation = axis_correlation(source, target, UNITS, dtype)
    assert correlation.dtype == dtype
    assert torch.equal(correlation.double(), float64_correlation(source, target))


def test_the_blocked_correlation_is_the_float64_sum_up_to_float32_rounding_of_each_piece(monkeypatch):
    # float32 weights compute in float32: each entry of a piece's product sums `step` float32 terms,
    # so it is within step * 2^-24 of the exact sum of |terms| (the standard bound on a dot product);
    # the float64 sums over pieces add nothing visible at that scale.
    generator = torch.Generator().manual_seed(1)
    source, target = weights(generator, False), weights(generator, False)
    step = 11
    monkeypatch.setattr(lmc.matching.permutation, "CHUNK_ENTRIES", step * SIZE)
    correlation = axis_correlation(source, target, UNITS)
    absolute = float64_correlation({n: t.abs() for n, t in source.items()}, {n: t.abs() for n, t in target.items()})
    error = (correlation - float64_correlation(source, target)).abs()
    assert bool((error <= 1.01 * step * 2.0**-24 * absolute).all()), float((error / absolute).max())
    assert float(error.max()) > 0  # computed in float32, not float64


def test_the_assignment_leaves_the_callers_matrix_bit_for_bit_and_is_scipys_maximum():
    generator = torch.Generator().manual_seed(2)
    planted = torch.randperm(SIZE, generator=generator)
    correlation = torch.randn(SIZE, SIZE, generator=generator, dtype=torch.float64)
    correlation[planted, torch.arange(SIZE)] += 10.0  # source unit planted[i] is the target's unit i
    correlation[0, 1] = -0.0  # a signed zero must come back signed
    before = correlation.clone()
    perm = best_permutation(correlation)
    assert torch.equal(correlation.view(torch.int64), before.view(torch.int64))
    assert torch.equal(perm, planted)
    rows, cols = linear_sum_assignment(before.numpy(), maximize=True)
    assert torch.equal(perm[torch.as_tensor(cols)], torch.as_tensor(rows))


@pytest.mark.parametrize("kind", ["float32", "transposed"])
def test_a_matrix_scipy_would_copy_anyway_is_negated_in_a_copy(kind):
    correlation = torch.randn(40, 40, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    expected = best_permutation(correlation.clone())
    given = correlation.float() if kind == "float32" else correlation.T.contiguous().T
    before = given.clone()
    if kind == "float32":
        expected = best_permutation(given.double())
    assert torch.equal(best_permutation(given), expected)
    assert torch.equal(given, before)


def test_the_matrix_is_restored_when_the_solve_fails():
    correlation = torch.zeros(4, 4, dtype=torch.float64)
    correlation[1, 2] = torch.nan
    before = correlation.clone()
    with pytest.raises(ValueError):
        best_permutation(correlation)
    assert torch.equal(correlation.view(torch.int64), before.view(torch.int64))


# The temporaries beside the matrix (float64, or float32 as an FFN's of bf16 weights), measured as the
# growth of the peak RSS (VmHWM, reset through /proc/self/clear_refs before each step) with glibc handing
# every freed block of 64 KB or more back at once. Size 2048: the float64 matrix is 32 MB. Summing a whole
# float32 product into it added 48 MB (the product and its float64 cast), scipy's maximize=True a 32 MB
# copy, a float64 copy of a float32 matrix twice the matrix; blocks of
# CHUNK_ENTRIES (2^18 here: 1 MB of float32) add a few MB; the sparse assignment, blocks of 1/64 of the
# matrix and a graph of n * (CANDIDATES + 1) edges.
MEMORY_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    import lmc.matching.permutation as permutation
    from lmc.symmetry import AxisPermutation

    def reset_peak():
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")

    def peak():
        line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024

    permutation.CHUNK_ENTRIES = 1 << 18
    permutation.CANDIDATES = 8  # the sparse graph, some 8 arrays of n * CANDIDATES, scaled like the chunks
    generator, size = torch.Generator().manual_seed(0), 2048
    units = AxisPermutation("units", size, (("w", 0),))
    source, target = ({"w": torch.randn(size, 512, generator=generator).bfloat16()} for _ in range(2))
    first = permutation.SPARSE_FROM
    warm_up = permutation.axis_correlation(source, target, units)[:first, :first].clone()
    permutation.best_permutation(warm_up)  # its first calls (the sparse path from SPARSE_FROM units)
    del warm_up
    try:
        reset_peak()
    except OSError as error:
        print(json.dumps({"unavailable": str(error)}))
        raise SystemExit
    before = peak()
    correlation = permutation.axis_correlation(source, target, units, getattr(torch, sys.argv[1]))
    correlation_growth = peak() - before
    reset_peak()
    before = peak()
    permutation.best_permutation(correlation)
    print(json.dumps({
        "matrix": correlation.nbytes, "correlation": correlation_growth, "assignment": peak() - before,
    }))
    """
)


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads the peak RSS from /proc (Linux)")
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_neither_step_holds_a_temporary_the_size_of_the_matrix(dtype):
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "MALLOC_MMAP_THRESHOLD_": "65536"}
    run = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT, dtype], capture_output=True, text=True, env=environment, cwd=ROOT
    )
    assert run.returncode == 0, run.stderr[-3000:]
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    if "unavailable" in measured:
        pytest.skip(f"cannot reset the peak RSS here: {measured['unavailable']}")
    matrix, quarter = measured["matrix"], 2048 * 2048 * 8 / 4  # a quarter of the float64 matrix: 8 MB
    assert matrix < measured["correlation"] < matrix + quarter, measured
    assert measured["assignment"] < quarter, measured


def scipy_permutation(correlation: torch.Tensor) -> torch.Tensor:
    """scipy's maximizing assignment of ``correlation``, as :func:`best_permutation` writes it."""
    rows, cols = linear_sum_assignment(correlation.numpy(), maximize=True)
    perm = torch.empty(len(rows), dtype=torch.long)
    perm[torch.as_tensor(cols)] = torch.as_tensor(rows)
    return perm


def objective(correlation: torch.Tensor, perm: torch.Tensor) -> float:
    return float(correlation[perm, torch.arange(len(perm))].sum())


def assignment_costs(kind: str, size: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    correlation = torch.randn(size, size, generator=generator, dtype=torch.float64)
    if kind == "near_permutation":
        correlation *= 0.1
        correlation[torch.randperm(size, generator=generator), torch.arange(size)] += 1.0
    if kind == "ties":  # multiples of 1/4: a row's largest entries tie, and every sum of them is exact
        correlation = torch.round(correlation * 4) / 4
    return correlation


@pytest.mark.parametrize("kind", ["random", "near_permutation", "ties"])
@pytest.mark.parametrize("candidates", [1, 32])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_certified_sparse_assignment_reaches_scipys_optimum(monkeypatch, kind, candidates, dtype):
    # One candidate a row makes a first graph whose optimum is not the matrix's: only the certificate's
    # repairs reach scipy's optimum, so a certificate that passed a wrong matching would fail here. A
    # float32 matrix is solved as it is: the optimum of its own entries (scipy's, on them in float64).
    monkeypatch.setattr(lmc.matching.permutation, "CANDIDATES", candidates)
    monkeypatch.setattr(lmc.matching.permutation, "MAX_EDGES_PER_ROW", 10**6)
    monkeypatch.setattr(lmc.matching.permutation, "SPARSE_PASSES", 100)  # one candidate a row takes many
    correlation = assignment_costs(kind, 1024, seed=4).to(dtype)
    before = correlation.clone()
    found = lmc.matching.permutation.certified_sparse_assignment(correlation)
    assert found is not None
    assert torch.equal(correlation, before) and correlation.dtype == dtype
    perm = torch.empty(len(found), dtype=torch.long)
    perm[torch.as_tensor(found)] = torch.arange(len(found))
    correlation = correlation.double()
    expected = scipy_permutation(correlation)
    if kind == "ties":  # optimal assignments may differ; the objective is exact on this grid
        assert objective(correlation, perm) == objective(correlation, expected)
        assert torch.equal(perm.sort().values, torch.arange(len(perm)))
    else:  # a unique optimum (continuous entries)
        assert torch.equal(perm, expected)


def test_the_sparse_graph_grows_only_from_broken_rows_and_needs_a_second_solve_on_a_random_cost(monkeypatch):
    edges, solve = [], lmc.matching.permutation.min_weight_full_bipartite_matching

    def counted(graph):
        edges.append(graph.nnz)
        return solve(graph)

    monkeypatch.setattr(lmc.matching.permutation, "min_weight_full_bipartite_matching", counted)
    correlation = assignment_costs("random", 1024, seed=5)
    perm = best_permutation(correlation)
    assert torch.equal(perm, scipy_permutation(correlation))
    assert len(edges) >= 2 and edges[0] < edges[-1] < 2 * edges[0], edges


def test_row_maxima_in_distinct_columns_are_the_assignment_without_a_solve(monkeypatch):
    def refused(graph):
        raise AssertionError("no solve is needed")

    monkeypatch.setattr(lmc.matching.permutation, "min_weight_full_bipartite_matching", refused)
    correlation = assignment_costs("near_permutation", 1024, seed=7)
    assert len(correlation.argmax(dim=1).unique()) == 1024  # the planted entry leads every row
    perm = best_permutation(correlation)
    assert torch.equal(perm, scipy_permutation(correlation))
    # One row's best moved onto another row's column: the maxima collide, and the solve runs.
    correlation[0, correlation[1].argmax()] = 2.0
    with pytest.raises(AssertionError, match="no solve is needed"):
        best_permutation(correlation)


def test_ties_over_every_row_are_solved_densely_at_scipys_optimum(monkeypatch):
    correlation = torch.randint(0, 3, (1024, 1024), generator=torch.Generator().manual_seed(6)).double()
    assert lmc.matching.permutation.certified_sparse_assignment(correlation) is None
    perm = best_permutation(correlation)
    assert objective(correlation, perm) == objective(correlation, scipy_permutation(correlation))


def test_a_large_correlation_with_nan_is_refused_by_name():
    size = lmc.matching.permutation.SPARSE_FROM
    correlation = torch.zeros(size, size, dtype=torch.float64)
    correlation[3, 4] = torch.nan
    with pytest.raises(ValueError, match="infinite or NaN"):
        best_permutation(correlation)
