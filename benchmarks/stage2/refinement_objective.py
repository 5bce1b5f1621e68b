"""Stage 2 at a fixed Stage 1 order: does the refinement lower the barrier of its orthogonal start?

For every pair of a finished ``first_attention`` run folder, the pair is aligned again from its
checkpoints with the paper's Stage 1 (``invariant``) and, after the same head order, Stage 2 as the
orthogonal start alone (Variant 2), the refinement of the weight objective (``full``, the paper's)
and the refinement of the data objective (``full``, ``objective=data``: the projections' outputs on
8 training batches of the fine-tuning half), and with the weight objective stopped after 1, 3 and
10 L-BFGS steps. Each is swept at the run's 25 alphas on the run's curve samples (the validation
split), so the orthogonal and full columns must equal the run's own ``summary.json``.

    python -m benchmarks refinement_objective --run runs/repro/mnist_vit_ape/first_attention \\
        --data configs/data/mnist_5k.yaml --name mnist_vit_ape
    # writes benchmarks/stage2/results/refinement_objective.{json,md}
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from benchmarks.run_files import datamodule, fine_tuned, loss_barrier
from lmc.adapters import model_spec
from lmc.connectivity.measure import training_calibration
from lmc.io import atomic_write_json, atomic_write_text
from lmc.matching import AlignOptions, align
from lmc.symmetry import read_attention

RESULTS = Path(__file__).parent / "results" / "refinement_objective"
#: Stage 2 settings, all after the paper's Stage 1 order (``metric="invariant"``).
SETTINGS = {
    "orthogonal": AlignOptions(method="orthogonal"),
    "full, 1 step": AlignOptions(steps=1),
    "full, 3 steps": AlignOptions(steps=3),
    "full, 10 steps": AlignOptions(steps=10),
    "full (30 steps)": AlignOptions(),
    "full, objective=data": AlignOptions(objective="data"),
}


@torch.no_grad()
def midpoint_product_deviation(aligned: torch.nn.Module, target: torch.nn.Module) -> float:
    """``sum_i ||Q_m^i K_m^iT - mean(Q^i K^iT)||^2 + ||V_m^i O_m^i - mean(V^i O^i)||^2`` of the first attention
    layer: the products its heads compute at the midpoint against the mean of the end points' products
    (the cross terms ``Q_A K_B^T``, ``V_A O_B`` and the like, which the weight objective does not weigh)."""
    layer = model_spec(target).attention[0]
    ends = [read_attention({n: p.double() for n, p in m.named_parameters()}, layer) for m in (aligned, target)]
    group = layer.queries_per_kv
    deviation = 0.0
    for head in range(layer.num_heads):
        kv = head // group
        pieces = [(w.query[head], w.key[kv], w.value[kv], w.out[head]) for w in ends]
        q, k, v, o = ((a + b) / 2 for a, b in zip(*pieces))
        mean_qk = sum(a[0] @ a[1].T for a in pieces) / 2
        mean_vo = sum(a[2] @ a[3] for a in pieces) / 2
        deviation += float((q @ k.T - mean_qk).pow(2).sum() + (v @ o - mean_vo).pow(2).sum())
    return deviation


def write_report(results: dict) -> None:
    lines = [
        "# Stage 2 at a fixed Stage 1 order: the refinement against its orthogonal start",
        "",
        "Written by `python -m benchmarks refinement_objective` (one thread). Aligned loss barrier as % of the naive",
        "one, per pair, after the paper's Stage 1 order: Variant 2 (orthogonal start), the weight objective's",
        "L-BFGS refinement stopped after 1, 3, 10 and 30 steps (30: lmc's `full`), and the refinement of",
        "the data objective (`objective=data`, 8 training batches of the fine-tuning half). In brackets: the",
        "first attention layer's distance to the target after each setting, in the setting's own objective",
        "(weights, or the projections' outputs for `objective=data`), which its refinement lowers. The second",
        "table: the midpoint's head products against the mean of the end points' (`midpoint_product_deviation`).",
        "",
    ]
    for name, family in results.items():
        labels = list(SETTINGS)
        lines += [f"## {name} (`{family['run']}`, {len(family['pairs'])} pairs)", ""]
        lines.append("| pair | naive (nats) | " + " | ".join(labels) + " |")
        lines.append("|---|---|" + "---|" * len(labels))
        for pair, entry in family["pairs"].items():
            cells = " | ".join(f"{entry['ratio'][label]:.1f} % ({entry['distance'][label]:.2f})" for label in labels)
            lines.append(f"| {pair} | {entry['naive']:.3f} | {cells} |")
        means = []
        for label in labels:
            values = [entry["ratio"][label] for entry in family["pairs"].values()]
            spread = statistics.stdev(values) if len(values) > 1 else float("nan")
            means.append(f"{statistics.mean(values):.1f} ± {spread:.1f} %")
        lines.append("| mean ± std | | " + " | ".join(means) + " |")
        lines += ["", "| pair | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
        for pair, entry in family["pairs"].items():
            lines.append(
                f"| {pair} | " + " | ".join(f"{entry['product_deviation'][label]:.2f}" for label in labels) + " |"
            )
        lines.append("")
        start = {pair: entry["ratio"]["orthogonal"] for pair, entry in family["pairs"].items()}
        for label in labels[1:]:
            higher = [pair for pair, entry in family["pairs"].items() if entry["ratio"][label] > start[pair]]
            lines.append(f"- `{label}` above the orthogonal start in {len(higher)} of {len(start)} pairs.")
        lines.append("")
    atomic_write_text(RESULTS.with_suffix(".md"), "\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="a finished first_attention lmc run folder")
    parser.add_argument("--data", type=Path, required=True, help="the run's DataModule config (configs/data/...)")
    parser.add_argument("--name", required=True, help="the family's name in the results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    modules = fine_tuned(args.run)
    data = datamodule(args.data)
    calibration = training_calibration(data, modules[0].model_loss, 8)
    curve_batches = list(DataLoader(data.split("val"), batch_size=data.batch_size))
    path = RESULTS.with_suffix(".json")
    results = json.loads(path.read_text()) if path.is_file() else {}
    family = {"run": str(args.run), "pairs": {}}
    for i, j in itertools.combinations(range(len(modules)), 2):
        source, target = modules[i].model, modules[j]
        naive = loss_barrier(target, source, curve_batches)
        entry = {"naive": naive, "ratio": {}, "distance": {}, "product_deviation": {}}
        for label, options in SETTINGS.items():
            aligned, report = align(source, target.model, "first_attention", options, calibration)
            entry["ratio"][label] = 100 * loss_barrier(target, aligned, curve_batches) / naive
            entry["distance"][label] = report.layers[0].distance[options.method]
            entry["product_deviation"][label] = midpoint_product_deviation(aligned, target.model)
        family["pairs"][f"{i}_{j}"] = entry
        print(f"{args.name} {i}_{j}: " + ", ".join(f"{k} {v:.1f}" for k, v in entry["ratio"].items()), flush=True)
    results[args.name] = family
    atomic_write_json(path, results)
    write_report(results)


if __name__ == "__main__":
    main()
