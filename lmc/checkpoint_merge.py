"""``lmc merge``: k checkpoints brought into one frame and their weighted average (docs/checkpoints.md, "Merging k
checkpoints"; the scheme: docs/alignment.md, "Many models at once").

:func:`merge_checkpoints` reads k lmc, Hugging Face or timm checkpoints of one model, aligns them into one frame
(:func:`lmc.matching.align_many`: each keeps its own function), and writes each aligned model, their weighted
average and a ``report.json`` in the inputs' own format, all or nothing (:func:`lmc.io.atomic_outputs`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmc.formats import Checkpoint, detect, load_external, require_same_architecture
from lmc.formats.external import Format, external_pair
from lmc.io import atomic_outputs, atomic_write_json, check_outputs
from lmc.matching import PROBE_RTOL, AlignmentError, AlignOptions, ManyAlignment, align_many
from lmc.matching.checks import probe_error, refuse_data_aware_external
from lmc.matching.options import checked_options
from lmc.symmetry import Scope, compute_dtype


@dataclass(frozen=True)
class MergeOptions:
    """How :func:`merge_checkpoints` reads the checkpoints and averages them.

    Attributes:
        weights: One non-negative weight per checkpoint, normalized to sum to one; ``None``: the uniform average.
        max_rounds: Most rounds of :func:`~lmc.matching.align_many` after aligning every model to the first.
        overwrite: Replace outputs that already exist (only once every new output is complete).
        timm_model: The timm model name of state-dict files (``timm.list_models()``).
        timm_args: ``timm.create_model`` arguments of state-dict files, e.g. ``{"num_classes": 10}``.
    """

    weights: Sequence[float] | None = None
    max_rounds: int = 10
    overwrite: bool = False
    timm_model: str | None = None
    timm_args: dict[str, Any] | None = None


@dataclass(frozen=True)
class MergeOutputs:
    """What :func:`merge_checkpoints` wrote.

    Attributes:
        inputs: The checkpoints, in order.
        format: Their format; the outputs are in it.
        aligned: Each checkpoint's aligned model (same function, in the common frame), in order.
        merged: The weighted average of the aligned models.
        report_file: The ``report.json`` written.
        weights: The weights used (normalized).
        result: What the alignment into one frame did.
    """

    inputs: list[Path]
    format: Format
    aligned: list[Path]
    merged: Path
    report_file: Path
    weights: list[float]
    result: ManyAlignment


def checked_weights(weights: Sequence[float] | None, count: int) -> list[float]:
    """``weights`` normalized to sum to one (uniform for ``None``); refused unless one finite, non-negative weight
    per checkpoint with a positive sum."""
    if weights is None:
        return [1.0 / count] * count
    weights = [float(weight) for weight in weights]
    if len(weights) != count:
        raise ValueError(f"--weights gives {len(weights)} weights for {count} checkpoints: give one per checkpoint")
    if not all(math.isfinite(weight) and weight >= 0 for weight in weights) or sum(weights) <= 0:
        raise ValueError(f"--weights must be finite, non-negative and not all zero, got {weights}")
    return [weight / sum(weights) for weight in weights]


def merge_checkpoints(
    checkpoints: Sequence[str | Path],
    output: str | Path,
    scope: Scope | None = None,
    options: AlignOptions | None = None,
    merge_options: MergeOptions = MergeOptions(),
) -> MergeOutputs:
    """Align CHECKPOINTS into one frame and write each aligned model, their weighted average and the report.

    Writes ``OUTPUT/aligned_<i>`` (checkpoint ``i``'s function, moved by its own group element into the frame of
    the others), ``OUTPUT/merged`` (``sum_i w_i aligned_i``) and ``OUTPUT/report.json``, in the inputs' format:
    lmc checkpoints (``.ckpt``), ``save_pretrained`` folders or timm folders (each loadable by its class's own
    loader; the aligned ones read back and probed). Every output is built before any is moved into place.

    Args:
        checkpoints: Two or more checkpoints of one model and format.
        output: Folder for the outputs (created; no output may replace or lie inside an input).
        scope: The group acting; default: the re-initialization lmc checkpoints were fine-tuned with, ``full_model``
            for the other formats.
        options: Alignment settings (weight-only; default: :class:`~lmc.matching.AlignOptions`'s defaults).
        merge_options: Weights, rounds, overwriting and timm state-dict files.

    Raises:
        ValueError: Fewer than two checkpoints, bad weights, data-aware settings or a bad output (one line), before
            any work.
        CheckpointError: A missing checkpoint, or checkpoints of different formats or models (naming the one).
        AlignmentError: A checkpoint that cannot join the first (naming its position), or a failed probe.
    """
    options, settings, output = checked_options(options), merge_options, Path(output)
    if len(checkpoints) < 2:
        raise ValueError(f"lmc merge needs at least two checkpoints, got {len(checkpoints)}")
    weights = checked_weights(settings.weights, len(checkpoints))
    detected = [detect(Path(path), settings.timm_model, settings.timm_args) for path in checkpoints]
    external = all([external_pair(detected[0], other) for other in detected[1:]])
    if external:
        refuse_data_aware_external(options)
    suffix = "" if external else ".ckpt"
    aligned_paths = [output / f"aligned_{i}{suffix}" for i in range(len(detected))]
    merged_path = output / f"merged{suffix}"
    inputs = [checkpoint.path for checkpoint in detected]
    check_outputs([*aligned_paths, merged_path, output / "report.json"], inputs, settings.overwrite)
    models, write, scope = _loaded(detected, scope, options)
    aligned, result = align_many(models, scope, options, settings.max_rounds)
    merged = _weighted_average(aligned, weights)
    with atomic_outputs(output, inputs, stale="aligned_*") as folder:
        for index, model in enumerate(aligned):
            write(model, folder / aligned_paths[index].name, models[index])
        write(merged, folder / merged_path.name, None)
        document = {
            "inputs": [str(path) for path in inputs],
            "format": detected[0].format,
            "scope": scope,
            "weights": weights,
            "rounds": result.rounds,
            "converged": result.converged,
            "changed": result.changed,
            "seconds": result.seconds,
            "outputs": {"aligned": [str(path) for path in aligned_paths], "merged": str(merged_path)},
            "alignments": [None if report is None else report.to_dict() for report in result.reports],
        }
        atomic_write_json(folder / "report.json", document)
    report_file = output / "report.json"
    return MergeOutputs(inputs, detected[0].format, aligned_paths, merged_path, report_file, weights, result)


def _loaded(detected: list[Checkpoint], scope: Scope | None, options: AlignOptions):
    """The models, a writer ``(model, path, source)`` in their format (``source``: the model whose function a
    written aligned model must keep, read back and probed), and the scope."""
    if detected[0].format == "lmc":
        from lmc.training.module import load_trained, require_same_model, save_trained, trained_scope

        loaded = [load_trained(checkpoint.path) for checkpoint in detected]
        require_same_model({checkpoint.path: settings for checkpoint, (_, settings) in zip(detected, loaded)})
        hyperparameters = loaded[0][1]

        def write_trained(model: nn.Module, path: Path, source: nn.Module | None) -> None:
            save_trained(model.state_dict(), hyperparameters, path)

        return [module.model for module, _ in loaded], write_trained, scope or trained_scope(hyperparameters)
    externals = [load_external(checkpoint) for checkpoint in detected]
    for other in externals[1:]:
        require_same_architecture(externals[0], other)  # names both folders

    def write_external(model: nn.Module, path: Path, source: nn.Module | None) -> None:
        path.mkdir()
        externals[0].write(model, path)
        if source is None:
            return
        written = externals[0].reload(path)
        error = probe_error(source, written, options.probe_batch_size, options.seed)
        rtol = PROBE_RTOL[externals[0].dtype] if options.check_rtol is None else options.check_rtol
        if not error <= rtol:
            raise AlignmentError(
                f"{path.name} written and read back changes its model's outputs by {error:.3g} > {rtol:g}: a bug in "
                f"lmc's {externals[0].format} writer; please report it"
            )

    return [external.model for external in externals], write_external, scope or "full_model"


@torch.no_grad()
def _weighted_average(models: Sequence[nn.Module], weights: Sequence[float]) -> nn.Module:
    """A copy of ``models[0]`` whose parameters are ``sum_i w_i`` those of ``models[i]`` (in the compute dtype)."""
    merged = copy.deepcopy(models[0])
    others = [dict(model.named_parameters()) for model in models]
    for name, parameter in merged.named_parameters():
        compute = compute_dtype(parameter.dtype)
        total = sum(weight * named[name].to(compute) for weight, named in zip(weights, others))
        parameter.copy_(total.to(parameter.dtype))
    return merged
