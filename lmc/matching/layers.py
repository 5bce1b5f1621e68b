"""The per-layer solves of alignment: both stages on one attention layer pair, read from any mapping of tensors.

Each reads only the tensors of its layer, by spec name, from a ``Mapping[str, Tensor]``: a
model's parameters in memory or a checkpoint streamed from disk.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch

from lmc.matching.calibration import PairedMoment
from lmc.matching.checks import all_finite, require_finite
from lmc.matching.grams import LayerGrams
from lmc.matching.heads import assign_heads, head_cost
from lmc.matching.options import AlignOptions
from lmc.matching.permutation import axis_correlation, best_permutation, row_blocks, squared_distance
from lmc.matching.results import AlignmentError, LayerAlignment
from lmc.matching.stage2 import attention_stages, stage_distances
from lmc.symmetry import (
    AttentionSpec,
    AttentionTransform,
    AxisPermutation,
    ModelTransform,
    ResidualGroup,
    SymmetrySpec,
    centered_basis,
    compute_dtype,
    head_rows,
)


def stacked_copies(correlation: torch.Tensor, size: int) -> torch.Tensor:
    """The ``(size, size)`` sum of the diagonal blocks of a ``(k * size, k * size)`` correlation
    (a fused projection's ``k`` stacked copies of the units, each copy matched with its own)."""
    copies = correlation.shape[0] // size
    if copies * size != correlation.shape[0]:
        raise AlignmentError(f"a watched signal has {correlation.shape[0]} units, not a multiple of {size}")
    return sum(correlation[c * size : (c + 1) * size, c * size : (c + 1) * size] for c in range(copies))


def layer_distance(source: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor], layer) -> float:
    """Distance over the layer's per-head weights and biases (:func:`squared_distance` of views: no GEMM, and
    no temporary larger than its pieces)."""
    total = 0.0
    for name in ("query", "key", "value", "out", "query_bias", "key_bias", "value_bias"):
        rows = head_rows(source, layer, name)
        if rows is not None:
            total += squared_distance(rows, head_rows(target, layer, name))
    return total**0.5


def axes_distance(source: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor], axes) -> float:
    """The distance over the parameters named in ``axes``, each read once, a block of rows at a time
    (:func:`~lmc.matching.permutation.row_blocks`)."""
    names = dict.fromkeys(name for name, _ in axes)
    blocks = ((a, b) for n in names for a, b in zip(row_blocks(source, n), row_blocks(target, n)))
    return sum(squared_distance(a, b) for a, b in blocks) ** 0.5


def attention_stage1(
    source: Mapping[str, torch.Tensor],
    target: Mapping[str, torch.Tensor],
    layer: AttentionSpec,
    options: AlignOptions,
    order: list[int] | None = None,
    input_moment: PairedMoment | None = None,
    output_moment: PairedMoment | None = None,
    cost_of: Callable[[LayerGrams], torch.Tensor] | None = None,
) -> tuple[LayerGrams, LayerGrams, torch.Tensor, torch.Tensor, torch.Tensor, dict[str, float]]:
    """The Grams, the Stage 1 cost and head assignment of one layer pair, and the seconds each took.

    Args:
        source, target: Parameters holding (at least) the layer's tensors, by spec name.
        layer: The layer.
        options: Metric and Stage 2 settings (the ``weight`` metric runs Stage 2 per candidate pair).
        order: A head order to impose instead of Stage 1's (:func:`imposed_order`).
        input_moment: The layer input's paired moments (augmented with 1), for ``objective="data"``
            and ``metric="activation"``.
        output_moment: What ``W_O`` reads, paired, for ``metric="activation"``.
        cost_of: The Stage 1 cost from the Grams Stage 2 fits, for metrics that need more than the
            Grams (``metric="midpoint"`` runs the models: :func:`~lmc.matching.midpoint.midpoint_cost`).

    Returns:
        ``(grams, stage2_grams, cost, match, kv_match, seconds)``: the weight Grams, the Grams
        Stage 2 fits (the data Grams under ``objective="data"``), ``cost`` ``(h, h)``, ``match``
        the target head of each source query head ``(h,)``, ``kv_match`` that of each KV head ``(h_kv,)``.
    """
    dtype = source[layer.query.parameter].dtype
    seconds = {}
    start = time.perf_counter()
    grams = LayerGrams.compute(source, target, layer)
    require_finite(grams.all_finite(), f"{layer.name}: the Gram matrices", dtype)
    data_grams = None
    if input_moment is not None:
        data_grams = LayerGrams.compute(source, target, layer, input_moment)
        require_finite(data_grams.all_finite(), f"{layer.name}: the data Gram matrices", dtype)
    stage2_grams = data_grams if options.objective == "data" else grams
    seconds["grams"] = time.perf_counter() - start
    start = time.perf_counter()
    if cost_of is not None:
        cost = cost_of(stage2_grams)
    else:
        cost_grams = data_grams if options.metric == "activation" else stage2_grams
        cost = head_cost(cost_grams, layer, options, output_moment)
    require_finite(bool(torch.isfinite(cost).all()), f"{layer.name}: the Stage 1 head cost", dtype)
    match, kv_match = assign_heads(cost, layer.queries_per_kv) if order is None else imposed_order(order, layer)
    seconds["stage1"] = time.perf_counter() - start
    return grams, stage2_grams, cost, match, kv_match, seconds


