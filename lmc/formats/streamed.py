"""Align Hugging Face checkpoints larger than memory, one layer at a time (issue #9, item 4).

:func:`align_directories` reads two ``save_pretrained`` folders (``config.json`` and
``model.safetensors`` or sharded ``model-0000x-of-0000y.safetensors`` with their index) tensor by
tensor through ``safetensors.safe_open`` and writes the aligned model, and any merges, shard by
shard. The layout comes from the model's adapter: the model is built on the ``meta`` device (no
weights), its :class:`~lmc.symmetry.SymmetrySpec` names the tensors of each layer, and each layer
pair is solved with the matcher's per-layer entry point
(:func:`~lmc.matching.alignment.align_attention_layer`), keeping only the small group element.

Peak memory stays near one layer pair plus one chunk of a tensor being copied: every file is
opened for one tensor (or one chunk of rows) and closed again, so no memory map grows with the
checkpoint, and each output shard is written through a stream (its header is the source shard's,
since aligning changes no name, shape or dtype). The whole output folder is written under a
temporary name and renamed into place at the end: never half-written, never over an input.

The whole-model probe of :func:`~lmc.matching.align` needs the model in memory; instead each
aligned attention layer is checked on its own: the layer's output on a random input, computed in
float64 from the stored (rounded) weights by docs/spec.md, section 1's formula, must match the source
layer's to :data:`~lmc.matching.PROBE_RTOL` of the stored dtype. Every layer keeping its function
keeps the whole model's.

Scopes: ``first_attention``, ``all_attention`` and ``first_block``. ``full_model`` couples every
tensor through the residual-stream permutation (coordinate descent over the whole model) and is
not streamed: align it in memory with :func:`lmc.matching.align`.
"""

from __future__ import annotations

import json
import math
import secrets
import shutil
import struct
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lmc.adapters import model_spec
from lmc.checkpoints import CheckpointError
from lmc.formats.huggingface import (
    CONFIG_FILE,
    INDEX_FILES,
    copy_tokenizer_files,
    model_class,
    read_config,
    weight_files,
    weight_index,
)
from lmc.io import atomic_write_json, check_output_folder
from lmc.matching import PROBE_RTOL, AlignmentError, AlignmentReport, AlignOptions, LayerAlignment
from lmc.matching.checks import check_same_attention
from lmc.matching.layers import align_attention_layer
from lmc.matching.permutation import axis_correlation, best_permutation
from lmc.symmetry import (
    AttentionSpec,
    ModelTransform,
    Scope,
    SymmetrySpec,
    check_scope,
    compute_dtype,
    read_attention,
    scope_blocks,
)

STREAMED_SCOPES: tuple[str, ...] = ("first_attention", "all_attention", "first_block")
"""The scopes :func:`align_directories` streams."""

#: Largest piece of a tensor held at once while copying, comparing or merging (bytes).
CHUNK_BYTES = 1 << 26

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class _Entry:
    """Where one tensor is stored: its shard file and its safetensors header entry."""

    shard: str
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, int]


def _read_header(path: Path) -> tuple[bytes, dict]:
    """The raw header prefix (length and JSON) of a safetensors file, and the parsed header."""
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise CheckpointError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        (length,) = struct.unpack("<Q", prefix)
        text = handle.read(length)
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path} is not a safetensors file: unreadable header ({error})") from error
    return prefix + text, header


