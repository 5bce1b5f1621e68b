"""Streamed alignment of Llama-shaped bf16 checkpoints larger than memory (issue #9, item 4).

Writes two random Llama-3-8B-shaped bf16 ``save_pretrained`` folders (5 GB shards with an index,
like HF; equal outside attention, the ``all_attention`` protocol) into ``--workdir``, then in fresh
subprocesses with ``--threads`` torch threads measures:

- the Gram-pass floor: read every attention tensor of both models (``safe_open``) and form each
  layer's Gram blocks (:class:`lmc.matching.grams.LayerGrams`), nothing else;
- ``lmc.formats.streamed.align_directories`` at ``all_attention`` (``method="full"``): time, its ratio to
  the floor, and the peak RSS of the process (``VmHWM``, interpreter and libraries included).

The Llama-3.2-1B shape is measured the same way, and at ``full_model`` with ``lmc.matching.align``
in memory (``full_model`` is not streamed), its pair independent everywhere.

    python benchmarks/streamed_align.py                       # 1b then 8b, into results/streamed_align.json
    python benchmarks/streamed_align.py --shapes 1b --keep    # keep the written folders
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]
SHAPES = {
    # name: (width, layers, heads, kv_heads, intermediate, vocab, tied embeddings)
    "1b": (2048, 16, 32, 8, 8192, 128256, True),  # Llama-3.2-1B
    "8b": (4096, 32, 32, 8, 14336, 128256, False),  # Llama-3-8B
    "8b-2layers": (4096, 2, 32, 8, 14336, 128256, False),  # Llama-3-8B's layers, two of them: per-layer costs
    "tiny": (256, 2, 4, 2, 512, 1000, False),  # a check of this script
}
FULL_MODEL = ("1b", "tiny")  # shapes also aligned at full_model, in memory
SHARD_BYTES = 5 * 10**9


def config_of(shape: str):
    from transformers import LlamaConfig

    width, layers, heads, kv_heads, intermediate, vocab, tied = SHAPES[shape]
    return LlamaConfig(
        hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=width // heads, intermediate_size=intermediate, vocab_size=vocab, tie_word_embeddings=tied,
        max_position_embeddings=8192, rope_theta=500000.0, bos_token_id=0, eos_token_id=0,
        architectures=["LlamaForCausalLM"], dtype="bfloat16",
    )  # fmt: skip


def write_pair(shape: str, workdir: Path, independent: bool) -> tuple[Path, Path, int]:
    """Source and target folders of random bf16 weights, sharded like HF; returns one model's bytes.

    Outside attention the target equals the source unless ``independent``. Each tensor is made and
    written on its own, so this needs no more memory than the largest tensor.
    """
    import torch

    from lmc.formats.streamed import skeleton

    config = config_of(shape)
    folders = (workdir / f"{shape}-source", workdir / f"{shape}-target")
    for folder in folders:
        config.save_pretrained(folder)
    shapes = {name: tuple(p.shape) for name, p in skeleton(folders[0]).named_parameters()}
    shards, current, size = [], [], 0
    for name, tensor_shape in shapes.items():
        nbytes = 2 * int(torch.Size(tensor_shape).numel())
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    shards.append(current)
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {name: file for file, names in zip(files, shards) for name in names}
    index = {
        "metadata": {"total_size": sum(2 * torch.Size(s).numel() for s in shapes.values())},
        "weight_map": weight_map,
    }
    for folder in folders:
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    generator = torch.Generator().manual_seed(0)
    for file, names in zip(files, shards):
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name in names:
            nbytes = 2 * torch.Size(shapes[name]).numel()
            header[name] = {"dtype": "BF16", "shape": list(shapes[name]), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        handles = [open(folder / file, "wb") for folder in folders]
        for handle in handles:
            handle.write(struct.pack("<Q", len(text)) + text)
        for name in names:
            std = 1.0 if name.endswith("norm.weight") else 0.02
            tensor = (torch.randn(shapes[name], generator=generator) * std).bfloat16()
            handles[0].write(tensor.reshape(-1).view(torch.uint8).numpy())
            if independent or "self_attn" in name:
                tensor = (torch.randn(shapes[name], generator=generator) * std).bfloat16()
            handles[1].write(tensor.reshape(-1).view(torch.uint8).numpy())
            del tensor
        for handle in handles:
            handle.close()
    return *folders, index["metadata"]["total_size"]


def peak_rss() -> int:
    """This process's peak resident memory (bytes).

    ``VmHWM`` of this process's own address space: ``ru_maxrss`` would also count the resident
    memory of the parent at the moment it started this subprocess (Linux keeps it across exec).
    """
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure_floor(source: str, target: str) -> dict:
    """Read each attention layer of both models and form its Gram blocks; nothing else."""
    from lmc.adapters import model_spec
    from lmc.formats.streamed import open_folder, skeleton
    from lmc.matching.grams import LayerGrams

    spec = model_spec(skeleton(source))
    start = time.perf_counter()
    checkpoints = open_folder(source)[1], open_folder(target)[1]
    for layer in spec.attention:
        source_layer, target_layer = ({n: c[n] for n in layer.parameters} for c in checkpoints)
        LayerGrams.compute(source_layer, target_layer, layer)
    return {"seconds": time.perf_counter() - start, "peak_rss": peak_rss()}


def measure_streamed(source: str, target: str, output: str, scope: str) -> dict:
    from lmc.formats.streamed import align_directories

    start = time.perf_counter()
    report = align_directories(source, target, output, scope)
    seconds = time.perf_counter() - start
    stages = {k: sum(layer.seconds.get(k, 0.0) for layer in report.layers) for k in ("grams", "stage1", "stage2")}
    return {
        "seconds": seconds,
        "peak_rss": peak_rss(),
        "stages": stages,
        "distance_ratio": report.distance["aligned"] / report.distance["naive"],
        "probe_relative_error": report.probe_relative_error,
    }


def measure_in_memory(source: str, target: str, scope: str) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    from lmc.matching import align

    start = time.perf_counter()
    models = [LlamaForCausalLM.from_pretrained(f, dtype=torch.bfloat16) for f in (source, target)]
    loaded = time.perf_counter() - start
    _, report = align(*models, scope=scope)
    return {
        "seconds": time.perf_counter() - start,
        "load_seconds": loaded,
        "peak_rss": peak_rss(),
        "distance_ratio": report.distance["aligned"] / report.distance["naive"],
        "probe_relative_error": report.probe_relative_error,
    }


def in_subprocess(threads: int, function: str, *args: str, timeout: float | None = None) -> dict:
    """Run ``function(*args)`` of this file in a fresh interpreter with ``threads`` torch threads."""
    code = (
        f"import sys, json, torch; sys.path.insert(0, {str(ROOT)!r}); torch.set_num_threads({threads}); "
        f"from benchmarks.streamed_align import {function}; print(json.dumps({function}(*sys.argv[1:])))"
    )
    environment = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    run = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=environment, timeout=timeout
    )
    if run.returncode:
        raise RuntimeError(f"{function} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["1b", "8b"], choices=list(SHAPES))
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/lmc-streamed-align"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keep", action="store_true", help="keep the written checkpoints")
    parser.add_argument("--full-model-timeout", type=float, default=900, help="seconds allowed to 1b full_model")
    parser.add_argument("--output", type=Path, default=Path(__file__).parent / "results" / "streamed_align.json")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))  # this checkout's lmc, not an installed one
    results = json.loads(args.output.read_text()) if args.output.exists() else {}
    for shape in args.shapes:
        workdir = args.workdir / shape
        shutil.rmtree(workdir, ignore_errors=True)
        workdir.mkdir(parents=True)
        try:
            start = time.perf_counter()
            source, target, model_bytes = write_pair(shape, workdir, independent=False)
            row = {"model_bytes": model_bytes, "write_seconds": time.perf_counter() - start, "threads": args.threads}
            print(shape, "written", row, flush=True)
            row["floor"] = in_subprocess(args.threads, "measure_floor", str(source), str(target))
            print(shape, "floor", row["floor"], flush=True)
            output = workdir / "aligned"
            row["all_attention"] = in_subprocess(
                args.threads, "measure_streamed", str(source), str(target), str(output), "all_attention"
            )
            print(shape, "all_attention", row["all_attention"], flush=True)
            shutil.rmtree(output)
            if shape in FULL_MODEL:
                for folder in (source, target):
                    shutil.rmtree(folder)
                source, target, _ = write_pair(shape, workdir, independent=True)
                try:
                    row["full_model"] = in_subprocess(
                        args.threads, "measure_in_memory", str(source), str(target), "full_model",
                        timeout=args.full_model_timeout,
                    )  # fmt: skip
                except subprocess.TimeoutExpired:
                    row["full_model"] = {"timed_out_after": args.full_model_timeout}
                print(shape, "full_model", row["full_model"], flush=True)
            results[shape] = row
            args.output.write_text(json.dumps(results, indent=2) + "\n")
        finally:
            if not args.keep:
                shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
