"""What :mod:`benchmarks.speed.streamed_align` measures, each function run in a fresh interpreter
(:func:`benchmarks.speed.streamed_align.in_subprocess`) on two written folders: floors, the streamed
alignment, its split by phase and memory trace, and the in-memory reference."""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.machine import peak_rss, rss_anon
from benchmarks.speed.streamed_shapes import SHARD_BYTES


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
    import lmc.matching.descent as descent
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
        descent.WeightDescent.align_attention,
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

    _StreamedDescent.holding, descent.WeightDescent.align_attention = traced_holding, traced_align_attention
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
    descent.axis_correlation = split.timed("gemm", descent.axis_correlation)  # the residual and unit correlations
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
