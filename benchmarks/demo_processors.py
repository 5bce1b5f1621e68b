"""Does the main job's headline hold on another processor? The demo under four kernel settings.

A processor picks its floating-point kernels by its vector width (ATen, oneDNN) and its vendor
(MKL); training amplifies their rounding into other models. This machine runs the demo
(``lmc.experiments.demo.run``) as itself and as a narrower processor would (ATen's and oneDNN's
AVX2 kernels, MKL's AVX2 branch), once with the kernels free and once pinned
(:data:`lmc.experiments.demo.PINNED_KERNELS`, and the pin again with MKL limited to AVX2
instructions). It reports each encoding's aligned/naive loss ratio, the shift of its mean between
the two processors in units of the larger spread over pairs, and whether the pinned runs trained
bit-identical models. Every run computes with one thread per encoding, both encodings side by side.

    python -m benchmarks.demo_processors            # writes benchmarks/results/demo_processors.{json,md}
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path
from typing import Any

import torch

from lmc.experiments import demo
from lmc.io import atomic_write_json, atomic_write_text

#: Each setting's environment: the processor's own kernels, and those an AVX2 processor picks.
SETTINGS = {
    "free, this processor": {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
    "free, as an AVX2 processor": {
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_CBWR": "AVX2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    },
    "pinned, this processor": demo.PINNED_KERNELS,
    "pinned, MKL limited to AVX2": {**demo.PINNED_KERNELS, "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}
#: The pairs of settings compared: the same demo on two processors.
COMPARISONS = (
    ("free, this processor", "free, as an AVX2 processor"),
    ("pinned, this processor", "pinned, MKL limited to AVX2"),
)


def _same_weights(first: Path, second: Path) -> bool:
    """Whether every fine-tuned checkpoint of two demo folders holds the same weights, bit for bit."""
    paths = sorted(p.relative_to(first) for p in first.glob("*/seed*/final.ckpt"))
    if not paths:
        return False
    for path in paths:
        a = torch.load(first / path, map_location="cpu", weights_only=True)["state_dict"]
        b = torch.load(second / path, map_location="cpu", weights_only=True)["state_dict"]
        if a.keys() != b.keys() or not all(torch.equal(a[k], b[k]) for k in a):
            return False
    return True


def measure(output: Path, epochs: int | None, results: Path) -> dict[str, Any]:
    """Run every setting in turn (``lmc run`` resumes a finished one), writing the results after each."""
    runs: dict[str, Any] = {}
    for name, environment in SETTINGS.items():
        folder = output / name.replace(", ", "_").replace(" ", "_")
        start = time.perf_counter()
        rows = demo.run(folder, epochs=epochs, kernels=environment)
        runs[name] = {
            "folder": str(folder),
            "environment": environment,
            "seconds": time.perf_counter() - start,
            "ratio": {
                row["label"]: row["summary"]["alignments"]["full"]["barrier_ratio"]["loss_barrier"] for row in rows
            },
            "pairs": {row["label"]: len(row["summary"]["pairs"]) for row in rows},
        }
        result = summarize(runs, epochs)
        atomic_write_json(results.with_suffix(".json"), result)
        atomic_write_text(results.with_suffix(".md"), report(result))
    return result


def summarize(runs: dict[str, Any], epochs: int | None) -> dict[str, Any]:
    """The settings run so far, and the comparisons of those whose two settings both ran."""
    comparisons = []
    for a, b in COMPARISONS:
        if a not in runs or b not in runs:
            continue
        entry = {
            "settings": [a, b],
            "identical_weights": _same_weights(Path(runs[a]["folder"]), Path(runs[b]["folder"])),
        }
        for label in demo.EXPERIMENTS:
            x, y = runs[a]["ratio"][label], runs[b]["ratio"][label]
            spread = max(x["std"], y["std"])
            entry[label] = {
                "shift": abs(x["mean"] - y["mean"]),
                "shift_in_spreads": abs(x["mean"] - y["mean"]) / spread,
            }
        comparisons.append(entry)
    return {
        "machine": {"processor": platform.processor() or platform.machine(), "torch": torch.__version__},
        "threads_per_run": 1,
        "epochs": epochs,
        "runs": runs,
        "comparisons": comparisons,
    }


def report(result: dict[str, Any]) -> str:
    lines = [
        "# The main job on two processors",
        "",
        f"Written by `python -m benchmarks.demo_processors` on {result['machine']['processor']} (torch "
        f"{result['machine']['torch']}): `lmc demo`"
        + (f" with {result['epochs']} epochs per phase" if result["epochs"] else "")
        + ", both encodings side by side, one thread each. An AVX2 processor is emulated by the kernel "
        "settings it would pick. Cells: the aligned/naive loss ratio, mean ± std over pairs. A setting not listed "
        "has not run yet (the script resumes finished runs: run it again to complete the table).",
        "",
        "| setting | APE | RoPE | wall time of this call (a resumed run is shorter) |",
        "|---|---|---|---|",
    ]
    for name, run in result["runs"].items():
        cells = [
            f"{run['ratio'][k]['mean']:.1f} ± {run['ratio'][k]['std']:.1f} % ({run['pairs'][k]} pairs)"
            for k in demo.EXPERIMENTS
        ]
        lines.append(f"| {name} | {' | '.join(cells)} | {run['seconds']:.0f} s |")
    lines += ["", "| processors compared | APE shift | RoPE shift | same weights |", "|---|---|---|---|"]
    for entry in result["comparisons"]:
        cells = [
            f"{entry[k]['shift']:.1f} points ({entry[k]['shift_in_spreads']:.2f} spreads)" for k in demo.EXPERIMENTS
        ]
        lines.append(
            f"| {entry['settings'][0]} vs {entry['settings'][1]} | {' | '.join(cells)} "
            f"| {'yes, bit for bit' if entry['identical_weights'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=Path("runs/demo_processors"))
    parser.add_argument("--epochs", type=int, default=None, help="epochs per phase (default: the main job's)")
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results/demo_processors"))
    args = parser.parse_args()
    print(report(measure(args.output, args.epochs, args.results)))


if __name__ == "__main__":
    main()
