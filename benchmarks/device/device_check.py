"""A GPU machine's short check: bf16 training, a streamed alignment with ``--device cuda``, the 8B streamed benchmark.

Three steps, each a documented command run in a subprocess with its own time limit, so that one
failure is recorded and the others still run:

1. ``training``: ``lmc fit`` of the digits main job's model (``configs/experiment/digits_vit_ape.yaml``)
   on one GPU in bf16 mixed precision (``configs/trainer/gpu.yaml``), ``--epochs`` epochs;
2. ``streamed_8b``: ``python -m benchmarks streamed_align`` on a Llama-3-8B-shaped pair
   (``--shape``: ``8b-2layers`` by default, the 8B's layers and vocabulary with two layers; ``8b`` for the
   whole model, about 32 GB of disk and 10 minutes more), its figures written beside this file;
3. ``align_cuda``: ``lmc align --scope all_attention`` on the pair step 2 wrote, with ``--device cuda``
   and with ``--device cpu``: both times, and the aligned/naive distances, which must agree.

The run writes ``results/device_check.json`` (the machine with its GPU, each step's command, exit
status, seconds and, on failure, the end of its output) and its rendering ``results/device_check.md``;
``--render`` renders the Markdown again from the JSON. ``--dry-run`` prints the commands, runs nothing.

    python -m benchmarks device                      # about 5 minutes on one H100 with 16 cores
    python -m benchmarks device --shape 8b --timeout 900
    python -m benchmarks device --dry-run
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.machine import ROOT, machine

RESULTS = Path(__file__).parent / "results" / "device_check.json"
STEPS = ("training", "streamed_8b", "align_cuda")
#: Largest relative difference of the aligned/naive distance ratio expected between ``--device cuda`` and ``cpu``:
#: the GPU's float32 GEMMs add up in another order than the CPU's, so the two agree to rounding, not bit for bit.
AGREEMENT = 1e-4


def commands(args: argparse.Namespace) -> dict[str, list[list[str]]]:
    """Each step's commands (run from the repository root), in order."""
    python, pair = sys.executable, args.workdir / "streamed" / args.shape
    training = [python, "-m", "lmc", "fit", "--config", "configs/experiment/digits_vit_ape.yaml"]
    training += ["--trainer", "configs/trainer/gpu.yaml", "--trainer.max_epochs", str(args.epochs)]
    training += ["--trainer.logger.init_args.save_dir", str(args.workdir / "training")]
    streamed = [python, "-m", "benchmarks", "streamed_align", "--shapes", args.shape, "--keep"]
    streamed += ["--threads", str(args.threads), "--workdir", str(args.workdir / "streamed")]
    streamed += ["--output", str(args.results.with_name("streamed_align.json"))]
    streamed += ["--note", "python -m benchmarks device"]
    align = [
        [python, "-m", "lmc", "align", str(pair / f"{args.shape}-source"), str(pair / f"{args.shape}-target")]
        + ["--output", str(args.workdir / f"aligned_{device}"), "--scope", "all_attention", "--device", device]
        for device in ("cuda", "cpu")
    ]
    return {"training": [training], "streamed_8b": [streamed], "align_cuda": align}


def run_step(step: list[list[str]], timeout: float) -> dict[str, Any]:
    """Run a step's commands in turn: each one's exit status and seconds; the output's end where one fails."""
    runs = []
    for command in step:
        start = time.perf_counter()
        try:
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
            status, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as expired:
            status, output = None, f"timed out after {timeout:g} s: {expired.stderr or ''}"
        run = {"command": " ".join(command), "status": status, "seconds": time.perf_counter() - start}
        if status != 0:
            run["output_end"] = str(output)[-3000:]
        runs.append(run)
        if status != 0:
            break
    return {"passed": all(run["status"] == 0 for run in runs) and len(runs) == len(step), "runs": runs}


def distance_ratio(output: Path) -> float | None:
    """The aligned/naive distance of an ``lmc align`` output folder's ``report.json`` (``None`` if absent)."""
    report = output / "report.json"
    if not report.is_file():
        return None
    distance = json.loads(report.read_text())["alignment"]["distance"]
    return distance["aligned"] / distance["naive"]


def gpu() -> dict[str, Any]:
    """The GPU torch sees: its name, memory and CUDA version."""
    import torch

    properties = torch.cuda.get_device_properties(0)
    return {"name": properties.name, "memory_bytes": properties.total_memory, "cuda": torch.version.cuda}