class HFCheckpoint:
    """A ``save_pretrained`` folder read one tensor (or one chunk of rows) at a time.

    Every read opens the shard with ``safe_open`` and closes it again, so the memory map never
    holds more than the piece being read.
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.config = read_config(self.folder)
        files = weight_files(self.folder)
        if any(path.suffix != ".safetensors" for path in files):
            raise CheckpointError(
                f"{self.folder} stores its weights as {files[0].name}; streamed alignment reads safetensors: "
                "save the model with save_pretrained(..., safe_serialization=True)"
            )
        self.shards = [path.name for path in files]
        self.index = weight_index(self.folder)
        self.headers: dict[str, bytes] = {}
        self.entries: dict[str, _Entry] = {}
        for shard in self.shards:
            self.headers[shard], header = _read_header(self.folder / shard)
            for name, entry in header.items():
                if name != "__metadata__":
                    self.entries[name] = _Entry(
                        shard, entry["dtype"], tuple(entry["shape"]), tuple(entry["data_offsets"])
                    )

    def names(self, shard: str) -> list[str]:
        """The tensors of ``shard`` in file order."""
        return sorted((n for n, e in self.entries.items() if e.shard == shard), key=lambda n: self.entries[n].offsets)

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Tensor ``name`` (rows ``start:stop`` of it if given), in its stored dtype, in memory of its own."""
        from safetensors import safe_open

        with safe_open(str(self.folder / self.entries[name].shard), framework="pt") as handle:
            if start is None:
                return handle.get_tensor(name).clone()
            return handle.get_slice(name)[start:stop].clone()

    def chunks(self, name: str) -> Iterator[tuple[int, int]]:
        """Row ranges of ``name`` of at most :data:`CHUNK_BYTES` each (one range for a scalar)."""
        entry = self.entries[name]
        if len(entry.shape) == 0:
            yield 0, 0
            return
        row_bytes = max(1, (entry.offsets[1] - entry.offsets[0]) // max(1, entry.shape[0]))
        step = max(1, CHUNK_BYTES // row_bytes)
        for start in range(0, entry.shape[0], step):
            yield start, min(start + step, entry.shape[0])

    def read_chunk(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.read(name) if len(self.entries[name].shape) == 0 else self.read(name, start, stop)


def skeleton(folder: str | Path) -> nn.Module:
    """The model of a ``save_pretrained`` folder built on the ``meta`` device: its layout, no weights.

    Raises:
        CheckpointError: ``config.json`` names no single architecture.
        UnsupportedModelError: lmc has no adapter for it.
    """
    import transformers

    cls = model_class(read_config(folder), folder)
    config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    with torch.device("meta"):
        return cls(config)


def _write_tensor(handle, tensor: torch.Tensor) -> None:
    handle.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())


def attention_probe_error(
    layer: AttentionSpec, source: dict[str, torch.Tensor], aligned: dict[str, torch.Tensor], seed: int = 0
) -> float:
    """``||f_aligned(x) - f_source(x)|| / ||f_source(x)||`` for one attention layer on a random ``x``.

    The layer's output (docs/spec.md, section 1, RoPE included, no mask) is computed in float64 from the
    stored weights of each, so the rounding of the aligned weights to their dtype is measured.

    Args:
        layer: The layer.
        source, aligned: The layer's tensors before and after alignment, by spec name.
        seed: Seed of the probe input, 16 tokens (fewer if the RoPE table is shorter) of width ``d``.
    """
    length = 16 if layer.rotary is None else min(16, layer.rotary.angles.shape[0])
    x = torch.randn(length, layer.width, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)

    def rotate(states: torch.Tensor) -> torch.Tensor:  # (heads, T, d_h): pair p turns by angles[t, p]
        if layer.rotary is None:
            return states
        first, second = layer.rotary.pairs.T
        cos, sin = layer.rotary.angles[:length].cos(), layer.rotary.angles[:length].sin()
        a, b = states[..., first], states[..., second]
        rotated = states.clone()
        rotated[..., first], rotated[..., second] = a * cos - b * sin, a * sin + b * cos
        return rotated

    def output(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        w = read_attention(tensors, layer)

        def project(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # (heads, T, d_h)
            states = torch.einsum("td,hde->hte", x, weight.double())
            return states if bias is None else states + bias.double()[:, None, :]

        q = rotate(project(w.query, w.query_bias))
        k = rotate(project(w.key, w.key_bias)).repeat_interleave(layer.queries_per_kv, 0)
        v = project(w.value, w.value_bias).repeat_interleave(layer.queries_per_kv, 0)
        weights = (q @ k.mT / math.sqrt(layer.head_dim)).softmax(-1)
        return torch.einsum("hte,hed->td", weights @ v, w.out.double())  # (T, d)

    reference = output(source)
    return float((output(aligned) - reference).norm() / reference.norm())


class _Groups:
    """The transformed tensors of each block in scope, computed when a shard first needs them."""

    def __init__(self, source: HFCheckpoint, spec: SymmetrySpec, transform: ModelTransform, dtype, rtol, seed):
        self.source, self.spec, self.transform = source, spec, transform
        self.rtol, self.seed, self.dtype = rtol, seed, dtype
        self.members: dict[int, tuple[str, ...]] = {}
        for index in sorted(transform.attention.keys() | transform.feed_forward.keys()):
            block = spec.blocks[index]
            names = list(block.attention.parameters) if index in transform.attention else []
            names += list(block.feed_forward.parameters) if index in transform.feed_forward else []
            self.members[index] = tuple(dict.fromkeys(names))
        self.block_of = {name: index for index, names in self.members.items() for name in names}
        self.ready: dict[int, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}
        self.written: dict[int, set[str]] = {}
        self.probe_error = 0.0

    def take(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Tensor ``name`` of the source and aligned; a block's tensors are dropped once all have been taken."""
        index = self.block_of[name]
        if index not in self.ready:
            self.ready[index] = self._align_block(index)
            self.written[index] = set()
        source, aligned = self.ready[index]
        self.written[index].add(name)
        if len(self.written[index]) == len(self.members[index]):
            del self.ready[index], self.written[index]
        return source[name], aligned[name]

    def _align_block(self, index: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        source = {name: self.source.read(name) for name in self.members[index]}
        aligned = {name: tensor.clone() for name, tensor in source.items()}
        block = ModelTransform(
            attention={i: t for i, t in self.transform.attention.items() if i == index},
            feed_forward={i: p for i, p in self.transform.feed_forward.items() if i == index},
        )
        block.apply_(aligned, self.spec)
        if index in self.transform.attention:
            layer = self.spec.blocks[index].attention
            error = attention_probe_error(layer, source, aligned, self.seed)
            self.probe_error = max(self.probe_error, error)
            if not error <= self.rtol:
                raise AlignmentError(
                    f"{layer.name}: the aligned layer does not compute the source layer's function: relative output "
                    f"change {error:.3g} on the probe input > {self.rtol:g} ({_dtype_name(self.dtype)}). This is a bug "
                    "in lmc; please report it."
                )
        return source, aligned


def _check_inputs(source: HFCheckpoint, target: HFCheckpoint, model: nn.Module, scope: str) -> torch.dtype:
    """Refuse a pair that cannot be streamed; return the parameters' stored dtype."""
    if scope not in STREAMED_SCOPES:
        raise AlignmentError(
            f"scope {scope!r} is not streamed (every tensor moves with the residual-stream permutation); "
            f"stream one of {', '.join(STREAMED_SCOPES)}, or load both models and use lmc.matching.align"
        )
    source_layout = {n: (e.dtype, e.shape) for n, e in source.entries.items()}
    target_layout = {n: (e.dtype, e.shape) for n, e in target.entries.items()}
    if source_layout != target_layout:
        differing = sorted(set(source_layout.items()) ^ set(target_layout.items()))[:3]
        raise AlignmentError(
            f"{source.folder} and {target.folder} hold different tensors (name, (dtype, shape)), e.g. {differing}; "
            "align two checkpoints of one architecture"
        )
    parameters = {name: tuple(p.shape) for name, p in model.named_parameters()}
    stored = {name: parameters[name] for name in source.entries if name in parameters}
    missing = sorted(parameters.keys() - stored.keys())
    wrong = [(n, source.entries[n].shape, shape) for n, shape in stored.items() if source.entries[n].shape != shape]
    if missing or wrong:
        raise AlignmentError(
            f"{source.folder} does not fit its config.json's {type(model).__name__}: missing {missing[:3]}, "
            f"shapes (stored, model) {wrong[:3]}; save the model with save_pretrained"
        )
    dtypes = {source.entries[name].dtype for name in stored}
    if len(dtypes) != 1 or next(iter(dtypes)) not in _DTYPES:
        supported = ", ".join(_dtype_name(d) for d in PROBE_RTOL)
        raise AlignmentError(
            f"{source.folder} stores its parameters as {sorted(dtypes)}; lmc aligns models stored in one of "
            f"{supported}: save both with model.to(dtype).save_pretrained(...)"
        )
    return _DTYPES[dtypes.pop()]


def _check_output(output: Path, inputs: Iterable[Path], overwrite: bool) -> None:
    resolved = output.resolve()
    for folder in inputs:
        folder = folder.resolve()
        if folder == resolved or resolved in folder.parents or folder in resolved.parents:
            raise ValueError(f"the output {output} would overlap the input {folder}: choose a folder outside both")
    if output.exists() and not overwrite:
        raise ValueError(f"{output} already exists: choose a new folder or pass overwrite=True to replace it")
    check_output_folder(output.parent)


def _solve(
    source: HFCheckpoint, target: HFCheckpoint, spec: SymmetrySpec, scope: Scope, report: AlignmentReport
) -> None:
    """Find the scope's group element layer by layer, recording each layer in ``report``."""
    options = report.options
    attention, feed_forward, _ = scope_blocks(spec, scope)
    for index in feed_forward:
        hidden = spec.blocks[index].feed_forward.hidden
        names = spec.blocks[index].feed_forward.parameters
        start = time.perf_counter()
        block_source = {name: source.read(name) for name in names}
        block_target = {name: target.read(name) for name in names}
        perm = best_permutation(axis_correlation(block_source, block_target, hidden.axes, hidden.size))
        report.transform.feed_forward[index] = perm
        naive = sum(float((block_source[n] - block_target[n]).double().pow(2).sum()) for n in names) ** 0.5
        ModelTransform(feed_forward={index: perm}).apply_(block_source, spec)
        aligned = sum(float((block_source[n] - block_target[n]).double().pow(2).sum()) for n in names) ** 0.5
        report.layers.append(
            LayerAlignment(
                hidden.name,
                "feed_forward",
                torch.argsort(perm).tolist(),
                distance={"naive": naive, "permutation": aligned},
                seconds={"match": time.perf_counter() - start},
            )
        )
    for index in attention:
        layer = spec.blocks[index].attention
        layer_source = {name: source.read(name) for name in layer.parameters}
        layer_target = {name: target.read(name) for name in layer.parameters}
        for role, tensors in (("source", layer_source), ("target", layer_target)):
            for name, tensor in tensors.items():
                if not _finite(tensor):
                    raise AlignmentError(f"the {role} model's {name} holds NaN or Inf values; align finite checkpoints")
        order = (options.head_orders or {}).get(index)
        element, record = align_attention_layer(layer_source, layer_target, layer, options, order)
        report.transform.attention[index] = element
        report.layers.append(record)


def _finite(tensor: torch.Tensor) -> bool:
    """No NaN or Inf (extremes only: NaN propagates through both; faster than ``isfinite`` on half types)."""
    return tensor.numel() == 0 or bool(torch.isfinite(tensor.amax()) and torch.isfinite(tensor.amin()))


def _pieces(
    source: HFCheckpoint, target: HFCheckpoint, groups: _Groups, name: str
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(source, aligned, target)`` pieces of tensor ``name``: whole if it is transformed, else chunks of rows."""
    if name in groups.block_of:
        yield *groups.take(name), target.read(name)
        return
    for start, stop in source.chunks(name):
        piece = source.read_chunk(name, start, stop)
        yield piece, piece, target.read_chunk(name, start, stop)


def _write(
    source: HFCheckpoint,
    target: HFCheckpoint,
    folders: dict[float | None, Path],
    groups: _Groups,
    parameters: set[str],
    scoped: set[str],
    scope: Scope,
) -> dict[str, float]:
    """Write the aligned model (key ``None``) and each merge (key alpha) shard by shard.

    Outside the scope, source and target must be identical (checked chunk by chunk as they are
    copied). Returns the squared distances to the target over the scope, ``naive`` and ``aligned``.
    """
    squared = {"naive": 0.0, "aligned": 0.0}
    for folder in folders.values():
        folder.mkdir()
    for shard in source.shards:
        handles = {key: open(folder / shard, "wb") for key, folder in folders.items()}
        try:
            for handle in handles.values():
                handle.write(source.headers[shard])
            for name in source.names(shard):
                is_float = source.entries[name].dtype in _DTYPES
                for source_piece, aligned, target_piece in _pieces(source, target, groups, name):
                    if is_float and not (_finite(source_piece) and _finite(target_piece)):
                        raise AlignmentError(f"{name} holds NaN or Inf values; align finite checkpoints only")
                    if name in scoped:
                        squared["naive"] += float((source_piece - target_piece).double().pow(2).sum())
                        squared["aligned"] += float((aligned - target_piece).double().pow(2).sum())
                    elif name in parameters and not torch.equal(source_piece, target_piece):
                        gap = float((source_piece - target_piece).double().abs().max())
                        raise AlignmentError(
                            f"scope {scope!r} aligns only its re-initialized parameters, so everything else must be "
                            f"identical, but {name} differs (max abs difference {gap:.3g}). Use the scope the "
                            "checkpoints were fine-tuned with, or check that both come from the same pre-trained model."
                        )
                    for key, handle in handles.items():
                        merged = aligned if key is None or not is_float else torch.lerp(target_piece, aligned, key)
                        _write_tensor(handle, merged)
        finally:
            for handle in handles.values():
                handle.close()
        for folder in folders.values():
            size = (folder / shard).stat().st_size
            if size != (source.folder / shard).stat().st_size:
                raise AlignmentError(f"wrote {size} bytes to {folder / shard}, not the source's; this is a bug in lmc")
    return squared


def align_directories(
    source_dir: str | Path,
    target_dir: str | Path,
    output_dir: str | Path,
    scope: Scope = "first_attention",
    options: AlignOptions | None = None,
    merge_alphas: Iterable[float] = (),
    overwrite: bool = False,
) -> AlignmentReport:
    """Align the model saved in ``source_dir`` to the one in ``target_dir``, streaming both.

    Writes ``output_dir/aligned`` (a ``save_pretrained`` folder computing the source's function,
    sharded like the source), ``output_dir/merged_<a>`` for each alpha ``a`` (``(1 - a) * target +
    a * aligned``) and ``output_dir/report.json``. Half-precision weights are aligned in float32
    (the per-head problems in float64) and written back in their stored dtype.

    Args:
        source_dir: ``save_pretrained`` folder of the model to transform (never modified).
        target_dir: Folder of the model to come close to: same architecture, tensors and dtype.
        output_dir: Folder to create (written under a temporary name, renamed into place when
            complete; it may not overlap an input).
        scope: One of :data:`STREAMED_SCOPES`; every parameter outside it must be identical in both.
        options: As for :func:`lmc.matching.align`; ``probe_batch_size`` is unused (each layer is
            probed with 16 tokens) and ``seed`` seeds the probe.
        merge_alphas: Alphas in ``[0, 1]`` of the merges to write.
        overwrite: Replace an existing ``output_dir`` (only once the new one is complete).

    Returns:
        The report, as :func:`lmc.matching.align`'s; ``probe_relative_error`` is the largest over
        the aligned attention layers.

    Raises:
        CheckpointError: A folder is not a safetensors ``save_pretrained`` folder.
        AlignmentError: As :func:`lmc.matching.align`, and for ``full_model``.
        ValueError: A bad scope, alpha or output folder.
    """
    options = AlignOptions() if options is None else options
    if not isinstance(options, AlignOptions):
        raise TypeError(f"options must be an lmc.matching.AlignOptions, got {type(options).__name__}")
    if options.data_aware:
        raise ValueError(
            f"data-aware settings ({options.data_settings}) need calibration batches, which a streamed alignment "
            "of two folders does not read: use the weight settings (the defaults)"
        )
    check_scope(scope)
    alphas = list(dict.fromkeys(float(a) for a in merge_alphas))
    if any(not (math.isfinite(a) and 0 <= a <= 1) for a in alphas):
        raise ValueError(f"merge alphas must lie in [0, 1], got {alphas}")
    started = time.perf_counter()
    source, target = HFCheckpoint(source_dir), HFCheckpoint(target_dir)
    output = Path(output_dir)
    _check_output(output, [source.folder, target.folder], overwrite)
    model, target_model = skeleton(source.folder), skeleton(target.folder)
    if type(target_model) is not type(model):
        raise AlignmentError(f"{source.folder} and {target.folder} hold different architectures")
    dtype = _check_inputs(source, target, model, scope)
    spec = model_spec(model)
    check_same_attention(spec, model_spec(target_model))
    rtol = PROBE_RTOL[dtype] if options.check_rtol is None else options.check_rtol
    report = AlignmentReport(scope, options, _dtype_name(dtype), rtol, _dtype_name(compute_dtype(dtype)))
    if options.method != "naive":
        _solve(source, target, spec, scope, report)

    parameters = {name for name, _ in model.named_parameters()}
    attention, feed_forward, _ = scope_blocks(spec, scope)
    scoped = {name for i in attention for name in spec.blocks[i].attention.parameters}
    scoped |= {name for i in feed_forward for name in spec.blocks[i].feed_forward.parameters}
    groups = _Groups(source, spec, report.transform, dtype, rtol, options.seed)
    temporary = output.with_name(f".{output.name}.{secrets.token_hex(6)}.tmp")
    folders = {None: temporary / "aligned", **{a: temporary / f"merged_{a:g}" for a in alphas}}
    try:
        temporary.mkdir(parents=True)
        squared = _write(source, target, folders, groups, parameters, scoped, scope)
        extra = [CONFIG_FILE] + ([] if source.index is None else [INDEX_FILES[0]])
        for folder in folders.values():
            for name in extra:
                shutil.copyfile(source.folder / name, folder / name)
            copy_tokenizer_files(source.folder, folder)
        report.distance = {key: value**0.5 for key, value in squared.items()}
        report.probe_relative_error = groups.probe_error
        report.seconds = time.perf_counter() - started
        atomic_write_json(temporary / "report.json", report.to_dict())
        if output.exists():  # overwrite: the old folder goes only once the new one is complete
            retired = output.with_name(f".{output.name}.{secrets.token_hex(6)}.old")
            output.rename(retired)
            temporary.rename(output)
            shutil.rmtree(retired)
        else:
            temporary.rename(output)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return report
