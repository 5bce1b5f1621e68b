"""Align one checkpoint to another and write the aligned model, its merges and the report: ``lmc align``'s one path.

:func:`align_checkpoints` takes two checkpoints of one supported format (lmc checkpoints, Hugging
Face ``save_pretrained`` folders, timm folders or state-dict files), checks the request once before
any work, aligns them (in memory, or streamed where both are folders of safetensors:
:func:`lmc.matching.streamed_write.write_streamed`) and writes every output through one writer
(:func:`lmc.io.atomic_outputs`), in the inputs' own format: ``aligned`` (``aligned.ckpt`` for lmc
checkpoints), ``report.json`` and ``merged_<a>`` (``merged_<a>.ckpt``) for each merge alpha ``a``.
The module sits above :mod:`lmc.matching`, :mod:`lmc.formats` and :mod:`lmc.training`: it reads all three formats.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lmc.formats import Checkpoint, detect, load_external, require_same_architecture
from lmc.formats.external import Format, alignment_document, external_pair
from lmc.formats.streamed import open_folder, streamable
from lmc.io import atomic_outputs, atomic_write_json, check_outputs
from lmc.matching import AlignmentError, AlignmentReport, AlignOptions, align
from lmc.matching.alignment import target_frame
from lmc.matching.checks import probe_error, refuse_data_aware_external
from lmc.matching.merge import check_alphas, interpolate
from lmc.matching.options import checked_options
from lmc.matching.streamed import checked_device
from lmc.matching.streamed_write import write_streamed
from lmc.symmetry import Scope

if TYPE_CHECKING:
    from lmc.data import LMCDataModule


@dataclass(frozen=True)
class CheckpointOptions:
    """How :func:`align_checkpoints` reads the checkpoints, and what it writes besides the aligned model.

    Attributes:
        merge_alphas: Also write ``(1 - a) * target + a * aligned source`` for each alpha ``a`` in ``[0, 1]``.
        overwrite: Replace outputs that already exist (only once every new output is complete).
        timm_model: The timm model name of state-dict files (``timm.list_models()``).
        timm_args: ``timm.create_model`` arguments of state-dict files, e.g. ``{"num_classes": 10}``.
        data: The :class:`~lmc.data.LMCDataModule` whose training split calibrates data-aware settings
            (lmc checkpoints only; required by those settings alone).
        device: Where a streamed alignment (two folders of safetensors) computes its Grams, correlations
            and transforms: ``"cpu"``, or ``"cuda"`` for a GPU; every other alignment runs on the CPU.
    """

    merge_alphas: Sequence[float] = ()
    overwrite: bool = False
    timm_model: str | None = None
    timm_args: dict[str, Any] | None = None
    data: LMCDataModule | None = None
    device: str = "cpu"


@dataclass(frozen=True)
class AlignmentOutputs:
    """What :func:`align_checkpoints` wrote.

    Attributes:
        source: The checkpoint that was transformed.
        target: The checkpoint it was aligned to.
        format: Their format (``"lmc"``, ``"huggingface"`` or ``"timm"``); the outputs are in it.
        streamed: Whether the pair was aligned streamed (:func:`lmc.matching.streamed_write.write_streamed`).
        aligned: The aligned model's file (lmc) or folder.
        report_file: The ``report.json`` written.
        merges: Each merge alpha and the merge's file or folder.
        report: The alignment report (scope, options, distances, checks).
    """

    source: Path
    target: Path
    format: Format
    streamed: bool
    aligned: Path
    report_file: Path
    merges: dict[float, Path]
    report: AlignmentReport


def align_checkpoints(
    source: str | Path | Checkpoint,
    target: str | Path | Checkpoint,
    output: str | Path,
    scope: Scope | None = None,
    options: AlignOptions | None = None,
    checkpoint_options: CheckpointOptions = CheckpointOptions(),
) -> AlignmentOutputs:
    """Align SOURCE to TARGET and write the aligned (and merged) models and the report into OUTPUT.

    Writes ``OUTPUT/aligned`` (it computes SOURCE's function, with weights close to TARGET's),
    ``OUTPUT/report.json`` and, for each merge alpha ``a``, ``OUTPUT/merged_<a>``, each in the
    inputs' own format: lmc checkpoints (``aligned.ckpt``, ``merged_<a>.ckpt``), ``save_pretrained``
    folders (with the tokenizer files), or timm folders (``model.safetensors`` and ``config.json``).
    Two folders of safetensors are aligned streamed, shard by shard; the others in memory, the
    external formats' aligned model then read back and probed. Every output is built before any
    is moved into place, so a failure leaves OUTPUT as it was; merges of an earlier alignment at
    other alphas are removed.

    Args:
        source: Checkpoint to transform: a path, or a :class:`~lmc.formats.Checkpoint` (:func:`~lmc.formats.detect`).
        target: Checkpoint to align to, of the same model and format.
        output: Folder for the outputs (created; no output may replace or lie inside an input).
        scope: Symmetries to align; default: the re-initialization lmc checkpoints were fine-tuned
            with, ``full_model`` for the other formats.
        options: Alignment settings (default: :class:`~lmc.matching.AlignOptions`'s defaults);
            data-aware ones need ``checkpoint_options.data`` and lmc checkpoints.
        checkpoint_options: Merges, overwriting, timm state-dict files, the calibration data and the device.

    Returns:
        What was written, and the report.

    Raises:
        ValueError: A bad alpha, device, data-aware setting or output (one line naming the fix), before any work.
        CheckpointError: A missing or unreadable checkpoint, or two of different formats or models.
        AlignmentError: As :func:`lmc.matching.align`.
        WriteError: The outputs cannot be written.
    """
    options, settings, output = checked_options(options), checkpoint_options, Path(output)
    alphas = check_alphas(settings.merge_alphas, "merge alphas")
    pair = tuple(_detected(path, settings) for path in (source, target))
    external = external_pair(*pair)
    if external:
        refuse_data_aware_external(options)
    streamed = external and all(streamable(checkpoint) for checkpoint in pair)
    device = _checked_device(settings.device, streamed)
    suffix = "" if external else ".ckpt"
    aligned, merges = output / f"aligned{suffix}", {a: output / f"merged_{a:g}{suffix}" for a in alphas}
    inputs = [checkpoint.path for checkpoint in pair]
    check_outputs([aligned, output / "report.json", *merges.values()], inputs, settings.overwrite)
    with atomic_outputs(output, inputs, stale="merged_*") as folder:
        if not external:
            report = _align_trained(pair, folder, scope, options, settings.data, alphas)
            document = report.to_dict()
        else:
            if streamed:
                report, written_error = write_streamed(pair, folder, scope or "full_model", options, alphas, device)
            else:
                report, written_error = _align_loaded(pair, folder, scope or "full_model", options, alphas, aligned)
            named = {"aligned": aligned, **{f"merged_{a:g}": path for a, path in merges.items()}}
            document = alignment_document(*inputs, pair[0].format, report, written_error, named)
        atomic_write_json(folder / "report.json", document)
    return AlignmentOutputs(*inputs, pair[0].format, streamed, aligned, output / "report.json", merges, report)


def align_directories(
    source_dir: str | Path | Checkpoint,
    target_dir: str | Path | Checkpoint,
    output_dir: str | Path,
    scope: Scope = "first_attention",
    options: AlignOptions | None = None,
    **settings: Any,
) -> AlignmentReport:
    """:func:`align_checkpoints` of two Hugging Face or timm folders of safetensors, aligned streamed.

    Args:
        source_dir: Folder of the model to transform (never modified).
        target_dir: Folder of the model to come close to: same architecture, tensors and dtype.
        output_dir: The output folder.
        scope: Every parameter outside it must be identical in both.
        options: As for :func:`lmc.matching.align`; ``probe_batch_size`` is unused (each layer is
            probed with 16 tokens) and ``seed`` seeds the probe.
        **settings: Fields of :class:`CheckpointOptions`: ``merge_alphas``, ``overwrite``, ``device``.

    Returns:
        The report, as :func:`lmc.matching.align`'s; ``probe_relative_error`` is the largest over
        the aligned attention layers.

    Raises:
        CheckpointError: A path is not such a folder (and as :func:`align_checkpoints`).
    """
    pair = [open_folder(path)[0] for path in (source_dir, target_dir)]
    return align_checkpoints(*pair, output_dir, scope, options, CheckpointOptions(**settings)).report


def _detected(checkpoint: str | Path | Checkpoint, settings: CheckpointOptions) -> Checkpoint:
    if isinstance(checkpoint, Checkpoint):
        return checkpoint
    return detect(checkpoint, settings.timm_model, settings.timm_args)


def _checked_device(device: str, streamed: bool) -> torch.device:
    """``device`` where the alignment streams (refused if PyTorch cannot reach it); else only the CPU."""
    if streamed:
        return checked_device(device)
    if device != "cpu":
        raise ValueError(
            f"--device {device}: only a streamed alignment (two Hugging Face or timm folders of safetensors) runs "
            "on another device; align these checkpoints with --device cpu"
        )
    return torch.device("cpu")


def _merged(target: nn.Module, aligned: nn.Module, alpha: float) -> nn.Module:
    """``(1 - alpha) * target + alpha * aligned``: a copy of ``target`` whose parameters are interpolated
    (:func:`~lmc.matching.merge.interpolate`, the one merge recipe); ``target`` in the aligned model's frame
    (:func:`~lmc.matching.alignment.target_frame`: folded for the extended group)."""
    merged = copy.deepcopy(target)
    aligned_parameters = dict(aligned.named_parameters())
    with torch.no_grad():
        for name, parameter in merged.named_parameters():
            parameter.copy_(interpolate(parameter, aligned_parameters[name], alpha))
    return merged


def _align_trained(
    pair: tuple[Checkpoint, Checkpoint],
    folder: Path,
    scope: Scope | None,
    options: AlignOptions,
    data: LMCDataModule | None,
    alphas: list[float],
) -> AlignmentReport:
    """Align two lmc checkpoints in memory; write ``aligned.ckpt`` and each ``merged_<a>.ckpt`` into ``folder``."""
    from lmc.connectivity import training_calibration
    from lmc.training.module import load_trained, require_same_model, save_trained, trained_scope

    (source_module, hyperparameters), (target_module, target_hyperparameters) = (load_trained(c.path) for c in pair)
    require_same_model({pair[0].path: hyperparameters, pair[1].path: target_hyperparameters})
    scope = scope or trained_scope(hyperparameters)
    options = options.for_scope(scope)
    calibration = None
    if options.data_aware:
        if data is None:
            raise ValueError("--data FILE_OR_CLASS (the training data that calibrates data-aware options) is required")
        source_module.require_data(data)
        calibration = training_calibration(data, source_module.model_loss, options.calibration_batches)
    aligned, report = align(
        source_module.model, target_module.model, scope=scope, options=options, calibration=calibration
    )
    save_trained(aligned.state_dict(), hyperparameters, folder / "aligned.ckpt")
    frame = target_frame(target_module.model, report)
    for alpha in alphas:
        merged = _merged(frame, aligned, alpha)
        save_trained(merged.state_dict(), hyperparameters, folder / f"merged_{alpha:g}.ckpt")
        del merged
    return report


def _align_loaded(
    pair: tuple[Checkpoint, Checkpoint],
    folder: Path,
    scope: Scope,
    options: AlignOptions,
    alphas: list[float],
    destination: Path,
) -> tuple[AlignmentReport, float]:
    """Align two Hugging Face or timm checkpoints in memory; write ``aligned`` (read back and probed: the relative
    change of the source's outputs is returned) and each ``merged_<a>`` into ``folder``, in their format.

    ``destination`` is where the aligned folder goes once every output is written (the error names it).
    """
    source_model, target_model = load_external(pair[0]), load_external(pair[1])
    require_same_architecture(source_model, target_model)
    aligned, report = align(source_model.model, target_model.model, scope=scope, options=options)
    (folder / "aligned").mkdir()
    source_model.write(aligned, folder / "aligned")
    written = source_model.reload(folder / "aligned")
    written_error = probe_error(source_model.model, written, options.probe_batch_size, options.seed)
    if not written_error <= report.check_rtol:
        raise AlignmentError(
            f"the aligned model written to {destination} and read back changes the source's outputs by "
            f"{written_error:.3g} > {report.check_rtol:g} (the {report.dtype} tolerance): a bug in lmc's "
            f"{source_model.format} writer; please report it"
        )
    frame = target_frame(target_model.model, report)
    for alpha in alphas:
        merged = _merged(frame, aligned, alpha)
        (folder / f"merged_{alpha:g}").mkdir()
        source_model.write(merged, folder / f"merged_{alpha:g}")
        del merged
    return report, written_error
