"""Align checkpoints larger than memory, one layer at a time: two folders of safetensors in, one out.

:func:`align_directories` reads two Hugging Face ``save_pretrained`` folders (``model.safetensors``
or sharded ``model-0000x-of-0000y.safetensors`` with their index) or timm folders
(``model.safetensors`` beside timm's ``config.json``) as lazy mappings
(:class:`~lmc.formats.safetensors.SafetensorsCheckpoint`) and writes the aligned model, and any
merges, shard by shard. It runs the in-memory matcher's own per-layer solves
(:func:`~lmc.matching.layers.align_attention_layer`, :func:`~lmc.matching.layers.align_feed_forward_layer`),
checks (:mod:`lmc.matching.checks`) and merge (:func:`~lmc.connectivity.interpolation.interpolate`);
the layout comes from the model's adapter, the model built with its parameters on the ``meta``
device (:func:`skeleton`).

Peak memory stays near one layer pair plus one chunk of a tensor being copied, and each output
shard is written through a stream (its header is the source shard's: aligning changes no name,
shape or dtype). The output folder is written under a temporary name and renamed into place when
complete (:func:`~lmc.io.atomic_output_folder`): never half-written, never over an input.

The whole-model probe of :func:`~lmc.matching.align` needs the model in memory; instead each
aligned attention layer is checked on its own (:func:`~lmc.matching.checks.attention_probe_error`):
every layer keeping its function keeps the whole model's.

Scopes: :data:`STREAMED_SCOPES`. ``full_model`` couples every tensor through the residual-stream
permutation (coordinate descent over the whole model) and is aligned in memory.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from lmc.adapters import adapter_for, model_spec
from lmc.checkpoints import CheckpointError
from lmc.connectivity.interpolation import check_alphas, interpolate
from lmc.formats import huggingface, timm_files
from lmc.formats.external import FORMAT_NAMES, Checkpoint, detect
from lmc.formats.safetensors import SAFETENSORS_DTYPES, SafetensorsCheckpoint, write_tensor
from lmc.io import atomic_output_folder, atomic_write_json, check_output_folder, overlapping_input
from lmc.matching import AlignmentError, AlignmentReport, AlignOptions
from lmc.matching.checks import (
    attention_probe_error,
    check_dtype,
    check_finite,
    check_head_orders,
    check_probe,
    check_same_attention,
    check_same_tensors,
    check_unchanged,
)
from lmc.matching.layers import align_attention_layer, align_feed_forward_layer
from lmc.matching.options import checked_options
from lmc.symmetry import ModelTransform, Scope, SymmetrySpec, check_scope, scope_blocks

STREAMED_SCOPES: tuple[str, ...] = ("first_attention", "all_attention", "first_block")
"""The scopes :func:`align_directories` streams."""


def weight_files(checkpoint: Checkpoint) -> list[Path] | None:
    """The weight files of a Hugging Face or timm folder (shards in order); ``None`` for other checkpoints."""
    if checkpoint.format == "timm" and checkpoint.path.is_dir():
        return [timm_files.weight_file(checkpoint.path)]
    if checkpoint.format == "huggingface":
        return huggingface.weight_files(checkpoint.path)
    return None


def streamable(checkpoint: Checkpoint) -> bool:
    """Whether :func:`align_directories` reads ``checkpoint``: a Hugging Face or timm folder of safetensors."""
    files = weight_files(checkpoint)
    return files is not None and all(path.suffix == ".safetensors" for path in files)


def open_folder(checkpoint: Checkpoint | str | Path) -> tuple[Checkpoint, SafetensorsCheckpoint]:
    """A Hugging Face or timm folder (detected, or as :func:`~lmc.formats.detect` found it) and its weights as a
    lazy mapping.

    Raises:
        CheckpointError: It is not such a folder, or stores its weights in another format.
    """
    checkpoint = checkpoint if isinstance(checkpoint, Checkpoint) else detect(checkpoint)
    files = weight_files(checkpoint)
    if files is None:
        raise CheckpointError(
            f"{checkpoint.path} is {FORMAT_NAMES[checkpoint.format]}, not a folder: streamed alignment reads Hugging "
            "Face (save_pretrained) or timm folders of safetensors"
        )
    return checkpoint, SafetensorsCheckpoint(checkpoint.path, files)


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Build modules with their parameters on the ``meta`` device and their buffers (RoPE tables) on the CPU."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, parameter: nn.Parameter | None) -> None:
        register(module, name, parameter)
        if parameter is not None and not parameter.is_meta:  # a tied parameter is registered again as it is
            module._parameters[name] = nn.Parameter(parameter.to("meta"), requires_grad=parameter.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def skeleton(checkpoint: Checkpoint | str | Path, weights: Mapping[str, torch.Tensor] | None = None) -> nn.Module:
    """The model of a Hugging Face or timm folder with its parameters on ``meta``: its layout, no weights.

    Buffers are computed as the model builds them; frozen parameters (constants such as
    RoFormer's sinusoidal table, which the symmetry spec reads) are loaded from ``weights``.

    Raises:
        CheckpointError: The folder's config names no single architecture.
        UnsupportedModelError: lmc has no adapter for it.
    """
    checkpoint = checkpoint if isinstance(checkpoint, Checkpoint) else detect(checkpoint)
    folder = checkpoint.path
    with _parameters_on_meta():
        if checkpoint.format == "timm":
            model = timm_files.create_model(f"local-dir:{folder}", {}, folder)
        else:
            cls = huggingface.model_class(checkpoint.config, folder)
            model = cls(cls.config_class.from_dict(checkpoint.config))
    for name, parameter in list(model.named_parameters()):
        if not parameter.requires_grad and weights is not None and name in weights:
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner)._parameters[leaf] = nn.Parameter(weights[name], requires_grad=False)
    return model


def _check_inputs(source: SafetensorsCheckpoint, target: SafetensorsCheckpoint, model: nn.Module) -> torch.dtype:
    """Refuse a pair that cannot be aligned (as :func:`~lmc.matching.align` would); return the stored dtype."""
    check_same_tensors(source.layout(), target.layout())
    parameters = {name: tuple(p.shape) for name, p in model.named_parameters()}
    stored = {name: source.entries[name].shape for name in parameters if name in source.entries}
    missing = sorted(parameters.keys() - stored.keys())
    wrong = [(n, shape, parameters[n]) for n, shape in stored.items() if shape != parameters[n]]
    if missing or wrong:
        raise CheckpointError(
            f"{source.folder} does not fit its config.json's {type(model).__name__}: missing {missing[:3]}, "
            f"shapes (stored, model) {wrong[:3]}; save the model with save_pretrained"
        )
    dtypes = {source.entries[name].dtype for name in stored}
    if len(dtypes) != 1 or next(iter(dtypes)) not in SAFETENSORS_DTYPES:
        raise AlignmentError(
            f"{source.folder} stores its parameters as {sorted(dtypes)}; lmc aligns models stored in one "
            "floating-point dtype: save both with model.to(dtype)"
        )
    dtype = SAFETENSORS_DTYPES[dtypes.pop()]
    check_dtype(dtype)
    return dtype


def _solve(
    source: SafetensorsCheckpoint, target: SafetensorsCheckpoint, spec: SymmetrySpec, report: AlignmentReport
) -> None:
    """The scope's group element, layer by layer, each layer pair read on its own; recorded in ``report``."""
    options = report.options
    attention, feed_forward, _ = scope_blocks(spec, report.scope)
    check_head_orders(options.head_orders, attention, report.scope)

    def read(names: Iterable[str]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        tensors = {name: source[name] for name in names}, {name: target[name] for name in names}
        for role, layer in zip(("source", "target"), tensors):
            for name, tensor in layer.items():
                check_finite(role, name, tensor)
        return tensors

    for index in feed_forward:
        perm, record = align_feed_forward_layer(*read(spec.blocks[index].feed_forward.parameters), spec, index)
        report.transform.feed_forward[index] = perm
        report.layers.append(record)
    for index in attention:
        layer = spec.blocks[index].attention
        order = (options.head_orders or {}).get(index)
        element, record = align_attention_layer(*read(layer.parameters), layer, options, order)
        report.transform.attention[index] = element
        report.layers.append(record)


class _AlignedBlocks:
    """The transformed tensors of each block in scope, computed when a shard first needs them, each
    attention layer checked on its probe; a block is dropped once all its tensors are written."""

    def __init__(self, source: SafetensorsCheckpoint, spec: SymmetrySpec, report: AlignmentReport, dtype):
        self.source, self.spec, self.report, self.dtype = source, spec, report, dtype
        transform = report.transform
        self.members: dict[int, tuple[str, ...]] = {}
        for index in sorted(transform.attention.keys() | transform.feed_forward.keys()):
            block = spec.blocks[index]
            names = list(block.attention.parameters) if index in transform.attention else []
            names += list(block.feed_forward.parameters) if index in transform.feed_forward else []
            self.members[index] = tuple(dict.fromkeys(names))
        self.block_of = {name: index for index, names in self.members.items() for name in names}
        self.ready: dict[int, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], set[str]]] = {}

    def take(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Tensor ``name`` of the source and aligned."""
        index = self.block_of[name]
        if index not in self.ready:
            self.ready[index] = (*self._align(index), set())
        source, aligned, written = self.ready[index]
        written.add(name)
        if len(written) == len(self.members[index]):
            del self.ready[index]
        return source[name], aligned[name]

    def _align(self, index: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        source = {name: self.source[name] for name in self.members[index]}
        aligned = {name: tensor.clone() for name, tensor in source.items()}
        transform = self.report.transform
        ModelTransform(
            attention={i: t for i, t in transform.attention.items() if i == index},
            feed_forward={i: p for i, p in transform.feed_forward.items() if i == index},
        ).apply_(aligned, self.spec)
        if index in transform.attention:
            layer, options = self.spec.blocks[index].attention, self.report.options
            error = attention_probe_error(layer, source, aligned, options.seed)
            self.report.probe_relative_error = max(self.report.probe_relative_error, error)
            check_probe(error, self.report.check_rtol, self.dtype, options.check_rtol is None, f"layer {layer.name}")
        return source, aligned


def _pieces(
    source: SafetensorsCheckpoint, target: SafetensorsCheckpoint, blocks: _AlignedBlocks, name: str
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(source, aligned, target)`` pieces of tensor ``name``: whole if it is transformed, else chunks of rows."""
    if name in blocks.block_of:
        yield *blocks.take(name), target[name]
        return
    for start, stop in source.chunks(name):
        piece = source.rows(name, start, stop)
        yield piece, piece, target.rows(name, start, stop)


def _write(
    source: SafetensorsCheckpoint,
    target: SafetensorsCheckpoint,
    folders: dict[float | None, Path],
    blocks: _AlignedBlocks,
    parameters: set[str],
    scoped: set[str],
    scope: Scope,
) -> dict[str, float]:
    """Write the aligned model (key ``None``) and each merge (key alpha) shard by shard.

    Every piece is checked as it is copied: finite, and outside the scope equal in both. Returns
    the squared distances to the target over the scope, ``naive`` and ``aligned``.
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
                is_float = source.entries[name].is_float
                for source_piece, aligned, target_piece in _pieces(source, target, blocks, name):
                    if is_float:
                        check_finite("source", name, source_piece)
                        check_finite("target", name, target_piece)
                    if name in scoped:
                        squared["naive"] += float((source_piece - target_piece).double().pow(2).sum())
                        squared["aligned"] += float((aligned - target_piece).double().pow(2).sum())
                    elif name in parameters:
                        check_unchanged(scope, name, source_piece, target_piece)
                    for key, handle in handles.items():
                        merged = aligned if key is None or not is_float else interpolate(target_piece, aligned, key)
                        write_tensor(handle, merged)
        finally:
            for handle in handles.values():
                handle.close()
        for folder in folders.values():
            size = (folder / shard).stat().st_size
            if size != (source.folder / shard).stat().st_size:
                raise AlignmentError(f"wrote {size} bytes to {folder / shard}, not the source's; this is a bug in lmc")
    return squared


def _copy_other_files(source: Path, folder: Path) -> None:
    """The folder's files besides the weights: configs, the shard index, tokenizer files."""
    names = [huggingface.CONFIG_FILE] + [name for name in huggingface.INDEX_FILES[:1] if (source / name).is_file()]
    for name in names:
        shutil.copyfile(source / name, folder / name)
    huggingface.copy_tokenizer_files(source, folder)


def align_directories(
    source_dir: Checkpoint | str | Path,
    target_dir: Checkpoint | str | Path,
    output_dir: str | Path,
    scope: Scope = "first_attention",
    options: AlignOptions | None = None,
    merge_alphas: Iterable[float] = (),
    overwrite: bool = False,
) -> AlignmentReport:
    """Align the model saved in ``source_dir`` to the one in ``target_dir``, streaming both.

    Writes ``output_dir/aligned`` (a folder computing the source's function, sharded like the
    source), ``output_dir/merged_<a>`` for each alpha ``a`` (``(1 - a) * target + a * aligned``)
    and ``output_dir/report.json``. Half-precision weights are aligned in float32 (the per-head
    problems in float64) and written back in their stored dtype.

    Args:
        source_dir: Hugging Face or timm folder of the model to transform (never modified).
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
        CheckpointError: A folder is not a safetensors Hugging Face or timm folder, or a shard is corrupted.
        AlignmentError: As :func:`lmc.matching.align`, and for ``full_model``.
        ValueError: A bad scope, alpha or output folder.
    """
    options = checked_options(options)
    if options.data_aware:
        raise ValueError(
            f"data-aware settings ({options.data_settings}) need calibration batches, which a streamed alignment "
            "of two folders does not read: use the weight settings (the defaults)"
        )
    check_scope(scope)
    if scope not in STREAMED_SCOPES:
        raise AlignmentError(
            f"scope {scope!r} is not streamed (every tensor moves with the residual-stream permutation); "
            f"stream one of {', '.join(STREAMED_SCOPES)}, or load both models and use lmc.matching.align"
        )
    alphas = check_alphas(merge_alphas, "merge alphas")
    started = time.perf_counter()
    (source_checkpoint, source), (target_checkpoint, target) = open_folder(source_dir), open_folder(target_dir)
    output = Path(output_dir)
    clash = overlapping_input(output, [source.folder, target.folder])
    if clash is not None:
        raise ValueError(f"the output {output} would overlap the input {clash}: choose a folder outside both")
    if output.exists() and not overwrite:
        raise ValueError(f"{output} already exists: choose a new folder or pass overwrite=True to replace it")
    check_output_folder(output.parent)
    model, target_model = skeleton(source_checkpoint, source), skeleton(target_checkpoint, target)
    if type(target_model) is not type(model):
        raise AlignmentError(
            f"different architectures: {source.folder} holds a {type(model).__name__}, "
            f"{target.folder} a {type(target_model).__name__}"
        )
    saved_names = adapter_for(model).saved_names(model)  # GPT-NeoX's lm_head is embed_out in its files
    source, target = source.renamed(saved_names), target.renamed(saved_names)
    dtype = _check_inputs(source, target, model)
    spec = model_spec(model)
    check_same_attention(spec, model_spec(target_model))
    report = AlignmentReport.start(scope, options, dtype)
    if options.method != "naive":
        _solve(source, target, spec, report)

    parameters = {name for name, _ in model.named_parameters()}
    attention, feed_forward, _ = scope_blocks(spec, scope)
    scoped = {name for i in attention for name in spec.blocks[i].attention.parameters}
    scoped |= {name for i in feed_forward for name in spec.blocks[i].feed_forward.parameters}
    blocks = _AlignedBlocks(source, spec, report, dtype)
    with atomic_output_folder(output, inputs=[source.folder, target.folder]) as temporary:
        folders = {None: temporary / "aligned", **{a: temporary / f"merged_{a:g}" for a in alphas}}
        squared = _write(source, target, folders, blocks, parameters, scoped, scope)
        for folder in folders.values():
            _copy_other_files(source.folder, folder)
        report.distance = {key: value**0.5 for key, value in squared.items()}
        report.seconds = time.perf_counter() - started
        atomic_write_json(temporary / "report.json", report.to_dict())
    return report