def align_attention_layer(
    source: Mapping[str, torch.Tensor],
    target: Mapping[str, torch.Tensor],
    layer: AttentionSpec,
    options: AlignOptions,
    order: list[int] | None = None,
    naive_distance: float | None = None,
    input_moment: PairedMoment | None = None,
    output_moment: PairedMoment | None = None,
    cost_of: Callable[[LayerGrams], torch.Tensor] | None = None,
) -> tuple[AttentionTransform, LayerAlignment]:
    """Both stages on one attention layer pair: the group element up to ``options.last_stage`` and its record.

    Reads only the layer's tensors, so a caller can hand it one layer of each model at a time.

    Args:
        source, target: Parameters holding (at least) the layer's tensors, by spec name.
        layer: The layer.
        options: Method, metric and Stage 2 settings (``options.method`` is not ``"naive"``).
        order: A head order to impose instead of Stage 1's.
        naive_distance: The distance before alignment, recorded first (default: from ``source``).
        input_moment, output_moment: Activation statistics of data-aware options (:func:`attention_stage1`).
        cost_of: A Stage 1 cost that needs more than the Grams (:func:`attention_stage1`).

    Returns:
        ``(element, record)``: ``element`` maps the source layer's weights to the aligned ones;
        ``record.assignment``/``kv_assignment`` describe this element alone.
    """
    grams, stage2_grams, cost, match, kv_match, seconds = attention_stage1(
        source, target, layer, options, order, input_moment, output_moment, cost_of
    )
    start = time.perf_counter()
    stages = attention_stages(stage2_grams, layer, match, kv_match, options.last_stage, options)
    seconds["stage2"] = time.perf_counter() - start
    naive = layer_distance(source, target, layer) if naive_distance is None else naive_distance
    distance = {"naive": naive, **stage_distances(grams, layer, match, kv_match, stages)}
    record = LayerAlignment(
        name=layer.name,
        kind="attention",
        assignment=match.tolist(),
        kv_assignment=kv_match.tolist(),
        stage1_cost=cost.tolist(),
        distance=distance,
        seconds=seconds,
    )
    return stages[options.last_stage], record


def imposed_order(order: list[int], layer) -> tuple[torch.Tensor, torch.Tensor]:
    """``(match, kv_match)`` of a given head order, refused unless it keeps query heads with their KV head."""
    q = layer.queries_per_kv
    match = torch.as_tensor(order)
    if len(order) != layer.num_heads:
        raise AlignmentError(f"{layer.name}: a head order needs {layer.num_heads} entries, got {len(order)}")
    groups = match.view(-1, q) // q
    if not bool((groups == groups[:, :1]).all()):
        raise AlignmentError(f"{layer.name}: head order {order} splits the query heads of a key/value head")
    return match, groups[:, 0].clone()


def match_units(
    source: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor], permutation: AxisPermutation
) -> torch.Tensor:
    """The weight-matching permutation of ``permutation``'s units (Git Re-Basin's step; docs/spec.md, section 3).

    Args:
        source, target: Parameters holding (at least) the tensors of ``permutation.axes``, by name.
        permutation: The units (an FFN's hidden units, a task head's, the residual stream, the learned tokens).

    Returns:
        ``perm`` ``(size,)``: source unit ``perm[k]`` goes to position ``k``.
    """
    dtype = next(iter(source[name] for name, _ in permutation.axes)).dtype
    correlation = axis_correlation(source, target, permutation, compute_dtype(dtype))
    return correlated_units(correlation, permutation, dtype)


def correlated_units(correlation: torch.Tensor, permutation: AxisPermutation, dtype: torch.dtype) -> torch.Tensor:
    """The permutation of ``permutation``'s units maximizing their summed weight ``correlation`` ``(size, size)``
    (as :func:`match_units`), refused if the correlation overflowed for weights in ``dtype`` (checked by
    :func:`~lmc.matching.checks.all_finite`: ``isfinite`` would make a float64 copy of the matrix)."""
    require_finite(all_finite(correlation), f"{permutation.name}: the weight correlation", dtype)
    return best_permutation(correlation)


