"""The paper's Table 1, measured in one pair: every head order of the first attention layer, each
followed by the full Stage 2, and the noise of the evaluation data on their barriers.

A pair's alignments are ranked against all ``h!`` orders (GQA: those that keep query heads with
their key/value head), and ``L_hat = (L_method - L_top1) / (L_naive - L_top1) * 100`` says how
much of the gap between the naive and the best order's barrier a method leaves (docs/spec.md,
section 4). :func:`sweep_head_orders` computes exact ranks at a fraction of ``h!`` whole curves.
The statistics over pairs are :mod:`lmc.experiments.stats.table1`'s; the report's tables are
:mod:`lmc.experiments.report.table1`'s.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lmc.connectivity.interpolation import (
    BARRIER_METRICS,
    barriers,
    bootstrap_barriers,
    recorded_cluster_sums,
    weighted_barriers,
)
from lmc.experiments.protocol import RunError
from lmc.matching import AlignOptions

#: Key of a pair's head-order sweeps (order label -> result) beside its alignments' results.
HEAD_ORDERS = "head_orders"

#: Key of the evaluation noise of each alignment's head order (:func:`head_order_noise`) beside them.
HEAD_ORDER_NOISE = "head_order_noise"

#: Key of :func:`summarize_refinement` in ``summary.json``: the refinement's gap to its orthogonal start.
REFINEMENT = "refinement"

#: Bootstrap draws of the evaluated samples (in clusters) behind each noise estimate.
RESAMPLES = 1000

#: An order is told apart from another when its barrier is lower in at least this share of the draws.
TOLD_APART = 0.975

#: Random cuts of the evaluated clusters into two halves behind each held-out pick (:func:`held_out_orders`).
HALVES = 100


def rank_and_l_hat(order_barriers: dict[str, float], chosen: str, method: float, naive: float) -> tuple[int, float]:
    """The rank of the chosen head order among all orders, and ``L_hat`` of a method (docs/spec.md, section 4).

    Args:
        order_barriers: Barrier of each head order, each followed by the full Stage 2.
        chosen: The order the method's Stage 1 picked (a key of ``order_barriers``).
        method: The method's own barrier.
        naive: The naive barrier.

    Returns:
        ``(rank, L_hat)``: 1 for the best order (ties share the better rank), and
        ``(method - L_top1) / (naive - L_top1) * 100`` with ``L_top1`` the best order's barrier
        (NaN when the naive barrier is no worse than the best order's).
    """
    rank = 1 + sum(barrier < order_barriers[chosen] for barrier in order_barriers.values())
    top1 = min(order_barriers.values())
    l_hat = 100.0 * (method - top1) / (naive - top1) if naive > top1 else math.nan
    return rank, l_hat


def order_grid(orders: dict[str, dict[str, Any]]) -> list[float]:
    """The alphas of the whole head-order curves of a pair (:func:`sweep_head_orders`'s results)."""
    return max((r["settings"]["alphas"] for r in orders.values()), key=len)


def barriers_at(curve: dict[str, Any], alphas: list[float]) -> dict[str, float]:
    """A swept curve's barriers on ``alphas`` only: the head-order grid, among the curve's own alphas
    (the exact floats: ``k / 12`` is ``2k / 24``), so that a method and the orders it is ranked
    among are compared on the same points."""
    wanted = set(alphas)
    points = [point for point in curve["points"] if point["alpha"] in wanted]
    if len(points) != len(wanted):
        raise ValueError(
            f"the curve's alphas {[p['alpha'] for p in curve['points']]} do not hold the head orders' {alphas}"
        )
    return barriers(points)


def head_orders(layer) -> list[tuple[int, ...]]:
    """Every order of a layer's query heads that keeps each with its key/value head (``h!`` without GQA)."""
    if layer.num_heads > 6:
        raise RunError(
            f"protocol.head_orders scores all {layer.num_heads}! head orders of {layer.name}: use at most 6 heads"
        )
    q = layer.queries_per_kv
    return [
        order
        for order in itertools.permutations(range(layer.num_heads))
        if all(len({head // q for head in order[g : g + q]}) == 1 for g in range(0, layer.num_heads, q))
    ]


def picked_orders(results: dict[str, Any]) -> dict[str, str]:
    """Alignment label -> the order (label) of the first attention layer its Stage 1 picked; naive has none."""
    picked = {}
    for label, result in results.items():
        if layers := [layer for layer in result["alignment"]["layers"] if layer["kind"] == "attention"]:
            picked[label] = "".join(map(str, layers[0]["assignment"]))
    return picked


def sweep_head_orders(
    orders: list[tuple[int, ...]],
    results: dict[str, Any],
    alphas: list[float],
    folder: Path,
    sweep: Callable[..., dict[str, Any]],
) -> dict[str, dict[str, Any]]:
    """Every head order of the first attention layer followed by the full Stage 2, with exact
    ranks and ``L_top1`` at a fraction of ``h!`` whole curves.

    A barrier is the largest gap over the curve's alphas, so the gap on any of them bounds it from
    below. Each order is first swept at the two end points and the middle alpha (its
    ``screening``); orders picked by a listed alignment's Stage 1 get their whole curve, and so
    does every other order whose screening bound (loss or accuracy) lies below the largest whole-curve
    barrier of the picked ones. An order left at its bound can neither be strictly better than a
    picked order nor be the best one, so ranks and ``L_hat`` are those of all whole curves.

    ``alphas`` are a whole order curve's (``Protocol.order_alphas``): among the method curves' own,
    so that :func:`summarize_head_orders` compares every barrier on them (:func:`barriers_at`).
    """
    labels = ["".join(map(str, order)) for order in orders]
    full = {label: AlignOptions(head_orders={0: [int(h) for h in label]}) for label in labels}
    if len(alphas) <= 3:  # nothing to screen out
        return {label: sweep(full[label], folder / label, alphas, figures=False) for label in labels}
    screening = [alphas[0], alphas[len(alphas) // 2], alphas[-1]]
    bounds = {label: sweep(full[label], folder / "screening" / label, screening, figures=False) for label in labels}
    picked = set(picked_orders(results).values())
    swept = {label: sweep(full[label], folder / label, alphas, figures=False) for label in labels if label in picked}
    worst = {
        name: max((r["curves"]["aligned"][name] for r in swept.values()), default=math.inf)
        for name in ("loss_barrier", "accuracy_barrier")
    }
    for label in labels:
        if label not in swept and any(bounds[label]["curves"]["aligned"][n] < worst[n] for n in worst):
            swept[label] = sweep(full[label], folder / label, alphas, figures=False)
    return {label: swept.get(label, bounds[label]) for label in labels}


def head_order_noise(
    orders: dict[str, dict[str, Any]], picked: dict[str, str], folder: Path, alphas: list[float]
) -> dict[str, dict[str, Any]]:
    """How far each alignment's head order is from the best one, against the noise of the evaluation data.

    Every whole-curve order of :func:`sweep_head_orders` recorded its evaluated clusters' sums;
    :func:`~lmc.connectivity.interpolation.bootstrap_barriers` redraws those clusters (the same draws for
    every order), so each order's barrier has a distribution over evaluation sets of the same size.
    An order is told apart from another where its barrier is lower in :data:`TOLD_APART` of the draws.

    Args:
        orders: :func:`sweep_head_orders`'s results (order label -> result).
        picked: Alignment label -> the order its Stage 1 picked (a whole-curve order).
        folder: Where :func:`sweep_head_orders` swept them.
        alphas: The whole curves' alphas.

    Returns:
        Per alignment and barrier: ``gap`` (its order's barrier minus the best order's), ``gap_std``
        (the gap's bootstrap standard deviation), ``tie`` (the best order is not told apart from
        it) and ``rank_within_noise`` (1 + the orders told apart as lower). Empty when an order's
        clusters were not recorded (a distributed evaluation records none).
    """
    whole = {
        label: recorded_cluster_sums(folder / label / "lmc_sweep_state_0.json", alphas=alphas)
        for label, result in orders.items()
        if len(result["settings"]["alphas"]) == len(alphas)
    }
    if any(clusters is None for clusters in whole.values()) or not set(picked.values()) <= set(whole):
        return {}
    draws = bootstrap_barriers(whole, alphas, RESAMPLES)
    noise: dict[str, dict[str, Any]] = {}
    for label, chosen in picked.items():
        noise[label] = {}
        for name in ("loss_barrier", "accuracy_barrier"):
            barriers = {order: orders[order]["curves"]["aligned"][name] for order in whole}
            best = min(barriers, key=barriers.get)

            def told_apart(lower: str) -> bool:
                return float((draws[lower][name] < draws[chosen][name]).double().mean()) >= TOLD_APART

            noise[label][name] = {
                "gap": barriers[chosen] - barriers[best],
                "gap_std": float((draws[chosen][name] - draws[best][name]).std()),
                "tie": not told_apart(best),
                "rank_within_noise": 1 + sum(told_apart(order) for order in whole),
            }
    return noise


def held_out_orders(
    orders: dict[str, dict[str, Any]],
    picked: dict[str, str],
    folder: Path,
    naive_state: Path,
    alphas: list[float],
    halves: int = HALVES,
    seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """Each alignment's Stage 1 order against the order the evaluation data itself would pick, in one pair.

    The evaluated clusters are cut into two random halves. The order with the lowest barrier on one
    half is the held-out pick: chosen on samples independent of the other half, on which it and each
    alignment's order are scored (rank among the orders, and ``L_hat`` against that half's best order
    and naive barrier), over ``halves`` cuts and both directions. Stage 1 sees no evaluation data, so
    where it leaves no more than the held-out pick, the evaluation data cannot point to a better order
    either (at half its size: more samples would sharpen both the pick and its scoring). An order
    swept at the screening alphas only counts with its screening barrier on each half, a lower bound
    of its barrier (as in :func:`summarize_head_orders`), which can only favour the held-out pick.

    Args:
        orders: :func:`sweep_head_orders`'s results (order label -> result).
        picked: Alignment label -> the order its Stage 1 picked (a whole-curve order).
        folder: Where :func:`sweep_head_orders` swept them.
        naive_state: The pair's naive sweep state, which holds the naive curve on ``alphas``.
        alphas: The whole curves' alphas.
        halves: Random cuts into halves.
        seed: Seed of the cuts.

    Returns:
        Per barrier (``loss_barrier``, ``accuracy_barrier``): ``held_out`` and, per alignment label,
        ``{"rank", "l_hat"}``, means over the cuts' scored halves (``L_hat`` over those whose naive
        barrier lies above their best order's). Empty when a curve's clusters were not recorded.
    """
    curves = {}
    for label, result in orders.items():
        own = result["settings"]["alphas"]
        state = folder / label if len(own) == len(alphas) else folder / "screening" / label
        curves[label] = (own, recorded_cluster_sums(state / "lmc_sweep_state_0.json", alphas=own))
    curves[None] = (alphas, recorded_cluster_sums(naive_state, "naive", alphas))
    if any(clusters is None for _, clusters in curves.values()):
        return {}
    count = len(curves[None][1][0])
    generator = torch.Generator().manual_seed(seed)
    first = torch.zeros(halves, count, dtype=torch.float64)
    for cut in range(halves):
        first[cut, torch.randperm(count, generator=generator)[: count // 2]] = 1.0
    weights = torch.cat([first, 1.0 - first])  # (2 * halves, count): every cut's first half, then its second
    labels = list(orders)
    swap = torch.cat([torch.arange(halves, 2 * halves), torch.arange(halves)])  # the other half of each row
    result: dict[str, dict[str, Any]] = {}
    for name in ("loss_barrier", "accuracy_barrier"):
        barrier = {label: weighted_barriers(c, a, weights)[name] for label, (a, c) in curves.items()}
        table = torch.stack([barrier[label] for label in labels])  # (orders, rows)
        top1, naive = table.min(0).values, barrier[None]
        pick = table.argmin(0)[swap]  # each row's order picked on the other half

        def scored(index: torch.Tensor) -> dict[str, float]:
            own = table.gather(0, index[None])[0]
            ranks = 1.0 + (table < own).sum(0).double()
            l_hat = torch.where(naive > top1, 100.0 * (own - top1) / (naive - top1), math.nan)
            return {"rank": float(ranks.mean()), "l_hat": float(l_hat.nanmean())}

        result[name] = {"held_out": scored(pick)}
        for label, chosen in picked.items():
            result[name][label] = scored(torch.full_like(pick, labels.index(chosen)))
    return result


def refinement_noise(pair: Path, alphas: list[float]) -> dict[str, dict[str, Any]]:
    """How far Stage 2's gradient refinement (``full``) moved the barrier of its orthogonal start
    (``orthogonal``, Variant 2) in one pair, against the noise of the evaluation data.

    Both alignments' aligned curves recorded their evaluated clusters' sums in their sweep state;
    :func:`~lmc.connectivity.interpolation.bootstrap_barriers` redraws those clusters (the same draws
    for both curves), so the difference of the two barriers has a distribution over evaluation sets
    of the same size, as in :func:`head_order_noise`.

    Args:
        pair: The pair's folder (``pairs/<i>_<j>``), which holds ``orthogonal/`` and ``full/``.
        alphas: Alphas both curves hold (the orthogonal start's, among the full method's).

    Returns:
        Per barrier (``loss_barrier``, ``accuracy_barrier``): ``gap`` (full's barrier minus
        orthogonal's, on every evaluated sample), ``gap_std`` (the gap's bootstrap standard deviation),
        ``raised`` and ``lowered`` (full's barrier is higher, or lower, in at least :data:`TOLD_APART`
        of the draws). Empty when a curve's clusters were not recorded (a distributed evaluation records none).
    """
    curves = {
        label: recorded_cluster_sums(pair / label / "lmc_sweep_state_0.json", alphas=alphas)
        for label in ("orthogonal", "full")
    }
    if any(clusters is None for clusters in curves.values()):
        return {}
    draws = bootstrap_barriers(curves, alphas, RESAMPLES)
    whole = {label: barriers(recorded_points(cluster_sums, alphas)) for label, cluster_sums in curves.items()}
    noise = {}
    for name in ("loss_barrier", "accuracy_barrier"):
        difference = draws["full"][name] - draws["orthogonal"][name]
        noise[name] = {
            "gap": whole["full"][name] - whole["orthogonal"][name],
            "gap_std": float(difference.std()),
            "raised": float((difference > 0).double().mean()) >= TOLD_APART,
            "lowered": float((difference < 0).double().mean()) >= TOLD_APART,
        }
    return noise


def recorded_points(cluster_sums: list[list[dict[str, float]]], alphas: list[float]) -> list[dict[str, float]]:
    """A curve's points on all its evaluated samples, from their per-cluster sums (:func:`recorded_cluster_sums`)."""
    return [
        {
            "alpha": alpha,
            **{
                metric: sum(cluster[metric] for cluster in clusters) / sum(cluster["count"] for cluster in clusters)
                for metric in BARRIER_METRICS
            },
        }
        for alpha, clusters in zip(alphas, cluster_sums, strict=True)
    ]
