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

Peak memory stays near one layer pair plus one chunk of a tensor being copied, or at ``full_model`` the
largest FFN's correlation (float32 for bf16 or float32 weights) and one tensor pair: a tensor whose
rows no symmetry moves, such as an embedding or an LM head, is read, moved, correlated and measured a
block of rows at a time (:func:`~lmc.matching.permutation.row_blocks`), never whole. Each output
shard is written through a stream (its header is the source shard's: aligning changes no name,
shape or dtype). The output folder is written under a temporary name and renamed into place when
complete (:func:`~lmc.io.atomic_output_folder`): never half-written, never over an input.

Every scope streams, ``full_model`` too: the solves are the in-memory ones
(:func:`~lmc.matching.aligner.weight_alignment`, the coordinate descent over FFN, task-head, token,
head and residual permutations for ``full_model``), run on a view that reads each source tensor
through the group element found so far, so no model is ever held whole: a round of the descent
reads each tensor of both models once, block by block (an FFN's twice: once into its units' correlation,
once moved by their permutation), and forms the block's Grams and share of the ``d x d`` residual
correlation from that read (:meth:`_StreamedDescent.descent_round`).
In the other scopes no permutation crosses layers, so each attention layer is aligned when the
write pass first reaches it (:class:`_AlignedTensors`), from the read that writes it: the alignment
reads each tensor of both models once. Every transform is applied to a tensor read as stored, so
the aligned weights equal in-memory ``align``'s bit for bit (a permutation moves values exactly,
and each attention layer's element is applied once as in memory); the distances equal them up to
the order of summation.

The whole-model probe of :func:`~lmc.matching.align` needs the model in memory; instead each
aligned attention layer is checked on its own (:class:`~lmc.matching.checks.AttentionProbe`, its
input and output moved by the residual permutation), once as aligned and once as written and read
back, against the source layer's output computed once: every layer keeping its function (the
permutations of FFN units and of the residual stream move values exactly) keeps the whole model's.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from lmc.adapters import adapter_for, model_spec, scope_parameters
from lmc.checkpoints import CheckpointError
from lmc.connectivity.interpolation import check_alphas, interpolate
from lmc.formats import huggingface, timm_files
from lmc.formats.external import (
    FORMAT_NAMES,
    Checkpoint,
    ExternalModel,
    alignment_document,
    detect,
    require_same_architecture,
)
from lmc.formats.safetensors import (
    SAFETENSORS_DTYPES,
    SafetensorsCheckpoint,
    loaded_ties,
    tied_names,
    write_tensor,
)
from lmc.io import atomic_output_folder, atomic_write_json, check_output_folder, overlapping_input
from lmc.matching import AlignmentError, AlignmentReport, AlignOptions
from lmc.matching.aligner import WeightDescent, weight_alignment
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
from lmc.matching.options import checked_options
from lmc.matching.permutation import block_rows, blocks_of, squared_distance
from lmc.symmetry import (
    AttentionTransform,
    AxisPermutation,
    ModelTransform,
    Scope,
    SymmetrySpec,
    check_scope,
    scope_blocks,
)

STREAMED_SCOPES: tuple[str, ...] = ("first_attention", "all_attention", "first_block", "full_model")
"""The scopes :func:`align_directories` streams."""


