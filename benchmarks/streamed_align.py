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
rendered to the Markdown beside it (``results/streamed_align.md``): every figure of the Markdown
is one of the JSON's, or arithmetic on them and on this file's constants. Never edit either by
hand; ``--render`` renders the Markdown again from the JSON, measuring nothing.

    python benchmarks/streamed_align.py                       # 1b then 8b, into results/streamed_align.{json,md}
    python benchmarks/streamed_align.py --shapes 1b --keep    # keep the written folders
    python benchmarks/streamed_align.py --shapes 8b --full-model-streamed  # the 8B also streamed at full_model
    python benchmarks/streamed_align.py --render              # the Markdown again from the JSON
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shutil
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).parents[1]
SHAPES = {
    # name: (width, layers, heads, kv_heads, intermediate, vocab, tied embeddings)
    "1b": (2048, 16, 32, 8, 8192, 128256, True),  # Llama-3.2-1B
    "8b": (4096, 32, 32, 8, 14336, 128256, False),  # Llama-3-8B
    "8b-2layers": (4096, 2, 32, 8, 14336, 128256, False),  # Llama-3-8B's layers, two of them: per-layer costs
    "8b-4layers-32k": (4096, 4, 32, 8, 14336, 32000, False),  # four of them, a small vocabulary: memory by layer
    "small": (2048, 4, 32, 8, 8192, 32000, False),  # Llama-3.2-1B's layers, four of them: ~0.75 GB a model
    "tiny": (256, 2, 4, 2, 512, 1000, False),  # a check of this script
    "pythia-6.9b": (4096, 32, 32, 32, 16384, 50432, False),  # Pythia-6.9B (GPT-NeoX, parallel residual)
    "pythia-6.9b-2layers": (4096, 2, 32, 32, 16384, 50432, False),  # its layers, two of them: per-layer costs
    "neox-tiny": (256, 2, 4, 4, 1024, 1000, False),  # a check of this script on GPT-NeoX
}
NEOX = ("pythia-6.9b", "pythia-6.9b-2layers", "neox-tiny")  # GPT-NeoX shapes; the others are Llama's
NAMES = {
    "1b": "Llama-3.2-1B",
    "8b": "Llama-3-8B",
    "8b-2layers": "Llama-3-8B widths, 2 layers",
    "8b-4layers-32k": "Llama-3-8B widths, 4 layers, 32k vocab",
    "small": "Llama-3.2-1B widths, 4 layers, 32k vocab",
    "tiny": "tiny",
    "pythia-6.9b": "Pythia-6.9B (GPT-NeoX)",
    "pythia-6.9b-2layers": "Pythia-6.9B widths, 2 layers (GPT-NeoX)",
    "neox-tiny": "tiny GPT-NeoX",
}
FULL_MODEL = ("1b", "tiny", "neox-tiny")  # shapes also aligned at full_model, streamed and in memory
SHARD_BYTES = 5 * 10**9
TARGET = {"shape": "8b", "seconds": 600.0, "peak_rss": 3 * 10**9}
"""Issue #9's target: the 8B pair streamed at ``all_attention`` in under 10 minutes and 3 GB of peak RSS."""


def config_of(shape: str):
    from transformers import GPTNeoXConfig, LlamaConfig

    width, layers, heads, kv_heads, intermediate, vocab, tied = SHAPES[shape]
    if shape in NEOX:  # Pythia's: a quarter of each head rotary, parallel residual, untied
        return GPTNeoXConfig(
            hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=intermediate,
            vocab_size=vocab, tie_word_embeddings=tied, max_position_embeddings=2048, rotary_pct=0.25,
            use_parallel_residual=True, bos_token_id=0, eos_token_id=0, architectures=["GPTNeoXForCausalLM"],
            dtype="bfloat16",
        )  # fmt: skip
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

    from lmc.adapters import model_spec
    from lmc.formats.streamed import skeleton

    config = config_of(shape)
    folders = (workdir / f"{shape}-source", workdir / f"{shape}-target")
    for folder in folders:
        config.save_pretrained(folder)
    model = skeleton(folders[0])
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    attention = {name for layer in model_spec(model).attention for name in layer.parameters}
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
            if independent or name in attention:
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


