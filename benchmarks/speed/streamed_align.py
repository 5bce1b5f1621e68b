"""Streamed alignment of Llama-shaped bf16 checkpoints larger than memory (issue #9, item 4).

Writes two random Llama-3-8B-shaped bf16 ``save_pretrained`` folders (5 GB shards with an index,
like HF; equal outside attention, the ``all_attention`` protocol) into ``--workdir``, then in fresh
subprocesses with ``--threads`` torch threads measures:

- the Gram-pass floor: read every attention tensor of both models (``safe_open``) and form each
  layer's Gram blocks (:class:`lmc.matching.grams.LayerGrams`), nothing else;
- ``lmc.checkpoint_alignment.align_directories`` at ``all_attention`` (``method="full"``): time, its ratio to
  the floor, and the peak RSS of the process (``VmHWM``, interpreter and libraries included).

GPT-NeoX shapes (Pythia-6.9B's widths; ``--shapes pythia-6.9b-2layers``) are written and measured
alike. The Llama-3.2-1B shape is measured the same way, and at ``full_model`` on a pair independent
everywhere: streamed (its time split into reads, assignments and the rest, its rounds, and the
floor of one round: :func:`measure_full_floor`) and with ``lmc.matching.align`` in memory.

Each finished shape is written to ``--output`` (its row replacing that shape's; with ``--full-model-only``
joining the shape's earlier ``all_attention`` row; the file is read again just before, so runs of other
shapes that finished meanwhile stay) and the JSON is
rendered to the Markdown beside it (``results/streamed_align.md``, :mod:`benchmarks.speed.streamed_report`):
every figure of the Markdown is one of the JSON's, or arithmetic on them and on the constants of
:mod:`benchmarks.speed.streamed_shapes` (the measurements: :mod:`benchmarks.speed.streamed_measures`). Never
edit either by hand; ``--render`` renders the Markdown again from the JSON, measuring nothing.

    python -m benchmarks streamed_align                       # 1b then 8b, into results/streamed_align.{json,md}
    python -m benchmarks streamed_align --shapes 1b --keep    # keep the written folders
    python -m benchmarks streamed_align --shapes 8b --full-model-streamed  # the 8B also streamed at full_model
    python -m benchmarks streamed_align --render              # the Markdown again from the JSON
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.machine import ROOT, machine
from benchmarks.speed.streamed_report import render
from benchmarks.speed.streamed_shapes import FULL_MODEL, SHAPES, write_pair

__all__ = ["SHAPES", "merged", "render", "write_results", "main"]


def in_subprocess(threads: int, function: str, *args: str, timeout: float | None = None) -> dict:
    """Run ``function(*args)`` of :mod:`benchmarks.speed.streamed_measures` in a fresh interpreter with ``threads``
    torch threads."""
    code = (
        f"import sys, json, torch; sys.path.insert(0, {str(ROOT)!r}); torch.set_num_threads({threads}); "
        f"from benchmarks.speed.streamed_measures import {function}; print(json.dumps({function}(*sys.argv[1:])))"
    )
    environment = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    run = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=environment, timeout=timeout
    )
    if run.returncode:
        raise RuntimeError(f"{function} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


RUN_CONTEXT = ("model_bytes", "write_seconds", "threads", "machine", "note")
"""What a row says of the run that measured it, besides its measurements."""


def merged(output: Path, shape: str, row: dict[str, Any], full_model_only: bool) -> dict[str, dict[str, Any]]:
    """The results in ``output`` as they are now (another run may have written it since this one began) with
    ``row`` as ``shape``'s. A ``--full-model-only`` row joins the shape's earlier ``all_attention`` measurements,
    its own run's context (:data:`RUN_CONTEXT`) under ``full_model_run``; a row without ``full_model``
    measurements keeps the shape's earlier ones, with their run's context under ``full_model_run``."""
    results = json.loads(output.read_text()) if output.exists() else {}
    earlier = results.get(shape, {})
    full = {key for key in (*row, *earlier) if key.startswith("full_model")}
    if full_model_only and "all_attention" in earlier:
        context = {key: value for key, value in row.items() if key not in full}
        row = {**earlier, **{key: row[key] for key in full & row.keys()}, "full_model_run": context}
    elif not full & row.keys() and full & earlier.keys():  # an attention run keeps the earlier full_model one
        context = earlier.get("full_model_run") or {key: earlier[key] for key in RUN_CONTEXT if key in earlier}
        row = {**row, **{key: earlier[key] for key in full & earlier.keys()}, "full_model_run": context}
    results[shape] = row
    return results


def write_results(results: dict[str, dict[str, Any]], output: Path) -> None:
    """``results`` to ``output`` and its rendering to the Markdown beside it, each atomically."""
    from lmc.io import atomic_write_text

    atomic_write_text(output, json.dumps(results, indent=2) + "\n")
    atomic_write_text(output.with_suffix(".md"), render(results, output.name))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["1b", "8b"], choices=list(SHAPES))
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/lmc-streamed-align"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keep", action="store_true", help="keep the written checkpoints")
    parser.add_argument("--full-model-timeout", type=float, default=900, help="seconds allowed to 1b full_model")
    parser.add_argument("--output", type=Path, default=Path(__file__).parent / "results" / "streamed_align.json")
    parser.add_argument("--render", action="store_true", help="only render --output's Markdown from its JSON")
    parser.add_argument(
        "--full-model-streamed",
        action="store_true",
        help="also stream full_model on shapes not aligned in memory (the 8B: about 32 GB more to write)",
    )
    parser.add_argument(
        "--full-model-only",
        action="store_true",
        help="measure only the streamed full_model and its floor (with --full-model-streamed or a FULL_MODEL shape)",
    )
    parser.add_argument(
        "--compare-release",
        action="store_true",
        help="stream full_model first without release_freed_memory, then with it (the memory it saves)",
    )
    parser.add_argument("--note", default="", help="a remark on the machine, rendered with its row")
    args = parser.parse_args()
    if args.render:
        if not args.output.is_file():
            parser.error(f"--render reads {args.output}, which does not exist: run a shape first, or name the JSON")
        write_results(json.loads(args.output.read_text()), args.output)
        return
    for shape in args.shapes:
        workdir = args.workdir / shape
        shutil.rmtree(workdir, ignore_errors=True)
        workdir.mkdir(parents=True)
        try:
            where, start = machine(), time.perf_counter()  # the load before this shape's own work
            source, target, model_bytes = write_pair(shape, workdir, independent=False)
            row = {"model_bytes": model_bytes, "write_seconds": time.perf_counter() - start, "threads": args.threads}
            row["machine"] = where
            if args.note:
                row["note"] = args.note
            print(shape, "written", row, flush=True)
            output = workdir / "aligned"
            if not args.full_model_only:
                row["floor"] = in_subprocess(args.threads, "measure_floor", str(source), str(target))
                print(shape, "floor", row["floor"], flush=True)
                row["io_floor"] = in_subprocess(args.threads, "measure_io_floor", str(source), str(target), str(output))
                print(shape, "I/O floor", row["io_floor"], flush=True)
                row["all_attention"] = in_subprocess(
                    args.threads, "measure_streamed", str(source), str(target), str(output), "all_attention"
                )
                print(shape, "all_attention", row["all_attention"], flush=True)
                shutil.rmtree(output)
            if shape in FULL_MODEL or args.full_model_streamed:
                for folder in (source, target):
                    shutil.rmtree(folder)
                source, target, _ = write_pair(shape, workdir, independent=True)
                row["full_model_floor"] = in_subprocess(args.threads, "measure_full_floor", str(source), str(target))
                print(shape, "full_model floor", row["full_model_floor"], flush=True)
                if args.compare_release:
                    row["full_model_streamed_unreleased"] = in_subprocess(
                        args.threads, "measure_streamed_full", str(source), str(target), str(output), "false"
                    )
                    print(shape, "full_model streamed, unreleased", row["full_model_streamed_unreleased"], flush=True)
                    shutil.rmtree(output)
                row["full_model_streamed"] = in_subprocess(
                    args.threads, "measure_streamed_full", str(source), str(target), str(output)
                )
                print(shape, "full_model streamed", row["full_model_streamed"], flush=True)
                shutil.rmtree(output)
            if shape in FULL_MODEL:
                try:
                    row["full_model"] = in_subprocess(
                        args.threads, "measure_in_memory", str(source), str(target), "full_model", str(output),
                        timeout=args.full_model_timeout,
                    )  # fmt: skip
                except subprocess.TimeoutExpired:
                    row["full_model"] = {"timed_out_after": args.full_model_timeout}
                shutil.rmtree(output, ignore_errors=True)
                print(shape, "full_model", row["full_model"], flush=True)
            write_results(merged(args.output, shape, row, args.full_model_only), args.output)
        finally:
            if not args.keep:
                shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
