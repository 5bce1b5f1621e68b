"""Weight matching for permutation symmetries (Ainsworth et al. 2023, "Git Re-Basin").

One step: with every other symmetry held fixed, the permutation ``P`` of one axis group that
maximizes ``sum_(W, axis) <P W, W'>`` is a linear assignment on the correlation matrix
``S[a, b] = <W_a, W'_b>`` (slices of the parameters along the permuted axis).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import min_weight_full_bipartite_matching

from lmc.symmetry import AxisPermutation, compute_dtype

#: Entries of a tensor converted to a wider dtype at once (16 MB of float32), and of a block of rows read
#: at once (:func:`row_blocks`): an 8B model's embedding is never copied whole, and the temporaries beside
#: an FFN's float64 correlation stay a few tens of MB.
CHUNK_ENTRIES = 1 << 22


def squared_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """``sum((a - b) ** 2)``, the difference in the stored dtype and its square in float64, an eighth of
    :data:`CHUNK_ENTRIES` entries at a time (a 4 MB float64 difference: the distances run on the pieces
    the write pass holds, so no temporary outgrows them), its square summed as a dot product."""
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    total, entries = 0.0, max(1, CHUNK_ENTRIES // 8)
    for x, y in zip(a.split(entries), b.split(entries)):
        difference = (x - y).double()
        total += float(difference @ difference)
    return total


def block_rows(shape: tuple[int, ...] | torch.Size) -> int:
    """Rows (entries of axis 0) of a block of :func:`row_blocks` for a tensor of ``shape``: at most
    :data:`CHUNK_ENTRIES` entries, one row at least."""
    row_entries = math.prod(shape[1:])
    return max(1, CHUNK_ENTRIES // max(1, row_entries))


def row_blocks(tensors: Mapping[str, torch.Tensor], name: str) -> Iterator[torch.Tensor]:
    """Tensor ``name`` of ``tensors`` in blocks of :func:`block_rows` rows, in order (a scalar whole).

    A mapping that reads its tensors from disk may define ``row_blocks(name)`` serving the same
    blocks, each read alone (:mod:`lmc.matching.streamed`): then no tensor whose rows no symmetry
    moves, such as an embedding or an LM head, is ever held whole. Otherwise the blocks are views.
    """
    read = getattr(tensors, "row_blocks", None)
    if read is not None:
        yield from read(name)
        return
    yield from blocks_of(tensors[name].detach())


def blocks_of(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Views of ``tensor`` in blocks of :func:`block_rows` rows (a scalar whole): :func:`row_blocks` of a tensor
    in memory."""
    return tensor.split(block_rows(tensor.shape)) if tensor.dim() else (tensor,)