CPU = torch.device("cpu")


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (``None`` where the C library has none: musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _malloc_trim()


def release_freed_memory() -> None:
    """Hand the memory freed so far back to the operating system (glibc; elsewhere nothing).

    glibc serves blocks below its mmap threshold (which rises up to 32 MB as larger blocks are
    freed) from its heaps and keeps them resident once freed. A streamed alignment frees tensors of
    8-32 MB layer after layer (an 8B layer's K/V projections, their float32 copies, the Grams), and
    the freed space counts in the process's memory until it is reused; ``malloc_trim`` returns it
    between steps (four Llama-3-8B layers at ``full_model``: 0.67 GB kept between steps instead of up
    to 1.05 GB, the peak unchanged; ``benchmarks/results/streamed_align.md``).
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def checked_device(device: str | torch.device) -> torch.device:
    """``device`` as a :class:`torch.device`, refused with the fix if PyTorch cannot reach it.

    Raises:
        ValueError: Not a device name, or a CUDA device where no GPU is visible.
    """
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device {device!r} is not a device name ({error}): use 'cpu' or 'cuda'") from error
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device {str(device)!r}: PyTorch sees no CUDA GPU here (torch.cuda.is_available() is False); "
            "use device 'cpu' (--device cpu), or run on a machine with a GPU and a CUDA build of PyTorch"
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {str(device)!r}: streamed alignment runs on 'cpu' or 'cuda'")
    return device


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


def _tie_as_loaded(
    models: tuple[nn.Module, nn.Module], checkpoints: tuple[SafetensorsCheckpoint, SafetensorsCheckpoint]
) -> tuple[dict[str, str], dict[str, bool]]:
    """Tie the skeletons' parameters as the model's loader ties them (:func:`~lmc.formats.safetensors.loaded_ties`):
    a tied name the files store with other values than its parameter's is given a parameter of its own.

    Returns:
        The models' :func:`~lmc.formats.safetensors.tied_names` as built, and whether the loader ties
        each one the files store (the aligned folder is read back the same way).

    Raises:
        CheckpointError: One folder stores such a tensor tied and the other untied: two functions of different form.
    """
    tied = tied_names(models[0])
    ties = [loaded_ties(checkpoint, tied) for checkpoint in checkpoints]
    if ties[0] != ties[1]:
        name = next(n for n in ties[0].keys() | ties[1].keys() if ties[0].get(n) != ties[1].get(n))
        described = [{True: "equal to", False: "apart from", None: "without"}[t.get(name)] for t in ties]
        raise CheckpointError(
            f"{checkpoints[0].folder} stores {name} {described[0]} {tied[name]} and {checkpoints[1].folder} "
            f"{described[1]} it, so from_pretrained loads one model tied and the other untied: give two "
            f"checkpoints saved alike (save both with save_pretrained)"
        )
    for model in models:
        for name in (name for name, kept in ties[0].items() if not kept):
            owner, _, leaf = name.rpartition(".")
            shared = model.get_submodule(owner)._parameters[leaf]
            untied = nn.Parameter(torch.empty_like(shared, device="meta"), requires_grad=shared.requires_grad)
            model.get_submodule(owner)._parameters[leaf] = untied
    return tied, ties[0]


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


def _permutations(spec: SymmetrySpec, transform: ModelTransform | None = None) -> list[AxisPermutation]:
    """The axis permutations of ``spec`` (FFN units, task heads, the residual stream, the tokens), or of those
    ``transform`` moves."""
    if transform is None:
        hidden = [block.feed_forward.hidden for block in spec.blocks if block.feed_forward]
        return hidden + list(spec.task_heads) + [p for p in (spec.residual, spec.tokens) if p is not None]
    permutations = [spec.blocks[i].feed_forward.hidden for i in transform.feed_forward]
    permutations += [spec.task_heads[i] for i in transform.task_heads]
    permutations += [spec.residual] if transform.residual is not None else []
    permutations += [spec.tokens] if transform.tokens is not None else []
    return permutations


def _rows_moved(permutations: Iterable[AxisPermutation]) -> set[str]:
    """The tensors whose rows (axis 0) one of ``permutations`` moves: a block of their rows is not moved alone."""
    return {name for permutation in permutations for name, axis in permutation.axes if axis == 0}


class _Checked(Mapping[str, torch.Tensor]):
    """A checkpoint's tensors on ``device``, each refused by name if it holds NaN or Inf; the last one read is kept."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], role: str, device: torch.device = CPU):
        self.tensors, self.role, self.device, self.kept = tensors, role, device, ("", None)
        self.held: dict[str, torch.Tensor] = {}  # a block's tensors while a descent round works on it

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name`` read anew, checked, on the device."""
        tensor = self.tensors[name].to(self.device)
        check_finite(self.role, name, tensor)
        return tensor

    def row_blocks(self, name: str) -> Iterator[torch.Tensor]:
        """Tensor ``name`` a block of :func:`~lmc.matching.permutation.block_rows` rows at a time, each read
        anew and checked (:func:`~lmc.matching.permutation.row_blocks`), or the held tensor's."""
        if name in self.held:
            yield from blocks_of(self.held[name])
            return
        shape = self.tensors.entries[name].shape
        if not shape:
            yield self.read(name)
            return
        step = block_rows(shape)
        for start in range(0, shape[0], step):
            block = self.tensors.rows(name, start, start + step).to(self.device)
            check_finite(self.role, name, block)
            yield block

    def forget(self) -> None:
        self.kept = ("", None)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.held:
            return self.held[name]
        if self.kept[0] != name:
            self.kept = ("", None)  # dropped before the next is read: never two beside each other
            self.kept = (name, self.read(name))
        return self.kept[1]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


class _Transformed(Mapping[str, torch.Tensor]):
    """The source's tensors under the report's transform so far, each read and transformed when looked up.

    An attention layer's tensors are transformed together (its element mixes them); the last
    group read is kept until the transform changes (:meth:`forget`).
    """

    def __init__(self, source: _Checked, spec: SymmetrySpec, report: AlignmentReport):
        self.source, self.spec, self.report = source, spec, report
        self.layer_of = {name: i for i, block in enumerate(spec.blocks) for name in block.attention.parameters}
        # Tensors whose rows a symmetry may move are transformed whole; the rest a block of rows at a time.
        self.whole = set(self.layer_of) | _rows_moved(_permutations(spec))
        self.kept: dict[str, torch.Tensor] = {}
        self.held: dict[str, torch.Tensor] = {}  # a block's tensors while a descent round works on it

    def group(self, name: str) -> tuple[str, ...]:
        """The tensors transformed together with ``name``."""
        index = self.layer_of.get(name)
        if index is not None and index in self.report.transform.attention:
            return self.spec.blocks[index].attention.parameters
        return (name,)

    def transformed(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """Tensors ``names`` (whole attention layers) under the transform, each read anew (memory of its own)."""
        tensors = {name: self.source.read(name) for name in names}
        self.report.transform.apply_(tensors, self.spec, partial=True)
        return tensors

    def moved(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copies of ``tensors`` under the transform: whole attention layers, or a tensor's rows the transform keeps."""
        copies = {name: tensor.clone() for name, tensor in tensors.items()}
        self.report.transform.apply_(copies, self.spec, partial=True)
        return copies

    def row_blocks(self, name: str) -> Iterator[torch.Tensor]:
        """Tensor ``name`` under the transform a block of rows at a time (as :meth:`_Checked.row_blocks`): each
        block read and moved alone where no symmetry moves the tensor's rows, else blocks of it whole."""
        if name in self.held or name in self.whole:
            yield from blocks_of(self[name])
            return
        for block in self.source.row_blocks(name):
            self.report.transform.apply_({name: block}, self.spec, partial=True)  # in place, on a block of its own
            yield block

    def forget(self) -> None:
        self.kept = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.held:
            return self.held[name]
        if name not in self.kept:
            self.kept = {}  # dropped before the next group is read
            self.kept = self.transformed(self.group(name))
        return self.kept[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.source)

    def __len__(self) -> int:
        return len(self.source)


class _StreamedDescent(WeightDescent):
    """Weight matching over two checkpoints on disk: the source is read through the transform so far."""

    def __init__(self, source: Mapping, target: Mapping, spec: SymmetrySpec, report: AlignmentReport, dtype, device):
        original, target = _Checked(source, "source", device), _Checked(target, "target", device)
        super().__init__(_Transformed(original, spec, report), target, original, spec, report, dtype)

    def transform_parameters(self, transform: ModelTransform) -> None:
        # The held tensors were read through the transform so far: move them by the new step in place, as in
        # memory; every other tensor is read anew through the composed transform (a permutation moves values
        # exactly, so both give the same bits).
        transform.apply_(self.parameters.held, self.spec, partial=True)
        self.parameters.forget()
        release_freed_memory()

    def unit_correlation(self, permutation: AxisPermutation) -> torch.Tensor:
        # Its tensors are read one pair at a time (nothing held): an 8B FFN's correlation (822 MB) and the
        # pair being read are then the whole step beside what is kept, and the last pair is dropped before
        # the assignment.
        correlation = super().unit_correlation(permutation)
        self.parameters.forget()
        self.target.forget()
        release_freed_memory()
        return correlation

    @contextlib.contextmanager
    def holding(self, names: Iterable[str]) -> Iterator[None]:
        """Read tensors ``names`` (whole attention layers) of both models once and serve them from memory."""
        names = tuple(names)
        self.parameters.held = self.parameters.transformed(names)
        self.target.held = {name: self.target.read(name) for name in names}
        try:
            yield
        finally:
            self.parameters.held, self.target.held = {}, {}
            release_freed_memory()

    def descent_round(
        self, spec: SymmetrySpec, attention: list[int], feed_forward: list[int], residual_axes: list
    ) -> bool:
        """A round of :meth:`WeightDescent.descent_round` reading each tensor of both models once, an FFN's twice.

        The FFN, task-head, token and head steps each depend on the residual permutation only (each
        moves tensors no other of them reads), so their order does not change what they find. Each
        block's FFN step reads its tensors one pair at a time into the units' correlation
        (:meth:`unit_correlation`); then the block's tensors are read again through the permutation
        found and held for its head step and its share of the residual correlation, formed from the
        same tensors, moved by them. Holding an 8B FFN of both models (704 MB) beside its correlation
        (822 MB) was most of the peak; reading it twice costs a few percent of a round. The residual
        correlation adds up the same products as in memory, grouped by step (float64 sums in another
        order: equal up to rounding, the permutation found alike).
        """
        changed = False
        for index in range(len(spec.task_heads)):
            changed |= self.permute_task_head(index)
        if spec.tokens is not None:
            changed |= self.permute_tokens()
        steps = []  # (block index, its FFN step, its head step, the tensors they hold)
        for index, block in enumerate(spec.blocks):
            units = (
                tuple(dict.fromkeys(name for name, _ in block.feed_forward.hidden.axes))
                if index in feed_forward
                else ()
            )
            heads = block.attention.parameters if index in attention else ()
            if set(units) & set(heads):  # a tensor both steps move: one read serves both
                steps.append((index, True, True, tuple(dict.fromkeys(units + heads))))
                continue
            steps += [(index, True, False, units)] if units else []
            steps += [(index, False, True, heads)] if heads else []
        held = {name for *_, names in steps for name in names}
        residual = None
        if spec.residual is not None:
            rest = tuple((name, axis) for name, axis in residual_axes if name not in held)
            residual = self.residual_correlation(rest)
        for index, moves_units, moves_heads, names in steps:
            if moves_units:
                changed |= self.permute_feed_forward(index)
            if not moves_heads and residual is None:
                continue
            with self.holding(names):
                if moves_heads:
                    changed |= self.permute_heads(index)
                if residual is not None:
                    axes = tuple((name, axis) for name, axis in residual_axes if name in names)
                    residual += self.residual_correlation(axes)
        if residual is not None:
            changed |= self.permute_residual(residual)
        return changed


def _on_cpu(transform: ModelTransform) -> ModelTransform:
    """``transform`` with every tensor on the CPU (Stage 2 leaves its matrices where the weights were)."""
    return ModelTransform(
        attention={
            i: AttentionTransform(*(t.cpu() for t in (e.query_permutation, e.kv_permutation, e.qk, e.vo)))
            for i, e in transform.attention.items()
        },
        feed_forward={i: perm.cpu() for i, perm in transform.feed_forward.items()},
        task_heads={i: perm.cpu() for i, perm in transform.task_heads.items()},
        residual=None if transform.residual is None else transform.residual.cpu(),
        tokens=None if transform.tokens is None else transform.tokens.cpu(),
    )


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
        error = probe.error(reference, aligned, self.report.transform.residual)
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
        found = probe.error(reference, {name: written[name] for name in names}, report.transform.residual)
        check_probe(found, report.check_rtol, written[names[0]].dtype, report.options.check_rtol is None,
                    f"layer {layer.name} as written to {written.folder}")  # fmt: skip
        error = max(error, found)
    return error


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
    device: str | torch.device = "cpu",
) -> AlignmentReport:
    """Align the model saved in ``source_dir`` to the one in ``target_dir``, streaming both.

    Writes ``output_dir/aligned`` (a folder computing the source's function, sharded like the
    source), ``output_dir/merged_<a>`` for each alpha ``a`` (``(1 - a) * target + a * aligned``)
    and ``output_dir/report.json`` (:func:`~lmc.formats.external.alignment_document`: the alignment
    report, the per-layer probe check and that of the written layers read back). Half-precision
    weights are aligned in float32 (the per-head problems in float64) and written back in their
    stored dtype.

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
        device: Where the solves run: each tensor read is moved there, so the Grams, correlations
            and transforms of the search are computed there (``"cuda"``: a GPU); the assignments
            run on the CPU, and the output is transformed and written from the CPU.

    Returns:
        The report, as :func:`lmc.matching.align`'s; ``probe_relative_error`` is the largest over
        the aligned attention layers.

    Raises:
        CheckpointError: A folder is not a safetensors Hugging Face or timm folder, or a shard is corrupted.
        AlignmentError: As :func:`lmc.matching.align`.
        ValueError: A bad scope, alpha or output folder.
    """
    options = checked_options(options)
    device = checked_device(device)
    if options.data_aware:
        raise ValueError(
            f"data-aware settings ({options.data_settings}) need calibration batches, which a streamed alignment "
            "of two folders does not read: use the weight settings (the defaults)"
        )
    check_scope(scope)
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
    require_same_architecture(
        ExternalModel(source.folder, source_checkpoint.format, model),
        ExternalModel(target.folder, target_checkpoint.format, target_model),
    )
    saved_names = adapter_for(model).saved_names(model)  # GPT-NeoX's lm_head is embed_out in its files
    source, target = source.renamed(saved_names), target.renamed(saved_names)
    tied, ties = _tie_as_loaded((model, target_model), (source, target))
    dtype = _check_inputs(source, target, model)
    spec = model_spec(model)
    check_same_attention(spec, model_spec(target_model))
    report = AlignmentReport.start(scope, options, dtype)
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
    with atomic_output_folder(output, inputs=[source.folder, target.folder]) as temporary:
        folders = {None: temporary / "aligned", **{a: temporary / f"merged_{a:g}" for a in alphas}}
        first = len(report.layers)
        kept = {name: tied[name] for name, tie in ties.items() if tie}
        squared = _write(source, target, folders, blocks, parameters, scoped, scope, kept)
        # The write pass aligned layers in the order the files hold them: report them by layer, as in memory.
        order = {spec.blocks[index].attention.name: index for index in deferred}
        report.layers[first:] = sorted(report.layers[first:], key=lambda record: order[record.name])
        for folder in folders.values():
            _copy_other_files(source.folder, folder)
        report.distance = {key: value**0.5 for key, value in squared.items()}
        written = SafetensorsCheckpoint(folders[None], [folders[None] / shard for shard in source.shards])
        written = written.renamed(saved_names)
        if loaded_ties(written, tied) != ties:  # from_pretrained would load another model than the one aligned
            raise AlignmentError(f"{folders[None]} ties {sorted(tied)} otherwise than the source; this is a bug in lmc")
        written_error = _written_error(written, spec, report, blocks.references)
        report.seconds = time.perf_counter() - started
        named = {"aligned": output / "aligned", **{f"merged_{a:g}": output / f"merged_{a:g}" for a in alphas}}
        document = alignment_document(
            source.folder, target.folder, source_checkpoint.format, report, written_error, named
        )
        atomic_write_json(temporary / "report.json", document)
    return report
