"""Does the main job's headline hold on another processor? The demo under four kernel settings.

A processor picks its floating-point kernels by its vector width (ATen, oneDNN) and its vendor
(MKL); training amplifies their rounding into other models. This machine runs the demo
(``lmc.experiments.demo.run``) as itself and as a narrower processor would (ATen's and oneDNN's
AVX2 kernels, MKL's AVX2 branch), once with the kernels free (the demo's own setting) and once
pinned to kernels every x86-64 processor with AVX2 runs alike (:data:`PINNED`; the pin again with
MKL limited to AVX2 instructions). It reports each encoding's aligned/naive loss ratio, the shift
of its mean between the two processors in units of the larger spread over pairs, and whether the
two runs trained bit-identical models. Every run computes with one thread per encoding, both
encodings side by side.

    python -m benchmarks demo_processors            # writes benchmarks/reproduction/results/demo_processors.{json,md}
    python -m benchmarks demo_processors --settings free   # only the two free settings

A processor of another vendor is compared for real, not emulated: run the demo as itself there and
compare it with the results file this script wrote on the first machine,

    python -m benchmarks demo_processors --settings here --results benchmarks/reproduction/results/demo_vendors \
        --against benchmarks/reproduction/results/demo_processors.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.machine import processor_name
from lmc.experiments import demo
from lmc.io import atomic_write_json, atomic_write_text

#: The kernels an AVX2 processor picks: ATen's AVX2 kernels, MKL's AVX2 branch, oneDNN capped at AVX2.
AS_AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
#: Kernels every x86-64 processor with AVX2 runs alike: ATen's AVX2 kernels, MKL's conditional
#: numerical reproducibility mode, oneDNN capped at AVX2 (about 1.4-2x slower training steps).
PINNED = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "AVX2"}
#: Each setting's environment.
SETTINGS = {
    "free, this processor": demo.ONE_THREAD,
    "free, as an AVX2 processor": {**demo.ONE_THREAD, **AS_AVX2},
    "pinned, this processor": {**demo.ONE_THREAD, **PINNED},
    "pinned, MKL limited to AVX2": {**demo.ONE_THREAD, **PINNED, "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}
#: The pairs of settings compared: the same demo on two processors.
COMPARISONS = {
    "free": ("free, this processor", "free, as an AVX2 processor"),
    "pinned": ("pinned, this processor", "pinned, MKL limited to AVX2"),
}
#: What ``--settings`` can run: a comparison's two settings, or this processor alone (``--against``).
GROUPS = {**COMPARISONS, "here": ("free, this processor",)}
#: The setting compared with another machine's results file (``--against``).
HERE = "free, this processor"


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


def measure(
    output: Path, epochs: int | None, results: Path, groups: list[str], against: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Run the named groups' settings in turn (:data:`GROUPS`), writing the results after each.

    ``lmc run`` resumes a finished setting: its wall time is then the one an earlier call recorded
    in ``results`` (None where none did), and the settings of earlier calls stay in the table.
    ``against``: another processor's results file (:func:`summarize`'s), compared with this one.
    """
    path = results.with_suffix(".json")
    previous = json.loads(path.read_text()) if path.is_file() else {}
    runs: dict[str, Any] = previous.get("runs", {}) if previous.get("epochs") == epochs else {}
    for name in dict.fromkeys(setting for group in groups for setting in GROUPS[group]):
        environment = SETTINGS[name]
        folder = output / name.replace(", ", "_").replace(" ", "_")
        finished = all((folder / label / "summary.json").is_file() for label in demo.EXPERIMENTS)
        start = time.perf_counter()
        rows = demo.run(folder, epochs=epochs, kernels=environment)
        seconds = time.perf_counter() - start
        if finished:
            seconds = runs[name]["seconds"] if name in runs and runs[name]["folder"] == str(folder) else None
        runs[name] = {
            "folder": str(folder),
            "environment": environment,
            "seconds": seconds,
            "ratio": {
                row["label"]: row["summary"]["alignments"]["full"]["barrier_ratio"]["loss_barrier"] for row in rows
            },
            "pairs": {row["label"]: len(row["summary"]["pairs"]) for row in rows},
        }
        result = summarize(runs, epochs, against)
        atomic_write_json(path, result)
        atomic_write_text(results.with_suffix(".md"), report(result))
    return result


def _shifts(x: dict[str, Any], y: dict[str, Any]) -> dict[str, Any]:
    """Per encoding, how far two runs' mean ratios are apart, in points and in the larger spread over pairs."""
    shifts = {}
    for label in demo.EXPERIMENTS:
        a, b = x["ratio"][label], y["ratio"][label]
        shift = abs(a["mean"] - b["mean"])
        shifts[label] = {"shift": shift, "shift_in_spreads": shift / max(a["std"], b["std"])}
    return shifts