def axis_correlation(
    source: Mapping[str, torch.Tensor],
    target: Mapping[str, torch.Tensor],
    permutation: AxisPermutation,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """``S[a, b] = sum over (parameter, axis) of <slice a of source, slice b of target>``, ``(size, size)``.

    Over the permutation's axes and units only (:meth:`~lmc.symmetry.AxisPermutation.span`): an axis
    ``k * size`` long holds ``k`` stacked copies, whose correlations add up, and the entries outside a
    sub-range are left out. A tensor permuted along another axis than its first is read a block of rows
    at a time (:func:`row_blocks`). Each product runs in :func:`~lmc.symmetry.compute_dtype` of the
    parameter's dtype, over at most :data:`CHUNK_ENTRIES` entries of each at a time, and each product is
    added into the matrix in place (``addmm_``) for half-precision weights into a float32 matrix on their
    device, else a block of rows at a time, so that no temporary of the matrix's size is made beside it.

    Args:
        source, target: Parameters holding (at least) the tensors of ``permutation.axes``, by name.
        permutation: The units and the axes that carry them.
        dtype: The matrix's, which the products add up in. float64 (the default) for a sum over many
            tensors, such as the residual stream's over a whole model; a unit permutation's few tensors
            (an FFN's three) may add up in their :func:`~lmc.symmetry.compute_dtype`: float32 for
            float32 or bf16 weights, whose products are float32 sums already, so the matrix's entries
            keep about the products' precision (a few dozen more float32 roundings, one per piece of
            columns), while an 8B model's 14,336 FFN units take 822 MB instead of 1.64 GB.
    """
    size = permutation.size
    correlation = torch.zeros(size, size, dtype=dtype)
    step = max(1, CHUNK_ENTRIES // size)  # columns of a piece, and rows of a block of the product
    for name, axis in permutation.axes:
        if axis == 0:
            pairs = ((source[name].detach(), target[name].detach()),)
        else:
            pairs = zip(row_blocks(source, name), row_blocks(target, name))
        for source_block, target_block in pairs:
            units = slice(*permutation.span((name, axis), source_block.shape[axis]))
            a, b = (block.movedim(axis, 0)[units] for block in (source_block, target_block))
            copies = a.shape[0] // size
            a = a.reshape(copies, size, -1).transpose(0, 1).reshape(size, -1)
            b = b.reshape(copies, size, -1).transpose(0, 1).reshape(size, -1)
            dtype = compute_dtype(a.dtype)
            for start in range(0, a.shape[1], step):
                piece_a, piece_b = a[:, start : start + step].to(dtype), b[:, start : start + step].to(dtype)
                if dtype == correlation.dtype != a.dtype and piece_a.device == correlation.device:
                    # The GEMM adds into the matrix itself: no temporary, and at the full GEMM rate (row
                    # blocks of a few hundred rows cost an 8B model's FFN correlations about a quarter more).
                    # Half-precision weights only: its float32 sums differ from the row blocks' by an ulp, and
                    # float32 models keep the sums their committed alignments were found with.
                    correlation.addmm_(piece_a, piece_b.T)
                    continue
                for row in range(0, size, step):
                    correlation[row : row + step] += (piece_a[row : row + step] @ piece_b.T).cpu()
    return correlation


#: From this size on the assignment is solved sparsely and certified (:func:`best_permutation`); below it
#: scipy's dense solver takes milliseconds.
SPARSE_FROM = 1024
#: Candidate columns of each row in the first sparse solve: a unit's best few matches, by its correlation
#: (at 8,192 random units, 8 needed 6 solves, 16 needed 4, 32 needed 2: the fewest seconds).
CANDIDATES = 32
#: Sparse solves before giving up on a certificate and solving densely (random costs of 8,192 units need 2).
SPARSE_PASSES = 8
#: Edges of the sparse graph per row beyond which the dense solve is quicker (long ties in every row).
MAX_EDGES_PER_ROW = 4 * CANDIDATES
#: The sparse solve's selection and certificate read the correlation in this many blocks of rows: each
#: temporary is a few times 1/64 of the matrix.
BLOCKS = 64


def best_permutation(correlation: torch.Tensor) -> torch.Tensor:
    """The permutation ``perm`` (``new[i] = old[perm[i]]``) maximizing ``sum_i S[perm[i], i]``.

    From :data:`SPARSE_FROM` units on, the assignment is solved on a few candidate entries per row and
    proven optimal on the whole matrix (:func:`certified_sparse_assignment`), else (or when that proof
    is not reached) by scipy's dense solver (:func:`dense_assignment`). Either way the objective is the
    optimum; with ties in the optimum the two may return different permutations of the same objective.
    The caller's matrix ends bit for bit as it was. A float32 or float64 matrix on the CPU is read as it
    is by the sparse solve (a float32 one is never copied whole to float64 there: 822 MB more at 14,336
    units); the dense solve, which scipy runs in float64, copies any other.

    Args:
        correlation: ``S`` ``(n, n)``, finite.

    Returns:
        ``perm`` ``(n,)``.
    """
    if len(correlation) >= SPARSE_FROM:
        dtype = correlation.dtype if correlation.dtype in (torch.float32, torch.float64) else torch.float64
        matrix = correlation.to("cpu", dtype).contiguous()  # no copy of a contiguous CPU matrix of either
        found = certified_sparse_assignment(matrix)
        if found is not None:
            perm = torch.empty(len(found), dtype=torch.long)
            perm[torch.as_tensor(found)] = torch.arange(len(found))
            return perm
    return dense_assignment(correlation)


def dense_assignment(correlation: torch.Tensor) -> torch.Tensor:
    """:func:`best_permutation` by scipy's ``linear_sum_assignment`` on the whole matrix.

    scipy's ``maximize=True`` would negate a copy of ``S``, as large as it; instead a float64 contiguous CPU
    ``correlation`` is negated in place while scipy minimizes ``-S``, and negated back before this returns,
    even on an error: negation is exact, so the caller's matrix ends bit for bit as it was (no other thread
    may read it meanwhile). Any other ``correlation`` is negated in a float64 copy.

    Args:
        correlation: ``S`` ``(n, n)``, finite.

    Returns:
        ``perm`` ``(n,)``.
    """
    in_place = correlation.dtype == torch.float64 and correlation.device.type == "cpu" and correlation.is_contiguous()
    cost = correlation.neg_() if in_place else correlation.to("cpu", torch.float64, copy=True).neg_()
    try:
        rows, cols = linear_sum_assignment(cost.numpy())
    finally:
        if in_place:
            correlation.neg_()
    perm = torch.empty(len(rows), dtype=torch.long)
    perm[torch.as_tensor(cols)] = torch.as_tensor(rows)
    return perm


def certified_sparse_assignment(correlation: torch.Tensor) -> np.ndarray | None:
    """The assignment maximizing ``sum_i S[i, m[i]]``, found on a sparse graph and proven on the whole matrix.

    Where every row's largest entry lies in a column of its own, those entries are the assignment: no
    assignment sums more than the rows' maxima (a later round's cost, its units nearly aligned, often is
    one). Otherwise the graph holds each row's :data:`CANDIDATES` largest entries and the diagonal (a full
    matching, so the sparse problem is always feasible; in a later round of the descent the source was
    already moved by the previous round's permutations, so the diagonal is that round's assignment: a warm
    start). scipy's sparse solver (``min_weight_full_bipartite_matching``, LAPJVsp) finds its optimum ``m``.
    Column prices ``p`` then make ``m`` the best choice of every row within the graph: shortest paths from
    the matched columns (Bellman-Ford, ``p[j] <= p[m[i]] + S[i, m[i]] - S[i, j]`` on every edge). The
    certificate is LP duality on the whole matrix: if ``S[i, j] + p[j] <= S[i, m[i]] + p[m[i]] + tol`` for
    every ``(i, j)``, then ``u_i = S[i, m[i]] + p[m[i]] + tol``, ``v_j = -p[j]`` is a dual solution of value
    ``sum_i S[i, m[i]] + n tol``, so no assignment beats ``m`` by more than ``n tol``. ``tol = 4 n eps
    max|S|`` covers the rounding of the prices, sums of up to ``n`` terms, so the gap is the rounding of the
    objective itself (``4 n eps`` of ``n max|S|``). Entries that break the certificate join the graph and
    the solve repeats, at most :data:`SPARSE_PASSES` times.

    Args:
        correlation: ``S`` ``(n, n)``, float64 or float32, contiguous, on the CPU; read only, a block of rows
            at a time (no temporary of its size). The prices and the certificate compute in float64, in
            which every float32 entry is exact: the assignment is the optimum of the matrix as given.

    Returns:
        ``m`` ``(n,)``, row ``i``'s column, or ``None`` if no certificate was reached (prices that do not
        settle within ``n`` relaxations, :data:`SPARSE_PASSES` solves, or a graph of more than
        :data:`MAX_EDGES_PER_ROW` edges a row).

    Raises:
        ValueError: ``S`` has an infinite or NaN entry.
    """
    size, flat = len(correlation), correlation.view(-1)
    step = -(-size // BLOCKS)  # rows of a block
    rows, cols, top, bottom = [np.arange(size)], [np.arange(size)], -math.inf, math.inf
    row_best = []
    for start in range(0, size, step):
        block = correlation[start : start + step]
        low, high = (float(bound) for bound in torch.aminmax(block))  # NaN where the block has one
        if not math.isfinite(high - low):
            raise ValueError("the correlation has an infinite or NaN entry: no assignment maximizes it")
        top, bottom = max(top, high), min(bottom, low)
        row_best.append(block.argmax(dim=1).numpy())
        block_rows, block_cols = _row_leaders(block, -math.inf)
        rows.append(block_rows + start)
        cols.append(block_cols)
    best = np.concatenate(row_best)
    if len(np.unique(best)) == size:  # every row's largest entry in its own column: the rows' maxima bound
        return best  # every assignment's sum, and this one reaches the bound (units already nearly aligned)
    tolerance = 4 * size * float(np.finfo(np.float64).eps) * max(top, -bottom, float(np.finfo(np.float64).tiny))
    keys = np.zeros(0, dtype=np.int64)
    for _ in range(SPARSE_PASSES):
        if len(keys) + sum(map(len, rows)) > MAX_EDGES_PER_ROW * size:  # ties over most rows: dense is quicker
            return None
        keys = np.unique(np.concatenate([keys, *(r * size + c for r, c in zip(rows, cols))]))
        edge_rows, edge_cols = keys // size, keys % size
        values = flat[torch.as_tensor(keys)].double().numpy()
        # Weights shifted to at least 1: the sparse solver takes a zero entry for no edge.
        graph = csr_matrix((top - values + 1.0, (edge_rows, edge_cols)), shape=(size, size))
        matched = min_weight_full_bipartite_matching(graph)[1]
        matched_values = flat[torch.as_tensor(np.arange(size) * size + matched)].double().numpy()
        weights = matched_values[edge_rows] - values
        # Settled well inside the certificate's tolerance, so that the graph's own edges pass it.
        prices = _settled_prices(edge_rows, edge_cols, weights, matched, tolerance / 4)
        if prices is None:
            return None
        rows, cols = [], []
        prices_tensor = torch.from_numpy(prices)
        bars = torch.from_numpy(matched_values + prices[matched] + tolerance)  # each row's certified best
        for start in range(0, size, step):
            priced = correlation[start : start + step].double() + prices_tensor
            bar = bars[start : start + step]
            broken = (priced.amax(dim=1) > bar).nonzero()[:, 0]
            if len(broken):
                # A broken row's largest surpluses only: all of them can be most of a row when a column
                # the graph barely reached is priced far off, and the next solve reprices it.
                block_rows, block_cols = _row_leaders(priced[broken] - bar[broken, None], 0.0)
                rows.append(broken.numpy()[block_rows] + start)
                cols.append(block_cols)
        if not sum(len(r) for r in rows):
            return matched
    return None


def _row_leaders(block: torch.Tensor, floor: float) -> tuple[np.ndarray, np.ndarray]:
    """Rows and columns of the entries of ``block`` ``(rows, n)`` above ``floor`` and among their row's
    :data:`CANDIDATES` largest, ties with the last included: with many tied entries in a row, a choice among
    them by index would send every row to the same few columns."""
    count = min(CANDIDATES, block.shape[1])
    values, indices = torch.topk(block, min(count + 1, block.shape[1]), dim=1)
    tied = values[:, -1] == values[:, count - 1] if values.shape[1] > count else torch.zeros(len(block), dtype=bool)
    kept = values[:, :count] > floor
    kept[tied] = False
    leaders = kept.nonzero()
    rows, cols = leaders[:, 0], indices[leaders[:, 0], leaders[:, 1]]
    if tied.any():  # the rows whose tie runs past the first CANDIDATES: every entry of the tie
        where = tied.nonzero()[:, 0]
        part = block[where]
        extra = ((part >= values[where, count - 1 : count]) & (part > floor)).nonzero()
        rows, cols = torch.cat([rows, where[extra[:, 0]]]), torch.cat([cols, extra[:, 1]])
    return rows.numpy(), cols.numpy()


def _settled_prices(
    edge_rows: np.ndarray, edge_cols: np.ndarray, weights: np.ndarray, matched: np.ndarray, tolerance: float
) -> np.ndarray | None:
    """Column prices ``p`` ``(n,)`` with ``p[j] <= p[matched[i]] + weights[e] + tolerance`` on every edge
    ``e = (i, j)``: Bellman-Ford from 0, all edges relaxed at once per step; ``None`` after ``n`` steps (a
    negative cycle: the sparse matching was not optimal). Every column has an edge (the diagonal)."""
    size = len(matched)
    order = np.argsort(edge_cols, kind="stable")
    tails, weights = matched[edge_rows[order]], weights[order]
    starts = np.searchsorted(edge_cols[order], np.arange(size))
    prices = np.zeros(size)
    for _ in range(size):
        relaxed = np.minimum(prices, np.minimum.reduceat(prices[tails] + weights, starts))
        if not (relaxed < prices - tolerance).any():
            return relaxed
        prices = relaxed
    return None
