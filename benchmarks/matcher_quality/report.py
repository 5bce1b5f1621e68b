"""Tables from the study's per-pair JSON records (``benchmarks/matcher_quality/pairs.py``): markdown on stdout.

Usage: python -m benchmarks matcher_quality.report benchmarks/matcher_quality/results

The folder also holds other scripts' records (``checks.json``, ``path_<pe>.json``,
``learned_alignment.json`` of ``data_aware.py``): the pair tables read the files named
``<pe>_<i>_<j>.json`` only, in the order of their pairs.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

from benchmarks.matcher_quality.pairs import ORDERS


def ratio(value: float, naive: float) -> float:
    return 100 * value / naive


def l_hat(value: float, top1: float, naive: float) -> float:
    return 100 * (value - top1) / (naive - top1)


def mean_std(values) -> str:
    values = np.asarray(values, dtype=float)
    return f"{values.mean():.1f} ± {values.std(ddof=1):.1f}"


def assignment_cost(cost: list[list[float]], order) -> float:
    return float(sum(cost[i][int(j)] for i, j in enumerate(order)))


def main_table(records: list[dict]) -> list[str]:
    lines = [
        "| pair | naive loss barrier | V1 perm % | V2 orth % | full % | top-1 % | rank | L̂ loss full | "
        "L̂ acc full | L̂ loss orth | acc barrier naive | acc V2 % | acc full % |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    columns = {k: [] for k in ("v1", "v2", "full", "top1", "rank", "lhat", "lhat_acc", "lhat_orth", "acc2", "accf")}
    for r in records:
        m = r["metrics"]["invariant"]
        n, na = r["naive"]["loss_barrier"], r["naive"]["accuracy_barrier"]
        t, ta = r["top1_loss_barrier"]["value"], r["top1_accuracy_barrier"]["value"]
        row = {
            "v1": ratio(m["permutation"]["loss_barrier"], n),
            "v2": ratio(m["orthogonal"]["loss_barrier"], n),
            "full": ratio(m["full"]["loss_barrier"], n),
            "top1": ratio(t, n),
            "rank": m["rank"],
            "lhat": l_hat(m["full"]["loss_barrier"], t, n),
            "lhat_acc": l_hat(m["full"]["accuracy_barrier"], ta, na),
            "lhat_orth": l_hat(m["orthogonal"]["loss_barrier"], t, n),
            "acc2": ratio(m["orthogonal"]["accuracy_barrier"], na),
            "accf": ratio(m["full"]["accuracy_barrier"], na),
        }
        for k, v in row.items():
            columns[k].append(v)
        lines.append(
            f"| {r['pair'][0]}-{r['pair'][1]} | {n:.4f} | {row['v1']:.1f} | {row['v2']:.1f} | {row['full']:.1f} | "
            f"{row['top1']:.1f} | {row['rank']} | {row['lhat']:.1f} | {row['lhat_acc']:.1f} | {row['lhat_orth']:.1f} | "
            f"{na:.4f} | {row['acc2']:.1f} | {row['accf']:.1f} |"
        )
    c = columns
    lines.append(
        f"| mean ± std | | {mean_std(c['v1'])} | {mean_std(c['v2'])} | {mean_std(c['full'])} | {mean_std(c['top1'])} | "
        f"{mean_std(c['rank'])} | {mean_std(c['lhat'])} | {mean_std(c['lhat_acc'])} | {mean_std(c['lhat_orth'])} | "
        f"| {mean_std(c['acc2'])} | {mean_std(c['accf'])} |"
    )
    return lines


def metrics_table(records: list[dict]) -> list[str]:
    lines = [
        "| Stage 1 cost | rank (full) | V1 % | V2 % | full % | L̂ loss full | top-1 hits |",
        "|---|---|---|---|---|---|---|",
    ]
    for metric in records[0]["metrics"]:
        ranks, v1, v2, full, lh = [], [], [], [], []
        for r in records:
            m, n, t = r["metrics"][metric], r["naive"]["loss_barrier"], r["top1_loss_barrier"]["value"]
            ranks.append(m["rank"])
            v1.append(ratio(m["permutation"]["loss_barrier"], n))
            v2.append(ratio(m["orthogonal"]["loss_barrier"], n))
            full.append(ratio(m["full"]["loss_barrier"], n))
            lh.append(l_hat(m["full"]["loss_barrier"], t, n))
        hits = sum(rank == 1 for rank in ranks)
        lines.append(
            f"| {metric} | {mean_std(ranks)} | {mean_std(v1)} | {mean_std(v2)} | {mean_std(full)} | {mean_std(lh)} | "
            f"{hits}/{len(records)} |"
        )
    return lines


def stage2_table(records: list[dict]) -> list[str]:
    lines = [
        "| pair | dist² orth | dist² full | Q/K/V/O/bias share of dist² orth | same, full | max cond C orth→full | "
        "max cond B orth→full | smax C / smin C full | orth % | full % | full no-LS % | visible orth % | "
        "visible full % |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    cols = {k: [] for k in ("orth", "full", "nols", "vorth", "vfull")}
    for r in records:
        d, n = r["stage2"], r["naive"]["loss_barrier"]
        m = r["metrics"]["invariant"]

        def shares(terms: dict) -> tuple[float, str]:
            total = sum(terms.values())
            bias = terms["query_bias"] + terms["key_bias"] + terms["value_bias"]
            parts = [terms["query"], terms["key"], terms["value"], terms["out"], bias]
            return total, "/".join(f"{100 * p / total:.0f}" for p in parts)

        to, so = shares(d["orthogonal"]["terms"])
        tf, sf = shares(d["full"]["terms"])
        row = {
            "orth": ratio(m["orthogonal"]["loss_barrier"], n),
            "full": ratio(m["full"]["loss_barrier"], n),
            "nols": ratio(d["full_no_least_squares"]["barrier"]["loss_barrier"], n),
            "vorth": ratio(d["visible_orthogonal"]["barrier"]["loss_barrier"], n),
            "vfull": ratio(d["visible_full"]["barrier"]["loss_barrier"], n),
        }
        for k, v in row.items():
            cols[k].append(v)
        lines.append(
            f"| {r['pair'][0]}-{r['pair'][1]} | {to:.2f} | {tf:.2f} | {so} | {sf} | "
            f"{max(d['orthogonal']['C']['cond']):.2f}→{max(d['full']['C']['cond']):.1f} | "
            f"{max(d['orthogonal']['B']['cond']):.2f}→{max(d['full']['B']['cond']):.1f} | "
            f"{max(d['full']['C']['smax']):.2f} / {min(d['full']['C']['smin']):.2f} | "
            f"{row['orth']:.1f} | {row['full']:.1f} | {row['nols']:.1f} | {row['vorth']:.1f} | {row['vfull']:.1f} |"
        )
    c = cols
    lines.append(
        f"| mean ± std | | | | | | | | {mean_std(c['orth'])} | {mean_std(c['full'])} | {mean_std(c['nols'])} | "
        f"{mean_std(c['vorth'])} | {mean_std(c['vfull'])} |"
    )
    return lines


def orders_refinement(records: list[dict]) -> list[str]:
    """Over all 24 orders: how often full Stage 2 has a larger midpoint loss gap than the orthogonal start."""
    raised, total, diffs = 0, 0, []
    for r in records:
        for o in r["orders"]:
            total += 1
            diff = o["full_mid_gap"][0] - o["orthogonal_mid_gap"][0]
            raised += diff > 0
            diffs.append(100 * diff / r["naive"]["loss_barrier"])
    return [
        f"Over all {total} (pair, order) combinations, full Stage 2's midpoint loss gap exceeds the orthogonal "
        f"start's in {raised} ({100 * raised / total:.0f} %); mean change {mean_std(diffs)} % of the naive barrier."
    ]


def correlation_table(records: list[dict]) -> list[str]:
    """Spearman correlation, over the 24 orders, of each Stage 1 cost with full Stage 2's midpoint loss gap."""
    lines = [
        "| Stage 1 cost | Spearman ρ with full-Stage-2 midpoint gap (mean ± std over pairs) | "
        "rank (by midpoint gap) of its best order | picks the best order |",
        "|---|---|---|---|",
    ]
    for cost_name in records[0]["costs"]:
        rhos, ranks = [], []
        for r in records:
            gaps = np.array([o["full_mid_gap"][0] for o in r["orders"]])
            costs = np.array([assignment_cost(r["costs"][cost_name], order) for order in ORDERS])
            rhos.append(spearmanr(costs, gaps).statistic)
            best = int(np.argmin(costs))
            ranks.append(1 + int((gaps < gaps[best]).sum()))
        hits = sum(k == 1 for k in ranks)
        lines.append(f"| {cost_name} | {mean_std(rhos)} | {mean_std(ranks)} | {hits}/{len(records)} |")
    return lines