def render(results: dict[str, Any]) -> str:
    """The Markdown of a results JSON: every figure is one of the JSON's or a ratio of two."""
    where, card = results["machine"], results["gpu"]
    lines = [
        "# A GPU machine's check: bf16 training, `--device cuda`, the 8B streamed benchmark",
        "",
        "Rendered by `python -m benchmarks device` from `device_check.json` beside this file: do not edit either",
        f"by hand. {card['name']} ({card['memory_bytes'] / 2**30:.0f} GiB, CUDA {card['cuda']}); {where['cpu']}, "
        f"{where['cores']} cores, torch {where['torch']}, lmc {where['lmc_commit']}; pair `{results['shape']}`.",
        "",
        "| step | passed | command | exit status | seconds |",
        "|---|---|---|---|---|",
    ]
    for name, step in results["steps"].items():
        for run in step["runs"]:
            status = "timed out" if run["status"] is None else str(run["status"])
            passed = "yes" if step["passed"] else "no"
            lines.append(f"| {name} | {passed} | `{run['command']}` | {status} | {run['seconds']:.1f} |")
    ratios = results.get("distance_ratio", {})
    if len(ratios) == 2 and None not in ratios.values():
        cuda, cpu = ratios["cuda"], ratios["cpu"]
        seconds = [run["seconds"] for run in results["steps"]["align_cuda"]["runs"]]
        lines += [
            "",
            f"Distance aligned / naive: {cuda:.6f} on cuda, {cpu:.6f} on cpu (relative difference "
            f"{abs(cuda - cpu) / cpu:.1e}, at most {AGREEMENT:g} expected); `lmc align` took {seconds[0]:.1f} s "
            f"on cuda and {seconds[1]:.1f} s on cpu ({seconds[1] / seconds[0]:.2f}x). The streamed benchmark's "
            "own figures: `streamed_align.md` beside this file.",
        ]
    failed = [(name, run) for name, step in results["steps"].items() for run in step["runs"] if run["status"] != 0]
    for name, run in failed:
        lines += ["", f"{name} failed; the end of its output:", "", "```", run["output_end"].strip(), "```"]
    return "\n".join(lines) + "\n"


def write_results(results: dict[str, Any], path: Path) -> None:
    """``results`` to ``path`` and its rendering to the Markdown beside it, each atomically."""
    from lmc.io import atomic_write_text

    atomic_write_text(path, json.dumps(results, indent=2) + "\n")
    atomic_write_text(path.with_suffix(".md"), render(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="8b-2layers", choices=("8b-2layers", "8b"), help="the streamed pair")
    parser.add_argument("--epochs", type=int, default=2, help="epochs of the bf16 training step")
    parser.add_argument("--threads", type=int, default=16, help="torch threads of the streamed benchmark")
    parser.add_argument("--timeout", type=float, default=600, help="seconds allowed to each command")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/lmc-device-check"))
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS), help="align_cuda needs streamed_8b")
    parser.add_argument("--render", action="store_true", help="only render --results' Markdown from its JSON")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args()
    if args.render:
        if not args.results.is_file():
            parser.error(f"--render reads {args.results}, which does not exist: run the check first, or name the JSON")
        write_results(json.loads(args.results.read_text()), args.results)
        return
    planned = commands(args)
    if args.dry_run:
        for name in args.steps:
            print("\n".join(f"{name}: {' '.join(command)}" for command in planned[name]))
        return
    import torch

    if not torch.cuda.is_available():
        parser.error("no CUDA GPU here (torch.cuda.is_available() is False): run it on a GPU machine, or --dry-run")
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    results = {"machine": machine(), "gpu": gpu(), "shape": args.shape, "steps": {}}
    try:
        for name in args.steps:
            results["steps"][name] = run_step(planned[name], args.timeout)
            print(name, "passed" if results["steps"][name]["passed"] else "FAILED", flush=True)
        if "align_cuda" in results["steps"]:
            results["distance_ratio"] = {d: distance_ratio(args.workdir / f"aligned_{d}") for d in ("cuda", "cpu")}
    finally:
        shutil.rmtree(args.workdir, ignore_errors=True)
    write_results(results, args.results)
    print(render(results))


if __name__ == "__main__":
    main()
