"""Data-aware alignment on the main job's pairs: barrier ratios and time of each method (issue #8).

For every pair of fine-tuned seeds of ``lmc run``'s ``<runs>/<pe>/seed<k>/final.ckpt`` (reference
ViT on digits, ``first_attention``), align with each method through
:func:`lmc.connectivity.measure_connectivity` (the code ``lmc run`` uses) and report the loss
barrier ratio on the validation split and the alignment time. Data-aware methods calibrate on
the first ``calibration_batches`` batches (of 32) of a seeded shuffle of the training half B.

Usage: python -m benchmarks matcher_quality.data_aware --runs /tmp/demo_final2 --pes APE RoPE --seeds 3
       python -m benchmarks matcher_quality.data_aware --runs runs/repro --pes vit_ape/first_attention \
           --methods full learned --output benchmarks/matcher_quality/results/learned_alignment.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from lmc.connectivity import Evaluation, SweepHooks, data_identity, measure_connectivity, training_calibration
from lmc.connectivity.interpolation import evenly_spaced
from lmc.data import Digits
from lmc.matching import AlignOptions
from lmc.training.module import load_trained

METHODS = {
    "full": AlignOptions(),
    "full+objective=data": AlignOptions(objective="data"),
    "metric=activation": AlignOptions(metric="activation"),
    "metric=activation+objective=data": AlignOptions(metric="activation", objective="data"),
    "learned": AlignOptions(method="learned"),
    "learned+steps=120": AlignOptions(method="learned", learned_steps=120),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", required=True, help="folders <runs>/<pe>/seed<k>/final.ckpt")
    parser.add_argument("--pes", nargs="+", default=["APE", "RoPE"])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--output", default="benchmarks/matcher_quality/results/data_aware.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = Digits(batch_size=32, part="B")
    rows = {}
    for pe in args.pes:
        for i, j in itertools.combinations(range(args.seeds), 2):
            module, hyperparameters = load_trained(Path(args.runs, pe, f"seed{i}", "final.ckpt"))
            reference, _ = load_trained(Path(args.runs, pe, f"seed{j}", "final.ckpt"))
            module.eval()
            architecture = {k: hyperparameters.get(k) for k in ("model", "model_config")}
            loader = DataLoader(data.split("val"), batch_size=256)
            evaluation = Evaluation(module.metric_sums, loader, "val", data_identity(data), architecture)
            naive = {}
            for label, options in ((label, METHODS[label]) for label in args.methods):
                calibration = None
                if options.data_aware:
                    calibration = training_calibration(data, module.model_loss, options.calibration_batches)
                result = measure_connectivity(
                    module.model,
                    reference.model.eval(),
                    "first_attention",
                    options,
                    evenly_spaced(25),
                    evaluation,
                    SweepHooks(),
                    calibration,
                )
                naive = result["curves"]["naive"]
                alignment = result["alignment"]
                rows[f"{pe}/{i}-{j}/{label}"] = {
                    "loss_ratio": result["barrier_ratio"]["loss_barrier"],
                    "accuracy_ratio": result["barrier_ratio"]["accuracy_barrier"],
                    "seconds": alignment["seconds"],
                    "calibration_seconds": alignment["calibration_seconds"],
                    "calibration": alignment["calibration"]
                    and {k: alignment["calibration"][k] for k in ("split", "num_samples", "batches")},
                    "learned": alignment["learned"],
                }
                print(pe, f"{i}-{j}", label, rows[f"{pe}/{i}-{j}/{label}"], flush=True)
            rows[f"{pe}/{i}-{j}/naive_loss_barrier"] = naive["loss_barrier"]
    for pe in args.pes:
        for label in args.methods:
            found = [v for k, v in rows.items() if k.startswith(f"{pe}/") and k.endswith(f"/{label}")]
            ratios = [r["loss_ratio"] for r in found]
            seconds = [r["seconds"] for r in found]
            print(
                f"{pe:5s} {label:34s} loss ratio {statistics.mean(ratios):6.1f} ± {statistics.pstdev(ratios):5.1f} %"
                f"  per pair {', '.join(f'{r:.1f}' for r in ratios)}  align {statistics.mean(seconds):.2f} s"
            )
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