def rss_anon() -> int:
    """This process's resident anonymous memory now (bytes): what it allocated, without mapped files."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


class MemoryTrace:
    """``RssAnon`` sampled by a thread every ``interval`` seconds and at each phase's start, by phase (:meth:`enter`):
    each phase's peak, and the value at the end of each step (:meth:`step_end`: what is kept between steps)."""

    def __init__(self, interval: float = 0.05):
        self.phase, self.peaks, self.after_steps = "setup", {}, {}
        self.seconds, self.entered = {}, time.perf_counter()  # wall seconds by phase
        self.sample()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._sample_every, args=(interval,), daemon=True)
        self.thread.start()

    def sample(self) -> int:
        value = rss_anon()
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), value)
        return value

    def _sample_every(self, interval: float) -> None:
        while not self.stopped.wait(interval):
            self.sample()

    def enter(self, phase: str) -> None:
        self._clock()
        self.phase = phase
        self.sample()

    def _clock(self) -> None:
        now = time.perf_counter()
        self.seconds[self.phase] = self.seconds.get(self.phase, 0.0) + now - self.entered
        self.entered = now

    def step_end(self) -> None:
        self.after_steps.setdefault(self.phase, []).append(self.sample())

    def stop(self) -> dict:
        self._clock()
        self.stopped.set()
        self.thread.join()
        return {"peak_by_phase": self.peaks, "after_steps": self.after_steps}


class PhaseSplit:
    """Seconds of timed kinds of work (reads, GEMMs, assignments) by the :class:`MemoryTrace` phase they end
    in, each exclusive of the timed work inside it (the reads a correlation makes are reads, not GEMMs)."""

    def __init__(self, trace: MemoryTrace):
        self.trace, self.seconds, self.nested = trace, {}, []

    def timed(self, kind: str, function):
        def run(*args, **kwargs):
            begin = time.perf_counter()
            self.nested.append(0.0)
            try:
                return function(*args, **kwargs)
            finally:
                spent, inside = time.perf_counter() - begin, self.nested.pop()
                kinds = self.seconds.setdefault(self.trace.phase, {})
                kinds[kind] = kinds.get(kind, 0.0) + spent - inside
                if self.nested:
                    self.nested[-1] += spent

        return run

    def by_phase(self) -> dict[str, dict[str, float]]:
        """``{phase: {"seconds": wall, kind: seconds, ..., "rest": the untimed}}`` in the order phases ran."""
        split = {}
        for phase, wall in self.trace.seconds.items():
            kinds = self.seconds.get(phase, {})
            split[phase] = {"seconds": wall, **kinds, "rest": wall - sum(kinds.values())}
        return split


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


def measure_io_floor(source: str, target: str, output: str) -> dict:
    """The Gram-pass floor with the I/O no streamed alignment can avoid: every tensor of both models read
    once (each attention layer whole, for its Grams; every other tensor a chunk of rows at a time, as the
    write pass reads it) and one model's bytes written to ``output``, shard by shard; no solve, no transform."""
    from lmc.adapters import model_spec
    from lmc.formats.safetensors import write_tensor
    from lmc.formats.streamed import open_folder, skeleton
    from lmc.matching.grams import LayerGrams

    spec = model_spec(skeleton(source))
    layer_of = {name: layer for layer in spec.attention for name in layer.parameters}
    start = time.perf_counter()
    checkpoints = open_folder(source)[1], open_folder(target)[1]
    folder = Path(output)
    folder.mkdir()
    held: dict[str, Any] = {}
    for shard in checkpoints[0].shards:
        with open(folder / shard, "wb") as handle:
            handle.write(checkpoints[0].headers[shard])
            for name in checkpoints[0].names(shard):
                layer = layer_of.get(name)
                if layer is not None:
                    if name not in held:  # the layer's first tensor in the file: read the layer of both
                        source_layer, target_layer = ({n: c[n] for n in layer.parameters} for c in checkpoints)
                        LayerGrams.compute(source_layer, target_layer, layer)
                        held.update(source_layer)
                    write_tensor(handle, held.pop(name))
                    continue
                for begin, end in checkpoints[0].chunks(name):
                    piece = checkpoints[0].rows(name, begin, end)
                    checkpoints[1].rows(name, begin, end)
                    write_tensor(handle, piece)
    seconds = time.perf_counter() - start
    shutil.rmtree(folder)
    return {"seconds": seconds, "peak_rss": peak_rss()}