def signed_units(
    correlation: torch.Tensor, unsigned: torch.Tensor | None, permutation: AxisPermutation, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The permutation and signs of ``permutation``'s units maximizing their summed correlation (docs/spec.md,
    section 3, "Signs"): ``sum_i U[perm[i], i] + signs[i] S[perm[i], i]``, where ``U`` ``(size, size)`` is the
    part of ``correlation`` over the axes the signs leave alone (``permutation.unsigned``; ``None``: none) and
    ``S = correlation - U`` the part they flip.

    With one sign per unit each unit takes the sign of its ``S`` entry, so the assignment maximizes
    ``U + |S|``; with one global sign, the better of the assignments on ``U + S`` and ``U - S`` (``+1`` on a tie).
    Without a sign group this is :func:`correlated_units`.

    Returns:
        ``(perm, signs)``: ``perm`` as :func:`match_units`; ``signs`` ``(size,)`` of ``+-1`` (float64), unit ``i``
        after the permutation flipped where ``-1``; ``None`` without a sign group.
    """
    if permutation.signs == "none":
        return correlated_units(correlation, permutation, dtype), None
    require_finite(all_finite(correlation), f"{permutation.name}: the weight correlation", dtype)
    unsigned = torch.zeros_like(correlation) if unsigned is None else unsigned.to(correlation)
    signed = correlation - unsigned
    units = torch.arange(permutation.size)
    if permutation.signs == "each":
        perm = best_permutation(unsigned + signed.abs())
        return perm, torch.where(signed[perm, units] < 0, -1.0, 1.0).double()
    best = None
    for sign in (1.0, -1.0):
        cost = unsigned + sign * signed
        perm = best_permutation(cost)
        value = float(cost[perm, units].double().sum())
        if best is None or value > best[0]:
            best = (value, perm, sign)
    _, perm, sign = best
    return perm, torch.full((permutation.size,), sign, dtype=torch.float64)


def best_rotation(correlation: torch.Tensor, group: ResidualGroup, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """The rotation ``Q`` ``(d, d)`` (float64) of ``group`` maximizing ``sum_ij Q[i, j] correlation[j, i]`` (the
    residual correlation, source coordinate ``j`` against target coordinate ``i``): orthogonal Procrustes, ``U V^T``
    from the SVD of ``correlation^T``; for the centered group, the all-ones direction goes to the sign of its own
    correlation and its complement is solved alone (docs/spec.md, section 3, "Rotations").

    Returns:
        ``(Q, gain)``: ``gain`` is how much ``Q`` raises the summed correlation over the identity's, relative to
        the largest value (``>= 0``; 0 when the identity is already best).
    """
    require_finite(all_finite(correlation), "residual: the weight correlation", dtype)
    wanted = correlation.T.double().cpu()
    if group.centered:
        basis = centered_basis(group.width)
        turned = basis.T @ wanted @ basis
        left, _, right = torch.linalg.svd(turned[1:, 1:])
        sign = torch.tensor([[-1.0 if turned[0, 0] < 0 else 1.0]], dtype=torch.float64)
        rotation = basis @ torch.block_diag(sign, left @ right) @ basis.T
    else:
        left, _, right = torch.linalg.svd(wanted)
        rotation = left @ right
    best, kept = float((rotation * wanted).sum()), float(torch.trace(wanted))
    return rotation, max(best - kept, 0.0) / max(abs(best), torch.finfo(torch.float64).tiny)


def align_feed_forward_layer(
    source: Mapping[str, torch.Tensor],
    target: Mapping[str, torch.Tensor],
    spec: SymmetrySpec,
    index: int,
) -> tuple[torch.Tensor, LayerAlignment]:
    """Weight matching of one FFN's hidden units: the permutation and its record.

    Reads only the FFN's tensors, so a caller can hand it one block of each model at a time.
    The record's distances are over the tensors the permutation moves, before and after it.

    Returns:
        ``(perm, record)``: ``perm`` as :func:`match_units`; ``record.assignment`` the target unit of each source unit.
    """
    start = time.perf_counter()
    hidden = spec.blocks[index].feed_forward.hidden
    perm = match_units(source, target, hidden)
    names = dict.fromkeys(name for name, _ in hidden.axes)
    permuted = {name: source[name].clone() for name in names}
    ModelTransform(feed_forward={index: perm}).apply_(permuted, spec)
    distance = {
        "naive": axes_distance(source, target, hidden.axes),
        "permutation": axes_distance(permuted, target, hidden.axes),
    }
    seconds = {"match": time.perf_counter() - start}
    return perm, LayerAlignment(
        hidden.name, "feed_forward", torch.argsort(perm).tolist(), distance=distance, seconds=seconds
    )
