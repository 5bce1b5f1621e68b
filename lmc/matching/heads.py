"""Stage 1 of attention alignment: head costs and the head assignment (paper Section 5; docs/spec.md, section 3).

Stage 1 orders the heads by a linear assignment on an ``h x h`` cost between source and target
query heads; with grouped-query attention, query heads move only with their key/value head.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from lmc.matching.calibration import PairedMoment
from lmc.matching.grams import LayerGrams, frobenius_inner, trace
from lmc.matching.options import AlignOptions
from lmc.matching.stage2 import Stage2Problem, solve_stage2
from lmc.symmetry import AttentionSpec, qk_group, rotary_commutant, vo_group


def invariant_products(grams: LayerGrams, queries_per_kv: int) -> dict[str, torch.Tensor]:
    """Inner products of the invariants ``M_i = Q_i K_g^T`` (row-centred) and ``N_i = V_g O_i``.

    Uses ``<A1 B1^T, A2 B2^T> = sum((A1^T A2) * (B1^T B2))``: no ``d x d`` matrix is formed.

    Returns:
        ``qk_cross``, ``vo_cross`` of shape ``(h, h)`` and ``qk_source``, ``qk_target``,
        ``vo_source``, ``vo_target`` of shape ``(h,)``.
    """
    key_cross, key_source, key_target = grams.centred_key()
    q = queries_per_kv

    def per_query(kv: torch.Tensor) -> torch.Tensor:  # expand KV-group blocks (h_kv, d_h, d_h) to query heads
        return kv.repeat_interleave(q, 0)

    return {
        "qk_cross": _grouped_inner(grams.query_cross, key_cross, q),
        "vo_cross": _grouped_inner(grams.out_cross, grams.value_cross, q),
        "qk_source": frobenius_inner(grams.query_source, per_query(key_source)).double(),
        "qk_target": frobenius_inner(grams.query_target, per_query(key_target)).double(),
        "vo_source": frobenius_inner(per_query(grams.value_source), grams.out_source).double(),
        "vo_target": frobenius_inner(per_query(grams.value_target), grams.out_target).double(),
    }


def _grouped_inner(heads: torch.Tensor, groups: torch.Tensor, queries_per_kv: int) -> torch.Tensor:
    """``<heads[i, :, j, :], groups[g(i), :, g(j), :]>`` in float64 for query heads ``i, j`` (``g``: a head's KV
    group), shape ``(h, h)``, from ``heads`` ``(h, d_h, h, d_h)`` and ``groups`` ``(h_kv, d_h, h_kv, d_h)``.

    One source KV group at a time, in float64 copies of its blocks only: the group blocks are never
    expanded to the query heads (four copies of an 8B layer's 16.8M entries)."""
    h_kv, head_dim = groups.shape[:2]
    h = h_kv * queries_per_kv
    blocks = heads.reshape(h_kv, queries_per_kv, head_dim, h_kv, queries_per_kv, head_dim)
    inner = torch.empty(h_kv, queries_per_kv, h_kv, queries_per_kv, dtype=torch.float64, device=heads.device)
    for group in range(h_kv):
        products = blocks[group].double() * groups[group].double()[None, :, :, None, :]  # (q, d_h, h_kv, q, d_h)
        inner[group] = products.sum(dim=(1, 4))
    return inner.reshape(h, h)


def head_cost(
    grams: LayerGrams, spec: AttentionSpec, options: AlignOptions, head_outputs: PairedMoment | None = None
) -> torch.Tensor:
    """Stage 1 cost between source query head ``i`` and target query head ``j``, shape ``(h, h)``.

    Args:
        grams: The layer's Grams; for ``activation``, those on data (:meth:`LayerGrams.compute` with ``inputs``).
        spec: The layer.
        options: The metric, and Stage 2's settings for ``weight``.
        head_outputs: For ``activation``: the paired second moments of what ``W_O`` reads (the
            heads' outputs, ``(h d_h, h d_h)``) on the calibration tokens.

    Metrics (``options.metric``):
        ``invariant``: ``||M_i - M_j'||^2 + ||N_i - N_j'||^2`` (group-invariant products).
        ``rotary``: ``invariant`` with ``||M_i - M_j'||^2`` replaced, under RoPE, by the distance of the complete
            invariants of ``H`` (:func:`rotary_products`); without RoPE it is ``invariant``.
        ``balanced``: the same two terms, each divided by its heads' mean squared norm over both
            models: ``M`` (attention logits) and ``N`` (what the heads add to the residual stream)
            are in different units, and on the language models the first term is ~200x the second.
        ``weight``: the squared weight distance left after Stage 2 for each candidate pair
            (:func:`~lmc.matching.stage2.solve_stage2` with ``options``); with GQA the pair's own
            query head and its KV head stand for the group.
        ``correlation``: minus the cosine similarities of ``M`` and of ``N`` (scale-free).
        ``activation``: minus the cosine similarities, over the calibration tokens, of each head's
            output ``o_i = z_i W_O^i`` (``E<o_i, o'_j> / sqrt(E|o_i|^2 E|o'_j|^2)``, exact from the
            moments of ``z`` and the ``W_O`` Grams) and of its centred attention logits
            ``x_m W_Q^i W_K^i^T x_n^T`` over pairs of calibration tokens drawn independently (from
            the data Grams; with RoPE the rotation-free part, as ``invariant``). Both are invariant
            under the group, and neither reads directions the layer's input never takes.
        ``midpoint`` runs the models, so the aligner computes it (:mod:`lmc.matching.midpoint`).
    """
    if options.metric == "midpoint":
        raise ValueError(
            "metric='midpoint' runs the models on calibration batches (lmc.matching.midpoint.midpoint_cost), "
            "so it has no cost from the Grams alone; align in memory with a calibration"
        )
    if options.metric == "weight":
        return _pairwise_stage2_distance(grams, spec, options)
    p = invariant_products(grams, spec.queries_per_kv)
    if options.metric == "rotary":
        qk, vo = invariant_terms(p | rotary_products(grams, spec))  # the Q/K products replaced, V/O's kept
        return qk + vo
    if options.metric in ("invariant", "balanced"):
        qk, vo = invariant_terms(p)
        if options.metric == "balanced":
            return qk / _mean_square(p, "qk") + vo / _mean_square(p, "vo")
        return qk + vo
    qk = _cosine(p["qk_cross"], p["qk_source"], p["qk_target"])
    if options.metric == "correlation":
        return -(qk + _cosine(p["vo_cross"], p["vo_source"], p["vo_target"]))
    if head_outputs is None:
        raise ValueError("the activation metric needs the moments of the heads' outputs (head_outputs)")
    return -(qk + _cosine(*output_products(grams, head_outputs, spec.head_dim)))


def rotary_products(grams: LayerGrams, spec: AttentionSpec) -> dict[str, torch.Tensor]:
    """Inner products of the complete Q/K invariants of RoPE heads (docs/spec.md, section 3, "Stage 1 under RoPE").

    ``M_i = Q_i K_g^T`` sums the products of every rotary pair, and under RoPE the logits
    ``x_m W_Q R(n - m) W_K^T x_n^T`` read each pair's product apart, and its quarter turn too: for each class of
    pairs turning alike (one pair, unless several share their angles; :func:`~lmc.symmetry.rotary_commutant`),
    with coordinates ``c``, ``A = Q_c K_c^T`` and ``B = Q_c J K_c^T`` (``J`` the class's multiplication by ``i``,
    which commutes with every element of ``H``) are invariant, and so is ``Q_u K_u^T`` on the coordinates ``u``
    that never turn. Each inner product is ``sum((Q^T Q') * (K^T K'))``, with ``J^T (Q^T Q') J`` for ``B``, on the
    row-centred key Grams as :func:`invariant_products`. Without RoPE every coordinate is ``u``: the products
    equal :func:`invariant_products`'.

    Returns:
        ``qk_cross`` ``(h, h)``, ``qk_source`` and ``qk_target`` ``(h,)``.
    """
    key_cross, key_source, key_target = grams.centred_key()
    kv = torch.arange(spec.num_heads) // spec.queries_per_kv
    blocks: list[tuple[torch.Tensor, bool]] = [(torch.arange(spec.head_dim), False)]
    if spec.rotary is not None:
        group = rotary_commutant(spec.head_dim, spec.rotary)
        blocks = [(group.real_coordinates, False)]
        blocks += [(torch.cat([members[:, 0], members[:, 1]]), True) for members in group.complex_blocks]
    h = spec.num_heads
    products = {"qk_cross": torch.zeros(h, h), "qk_source": torch.zeros(h), "qk_target": torch.zeros(h)}
    products = {name: value.double() for name, value in products.items()}
    for coordinates, turns in blocks:
        if not len(coordinates):
            continue
        c = coordinates
        queries = grams.query_cross[:, c][:, :, :, c].double()  # (h, n, h, n)
        keys = key_cross[kv][:, c][:, :, kv][:, :, :, c].double()
        products["qk_cross"] += _turned_inner(queries, keys, turns, (1, 3))
        for side, query_gram, key_gram in (
            ("source", grams.query_source, key_source),
            ("target", grams.query_target, key_target),
        ):
            own_queries, own_keys = query_gram[:, c][:, :, c].double(), key_gram[kv][:, c][:, :, c].double()
            products[f"qk_{side}"] += _turned_inner(own_queries, own_keys, turns, (1, 2))
    return products


def _turned_inner(queries: torch.Tensor, keys: torch.Tensor, turns: bool, axes: tuple[int, int]) -> torch.Tensor:
    """``sum((Q^T Q') * (K^T K'))`` over the coordinate ``axes``, plus with ``turns`` the same with ``J^T (Q^T Q') J``.

    The coordinates are ``[x | y]`` halves of one class, so ``J^T X J = [[X_yy, -X_yx], [-X_xy, X_xx]]``: the
    halves swapped on both axes, entries signed by ``s_a s_b`` with ``s = [1 .. 1, -1 .. -1]``."""
    inner = (queries * keys).sum(dim=axes)
    if turns:
        n = queries.shape[axes[0]]
        swap = torch.cat([torch.arange(n // 2, n), torch.arange(n // 2)])
        signs = torch.cat([torch.ones(n // 2), -torch.ones(n // 2)]).double()
        turned = queries.index_select(axes[0], swap).index_select(axes[1], swap)
        shape_first, shape_second = [1] * queries.dim(), [1] * queries.dim()
        shape_first[axes[0]], shape_second[axes[1]] = n, n
        turned = turned * signs.view(shape_first) * signs.view(shape_second)
        inner = inner + (turned * keys).sum(dim=axes)
    return inner


def invariant_terms(products: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The two terms of the ``invariant`` cost from :func:`invariant_products`: ``||M_i - M_j'||^2``
    and ``||N_i - N_j'||^2``, each ``(h, h)`` (source query head ``i``, target query head ``j``)."""
    qk = products["qk_source"][:, None] + products["qk_target"][None, :] - 2 * products["qk_cross"]
    vo = products["vo_source"][:, None] + products["vo_target"][None, :] - 2 * products["vo_cross"]
    return qk, vo


def _mean_square(products: dict[str, torch.Tensor], term: str) -> torch.Tensor:
    """The heads' mean squared norm of one invariant (``||M_i||^2`` or ``||N_i||^2``) over both models:
    the unit of its term in the ``balanced`` cost (a term of zero heads stays zero)."""
    mean = (products[f"{term}_source"].mean() + products[f"{term}_target"].mean()) / 2
    return mean.clamp_min(torch.finfo(mean.dtype).tiny)


def _cosine(cross: torch.Tensor, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    tiny = torch.finfo(torch.float64).tiny
    return cross / (source[:, None] * target[None, :]).clamp(min=tiny).sqrt()


def output_products(
    grams: LayerGrams, head_outputs: PairedMoment, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``E<o_i, o'_j>`` ``(h, h)``, ``E|o_i|^2`` and ``E|o'_j|^2`` ``(h,)`` of the heads' outputs through ``W_O``.

    ``<z_i W_O^i, z'_j W_O'^j> = sum_ab z_i[a] z'_j[b] <W_O^i[a], W_O'^j[b]>``: the moments of ``z``
    times the output Grams, elementwise; no ``d``-wide product per token.
    """
    blocks = {
        k: getattr(head_outputs, k).unflatten(1, (-1, head_dim)).unflatten(0, (-1, head_dim))
        for k in ("source", "cross", "target")
    }
    out_cross = grams.out_cross.double()
    cross = torch.einsum("iajb,iajb->ij", out_cross, blocks["cross"].to(out_cross))
    diagonal = torch.arange(out_cross.shape[0])
    source = frobenius_inner(grams.out_source.double(), blocks["source"][diagonal, :, diagonal, :].to(out_cross))
    target = frobenius_inner(grams.out_target.double(), blocks["target"][diagonal, :, diagonal, :].to(out_cross))
    return cross, source, target


def _pairwise_stage2_distance(grams: LayerGrams, spec: AttentionSpec, options: AlignOptions) -> torch.Tensor:
    h, q = spec.num_heads, spec.queries_per_kv
    kv_of = torch.arange(h) // q
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(h), indexing="ij")
    rows, cols = rows.flatten(), cols.flatten()
    gs, gt = kv_of[rows], kv_of[cols]
    qk_problem = Stage2Problem(
        grams.query_source[rows].double(),
        grams.block("query", rows, cols),
        grams.key_source[gs].double(),
        grams.block("key", gs, gt),
        trace(grams.query_target[cols]) + trace(grams.key_target[gt]),
    )
    vo_problem = Stage2Problem(
        grams.value_source[gs].double(),
        grams.block("value", gs, gt),
        grams.out_source[rows].double(),
        grams.block("out", rows, cols),
        trace(grams.value_target[gt]) + trace(grams.out_target[cols]),
    )
    total = torch.zeros(h * h, dtype=torch.float64)
    for problem, group in ((qk_problem, qk_group(spec)), (vo_problem, vo_group(spec))):
        total += problem.distance(solve_stage2(problem, group, options))
    return total.reshape(h, h)


def assign_heads(cost: torch.Tensor, queries_per_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Solve Stage 1: KV groups by a linear assignment on group costs, then query heads inside.

    The cost of pairing source group ``g`` with target group ``g'`` is the optimal inner
    assignment of their query heads, so the result minimizes the total cost over every
    permutation that keeps query heads with their KV head.

    Args:
        cost: ``(h, h)`` cost of source query head ``i`` -> target query head ``j``.
        queries_per_kv: Query heads per KV head (1 without GQA).

    Returns:
        ``(match, kv_match)``: target head of each source query head ``(h,)`` and target KV
        head of each source KV head ``(h_kv,)``.
    """
    q = queries_per_kv
    h_kv = cost.shape[0] // q
    blocks = cost.double().cpu().numpy().reshape(h_kv, q, h_kv, q).transpose(0, 2, 1, 3)  # (g, g', i, j)
    inner = {}
    group_cost = np.zeros((h_kv, h_kv))
    for g in range(h_kv):
        for g2 in range(h_kv):
            rows, cols = linear_sum_assignment(blocks[g, g2])
            inner[g, g2] = cols
            group_cost[g, g2] = blocks[g, g2][rows, cols].sum()
    _, kv_match = linear_sum_assignment(group_cost)
    match = np.concatenate([kv_match[g] * q + inner[g, kv_match[g]] for g in range(h_kv)])
    return torch.as_tensor(match), torch.as_tensor(kv_match)