def measure_streamed(source: str, target: str, output: str, scope: str) -> dict:
    from lmc.checkpoint_alignment import align_directories

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


def measure_full_floor(source: str, target: str) -> dict:
    """One round's floor at ``full_model``: read every tensor of both models once, layer by layer, and
    run the GEMMs a round needs on them (each layer's Grams, its FFN correlation, every tensor's
    share of the residual correlation); no assignment, no transform, no write."""
    from lmc.adapters import model_spec
    from lmc.formats.streamed import open_folder, skeleton
    from lmc.matching.grams import LayerGrams
    from lmc.matching.permutation import axis_correlation
    from lmc.symmetry import compute_dtype

    model = skeleton(source)
    spec = model_spec(model)
    start = time.perf_counter()
    checkpoints = open_folder(source)[1], open_folder(target)[1]
    residual = {}
    for name, axis in spec.residual.axes:
        residual.setdefault(name, []).append((name, axis))
    groups = []
    for block in spec.blocks:
        groups.append((block, tuple(dict.fromkeys(block.attention.parameters + block.feed_forward.parameters))))
    grouped = {name for _, names in groups for name in names}
    groups += [(None, (name,)) for name, _ in model.named_parameters() if name not in grouped]
    for block, names in groups:
        source_part, target_part = ({n: c[n] for n in names} for c in checkpoints)
        if block is not None:
            LayerGrams.compute(source_part, target_part, block.attention)
            hidden = block.feed_forward.hidden
            dtype = compute_dtype(source_part[hidden.axes[0][0]].dtype)  # as the descent's unit correlations
            axis_correlation(source_part, target_part, hidden, dtype)
        axes = tuple(pair for name in names for pair in residual.get(name, []))
        axis_correlation(source_part, target_part, spec.residual.restricted(axes))
    return {"seconds": time.perf_counter() - start, "peak_rss": peak_rss()}


