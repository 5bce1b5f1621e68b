"""Align checkpoints larger than memory, one layer at a time: two folders of safetensors in, one out.

:func:`~lmc.matching.streamed_write.write_streamed` reads two Hugging Face ``save_pretrained``
folders (``model.safetensors`` or sharded ``model-0000x-of-0000y.safetensors`` with their index) or
timm folders (``model.safetensors`` beside timm's ``config.json``) as lazy mappings
(:class:`~lmc.formats.safetensors.SafetensorsCheckpoint`) and writes the aligned model, and any
merges, shard by shard. It runs the in-memory matcher's own per-layer solves
(:func:`~lmc.matching.layers.align_attention_layer`, :func:`~lmc.matching.layers.align_feed_forward_layer`),
checks (:mod:`lmc.matching.checks`) and merge (:func:`~lmc.matching.merge.interpolate`);
the layout comes from the model's adapter, the model built with its parameters on the ``meta``
device (:func:`~lmc.formats.streamed.skeleton`).

Peak memory stays near one layer pair plus one chunk of a tensor being copied, or at ``full_model`` the
largest FFN's correlation (float32 for bf16 or float32 weights) and one tensor pair: a tensor whose
rows no symmetry moves, such as an embedding or an LM head, is read, moved, correlated and measured a
block of rows at a time (:func:`~lmc.matching.permutation.row_blocks`), never whole. Each output
shard is written through a stream (its header is the source shard's: aligning changes no name,
shape or dtype). The output folder is written under a temporary name and renamed into place when
complete (:func:`~lmc.io.atomic_output_folder`): never half-written, never over an input.

Every scope streams, ``full_model`` too: the solves are the in-memory ones
(:func:`~lmc.matching.descent.weight_alignment`, the coordinate descent over FFN, task-head, token,
head and residual permutations for ``full_model``), run on a view that reads each source tensor
through the group element found so far, so no model is ever held whole: a round of the descent
reads each tensor of both models once, block by block (an FFN's twice: once into its units' correlation,
once moved by their permutation), and forms the block's Grams and share of the ``d x d`` residual
correlation from that read (:meth:`_StreamedDescent.descent_round`).
In the other scopes no permutation crosses layers, so each attention layer is aligned when the
write pass first reaches it (:class:`~lmc.matching.streamed_write._AlignedTensors`), from the read
that writes it: the alignment reads each tensor of both models once. Every transform is applied to
a tensor read as stored, so
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
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch

from lmc.matching import AlignmentReport
from lmc.matching.checks import check_finite
from lmc.matching.descent import WeightDescent
from lmc.matching.permutation import block_rows, blocks_of
from lmc.symmetry import AttentionTransform, AxisPermutation, ModelTransform, SymmetrySpec

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
    to 1.05 GB, the peak unchanged; ``benchmarks/speed/results/streamed_align.md``).
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


def _permutations(spec: SymmetrySpec, transform: ModelTransform | None = None) -> list[AxisPermutation]:
    """The axis permutations of ``spec`` (FFN units, task heads, the residual stream, the tokens), or of those
    ``transform`` moves."""
    if transform is None:
        hidden = [block.feed_forward.hidden for block in spec.blocks if block.feed_forward]
        return hidden + list(spec.task_heads) + [p for p in (spec.residual, spec.tokens) if p is not None]
    scaled = transform.feed_forward.keys() | transform.feed_forward_scales.keys()
    permutations = [spec.blocks[i].feed_forward.hidden for i in sorted(scaled)]
    permutations += [spec.task_heads[i] for i in transform.task_heads.keys() | transform.task_head_signs.keys()]
    moves_residual = (transform.residual, transform.residual_signs, transform.residual_rotation)
    permutations += [spec.residual] if any(part is not None for part in moves_residual) else []
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
        residual_signs=None if transform.residual_signs is None else transform.residual_signs.cpu(),
        task_head_signs={i: signs.cpu() for i, signs in transform.task_head_signs.items()},
        residual_rotation=None if transform.residual_rotation is None else transform.residual_rotation.cpu(),
        feed_forward_scales={i: scales.cpu() for i, scales in transform.feed_forward_scales.items()},
    )
