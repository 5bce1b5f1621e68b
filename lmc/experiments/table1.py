"""The paper's Table 1: every head order of the first attention layer, each followed by the full Stage 2.

A pair's alignments are ranked against all ``h!`` orders (GQA: those that keep query heads with
their key/value head), and ``L_hat = (L_method - L_top1) / (L_naive - L_top1) * 100`` says how
much of the gap between the naive and the best order's barrier a method leaves (docs/spec.md,
section 4). :func:`sweep_head_orders` computes exact ranks at a fraction of ``h!`` whole curves.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lmc.connectivity import NO_BARRIER
from lmc.connectivity.interpolation import (
    BARRIER_METRICS,
    CLUSTER_SAMPLES,
    barriers,
    bootstrap_barriers,
    recorded_cluster_sums,
    weighted_barriers,
)
from lmc.experiments.protocol import RunError
from lmc.experiments.spread import cell, curve_alphas_text, spread
from lmc.matching import AlignOptions

#: The matcher variants of Table 1, by their ``lmc run`` labels.
VARIANTS = {"permutation": "Variant 1 (Stage 1 only)", "orthogonal": "Variant 2 (orthogonal start)", "full": "full"}
#: What the paper reports (Table 1; Section 6.2; Appendix J).
PAPER_TABLE1 = {"permutation": "62-91 %", "orthogonal": "10-16 %", "full": "7-12 %"}
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


def summarize_head_orders(
    pairs: dict[tuple[int, int], dict[str, Any]],
    labels: list[str],
    folders: dict[tuple[int, int], Path] | None = None,
) -> dict[str, Any]:
    """Per alignment: its Stage 1 order's rank among all head orders of the first attention layer,
    ``L_hat`` for the loss and accuracy barriers (NaN for a pair whose naive barrier is below
    :data:`~lmc.connectivity.NO_BARRIER`, as its ratio), mean and spread over pairs (the paper's Table 1), and
    where measured (:func:`head_order_noise`) its gap to the best order, whether that gap exceeds the
    evaluation noise (``ties``: the pairs where it does not) and its rank within the noise.

    With the pairs' ``folders``, also :func:`held_out_orders` of each pair whose clusters were
    recorded (``halves``): the alignment's and the held-out pick's rank and ``L_hat`` on halves of
    the evaluated samples, and their paired difference."""
    first = next(iter(pairs.values()))[HEAD_ORDERS]
    study: dict[str, Any] = {"orders": len(first), "order_alphas": len(order_grid(first)), "alignments": {}}
    halves = {}
    for key, pair in pairs.items() if folders else ():
        orders = pair[HEAD_ORDERS]
        picked = picked_orders({label: pair[label] for label in labels})
        grid = order_grid(orders)
        halves[key] = held_out_orders(
            orders, picked, folders[key] / "orders", folders[key] / "naive_sweep_state.json", grid
        )
    for label in labels:
        per_pair = {}
        for (i, j), pair in pairs.items():
            result, orders = pair[label], pair[HEAD_ORDERS]
            chosen = picked_orders({label: result}).get(label)
            if chosen is None:  # naive: no head order
                continue
            grid = order_grid(orders)
            whole = sum(len(r["settings"]["alphas"]) == len(grid) for r in orders.values())
            entry = {"order": chosen, "whole_curves": whole}
            noise = pair.get(HEAD_ORDER_NOISE, {}).get(label, {})
            method, naive = (barriers_at(result["curves"][curve], grid) for curve in ("aligned", "naive"))
            for name in ("loss_barrier", "accuracy_barrier"):
                barriers = {order: r["curves"]["aligned"][name] for order, r in orders.items()}
                rank, l_hat = rank_and_l_hat(barriers, chosen, method[name], naive[name])
                if naive[name] < NO_BARRIER[name]:  # nothing to remove: left out of L_hat, as of the ratios
                    l_hat = math.nan
                entry[name] = {
                    "rank": rank,
                    "l_hat": l_hat,
                    "top1": min(barriers.values()),
                    "best_order": min(barriers, key=barriers.get),
                    **noise.get(name, {}),
                }
                if halves.get((i, j)):
                    held = halves[(i, j)][name]
                    entry[name]["halves"] = {"stage1": dict(held[label]), "held_out": dict(held["held_out"])}
                    if math.isnan(l_hat):  # as L_hat itself: a pair without a naive barrier is left out
                        for scored in entry[name]["halves"].values():
                            scored["l_hat"] = math.nan
            per_pair[f"{i}_{j}"] = entry
        if per_pair:
            study["alignments"][label] = {
                "per_pair": per_pair,
                **{
                    name: {
                        "rank": spread([float(e[name]["rank"]) for e in per_pair.values()]),
                        "l_hat": spread([e[name]["l_hat"] for e in per_pair.values()]),
                        "rank_within_noise": spread(
                            [float(e[name].get("rank_within_noise", math.nan)) for e in per_pair.values()]
                        ),
                        "gap": spread([e[name].get("gap", math.nan) for e in per_pair.values()]),
                        "ties": sum(bool(e[name].get("tie")) for e in per_pair.values()),
                        "noise_pairs": sum("tie" in e[name] for e in per_pair.values()),
                        **summarize_halves([e[name]["halves"] for e in per_pair.values() if "halves" in e[name]]),
                    }
                    for name in ("loss_barrier", "accuracy_barrier")
                },
            }
    return study


def summarize_halves(pairs: list[dict[str, dict[str, float]]]) -> dict[str, Any]:
    """Spread over pairs of :func:`held_out_orders`' scores of one alignment and barrier: the rank and
    ``L_hat`` of its order and of the held-out pick, and of their paired differences (``{}``: none measured)."""
    if not pairs:
        return {}
    stats = {}
    for score in ("rank", "l_hat"):
        stage1, held_out = ([pair[who][score] for pair in pairs] for who in ("stage1", "held_out"))
        stats[score] = {
            "stage1": spread(stage1),
            "held_out": spread(held_out),
            "difference": spread([a - b for a, b in zip(stage1, held_out, strict=True)]),
        }
    return {"halves": {"pairs": len(pairs), **stats}}


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


def summarize_refinement(pairs: dict[str, Path], alphas: list[float]) -> dict[str, Any]:
    """:func:`refinement_noise` of every pair whose clusters were recorded, and per barrier how many
    pairs the refinement raised (``raised``: any rise; ``raised_beyond_noise``) or lowered beyond the noise.

    Args:
        pairs: Pair name (``<i>_<j>``) -> its folder.
        alphas: Alphas both curves of every pair hold (the orthogonal start's).
    """
    per_pair = {name: noise for name, folder in pairs.items() if (noise := refinement_noise(folder, alphas))}
    counts = {
        name: {
            "pairs": len(per_pair),
            "raised": sum(entry[name]["gap"] > 0 for entry in per_pair.values()),
            "raised_beyond_noise": sum(entry[name]["raised"] for entry in per_pair.values()),
            "lowered_beyond_noise": sum(entry[name]["lowered"] for entry in per_pair.values()),
        }
        for name in ("loss_barrier", "accuracy_barrier")
    }
    return {"resamples": RESAMPLES, "told_apart": TOLD_APART, "per_pair": per_pair, **counts}


def head_order_table(study: dict[str, Any]) -> list[str]:
    """The lines of the head-order section of ``summary.md`` (:func:`summarize_head_orders`'s ``study``)."""
    lines = [
        f"Head orders of the first attention layer: all {study['orders']}, each followed by the full Stage 2, "
        f"each order's curve on {study.get('order_alphas', 'all the')} alphas, and the ranks and L_hat compare "
        "the methods' and the naive barriers on those alphas. "
        "Rank 1 is the order with the lowest barrier; L_hat = (L_method - L_top1) / (L_naive - L_top1) * 100. "
        "Orders that cannot change a rank or L_top1 are swept at three alphas only (see lmc.experiments.table1). "
        f"Against the noise of the evaluation data ({RESAMPLES} bootstrap draws of the evaluated samples, in "
        f"clusters of {CLUSTER_SAMPLES} consecutive ones): "
        "`rank within noise` counts only the orders told apart as lower, and `tied with best` the pairs "
        "whose order the best one is not told apart from. On halves of the evaluated samples "
        f"({HALVES} random cuts): the L_hat of the alignment's order on one half, and of the order with the "
        "lowest barrier on the other half (the held-out pick, what the evaluation data itself would choose).",
        "",
        "| alignment | rank (loss) | rank within noise (loss) | tied with best (loss) | L_hat loss % "
        "| L_hat loss % on a half | held-out pick's | rank (accuracy) | L_hat accuracy % |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, entry in study["alignments"].items():
        loss, accuracy, pairs = entry["loss_barrier"], entry["accuracy_barrier"], len(entry["per_pair"])
        halves = loss.get("halves", {}).get("l_hat", {})
        lines.append(
            f"| {label} | {cell(loss['rank'], 1)} | {cell(loss.get('rank_within_noise'), 1, of=pairs)} "
            f"| {ties(loss)} | {cell(loss['l_hat'], 1, of=pairs)} | {cell(halves.get('stage1'), 1, of=pairs)} "
            f"| {cell(halves.get('held_out'), 1, of=pairs)} "
            f"| {cell(accuracy['rank'], 1)} | {cell(accuracy['l_hat'], 1, of=pairs)} |"
        )
    return lines


def ties(stats: dict[str, Any]) -> str:
    """``k of n`` pairs whose order is tied with the best one, ``n/a`` where no noise was measured."""
    return f"{stats['ties']} of {stats['noise_pairs']}" if stats.get("noise_pairs") else "n/a"


def table1_section(runs: list[tuple[Any, dict[str, Any]]]) -> list[str]:
    """The report's Table 1 of the ``(family, summary)`` of each finished Table 1 run (``docs/results.md``).

    A variant no run aligned with (a protocol that lists fewer) has no column.
    """
    variants = {
        label: title
        for label, title in VARIANTS.items()
        if not runs or any(label in summary["alignments"] for _, summary in runs)
    }
    lines = [
        "## Table 1: Stage 1's head order and the matcher's variants (first attention layer)",
        "",
        "Rank of the head order Stage 1 picks among all orders of the first layer's heads that keep each "
        "query head with its key/value head (`orders`: 4! = 24 for 4 heads, 8 for 4 query heads on 2 key/value "
        "heads), each followed by the full Stage 2, on "
        + order_alphas_text(runs)
        + "; `L_hat = (L_method - L_top1) / (L_naive - L_top1) * 100` (a pair without a naive barrier is left "
        "out of it as of the ratios, and a cell over fewer pairs says so), and the "
        "aligned barrier as % of the naive one for each variant (loss barrier; accuracy in the "
        f"second table). Against the noise of the evaluation data (bootstrap draws of its samples, in clusters of "
        f"{CLUSTER_SAMPLES} consecutive ones): `within "
        "noise` counts only the orders told apart as lower, `tied` the pairs whose order the best one is not "
        "told apart from.",
        "",
        "| family | pairs | orders | rank (loss) | within noise | tied | L_hat loss | rank (acc) | L_hat acc | "
        + " | ".join(variants.values())
        + " |",
        "|---|---|---|---|---|---|---|---|---|" + "---|" * len(variants),
    ]
    accuracy = ["", "| family | " + " | ".join(f"{v}, accuracy" for v in variants.values()) + " |"]
    accuracy.append("|---|" + "---|" * len(variants))
    for family, summary in runs:
        orders = summary["head_orders"]["alignments"].get("full", {})
        loss, acc = orders.get("loss_barrier", {}), orders.get("accuracy_barrier", {})
        ratios = {label: summary["alignments"].get(label, {}).get("barrier_ratio", {}) for label in variants}
        pairs = len(summary["pairs"])
        lines.append(
            f"| {family.title} | {pairs} | {summary['head_orders']['orders']} | {cell(loss.get('rank'), of=pairs)} "
            f"| {cell(loss.get('rank_within_noise'), of=pairs)} | {ties(loss) if loss else 'n/a'} "
            f"| {cell(loss.get('l_hat'), of=pairs)} | {cell(acc.get('rank'), of=pairs)} "
            f"| {cell(acc.get('l_hat'), of=pairs)} | "
            + " | ".join(cell(ratios[label].get("loss_barrier"), unit=" %", of=pairs) for label in variants)
            + " |"
        )
        accuracy.append(
            f"| {family.title} | "
            + " | ".join(cell(ratios[label].get("accuracy_barrier"), unit=" %", of=pairs) for label in variants)
            + " |"
        )
    lines.append(
        "| paper (ViT/BERT, 4 data sets) | 10 | 24 | low | n/a | n/a | near 0 | low | near 0 | "
        + " | ".join(PAPER_TABLE1[label] for label in variants)
        + " |"
    )
    grids = curve_alphas_text([{v: s["alignments"][v] for v in variants if v in s["alignments"]} for _, s in runs])
    return lines + accuracy + ([] if not grids else ["", grids]) + ["", *refinement_lines(runs)]


def order_alphas_text(runs: list[tuple[Any, dict[str, Any]]]) -> str:
    """How many alphas the runs' head-order curves have (rank and ``L_hat`` compare barriers on them)."""
    counts = sorted({str(summary["head_orders"].get("order_alphas", "?")) for _, summary in runs})
    return (
        f"{'/'.join(counts) or 'all'} alphas of the curves (the rank and `L_hat` compare the method's and the "
        "naive barrier on the same alphas)"
    )


def refinement_lines(runs: list[tuple[Any, dict[str, Any]]]) -> list[str]:
    """Whether Stage 2's gradient refinement lowered the barrier of its orthogonal start, pair by pair
    (the paper finds it always does: Variant 2 10-16 %, full 7-12 %), and where the summary measured it
    (:func:`summarize_refinement`), whether a rise or a fall exceeds the noise of the evaluation data."""
    lines = []
    for family, summary in runs:
        alignments = summary["alignments"]
        if "orthogonal" not in alignments or "full" not in alignments:
            continue
        start, refined = alignments["orthogonal"]["per_pair"], alignments["full"]["per_pair"]
        raised = [
            pair
            for pair in refined
            if refined[pair]["aligned"]["loss_barrier"] > start[pair]["aligned"]["loss_barrier"]
        ]
        line = (
            f"- {family.title}: the refinement (full) raised the loss barrier of its orthogonal start (Variant 2) "
            f"in {len(raised)} of {len(refined)} pairs" + (f" ({', '.join(raised)})" if raised else "")
        )
        measured = summary.get(REFINEMENT, {}).get("per_pair", {})
        if measured:
            noise = {pair: entry["loss_barrier"] for pair, entry in measured.items()}
            beyond = [f"{pair} {e['gap']:+.3f} ± {e['gap_std']:.3f} nats" for pair, e in noise.items() if e["raised"]]
            draws = f"in at least {TOLD_APART:.1%} of {RESAMPLES} bootstrap draws of the evaluated samples"
            lowered = f"{sum(e['lowered'] for e in noise.values())} of {len(noise)}"
            if raised or beyond:
                line += (
                    f", of which {len(beyond)} beyond the evaluation noise (higher {draws}"
                    + (f": {', '.join(beyond)}" if beyond else "")
                    + f"), and lowered it beyond the noise in {lowered}"
                )
            else:
                line += f", and lowered it beyond the evaluation noise (lower {draws}) in {lowered}"
            if len(noise) < len(refined):  # a distributed evaluation records no clusters
                line += f" (noise measured in {len(noise)} of {len(refined)} pairs)"
        lines.append(line + ".")
    return lines


def stage1_settings(label: str) -> str:
    """What a full-method alignment label changes from the paper's Stage 1: ``full`` -> ``invariant``,
    ``full-metric=weight-objective=data`` -> ``metric=weight-objective=data``."""
    return "invariant" if label == "full" else label.removeprefix("full-")


def appendix_k_section(runs: list[tuple[Any, dict[str, Any]]]) -> list[str]:
    """The report's Appendix K: each Stage 1 metric's rank, ``L_hat`` and barrier ratio per Table 1 run."""
    lines = [
        "## Appendix K: Stage 1 metrics",
        "",
        "Each Stage 1 setting of the full method (its metric, and with `objective=data` the activations it "
        "weighs on the calibration batches): the rank of its head order, followed by the full Stage 2, among "
        "the first layer's head orders (Table 1's `orders`), the same against the evaluation noise, `L_hat`, "
        "and the method's aligned loss barrier as % of the naive one.",
        "",
        "| family | metric | rank (loss) | within noise | tied | L_hat loss | loss ratio | rank (acc) | L_hat acc |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for family, summary in runs:
        for label, orders in summary["head_orders"]["alignments"].items():
            entry = summary["alignments"].get(label)
            if not label.startswith("full") or not entry:  # Appendix K: the full method's Stage 1 settings
                continue
            metric = stage1_settings(label)
            loss, acc, pairs = orders["loss_barrier"], orders["accuracy_barrier"], len(summary["pairs"])
            ratio = cell(entry["barrier_ratio"]["loss_barrier"], unit=" %", of=pairs)
            lines.append(
                f"| {family.title} | `{metric}` | {cell(loss['rank'], of=pairs)} "
                f"| {cell(loss.get('rank_within_noise'), of=pairs)} | {ties(loss)} | {cell(loss['l_hat'], of=pairs)} "
                f"| {ratio} | {cell(acc['rank'], of=pairs)} | {cell(acc['l_hat'], of=pairs)} |"
            )
    metrics = [{label: e for label, e in s["alignments"].items() if label.startswith("full")} for _, s in runs]
    if grids := curve_alphas_text(metrics):
        lines += ["", f"Loss ratios: {grids[0].lower()}{grids[1:]}"]
    return lines


#: The paper's Table 1 finding (rank near 1, ``L_hat`` near 0) as this study checks it, against the
#: evaluation noise: Stage 1's mean rank within the noise and its mean ``L_hat`` (%) at most these.
PAPER_FINDING = {"rank_within_noise": 2.0, "l_hat": 10.0}
#: A difference of means over pairs is told apart from 0 beyond this many standard errors.
STANDARD_ERRORS = 2.0


def standard_error(stats: dict[str, float]) -> float:
    """The standard error of :func:`~lmc.experiments.spread.spread`'s mean (NaN for fewer than 2 values)."""
    return stats["std"] / math.sqrt(stats["count"]) if stats["count"] > 1 else math.nan


#: :func:`held_out_verdict`'s verdicts, as the report's table prints them.
VERDICTS = {
    "met": "met",
    "missed": "missed: held-out samples pick better orders",
    "unresolved": "missed, as by the held-out pick: beyond this evaluation's resolution",
    "inconclusive": "missed, not told apart from the held-out pick",
    "unmeasured": "missed (no held-out measure)",
}


def held_out_verdict(loss: dict[str, Any]) -> str:
    """What a Stage 1 setting's loss-barrier statistics (:func:`summarize_head_orders`) say about the
    paper's finding (a key of :data:`VERDICTS`): ``met`` (:data:`PAPER_FINDING`); else ``missed`` where
    its order's ``L_hat`` on halves of the evaluated samples exceeds the held-out pick's by more than
    :data:`STANDARD_ERRORS` standard errors over pairs; else ``unresolved`` where the held-out pick's
    own ``L_hat`` exceeds the finding's too, and ``inconclusive`` where it does not."""
    within, l_hat = loss.get("rank_within_noise", {}).get("mean", math.nan), loss["l_hat"]["mean"]
    if within <= PAPER_FINDING["rank_within_noise"] and l_hat <= PAPER_FINDING["l_hat"]:
        return "met"
    halves = loss.get("halves", {}).get("l_hat", {})
    if not halves or halves["difference"]["count"] < 2:
        return "unmeasured"
    if halves["difference"]["mean"] > STANDARD_ERRORS * standard_error(halves["difference"]):
        return "missed"
    return "unresolved" if halves["held_out"]["mean"] > PAPER_FINDING["l_hat"] else "inconclusive"


def held_out_section(runs: list[tuple[Any, dict[str, Any]]]) -> list[str]:
    """The report's comparison of each Stage 1 setting with an order picked on held-out evaluation
    samples (:func:`held_out_orders`), with its verdict on the paper's finding (:func:`held_out_verdict`);
    empty where no run measured it."""
    rows = []
    for family, summary in runs:
        for label, orders in summary["head_orders"]["alignments"].items():
            loss = orders["loss_barrier"]
            if not label.startswith("full") or "halves" not in loss:
                continue
            halves, pairs = loss["halves"], loss["halves"]["pairs"]
            rank, l_hat = halves["rank"], halves["l_hat"]
            rows.append(
                f"| {family.title} | `{stage1_settings(label)}` | {pairs} | {cell(rank['stage1'], of=pairs)} "
                f"| {cell(rank['held_out'], of=pairs)} | {cell(l_hat['stage1'], of=pairs)} "
                f"| {cell(l_hat['held_out'], of=pairs)} | {cell(l_hat['difference'], of=pairs)} "
                f"| {VERDICTS[held_out_verdict(loss)]} |"
            )
    if not rows:
        return []
    return [
        "## Stage 1 against an order picked on held-out samples",
        "",
        f"The evaluated samples are cut into two random halves ({HALVES} cuts, in clusters of {CLUSTER_SAMPLES}, "
        "both directions): the order with the lowest loss barrier on one half is the held-out pick, and on the "
        "other half it and each Stage 1 setting's order (each followed by the full Stage 2) are scored: rank "
        "among the orders and `L_hat` against that half's best order. Stage 1 sees no evaluation data; the "
        "held-out pick sees as many samples as it is scored on. `difference` is Stage 1's `L_hat` minus the "
        "held-out pick's, pair by pair. The paper's finding counts as met where the rank within noise "
        f"(Table 1) is at most {PAPER_FINDING['rank_within_noise']:g} and `L_hat` at most "
        f"{PAPER_FINDING['l_hat']:g} %; where it is not, held-out samples pick better orders if the difference "
        f"exceeds {STANDARD_ERRORS:g} standard errors over pairs, and otherwise the evaluation data cannot "
        "point to a better order either.",
        "",
        "| family | metric | pairs | rank on a half | held-out pick's rank | L_hat on a half "
        "| held-out pick's L_hat | difference | paper's finding |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        *finding_lines(runs),
    ]


def finding_lines(runs: list[tuple[Any, dict[str, Any]]]) -> list[str]:
    """Per family: whether the paper's cost (``invariant``) meets the paper's finding, why not where
    it does not (:func:`held_out_verdict`), and which Stage 1 settings meet it."""
    lines = []
    for family, summary in runs:
        settings = {
            stage1_settings(label): orders["loss_barrier"]
            for label, orders in summary["head_orders"]["alignments"].items()
            if label.startswith("full")
        }
        if "invariant" not in settings:
            continue
        paper = settings["invariant"]
        verdict = held_out_verdict(paper)
        halves = paper.get("halves", {}).get("l_hat", {})
        gap = held = ""
        if halves and halves["difference"]["count"] > 1:
            difference = halves["difference"]
            gap = (
                f" (`L_hat` on a half {difference['mean']:+.1f} points from the held-out pick's, standard error "
                f"{standard_error(difference):.1f}, {difference['count']} pairs)"
            )
            held = f"{halves['held_out']['mean']:.1f} %"
        outcomes = {
            "met": "meets the paper's finding",
            "missed": f"misses it, and held-out samples pick better orders{gap}",
            "unresolved": f"misses it, and so does an order picked on held-out samples ({held} on a half){gap}: "
            "the evaluation data cannot point to a better order",
            "inconclusive": f"misses it, but is not told apart from an order picked on held-out samples{gap}, "
            f"which leaves {held} on a half",
            "unmeasured": "misses it (no held-out measure)",
        }
        line = f"- {family.title}: the paper's cost (`invariant`) {outcomes[verdict]}"
        others = [
            f"`{name}`" for name, loss in settings.items() if name != "invariant" and held_out_verdict(loss) == "met"
        ]
        also = "also " if verdict == "met" else ""
        line += f"; {also}met by {', '.join(others)}." if others else f"; {also}met by no other Stage 1 setting."
        lines.append(line)
    return lines