def measure_streamed_full(source: str, target: str, output: str, release: str = "true") -> dict:
    """``align_directories`` at ``full_model``, its time split: reads of the files (``SafetensorsCheckpoint.rows``),
    assignments (``lmc.matching.permutation.best_permutation`` of the weight-matching steps, with each
    one's size and seconds), and the rest (GEMMs of the correlations and Grams, Stage 2, transforms,
    writes); its rounds; and its memory by phase (:class:`MemoryTrace`: each descent round, Stage 2,
    the write pass, the check of the written layers). ``release="false"`` measures it without
    :func:`lmc.matching.streamed.release_freed_memory` (as lmc was before it)."""
    import lmc.matching.aligner as aligner
    import lmc.matching.layers as layers
    import lmc.matching.streamed as streamed
    import lmc.matching.streamed_write as streamed_write
    from lmc.formats.safetensors import SafetensorsCheckpoint
    from lmc.matching.grams import LayerGrams
    from lmc.matching.streamed import _StreamedDescent

    if release == "false":
        streamed._MALLOC_TRIM = None
    trace = MemoryTrace()
    holding, align_attention, write, written_error = (
        _StreamedDescent.holding,
        aligner.WeightDescent.align_attention,
        streamed_write._write,
        streamed_write._written_error,
    )

    @contextlib.contextmanager
    def traced_holding(self, names):
        with holding(self, names):
            yield
        trace.step_end()

    def traced_align_attention(self, index):
        trace.enter("stage 2")
        align_attention(self, index)
        trace.step_end()

    def in_phase(phase, function):
        def traced(*args):
            trace.enter(phase)
            return function(*args)

        return traced

    _StreamedDescent.holding, aligner.WeightDescent.align_attention = traced_holding, traced_align_attention
    streamed_write._write, streamed_write._written_error = in_phase("write", write), in_phase("check", written_error)

    split, assignments, rounds = PhaseSplit(trace), [], [0]
    solve, descent_round = layers.best_permutation, _StreamedDescent.descent_round

    def sized_solve(correlation):
        begin = time.perf_counter()
        found = solve(correlation)
        assignments.append((len(correlation), time.perf_counter() - begin))
        return found

    def counted(self, *args):
        rounds[0] += 1
        trace.enter(f"round {rounds[0]}")
        return descent_round(self, *args)

    layers.best_permutation = split.timed("assignment", sized_solve)  # correlated_units calls it
    SafetensorsCheckpoint.rows = split.timed("read", SafetensorsCheckpoint.rows)
    aligner.axis_correlation = split.timed("gemm", aligner.axis_correlation)  # the residual and unit correlations
    LayerGrams.compute = staticmethod(split.timed("gemm", LayerGrams.compute))
    _StreamedDescent.descent_round = counted
    row = measure_streamed(source, target, output, "full_model")
    sizes = sorted({size for size, _ in assignments})
    row["memory"] = trace.stop()
    row["split_by_phase"] = split.by_phase()
    spent = {kind: sum(p.get(kind, 0.0) for p in row["split_by_phase"].values()) for kind in ("read", "assignment")}
    row["split"] = {**spent, "rest": row["seconds"] - sum(spent.values())}
    row["rounds"] = rounds[0]
    row["assignment_seconds_by_size"] = {str(n): sum(t for m, t in assignments if m == n) for n in sizes}
    row["assignments"] = len(assignments)
    return row