def check_against(against: Any, epochs: int | None) -> None:
    """Refuse another machine's results that hold no free run of this demo (``--epochs`` included)."""
    if (
        not isinstance(against, dict)
        or against.get("epochs") != epochs
        or HERE not in against.get("runs", {})
        or "processor" not in against.get("machine", {})
    ):
        raise ValueError(
            f"the results to compare against hold no '{HERE}' run with epochs={epochs}: pass a results file "
            "of this script run with the same --epochs on the other machine"
        )


def summarize(runs: dict[str, Any], epochs: int | None, against: dict[str, Any] | None = None) -> dict[str, Any]:
    """The settings run so far, and the comparisons of those whose two settings both ran; with
    ``against`` (another machine's results), also this processor's free run against that one's."""
    comparisons = []
    for a, b in COMPARISONS.values():
        if a not in runs or b not in runs:
            continue
        identical = _same_weights(Path(runs[a]["folder"]), Path(runs[b]["folder"]))
        comparisons.append({"settings": [a, b], "identical_weights": identical, **_shifts(runs[a], runs[b])})
    here = processor_name()
    if against is not None and HERE in runs:
        check_against(against, epochs)
        there = against["machine"]["processor"]
        settings = [f"free, {here}", f"free, {there}"]  # another machine's checkpoints are not here to compare
        comparisons.append(
            {"settings": settings, "identical_weights": None, **_shifts(runs[HERE], against["runs"][HERE])}
        )
    return {
        "machine": {"processor": here, "cores": os.cpu_count(), "torch": torch.__version__},
        "threads_per_run": 1,
        "epochs": epochs,
        "runs": runs,
        "comparisons": comparisons,
    }


def report(result: dict[str, Any]) -> str:
    lines = [
        "# The main job on two processors",
        "",
        f"Written by `python -m benchmarks demo_processors` on {result['machine']['processor']} "
        f"({result['machine']['cores']} cores, torch {result['machine']['torch']}): `lmc demo`"
        + (f" with {result['epochs']} epochs per phase" if result["epochs"] else "")
        + ", both encodings side by side, one thread each. An AVX2 processor is emulated by the kernel "
        "settings it would pick. Cells: the aligned/naive loss ratio, mean ± std over pairs. A setting not listed "
        "has not run yet (the script resumes finished runs and keeps their times: run it again to complete the table).",
        "",
        "| setting | APE | RoPE | wall time of its run |",
        "|---|---|---|---|",
    ]
    for name, run in result["runs"].items():
        cells = [
            f"{run['ratio'][k]['mean']:.1f} ± {run['ratio'][k]['std']:.1f} % ({run['pairs'][k]} pairs)"
            for k in demo.EXPERIMENTS
        ]
        seconds = "resumed, not timed" if run["seconds"] is None else f"{run['seconds']:.0f} s"
        lines.append(f"| {name} | {' | '.join(cells)} | {seconds} |")
    lines += ["", "| processors compared | APE shift | RoPE shift | same weights |", "|---|---|---|---|"]
    for entry in result["comparisons"]:
        cells = [
            f"{entry[k]['shift']:.1f} points ({entry[k]['shift_in_spreads']:.2f} spreads)" for k in demo.EXPERIMENTS
        ]
        lines.append(
            f"| {entry['settings'][0]} vs {entry['settings'][1]} | {' | '.join(cells)} "
            f"| {_same(entry['identical_weights'])} |"
        )
    return "\n".join(lines) + "\n"


def _same(identical: bool | None) -> str:
    return "n/a (two machines)" if identical is None else "yes, bit for bit" if identical else "no"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=Path("runs/demo_processors"))
    parser.add_argument("--epochs", type=int, default=None, help="epochs per phase (default: the main job's)")
    parser.add_argument("--results", type=Path, default=Path(__file__).parent / "results" / "demo_processors")
    parser.add_argument(
        "--settings", nargs="+", choices=list(GROUPS), default=list(COMPARISONS), help="the comparisons to run"
    )
    parser.add_argument("--against", type=Path, help="this script's results file (.json) from another processor")
    args = parser.parse_args()
    against = None
    if args.against is not None:
        if not args.against.is_file():
            raise SystemExit(f"--against {args.against} does not exist: pass the .json this script wrote elsewhere")
        try:  # before any demo runs: a wrong file is one line, not minutes of work lost
            against = json.loads(args.against.read_text())
        except ValueError as error:
            raise SystemExit(
                f"--against {args.against} is not this script's results file (not JSON: {error})"
            ) from None
        try:
            check_against(against, args.epochs)
        except ValueError as error:
            raise SystemExit(f"--against {args.against}: {error}") from None
    print(report(measure(args.output, args.epochs, args.results, args.settings, against)))


if __name__ == "__main__":
    main()