def visible_table(records: list[dict]) -> list[str]:
    lines = [
        "| pair | current full % | visible pipeline perm % | orth % | full % | rank of visible order |",
        "|---|---|---|---|---|---|",
    ]
    cur, vp, vo, vf = [], [], [], []
    for r in records:
        n = r["naive"]["loss_barrier"]
        v = r["visible_pipeline"]
        m = r["metrics"]["invariant"]
        row = [ratio(m["full"]["loss_barrier"], n)] + [
            ratio(v[s]["loss_barrier"], n) for s in ("permutation", "orthogonal", "full")
        ]
        for lst, x in zip((cur, vp, vo, vf), row):
            lst.append(x)
        lines.append(
            f"| {r['pair'][0]}-{r['pair'][1]} | {row[0]:.1f} | {row[1]:.1f} | {row[2]:.1f} | {row[3]:.1f} | "
            f"{r['metrics']['visible_invariant']['rank']} |"
        )
    lines.append(f"| mean ± std | {mean_std(cur)} | {mean_std(vp)} | {mean_std(vo)} | {mean_std(vf)} | |")
    return lines


def pair_records(folder: Path, pe: str) -> list[dict]:
    """The per-pair records ``<pe>_<i>_<j>.json`` of ``pairs.py`` in ``folder``, sorted by pair.

    Other JSON files whose names start with ``<pe>_`` (``learned_alignment.json``) are not pairs.
    """
    pattern = re.compile(rf"{re.escape(pe)}_(\d+)_(\d+)\.json")
    found = {}
    for path in folder.glob(f"{pe}_*.json"):
        match = pattern.fullmatch(path.name)
        if match:
            found[int(match[1]), int(match[2])] = path
    return [json.loads(found[pair].read_text()) for pair in sorted(found)]