def measure_in_memory(source: str, target: str, scope: str, output: str) -> dict:
    """``align`` on both models loaded whole, the aligned model then saved to ``output`` as the streamed
    run writes its own: ``seconds`` covers the loads, the alignment and the save, like the streamed time."""
    import torch
    from transformers import AutoModelForCausalLM

    from lmc.matching import align

    start = time.perf_counter()
    models = [AutoModelForCausalLM.from_pretrained(f, dtype=torch.bfloat16) for f in (source, target)]
    loaded = time.perf_counter() - start
    aligned, report = align(*models, scope=scope)
    saving = time.perf_counter()
    aligned.save_pretrained(output, max_shard_size=SHARD_BYTES)
    finished = time.perf_counter()
    return {
        "seconds": finished - start,
        "load_seconds": loaded,
        "save_seconds": finished - saving,
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


def machine() -> dict[str, Any]:
    """Where a shape is measured: CPU, cores, memory, torch version and the load average before the run."""
    import torch

    cpu = next(
        (line.split(":", 1)[1].strip() for line in _lines("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor() or platform.machine(),
    )
    memory = next((int(line.split()[1]) * 1024 for line in _lines("/proc/meminfo") if line.startswith("MemTotal:")), 0)
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_bytes": memory,
        "torch": torch.__version__,
        "load_average_before": os.getloadavg()[0],
        "lmc_commit": lmc_commit(),
    }


def lmc_commit() -> str:
    """The commit of the lmc measured (this checkout's), ``+changes`` where lmc/ or benchmarks/ differ from it."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short=10", "HEAD") or "unknown"
    return commit + ("+changes" if git("status", "--porcelain", "--", "lmc", "benchmarks") else "")


def _lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def _gb(value: float) -> str:
    return f"{value / 1e9:.2f} GB"


def _seconds(value: float) -> str:
    return f"{value:.1f} s"


def _shape_text(shape: str) -> str:
    width, layers, heads, kv_heads, intermediate, vocab, tied = SHAPES[shape]
    text = f"{layers} layers, width {width}, {heads} heads, {kv_heads} KV heads, d_h {width // heads}"
    return f"{NAMES.get(shape, shape)} ({text}{', tied' if tied else ''})"


def render(results: dict[str, dict[str, Any]], json_name: str = "streamed_align.json") -> str:
    """The Markdown of a results JSON (what :func:`main` writes beside it): its figures and sums of them only."""
    shapes = list(results)
    threads = sorted({row["threads"] for row in results.values()})
    lines = [
        "# Streamed alignment (`lmc.checkpoint_alignment.align_directories`): time and peak memory, bf16 Llama and "
        "GPT-NeoX shapes",
        "",
        f"Rendered by `benchmarks/streamed_align.py` from `{json_name}` beside this file: do not edit",
        "either by hand. Each row is one run of the script on that shape (rows of several runs are",
        "merged by shape), e.g.",
        "",
        f"    python benchmarks/streamed_align.py --shapes {' '.join(shapes)} --threads {' '.join(map(str, threads))}",
        "",
        "Pairs: random bf16 weights (`N(0, 0.02)`, norms `N(0, 1)`), written by the benchmark as Hugging",
        f"Face `save_pretrained` folders with {SHARD_BYTES / 1e9:g} GB shards and an index; source and target",
        'equal outside attention. `all_attention`, `method="full"`. Gram-pass floor: read every attention',
        "tensor of both models through `safe_open` and form each layer's Gram blocks, nothing else. The",
        "rest of the streamed time is the write pass (read both models, transform, write one). I/O floor:",
        "the Gram pass with the I/O no streamed alignment avoids, every tensor of both models read once",
        "and one model written (`measure_io_floor`). Peak RSS: the measuring process's `VmHWM`",
        "(interpreter, torch and transformers included).",
        "",
    ]
    target = results.get(TARGET["shape"], {}).get("all_attention")
    if target is not None:
        met = target["seconds"] < TARGET["seconds"] and target["peak_rss"] < TARGET["peak_rss"]
        one = results[TARGET["shape"]]["model_bytes"]
        lines += [
            f"**{NAMES[TARGET['shape']]} at `all_attention`: {target['seconds'] / 60:.1f} minutes, "
            f"{_gb(target['peak_rss'])} peak RSS** (issue #9's target: under {TARGET['seconds'] / 60:g} minutes "
            f"and {TARGET['peak_rss'] / 1e9:g} GB; {'met' if met else 'missed'}). One model is {_gb(one)}, "
            f"so loading both would take {_gb(2 * one)}.",
            "",
        ]
    lines += [
        "## Streamed `all_attention`",
        "",
        "| shape | one model (bf16) | torch threads | writing the pair | Gram-pass floor | I/O floor | streamed (grams "
        "+ stage 1 + stage 2 + rest) | x Gram-pass floor | x I/O floor | stage 2 per layer | peak RSS | distance "
        "aligned / naive | worst layer probe error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for shape, row in results.items():
        if "all_attention" not in row:  # measured with --full-model-only
            continue
        streamed, floor = row["all_attention"], row["floor"]
        stages = streamed["stages"]
        rest = streamed["seconds"] - sum(stages.values())
        parts = " + ".join(f"{stages[k]:.1f}" for k in ("grams", "stage1", "stage2")) + f" + {rest:.1f}"
        io_floor = row.get("io_floor")  # rows measured before the I/O floor have none
        io_text = ("-", "-")
        if io_floor:
            io_text = (_seconds(io_floor["seconds"]), f"{streamed['seconds'] / io_floor['seconds']:.2f}")
        lines.append(
            f"| {_shape_text(shape)} | {_gb(row['model_bytes'])} | {row['threads']} | {_seconds(row['write_seconds'])} "
            f"| {_seconds(floor['seconds'])} | {io_text[0]} | **{_seconds(streamed['seconds'])}** ({parts}) "
            f"| {streamed['seconds'] / floor['seconds']:.2f} | {io_text[1]} "
            f"| {stages['stage2'] / SHAPES[shape][1]:.2f} s "
            f"| **{_gb(streamed['peak_rss'])}** | {streamed['distance_ratio']:.4f} "
            f"| {streamed['probe_relative_error']:.1e} |"
        )
    floors = ", ".join(
        f"{NAMES.get(shape, shape)} {_gb(row['floor']['peak_rss'])}" for shape, row in results.items() if "floor" in row
    )
    lines += ["", f"Peak RSS of the Gram-pass floor alone: {floors}."]
    in_memory = {shape: row["full_model"] for shape, row in results.items() if "full_model" in row}
    if in_memory:
        lines += [
            "",
            "## `full_model` in memory",
            "",
            "Measured with `lmc.matching.align` after `from_pretrained` of both bf16 models, a pair independent",
            "everywhere, then `save_pretrained` of the aligned model (rows without a save time: runs of lmc",
            "d93479c and before, which did not save): the reference of the streamed `full_model` below.",
            "",
            "| shape | time (loading both; saving) | peak RSS | x one model | distance aligned / naive | probe "
            "relative error |",
            "|---|---|---|---|---|---|",
        ]
        for shape, run in in_memory.items():
            if "timed_out_after" in run:
                lines.append(
                    f"| {_shape_text(shape)} | not finished in {_seconds(run['timed_out_after'])} | - | - | - | - |"
                )
                continue
            lines.append(
                f"| {_shape_text(shape)} | **{_seconds(run['seconds'])}** ({_seconds(run['load_seconds'])}; "
                f"{_seconds(run['save_seconds']) if 'save_seconds' in run else '-'}) "
                f"| **{_gb(run['peak_rss'])}** | {run['peak_rss'] / results[shape]['model_bytes']:.1f} "
                f"| {run['distance_ratio']:.4f} | {run['probe_relative_error']:.1e} |"
            )
    streamed_full = {shape: row for shape, row in results.items() if "full_model_streamed" in row}
    if streamed_full:
        lines += [
            "",
            "## Streamed `full_model`",
            "",
            "`align_directories` at `full_model` on the independent pair. Floor of one round: read every tensor",
            "of both models once, layer by layer, and run the GEMMs a round needs (Grams, FFN correlations, the",
            "residual correlation). A round of the streamed descent reads each tensor of both models once (a",
            "block's head and residual steps share one read) and each FFN once more, a tensor pair at a time into",
            "its units' correlation, so that the correlation is never held beside both models' FFN (runs of lmc",
            "cf7c59d and before held it: one read); the whole run also reads the anchors before the rounds, each",
            "layer for Stage 2 and both models to write, so the ratio is given per round. Split:",
            "file reads, the assignments (`best_permutation`), the rest (GEMMs, Stage 2, transforms, writes).",
            "",
            "| shape | streamed | rounds | reads + assignments + rest | assignments (size: seconds) "
            "| floor of one round | x floor per round | peak RSS | x in-memory time | distance aligned / naive |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for shape, row in streamed_full.items():
            run, floor = row["full_model_streamed"], row["full_model_floor"]
            split = " + ".join(f"{run['split'][k]:.1f}" for k in ("read", "assignment", "rest"))
            sizes = ", ".join(f"{n}: {t:.1f}" for n, t in run["assignment_seconds_by_size"].items())
            per_round = run["seconds"] / max(1, run["rounds"]) / floor["seconds"]
            in_memory = row.get("full_model", {})
            ratio = f"{run['seconds'] / in_memory['seconds']:.2f}" if "seconds" in in_memory else "-"
            lines.append(
                f"| {_shape_text(shape)} | **{_seconds(run['seconds'])}** | {run['rounds']} | {split} "
                f"| {run['assignments']} ({sizes}) | {_seconds(floor['seconds'])} | {per_round:.2f} "
                f"| **{_gb(run['peak_rss'])}** | {ratio} | {run['distance_ratio']:.4f} |"
            )
        lines += _split_lines(streamed_full)
        lines += _memory_lines(streamed_full)
    lines += ["", "## Machines", ""]
    for shape, row in results.items():
        runs = [(NAMES.get(shape, shape), row)]
        if "full_model_run" in row:
            context = row["full_model_run"]
            runs.append(
                (f"{NAMES.get(shape, shape)}, streamed `full_model` ({context['threads']} torch threads)", context)
            )
        for name, run in runs:
            where = run.get("machine")
            if where is None:
                lines.append(f"- {name}: not recorded (measured before the script recorded it).")
                continue
            commit = f", lmc {where['lmc_commit']}" if "lmc_commit" in where else ""
            lines.append(
                f"- {name}: {where['cpu']}, {where['cores']} cores, {_gb(where['memory_bytes'])} of memory, torch "
                f"{where['torch']}{commit}, load average {where['load_average_before']:.2f} before the run"
                + (f"; {run['note']}." if run.get("note") else ".")
            )
    return "\n".join(lines) + "\n"


def _split_lines(rows: dict[str, dict[str, Any]]) -> list[str]:
    """The time of each streamed ``full_model`` run by phase (:class:`PhaseSplit`)."""
    lines = []
    for shape, row in rows.items():
        split = row["full_model_streamed"].get("split_by_phase")
        if split is None:  # measured before the script split it
            continue
        lines += [
            "",
            f"Time of {NAMES.get(shape, shape)}'s streamed run by phase (setup: the folders opened and the residual",
            "step on the tensors no other permutation moves; a round: the FFN, head and residual steps; GEMMs: the",
            "correlations and Grams; rest: Stage 2's solves, transforms, writes, probe checks):",
            "",
            "| phase | wall | file reads | GEMMs | assignments | rest |",
            "|---|---|---|---|---|---|",
        ]
        for phase, kinds in split.items():
            parts = " | ".join(_seconds(kinds.get(kind, 0.0)) for kind in ("read", "gemm", "assignment", "rest"))
            lines.append(f"| {phase} | {_seconds(kinds['seconds'])} | {parts} |")
    return lines


def _memory_lines(rows: dict[str, dict[str, Any]]) -> list[str]:
    """The memory traces of the streamed ``full_model`` runs (:class:`MemoryTrace`), and what releasing the freed
    memory saved where a run without it was measured beside."""
    lines = []
    for shape, row in rows.items():
        runs = [(key, row[key]) for key in ("full_model_streamed_unreleased", "full_model_streamed") if key in row]
        runs = [(key, run) for key, run in runs if "memory" in run]
        if not runs:
            continue
        lines += [
            "",
            f"Memory of {NAMES.get(shape, shape)} by phase (`RssAnon`, sampled every 0.05 s; peak RSS is `VmHWM`):",
            "",
        ]
        for key, run in runs:
            memory = run["memory"]
            peaks = ", ".join(f"{phase} {_gb(value)}" for phase, value in memory["peak_by_phase"].items())
            kept = "; ".join(
                f"{phase}: {' '.join(f'{value / 1e9:.2f}' for value in values)}"
                for phase, values in memory["after_steps"].items()
            )
            how = "without releasing freed memory" if key.endswith("unreleased") else "as lmc runs it"
            lines.append(
                f"- {how} ({_seconds(run['seconds'])}, peak RSS {_gb(run['peak_rss'])}): peaks {peaks}; "
                f"kept after each step (GB) {kept}."
            )
    return lines


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
    sys.path.insert(0, str(ROOT))  # this checkout's lmc, not an installed one
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
