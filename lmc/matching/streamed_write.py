"""The write pass of the streamed alignment (:mod:`lmc.matching.streamed`): the checks, the shards and the merges.

:func:`write_streamed` aligns two safetensors folders with the streamed search and writes the
aligned model, and any merges, shard by shard (the route of
:func:`lmc.checkpoint_alignment.align_checkpoints` for such folders).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from lmc.adapters import adapter_for, model_spec, scope_parameters
from lmc.checkpoints import CheckpointError
from lmc.formats.external import Checkpoint, ExternalModel, require_same_architecture
from lmc.formats.safetensors import SAFETENSORS_DTYPES, SafetensorsCheckpoint, loaded_ties, write_tensor
from lmc.formats.streamed import copy_other_files, open_folder, skeleton, tie_as_loaded
from lmc.matching import AlignmentError, AlignmentReport, AlignOptions
from lmc.matching.alignment import group_spec, record_fold
from lmc.matching.checks import (
    AttentionProbe,
    check_dtype,
    check_finite,
    check_head_orders,
    check_probe,
    check_same_attention,
    check_same_tensors,
    check_unchanged,
)
from lmc.matching.descent import weight_alignment
from lmc.matching.merge import interpolate
from lmc.matching.permutation import squared_distance
from lmc.matching.streamed import (
    _Checked,
    _on_cpu,
    _permutations,
    _rows_moved,
    _StreamedDescent,
    _Transformed,
    release_freed_memory,
)
from lmc.matching.streamed_fold import FoldedCheckpoint
from lmc.symmetry import Scope, SymmetrySpec, scope_blocks


def _check_inputs(source: SafetensorsCheckpoint, target: SafetensorsCheckpoint, model: nn.Module) -> torch.dtype:
    """Refuse a pair that cannot be aligned (as :func:`~lmc.matching.align` would); return the stored dtype."""
    parameters = {name: tuple(p.shape) for name, p in model.named_parameters()}
    for checkpoint in (source, target):  # each folder against its config first: a refusal naming the folder
        stored = {name: checkpoint.entries[name].shape for name in parameters if name in checkpoint.entries}
        missing = sorted(parameters.keys() - stored.keys())
        wrong = [(n, shape, parameters[n]) for n, shape in stored.items() if shape != parameters[n]]
        if missing or wrong:
            details = [f"missing {missing[:3]}"] if missing else []
            details += [f"shapes (stored, model) {wrong[:3]}"] if wrong else []
            raise CheckpointError(
                f"{checkpoint.folder} does not fit its config.json's {type(model).__name__}: {', '.join(details)}; "
                "save the model with save_pretrained"
            )
    check_same_tensors(source.layout(), target.layout())
    dtypes = {source.entries[name].dtype for name in parameters}
    if len(dtypes) != 1 or next(iter(dtypes)) not in SAFETENSORS_DTYPES:
        raise AlignmentError(
            f"{source.folder} stores its parameters as {sorted(dtypes)}; lmc aligns models stored in one "
            "floating-point dtype: save both with model.to(dtype)"
        )
    dtype = SAFETENSORS_DTYPES[dtypes.pop()]
    check_dtype(dtype)
    return dtype


_Layer = dict[str, torch.Tensor]
"""An attention layer's tensors by name."""


