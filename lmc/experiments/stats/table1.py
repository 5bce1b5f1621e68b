"""Table 1 over pairs: each alignment's head-order rank, ``L_hat`` and their noise, mean and spread
over pairs (the paper's Table 1), and the refinement's gap to its orthogonal start.

Each pair's measures are :mod:`lmc.experiments.table1`'s; the report reads these statistics
(:mod:`lmc.experiments.report.table1`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmc.connectivity import NO_BARRIER
from lmc.experiments.stats.records import Record, to_json
from lmc.experiments.stats.spread import Spread
from lmc.experiments.table1 import (
    HEAD_ORDER_NOISE,
    HEAD_ORDERS,
    RESAMPLES,
    TOLD_APART,
    barriers_at,
    held_out_orders,
    order_grid,
    picked_orders,
    rank_and_l_hat,
    refinement_noise,
)

#: The barriers Table 1 scores, as keys of its statistics.
BARRIER_NAMES = ("loss_barrier", "accuracy_barrier")


@dataclass(frozen=True)
class HalvesScore(Record):
    """One score (rank or ``L_hat``) on halves of the evaluated samples, spread over pairs: of the
    alignment's order, of the held-out pick, and of their paired difference."""

    stage1: Spread
    held_out: Spread
    difference: Spread


@dataclass(frozen=True)
class HalvesStats(Record):
    """An alignment's order against the held-out pick on halves of the evaluated samples, over ``pairs``."""

    pairs: int
    rank: HalvesScore
    l_hat: HalvesScore


@dataclass(frozen=True)
class OrderStats(Record):
    """One alignment's Table 1 statistics of one barrier over pairs (``None``: not measured).

    Attributes:
        rank: Its Stage 1 order's rank among all head orders.
        l_hat: ``L_hat`` (%), over the pairs with a naive barrier.
        rank_within_noise: The rank counting only the orders told apart as lower.
        gap: Its order's barrier minus the best order's.
        ties: Pairs whose order the best one is not told apart from.
        noise_pairs: Pairs whose evaluation noise was measured.
        halves: Its order against the held-out pick, where the clusters were recorded.
    """

    rank: Spread | None = None
    l_hat: Spread | None = None
    rank_within_noise: Spread | None = None
    gap: Spread | None = None
    ties: int | None = None
    noise_pairs: int | None = None
    halves: HalvesStats | None = None


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
            for name in BARRIER_NAMES:
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
                **{name: to_json(order_stats([e[name] for e in per_pair.values()])) for name in BARRIER_NAMES},
            }
    return study


def order_stats(pairs: list[dict[str, Any]]) -> OrderStats:
    """One alignment's :class:`OrderStats` of one barrier from its per-pair entries (rank, ``L_hat``
    and, where measured, the noise of :func:`head_order_noise` and the ``halves``)."""
    return OrderStats(
        rank=Spread.of([float(entry["rank"]) for entry in pairs]),
        l_hat=Spread.of([entry["l_hat"] for entry in pairs]),
        rank_within_noise=Spread.of([float(entry.get("rank_within_noise", math.nan)) for entry in pairs]),
        gap=Spread.of([entry.get("gap", math.nan) for entry in pairs]),
        ties=sum(bool(entry.get("tie")) for entry in pairs),
        noise_pairs=sum("tie" in entry for entry in pairs),
        halves=summarize_halves([entry["halves"] for entry in pairs if "halves" in entry]),
    )


def summarize_halves(pairs: list[dict[str, dict[str, float]]]) -> HalvesStats | None:
    """Spread over pairs of :func:`held_out_orders`' scores of one alignment and barrier: the rank and
    ``L_hat`` of its order and of the held-out pick, and of their paired differences (``None``: none measured)."""
    if not pairs:
        return None
    scores = {}
    for score in ("rank", "l_hat"):
        stage1, held_out = ([pair[who][score] for pair in pairs] for who in ("stage1", "held_out"))
        difference = [a - b for a, b in zip(stage1, held_out, strict=True)]
        scores[score] = HalvesScore(Spread.of(stage1), Spread.of(held_out), Spread.of(difference))
    return HalvesStats(pairs=len(pairs), **scores)


@dataclass(frozen=True)
class RefinementNoise(Record):
    """How far the refinement moved one barrier of its orthogonal start in one pair (:func:`refinement_noise`)."""

    gap: float
    gap_std: float
    raised: bool
    lowered: bool


@dataclass(frozen=True)
class RefinementCount(Record):
    """Over pairs, how many the refinement raised (any rise; beyond the noise) or lowered beyond the noise."""

    pairs: int
    raised: int
    raised_beyond_noise: int
    lowered_beyond_noise: int


@dataclass(frozen=True)
class RefinementSummary(Record):
    """The refinement's gap to its orthogonal start over a run's pairs (``None``: not in the summary read).

    Attributes:
        resamples: Bootstrap draws behind each pair's noise.
        told_apart: The share of draws that tells a rise or a fall from the noise.
        per_pair: Per pair whose clusters were recorded, per barrier, :class:`RefinementNoise`.
        loss_barrier: The counts of the loss barrier.
        accuracy_barrier: The counts of the accuracy barrier.
    """

    resamples: int | None = None
    told_apart: float | None = None
    per_pair: dict[str, dict[str, RefinementNoise]] | None = None
    loss_barrier: RefinementCount | None = None
    accuracy_barrier: RefinementCount | None = None


def summarize_refinement(pairs: dict[str, Path], alphas: list[float]) -> dict[str, Any]:
    """:func:`refinement_noise` of every pair whose clusters were recorded, and per barrier how many
    pairs the refinement raised (``raised``: any rise; ``raised_beyond_noise``) or lowered beyond the
    noise: a :class:`RefinementSummary` as ``summary.json`` holds it.

    Args:
        pairs: Pair name (``<i>_<j>``) -> its folder.
        alphas: Alphas both curves of every pair hold (the orthogonal start's).
    """
    per_pair = {
        name: {barrier: RefinementNoise(**entry) for barrier, entry in noise.items()}
        for name, folder in pairs.items()
        if (noise := refinement_noise(folder, alphas))
    }
    counts = {
        name: RefinementCount(
            pairs=len(per_pair),
            raised=sum(entry[name].gap > 0 for entry in per_pair.values()),
            raised_beyond_noise=sum(entry[name].raised for entry in per_pair.values()),
            lowered_beyond_noise=sum(entry[name].lowered for entry in per_pair.values()),
        )
        for name in BARRIER_NAMES
    }
    return to_json(RefinementSummary(RESAMPLES, TOLD_APART, per_pair, **counts))