def main() -> None:
    """Print every table of the study's records in the folder named on the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = Path(__file__).parent / "results"
    parser.add_argument("folder", type=Path, nargs="?", default=default, help="the records' folder")
    folder = parser.parse_args().folder
    if not folder.is_dir():
        raise SystemExit(f"{folder} is not a folder of pairs.py records")
    for pe in ("learned", "rope"):
        records = pair_records(folder, pe)
        if not records:
            continue
        print(f"\n## {pe}: {len(records)} pairs\n")
        for title, table in (
            ("Variants (invariant Stage 1 cost, the default)", main_table),
            ("Every Stage 1 cost", metrics_table),
            ("Stage 2 diagnostics at the default order", stage2_table),
            ("Refinement over all orders", orders_refinement),
            ("Stage 1 costs against the barrier over the 24 orders", correlation_table),
            ("Matching on the visible weights (pipeline)", visible_table),
        ):
            print(f"\n### {title}\n")
            print("\n".join(table(records)))
    print_paths(folder)


def path_table(path: dict) -> list[str]:
    """Midpoint loss gap (% of naive) after k L-BFGS iterations, per objective (``path.py``)."""
    keys = [k for k in next(iter(path.values())) if "/" in k]
    steps = [p["steps"] for p in next(iter(path.values()))[keys[0]]]
    lines = [
        "| order / objective | " + " | ".join(f"{s} steps" for s in steps) + " | raised by 30 steps | max cond at 30 |",
        "|---|" + "---|" * (len(steps) + 2),
    ]
    for key in keys:
        gaps = np.array([[p["mid_gap_pct"] for p in pair[key]] for pair in path.values()])
        raised = int((gaps[:, -1] > gaps[:, 0]).sum())
        cond = [pair[key][-1]["max_cond"] for pair in path.values()]
        lines.append(
            f"| {key} | "
            + " | ".join(mean_std(gaps[:, k]) for k in range(len(steps)))
            + f" | {raised}/{len(gaps)} | {np.mean(cond):.1f} (max {np.max(cond):.1f}) |"
        )
    lines += [
        "",
        "| pair | data-weighted Stage 1 order: midpoint rank (invariant / weight) | perm % | orth % | full % |",
    ]
    lines.append("|---|---|---|---|---|")
    cols = [[], [], []]
    for name, pair in path.items():
        p = pair["data_pipeline"]
        for c, s in zip(cols, ("permutation", "orthogonal", "full")):
            c.append(p[s])
        lines.append(
            f"| {name} | {p['invariant_midgap_rank']} / {p['weight_midgap_rank']} | {p['permutation']:.1f} | "
            f"{p['orthogonal']:.1f} | {p['full']:.1f} |"
        )
    lines.append(f"| mean ± std | | {mean_std(cols[0])} | {mean_std(cols[1])} | {mean_std(cols[2])} |")
    return lines


def print_paths(folder: Path) -> None:
    for pe in ("learned", "rope"):
        file = folder / f"path_{pe}.json"
        if file.exists():
            print(f"\n### {pe}: along the refinement (midpoint loss gap, % of naive)\n")
            print("\n".join(path_table(json.loads(file.read_text()))))


if __name__ == "__main__":
    main()
