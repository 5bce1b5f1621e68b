"""Table 1 on fewer alphas: do ranks and L_hat change when every barrier is read on a coarser grid?

For every pair of a finished Table 1 run whose head orders were swept at all the curves' alphas
(``protocol.head_order_alphas`` unset, 25), each alignment's rank and ``L_hat`` (loss barrier)
are computed again with every barrier (the orders', the method's, the naive one) read on every
other alpha (13) and every third (9): the grids ``protocol.head_order_alphas`` can pick. Orders
left at their three-alpha screening bound keep it (the bound holds on every grid that includes
alphas 0, 0.5 and 1). Nothing is evaluated: the run's stored points are read.

    python -m benchmarks head_order_grid --run runs/bible/bible_bert_ape/first_attention --name bible_bert_ape
    # writes benchmarks/alpha_grids/results/head_order_grid.{json,md}
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from benchmarks.run_files import pair_result
from lmc.connectivity.interpolation import evenly_spaced
from lmc.experiments.table1 import barriers_at, picked_orders, rank_and_l_hat
from lmc.io import atomic_write_json, atomic_write_text

RESULTS = Path(__file__).parent / "results" / "head_order_grid"
GRIDS = (25, 13, 9)


def pair_ranks(pair: Path, grid: list[float]) -> dict[str, tuple[int, float]]:
    """Alignment label -> (rank, L_hat of the loss barrier) of one pair, every barrier read on ``grid``."""
    results = {p.name: pair_result(p) for p in pair.iterdir() if (p / "lmc_results.json").is_file()}
    orders = {p.name: pair_result(p) for p in (pair / "orders").iterdir() if (p / "lmc_results.json").is_file()}
    whole = max(len(r["settings"]["alphas"]) for r in orders.values())
    if whole != GRIDS[0]:
        raise SystemExit(f"{pair}: its head orders were swept at {whole} alphas; this needs a run at {GRIDS[0]}")
    order_barriers = {
        order: barriers_at(r["curves"]["aligned"], grid)["loss_barrier"]
        if len(r["settings"]["alphas"]) == whole
        else r["curves"]["aligned"]["loss_barrier"]  # a screening bound
        for order, r in orders.items()
    }
    ranks = {}
    for label, chosen in picked_orders(results).items():
        method, naive = (barriers_at(results[label]["curves"][c], grid)["loss_barrier"] for c in ("aligned", "naive"))
        ranks[label] = rank_and_l_hat(order_barriers, chosen, method, naive)
    return ranks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="a finished Table 1 run folder (its pairs/)")
    parser.add_argument("--name", required=True, help="the family's name in the result files")
    args = parser.parse_args()
    pairs = sorted(p for p in (args.run / "pairs").iterdir() if (p / "orders").is_dir())
    if not pairs:
        raise SystemExit(f"{args.run}/pairs holds no pair with head orders: pass a finished Table 1 run")
    measured = {n: {pair.name: pair_ranks(pair, evenly_spaced(n)) for pair in pairs} for n in GRIDS}
    labels = sorted(measured[GRIDS[0]][pairs[0].name])
    table: dict[str, Any] = {}
    for label in labels:
        reference = [measured[GRIDS[0]][p.name][label] for p in pairs]
        table[label] = {}
        for n in GRIDS:
            values = [measured[n][p.name][label] for p in pairs]
            table[label][n] = {
                "mean_rank": statistics.mean(rank for rank, _ in values),
                "mean_l_hat": statistics.mean(l_hat for _, l_hat in values),
                "ranks_changed": sum(a[0] != b[0] for a, b in zip(values, reference)),
                "largest_l_hat_change": max(abs(a[1] - b[1]) for a, b in zip(values, reference)),
            }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(
        RESULTS.with_suffix(".json"), {"run": str(args.run), "name": args.name, "pairs": len(pairs), "table": table}
    )
    lines = [
        "# Table 1's ranks and L_hat on coarser alpha grids",
        "",
        f"`python -m benchmarks head_order_grid --run {args.run} --name {args.name}`: {len(pairs)} pairs of "
        f"`{args.name}`, every barrier (the head orders', the method's, the naive one) read on "
        + ", ".join(f"{n}" for n in GRIDS)
        + " evenly spaced alphas of the run's 25. Loss barrier; `changed`: pairs whose rank differs from "
        "the 25-alpha rank; `largest change`: the largest |L_hat difference| to the 25-alpha L_hat over pairs.",
        "",
        "| alignment | " + " | ".join(f"{n} alphas: rank, L_hat %, changed, largest change" for n in GRIDS) + " |",
        "|---|" + "---|" * len(GRIDS),
    ]
    for label, by_grid in table.items():
        cells = [
            f"{e['mean_rank']:.2f}, {e['mean_l_hat']:.2f}, {e['ranks_changed']} of {len(pairs)}, "
            f"{e['largest_l_hat_change']:.2f}"
            for e in by_grid.values()
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    atomic_write_text(RESULTS.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