class _AlignedTensors:
    """The tensors the final transform moves, computed when a shard first needs them; each attention
    layer's together, checked on its probe and dropped once all its tensors are written.

    In a scope without the residual stream each attention layer's element depends on that layer
    alone, so the layers of ``deferred`` are aligned here, when the write pass first reaches them
    (by ``descent``): their tensors of both models are read once, for the alignment and the output.
    """

    def __init__(
        self,
        aligned: _Transformed,
        report: AlignmentReport,
        dtype: torch.dtype,
        descent: _StreamedDescent | None = None,
        deferred: Iterable[int] = (),
    ):
        self.aligned, self.report, self.dtype, self.descent = aligned, report, dtype, descent
        self.deferred = set(deferred)
        spec, transform = aligned.spec, report.transform
        permutations = _permutations(spec, transform)
        self.moved = {name for permutation in permutations for name, _ in permutation.axes}
        layers = self.deferred | transform.attention.keys()
        attention = {name for i in layers for name in spec.blocks[i].attention.parameters}
        self.moved |= attention
        # Tensors whose rows stay in place are moved a chunk of rows at a time (an embedding, an LM head).
        self.whole = attention | _rows_moved(permutations)
        self.ready: dict[int, tuple[_Layer, _Layer, _Layer | None, set[str]]] = {}
        # Each aligned layer's probe and the source layer's output on it: the written layer's check reads
        # only the written tensors.
        self.references: dict[int, tuple[AttentionProbe, torch.Tensor]] = {}

    def take(self, name: str, target: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tensor ``name`` of the source, aligned, and of ``target``."""
        index = self.aligned.layer_of.get(name)
        if index is None or (index not in self.deferred and index not in self.report.transform.attention):
            source = self.aligned.source[name]
            return source, self.aligned.moved({name: source})[name], target[name]
        names = self.aligned.spec.blocks[index].attention.parameters
        if index not in self.ready:
            self.ready[index] = (*self._align(index, names), set())
        source, aligned, targets, written = self.ready[index]
        written.add(name)
        if len(written) == len(names):
            del self.ready[index]
        return source[name], aligned[name], target[name] if targets is None else targets[name]

    def _align(self, index: int, names: tuple[str, ...]) -> tuple[_Layer, _Layer, _Layer | None]:
        """Layer ``index`` of the source, aligned, and of the target where it was read with them."""
        if index in self.deferred:
            source, aligned, target = self._align_layer(index, names)
        else:
            source = {name: self.aligned.source.read(name) for name in names}
            aligned, target = self.aligned.moved(source), None  # from the tensors just read: each is read once
        layer, options = self.aligned.spec.blocks[index].attention, self.report.options
        probe = AttentionProbe(layer, options.seed)
        reference = probe.output(source)
        self.references[index] = probe, reference
        transform = self.report.transform
        error = probe.error(
            reference, aligned, transform.residual, transform.residual_signs, transform.residual_rotation
        )
        self.report.probe_relative_error = max(self.report.probe_relative_error, error)
        check_probe(error, self.report.check_rtol, self.dtype, options.check_rtol is None, f"layer {layer.name}")
        return source, aligned, target

    def _align_layer(self, index: int, names: tuple[str, ...]) -> tuple[_Layer, _Layer, _Layer]:
        """Both stages on attention layer ``index`` from one read of its tensors in each model (on the
        descent's device); the source's, the aligned and the target's tensors on the CPU."""
        descent = self.descent
        with descent.holding(names):
            source = {name: tensor.clone() for name, tensor in descent.parameters.held.items()}
            descent.original.held = source  # the naive distance's
            try:
                descent.align_attention(index)  # moves the held tensors by the layer's element, in place
            finally:
                descent.original.held = {}
            aligned, target = descent.parameters.held, descent.target.held
        self.report.transform = _on_cpu(self.report.transform)
        return tuple({name: tensor.cpu() for name, tensor in layer.items()} for layer in (source, aligned, target))


def _pieces(
    source: SafetensorsCheckpoint, target: SafetensorsCheckpoint, blocks: _AlignedTensors, name: str
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(source, aligned, target)`` pieces of tensor ``name``, the source's checked finite: whole if it is
    transformed whole, else chunks of rows (``aligned`` is then the source's piece itself where the transform
    leaves the tensor)."""
    if name in blocks.whole:
        yield blocks.take(name, target)
        return
    is_float = source.entries[name].is_float
    for start, stop in source.chunks(name):
        piece = source.rows(name, start, stop)
        if is_float:
            check_finite("source", name, piece)
        aligned = blocks.aligned.moved({name: piece})[name] if name in blocks.moved else piece
        yield piece, aligned, target.rows(name, start, stop)
        del piece, aligned  # before the next piece is read, so that one piece of each is held at a time


def _write(
    source: SafetensorsCheckpoint,
    target: SafetensorsCheckpoint,
    folders: dict[float | None, Path],
    blocks: _AlignedTensors,
    parameters: set[str],
    scoped: set[str],
    scope: Scope,
    tied: Mapping[str, str],
) -> dict[str, float]:
    """Write the aligned model (key ``None``) and each merge (key alpha) shard by shard.

    Every tensor is read once from each model, and every piece checked as it is copied: finite,
    and outside the scope equal in both; a tied parameter's other name that the files store
    (``tied``) is written as its parameter is, so the loader ties it again. Returns the squared
    distances to the target over the scope, ``naive`` and ``aligned``.
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
                unchanged = name in parameters and name not in scoped
                for source_piece, aligned, target_piece in _pieces(source, target, blocks, tied.get(name, name)):
                    if unchanged:  # equal to the source's piece, so finite too
                        check_unchanged(scope, name, source_piece, target_piece)
                    elif is_float:
                        check_finite("target", name, target_piece)
                    if name in scoped:
                        squared["naive"] += squared_distance(source_piece, target_piece)
                        squared["aligned"] += squared_distance(aligned, target_piece)
                    # A merge of two equal pieces is the piece itself (torch.lerp is exact at equal ends).
                    same_ends = not is_float or (unchanged and aligned is source_piece)
                    for key, handle in handles.items():
                        merged = aligned if key is None or same_ends else interpolate(target_piece, aligned, key)
                        write_tensor(handle, merged)
                        del merged
                    del source_piece, aligned, target_piece  # before the next piece is read (see _pieces)
                release_freed_memory()
        finally:
            for handle in handles.values():
                handle.close()
        for folder in folders.values():
            size = (folder / shard).stat().st_size
            if size != (source.folder / shard).stat().st_size:
                raise AlignmentError(f"wrote {size} bytes to {folder / shard}, not the source's; this is a bug in lmc")
    return squared


def _written_error(
    written: SafetensorsCheckpoint,
    spec: SymmetrySpec,
    report: AlignmentReport,
    references: Mapping[int, tuple[AttentionProbe, torch.Tensor]],
) -> float:
    """The largest probe error of the aligned attention layers as written to disk and read back (the
    layers whose weights were rounded; every other tensor is a permuted copy, checked by its size),
    against the source layers' outputs on each probe (``references``, :attr:`_AlignedTensors.references`)."""
    error = 0.0
    for index in sorted(report.transform.attention):
        layer = spec.blocks[index].attention
        names = layer.parameters
        probe, reference = references[index]
        transform = report.transform
        layer_tensors = {name: written[name] for name in names}
        found = probe.error(
            reference, layer_tensors, transform.residual, transform.residual_signs, transform.residual_rotation
        )
        check_probe(found, report.check_rtol, written[names[0]].dtype, report.options.check_rtol is None,
                    f"layer {layer.name} as written to {written.folder}")  # fmt: skip
        error = max(error, found)
    return error


def write_streamed(
    pair: tuple[Checkpoint, Checkpoint],
    folder: Path,
    scope: Scope,
    options: AlignOptions,
    alphas: list[float],
    device: torch.device,
) -> tuple[AlignmentReport, float]:
    """Align the model of a Hugging Face or timm folder of safetensors to another's, streaming both, and write
    ``folder/aligned`` (sharded like the source) and ``folder/merged_<a>`` for each alpha, shard by shard.

    The route of :func:`lmc.checkpoint_alignment.align_checkpoints` for two such folders, which checks
    the options, alphas, device and outputs and writes ``report.json``. Half-precision weights are
    aligned in float32 (the per-head problems in float64) and written back in their stored dtype.

    Args:
        pair: The source's and the target's folder, as :func:`~lmc.formats.detect` found them (never modified).
        folder: An existing empty folder (the temporary one of the outputs).
        scope: Every parameter outside it must be identical in both.
        options: As for :func:`lmc.matching.align`; ``probe_batch_size`` is unused (each layer is
            probed with 16 tokens) and ``seed`` seeds the probe.
        alphas: Checked alphas in ``[0, 1]`` of the merges to write.
        device: Where the solves run: each tensor read is moved there, so the Grams, correlations
            and transforms of the search are computed there; the assignments run on the CPU, and the
            output is transformed and written from the CPU.

    Returns:
        The report, as :func:`lmc.matching.align`'s (``probe_relative_error`` is the largest over the
        aligned attention layers), and the largest probe error of the written layers read back.

    Raises:
        CheckpointError: A folder does not fit its config, or a shard is corrupted.
        AlignmentError: As :func:`lmc.matching.align`.
    """
    started = time.perf_counter()
    (source_checkpoint, source), (target_checkpoint, target) = open_folder(pair[0]), open_folder(pair[1])
    model, target_model = skeleton(source_checkpoint, source), skeleton(target_checkpoint, target)
    require_same_architecture(
        ExternalModel(source.folder, source_checkpoint.format, model),
        ExternalModel(target.folder, target_checkpoint.format, target_model),
    )
    saved_names = adapter_for(model).saved_names(model)  # GPT-NeoX's lm_head is embed_out in its files
    source, target = source.renamed(saved_names), target.renamed(saved_names)
    tied, ties = tie_as_loaded((model, target_model), (source, target))
    dtype = _check_inputs(source, target, model)
    spec = group_spec(model_spec(model), options)
    check_same_attention(spec, model_spec(target_model))
    report = AlignmentReport.start(scope, options, dtype)
    if options.residual == "orthogonal":  # both read folded (the extended group), as align folds them in memory
        if scope != "full_model":
            raise ValueError(
                f"residual='orthogonal' rotates the residual stream by weight, which scope {scope!r} does not "
                "align: use scope='full_model', or residual='permutation'"
            )
        source, target = FoldedCheckpoint(source, spec.folds), FoldedCheckpoint(target, spec.folds)
        record_fold(report, spec, source.folded)
    if options.unit_scales and scope != "full_model":
        raise ValueError(
            f"unit_scales=True scales the FFN units inside the whole-model descent, which scope {scope!r} does not "
            "run: use scope='full_model', or unit_scales=False"
        )
    descent = _StreamedDescent(source, target, spec, report, dtype, device)
    deferred: list[int] = []
    if options.method != "naive":
        attention, feed_forward, whole = scope_blocks(spec, scope)
        check_head_orders(options.head_orders, attention, scope)
        # Without the residual stream, each attention layer is aligned when the write pass reaches it: one read.
        deferred = [] if whole else attention
        weight_alignment(descent, spec, [] if deferred else attention, feed_forward, whole)

    parameters = {name for name, _ in model.named_parameters()}
    scoped = set(scope_parameters(model, scope, spec))
    report.transform = _on_cpu(report.transform)
    aligned = _Transformed(_Checked(source, "source"), spec, report)
    blocks = _AlignedTensors(aligned, report, dtype, descent if deferred else None, deferred)
    del descent  # what it keeps on the device, unless the write pass aligns layers
    folders = {None: folder / "aligned", **{a: folder / f"merged_{a:g}" for a in alphas}}
    first = len(report.layers)
    kept = {name: tied[name] for name, tie in ties.items() if tie}
    squared = _write(source, target, folders, blocks, parameters, scoped, scope, kept)
    # The write pass aligned layers in the order the files hold them: report them by layer, as in memory.
    order = {spec.blocks[index].attention.name: index for index in deferred}
    report.layers[first:] = sorted(report.layers[first:], key=lambda record: order[record.name])
    for written_folder in folders.values():
        copy_other_files(source.folder, written_folder)
    report.distance = {key: value**0.5 for key, value in squared.items()}
    written = SafetensorsCheckpoint(folders[None], [folders[None] / shard for shard in source.shards])
    written = written.renamed(saved_names)
    if loaded_ties(written, tied) != ties:  # from_pretrained would load another model than the one aligned
        raise AlignmentError(f"{folders[None]} ties {sorted(tied)} otherwise than the source; this is a bug in lmc")
    written_error = _written_error(written, spec, report, blocks.references)
    report.seconds = time.perf_counter() - started
    return report, written_error
