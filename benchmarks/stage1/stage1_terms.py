"""Which term of the paper's Stage 1 cost follows the barrier: Q/K, V/O, or neither?

The ``invariant`` cost of pairing source head ``i`` with target head ``j`` is
``||M_i - M_j'||^2 + ||N_i - N_j'||^2`` with ``M = Q K^T`` and ``N = V O`` per head
(:func:`lmc.matching.heads.head_cost`), and a head order's cost is the sum over its pairs. For
every pair of a finished Table 1 run (``protocol.head_orders``), this reads the barrier of each
head order swept whole (and the screening bound of the others, a lower bound of their barrier)
and, from the two fine-tuned checkpoints, each order's Q/K cost, V/O cost and their sum. Per pair
and term it reports the Spearman correlation of cost and loss barrier over the orders swept whole,
the barrier rank of the term's cheapest order among all orders, and each term's spread over all
orders (a term whose spread dwarfs the other's decides the order alone). Nothing is
evaluated: the run's stored curves are read.

    python -m benchmarks stage1_terms --run runs/repro/gpt2_ape/first_attention --name "GPT-2"
    # writes (merging by name) benchmarks/stage1/results/stage1_terms.{json,md}
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

import torch
from scipy.stats import spearmanr

from benchmarks.run_files import pair_result
from lmc.adapters import model_spec
from lmc.experiments.spread import cell, spread
from lmc.experiments.table1 import order_grid
from lmc.io import atomic_write_json, atomic_write_text
from lmc.matching import AlignOptions
from lmc.matching.grams import LayerGrams
from lmc.matching.heads import head_cost, invariant_products, invariant_terms
from lmc.training.module import load_trained

RESULTS = Path(__file__).parent / "results" / "stage1_terms"
TERMS = ("qk", "vo", "total", "balanced")


def term_costs(source: torch.nn.Module, target: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The first attention layer's invariant cost per term, ``(h, h)``: source head ``i`` on target head ``j``;
    ``total`` is the matcher's ``invariant`` cost, ``balanced`` its ``metric="balanced"``."""
    layer = model_spec(target).attention[0]
    grams = LayerGrams.compute(dict(source.named_parameters()), dict(target.named_parameters()), layer)
    qk, vo = invariant_terms(invariant_products(grams, layer.queries_per_kv))
    return {"qk": qk, "vo": vo, "total": qk + vo, "balanced": head_cost(grams, layer, AlignOptions(metric="balanced"))}


def order_cost(cost: torch.Tensor, order: str) -> float:
    """The cost of a head order (its label: the target head of each source head)."""
    return float(sum(cost[i, int(j)] for i, j in enumerate(order)))


def measure_pair(costs: dict[str, torch.Tensor], whole: dict[str, float], bounds: dict[str, float]) -> dict[str, Any]:
    """Per term: Spearman of cost and loss barrier over the whole-curve orders (``whole``), the rank of
    the term's cheapest order among all orders (those left at their screening bound, ``bounds``,
    count with it: a lower bound of their barrier, so a rank through one is a lower bound), and the
    term's spread over all orders."""
    known = {**bounds, **whole}
    entry: dict[str, Any] = {"whole_orders": len(whole)}
    for term in TERMS:
        cost = {order: order_cost(costs[term], order) for order in known}
        cheapest = min(known, key=cost.get)
        swept = sorted(whole)
        entry[term] = {
            "spearman": float(spearmanr([cost[o] for o in swept], [whole[o] for o in swept]).statistic)
            if len(swept) > 2
            else math.nan,
            "rank_of_cheapest": 1 + sum(known[o] < known[cheapest] for o in known),
            "cheapest_swept_whole": cheapest in whole,
            "spread": statistics.pstdev(cost.values()),
        }
    return entry


def _barriers(pair: Path) -> tuple[dict[str, float], dict[str, float]]:
    """The loss barrier of each whole-curve head order of a pair, and the screening bound of the others."""
    orders = {folder.name: pair_result(folder) for folder in (pair / "orders").glob("*") if folder.name != "screening"}
    grid = order_grid(orders)
    whole = {o: r["curves"]["aligned"]["loss_barrier"] for o, r in orders.items() if r["settings"]["alphas"] == grid}
    bounds = {
        folder.name: pair_result(folder)["curves"]["aligned"]["loss_barrier"]
        for folder in (pair / "orders" / "screening").glob("*")
        if folder.name not in whole
    }
    return whole, bounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="a finished Table 1 run folder")
    parser.add_argument("--name", required=True, help="the family's name in the result files")
    args = parser.parse_args()
    seeds = sorted(args.run.glob("seed*/final.ckpt"), key=lambda p: int(p.parent.name[4:]))
    pairs = sorted(p for p in (args.run / "pairs").glob("*_*") if (p / "orders").is_dir())
    if len(seeds) < 2 or not pairs:
        raise SystemExit(f"{args.run} holds no finished Table 1 pairs (seed<k>/final.ckpt, pairs/<i>_<j>/orders)")
    models = [load_trained(path)[0].eval().model for path in seeds]
    measured = {}
    for pair in pairs:
        i, j = map(int, pair.name.split("_"))
        measured[pair.name] = measure_pair(term_costs(models[i], models[j]), *_barriers(pair))
    summary = {
        term: {
            **{
                stat: spread([e[term][stat] for e in measured.values()])
                for stat in ("spearman", "rank_of_cheapest", "spread")
            },
            "cheapest_swept_whole": sum(e[term]["cheapest_swept_whole"] for e in measured.values()),
        }
        for term in TERMS
    }
    whole = statistics.fmean(e["whole_orders"] for e in measured.values())
    path = RESULTS.with_suffix(".json")
    results = json.loads(path.read_text()) if path.is_file() else {}
    results[args.name] = {"run": str(args.run), "pairs": measured, "mean": summary, "whole_orders": whole}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, results)
    lines = [
        "# Which term of the invariant Stage 1 cost follows the barrier",
        "",
        "Written by `python -m benchmarks stage1_terms` (module docstring: what each column means). Per family, the "
        "mean ± std over pairs: Spearman correlation of each term's order cost with the order's loss barrier "
        "over the orders swept whole, the barrier rank of the term's cheapest order among all orders (1: the "
        "lowest barrier; through an order left at its screening bound, a lower bound), in how many pairs that "
        "order was swept whole, and the standard deviation of the term's cost over all orders.",
    ]
    for name, entry in results.items():
        lines += [
            "",
            f"## {name}",
            "",
            f"Run `{entry['run']}`, {len(entry['pairs'])} pairs, {entry['whole_orders']:.1f} orders swept whole "
            "per pair.",
            "",
            "| term | Spearman (cost, barrier) | rank of its cheapest order | its cheapest swept whole "
            "| spread of its cost |",
            "|---|---|---|---|---|",
        ]
        pairs = len(entry["pairs"])
        for term in TERMS:
            stats = entry["mean"][term]
            lines.append(
                f"| {term} | {cell(stats['spearman'], 2, of=pairs)} | {cell(stats['rank_of_cheapest'], 1)} "
                f"| {stats['cheapest_swept_whole']} of {pairs} | {stats['spread']['mean']:.3g} |"
            )
    atomic_write_text(RESULTS.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
