"""The extended group streamed: full_model with residual="orthogonal" and unit scales against the default group.

For each shape (``benchmarks.speed.streamed_shapes``: Llama-shaped bf16 folders of two independent models), in the
same run and each in a process of its own (its peak resident memory its own):

- ``lmc.checkpoint_alignment.align_directories`` at ``full_model`` with the default options: time, peak memory, the
  aligned over naive weight distance;
- the same with ``AlignOptions(residual="orthogonal", unit_scales=True)``: both folders read folded, the residual
  step a rotation (orthogonal Procrustes), the gated units' scales in closed form;
- the ratio of the two times (issue target: at most 1.5 at the 8B shape, under 3 GB).

Writes ``benchmarks/speed/results/extended_group.{json,md}``; rows accumulate, one per shape and run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.machine import machine, machine_line
from benchmarks.speed.streamed_shapes import NAMES, SHAPES, write_pair

RESULTS = Path(__file__).parent / "results" / "extended_group.json"
VARIANTS = {"default": {}, "extended": {"residual": "orthogonal", "unit_scales": True}}


def measure(source: str, target: str, output: str, options: dict, threads: int) -> dict:
    """One streamed full_model alignment in this process: seconds, peak memory, distances, rounds."""
    import torch

    from benchmarks.machine import peak_rss
    from lmc.checkpoint_alignment import align_directories
    from lmc.matching import AlignOptions

    torch.set_num_threads(threads)
    start = time.perf_counter()
    report = align_directories(source, target, output, "full_model", AlignOptions(**options))
    return {
        "seconds": time.perf_counter() - start,
        "peak_rss": peak_rss(),
        "distance": report.distance,
        "distance_ratio": report.distance["aligned"] / report.distance["naive"],
        "residual_group": report.residual_group,
        "probe_relative_error": report.probe_relative_error,
    }


def in_process(source: Path, target: Path, output: Path, options: dict, threads: int) -> dict:
    """:func:`measure` in a fresh Python process (its own peak memory)."""
    code = (
        "import json, sys; from benchmarks.speed.extended_group import measure; "
        f"print(json.dumps(measure({str(source)!r}, {str(target)!r}, {str(output)!r}, {options!r}, {threads})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"the {options or 'default'} alignment failed:\n{done.stderr[-3000:]}")
    shutil.rmtree(output, ignore_errors=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def render(rows: list[dict]) -> str:
    """The Markdown table of every row: per shape, each variant's time, peak memory and distance ratio."""
    lines = [
        "# The extended group streamed: full_model, default group against residual='orthogonal' with unit scales",
        "",
        "Written by `python -m benchmarks extended_group` (benchmarks/speed/extended_group.py) from its JSON; "
        "each alignment in a process of its own, both in the same run. Each aligned/naive ratio is in its own frame: "
        "the default group's between the models as stored, the extended group's between the folded models (the "
        "fold changes the naive distance too), so the two ratios are not a comparison of the groups.",
        "",
        "| shape | machine | threads | default s | default GB | extended s | extended GB | time ratio | "
        "aligned/naive default | aligned/naive extended | residual group |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        default, extended = row["default"], row["extended"]
        lines.append(
            f"| {NAMES[row['shape']]} | {row['machine_line']} | {row['threads']} | {default['seconds']:.1f} | "
            f"{default['peak_rss'] / 1e9:.2f} | {extended['seconds']:.1f} | {extended['peak_rss'] / 1e9:.2f} | "
            f"{extended['seconds'] / default['seconds']:.2f} | {default['distance_ratio']:.4f} | "
            f"{extended['distance_ratio']:.4f} | {extended['residual_group']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["8b"], choices=list(SHAPES))
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/lmc-extended-group"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--render", action="store_true", help="only render --output's Markdown from its JSON")
    args = parser.parse_args()
    rows = json.loads(args.output.read_text()) if args.output.is_file() else []
    if not args.render:
        for shape in args.shapes:
            workdir = args.workdir / shape
            shutil.rmtree(workdir, ignore_errors=True)
            workdir.mkdir(parents=True)
            row = {"shape": shape, "threads": args.threads, "machine": machine(), "machine_line": machine_line()}
            source, target, _ = write_pair(shape, workdir, independent=True)
            for name, options in VARIANTS.items():
                row[name] = in_process(source, target, workdir / f"aligned_{name}", options, args.threads)
                print(shape, name, row[name], flush=True)
            shutil.rmtree(workdir, ignore_errors=True)
            rows.append(row)
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(json.dumps(rows, indent=1) + "\n")
    args.output.with_suffix(".md").write_text(render(rows))


if __name__ == "__main__":
    main()
