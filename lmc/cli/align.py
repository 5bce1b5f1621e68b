"""``lmc align``: align one checkpoint to another; write the aligned model, its merges and the report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# A lazy package: formats.Checkpoint, in annotations only, would load torch. No TYPE_CHECKING block: jsonargparse
# runs those of a command's module when it builds the parser, and --help loads no torch.
from lmc import formats
from lmc.cli.inputs import (
    DataSource,
    check_outputs,
    data_module,
    external_pair,
    refuse_data_aware_external,
    remove_other_merges,
    required,
    trained_scope,
)
from lmc.matching import AlignOptions
from lmc.symmetry import Scope


def align(
    source: Path,
    target: Path,
    output: Path | None = None,
    scope: Scope | None = None,
    merge_alpha: float | list[float] | None = None,
    overwrite: bool = False,
    timm_model: str | None = None,
    timm_args: dict[str, Any] | None = None,
    data: DataSource | None = None,
    options: AlignOptions = AlignOptions(),
    device: str = "cpu",
) -> None:
    """Align SOURCE to TARGET and write the aligned (and merged) models into OUTPUT.

    Writes OUTPUT/aligned (computes SOURCE's function, weights close to TARGET's),
    OUTPUT/report.json and, for each merge alpha a, OUTPUT/merged_<a> holding
    (1 - a) * TARGET + a * aligned SOURCE, each in the inputs' own format: lmc checkpoints
    (aligned.ckpt, merged_<a>.ckpt), save_pretrained directories (with the tokenizer files), or
    timm folders (model.safetensors and config.json).

    Args:
        source: Checkpoint to transform: an lmc checkpoint, a Hugging Face model directory, a timm
            folder, or a timm state-dict file with --timm_model.
        target: Checkpoint to align to, of the same model and format.
        output: Folder for the outputs (required; created; never one of the inputs).
        scope: Symmetries to align; default: the re-initialization lmc checkpoints were fine-tuned
            with, full_model for other formats.
        merge_alpha: Also write the merge at this alpha in [0, 1], or at each of a list of them ('[0.25, 0.5]').
        overwrite: Replace outputs that already exist.
        timm_model: The timm model name of state-dict files (timm.list_models()).
        timm_args: timm.create_model arguments of state-dict files, e.g. '{num_classes: 10}'.
        data: The DataModule whose training split calibrates data-aware settings (objective data,
            metric activation or midpoint, unit_matching activation, method learned; required by them only): a
            configs/data/*.yaml file, a class path such as lmc.data.Digits, or
            '{class_path: ..., init_args: {...}}'.
        options: Alignment settings.
        device: Where a streamed alignment (two safetensors folders) computes its Grams, correlations
            and transforms: cpu, or cuda for a GPU (the assignments stay on the CPU).
    """
    from lmc.connectivity import training_calibration
    from lmc.formats import detect
    from lmc.io import atomic_write_json
    from lmc.matching import align as align_models
    from lmc.matching.alignment import target_frame
    from lmc.matching.merge import check_alphas, interpolate
    from lmc.training.module import load_trained, require_same_model, save_trained

    output = required(output, "--output DIR")
    given = [merge_alpha] if isinstance(merge_alpha, (int, float)) else merge_alpha or []
    alphas = check_alphas(given, "--merge_alpha values")
    checkpoints = detect(source, timm_model, timm_args), detect(target, timm_model, timm_args)
    if external_pair(*checkpoints):
        refuse_data_aware_external(options)
        if _streamable(checkpoints, scope):
            _align_streamed(checkpoints, output, scope, alphas, overwrite, options, device)
            return
    if device != "cpu":
        raise ValueError(
            f"--device {device}: only a streamed alignment (two Hugging Face or timm folders of safetensors) runs "
            "on another device; align these checkpoints with --device cpu"
        )
    if external_pair(*checkpoints):
        _align_external(source, target, output, scope, alphas, overwrite, checkpoints, options)
        return
    outputs = [output / "aligned.ckpt", output / "report.json", *(output / f"merged_{a:g}.ckpt" for a in alphas)]
    check_outputs(outputs, inputs=[source, target], overwrite=overwrite)
    source_module, hyperparameters = load_trained(source)
    target_module, target_hyperparameters = load_trained(target)
    require_same_model({source: hyperparameters, target: target_hyperparameters})
    scope = scope or trained_scope(hyperparameters)
    options = options.for_scope(scope)
    calibration = None
    if options.data_aware:
        data = required(data, "--data FILE_OR_CLASS (the training data that calibrates data-aware options)")
        data = data_module(data)
        source_module.require_data(data)
        calibration = training_calibration(data, source_module.model_loss, options.calibration_batches)
    aligned, report = align_models(
        source_module.model, target_module.model, scope=scope, options=options, calibration=calibration
    )
    aligned_weights = aligned.state_dict()
    save_trained(aligned_weights, hyperparameters, outputs[0])
    atomic_write_json(outputs[1], report.to_dict())
    print(f"aligned {source} to {target} ({scope}, {options.method}): wrote {outputs[0]}")
    print(f"distance to target over the scope: {report.distance['naive']:.4f} -> {report.distance['aligned']:.4f}")
    target_weights = target_frame(target_module.model, report).state_dict()
    for alpha, path in zip(alphas, outputs[2:]):
        merged = {name: interpolate(target_weights[name], value, alpha) for name, value in aligned_weights.items()}
        save_trained(merged, hyperparameters, path)
        print(f"merged (1 - {alpha:g}) * target + {alpha:g} * aligned source: wrote {path}")
    remove_other_merges(output, outputs[2:])


def _streamable(checkpoints: tuple[formats.Checkpoint, formats.Checkpoint], scope: Scope | None) -> bool:
    """Whether ``lmc align`` streams: two folders of safetensors (Hugging Face or timm) at a scope that streams
    (``full_model`` where none is given)."""
    from lmc.formats.streamed import streamable
    from lmc.matching.streamed_write import STREAMED_SCOPES

    return (scope or "full_model") in STREAMED_SCOPES and all(streamable(checkpoint) for checkpoint in checkpoints)


def _align_streamed(
    checkpoints: tuple[formats.Checkpoint, formats.Checkpoint],
    output: Path,
    scope: Scope,
    alphas: list[float],
    overwrite: bool,
    options: AlignOptions,
    device: str,
) -> None:
    """``lmc align`` of two safetensors folders, layer by layer and shard by shard (lmc.matching.streamed)."""
    from lmc.matching.streamed_write import align_directories

    source, target = (checkpoint.path for checkpoint in checkpoints)
    scope = scope or "full_model"
    outputs = [output / "aligned", output / "report.json", *(output / f"merged_{a:g}" for a in alphas)]
    check_outputs(outputs, inputs=[source, target], overwrite=overwrite)
    report = align_directories(*checkpoints, output, scope, options, alphas, overwrite, device)
    print(f"aligned {source} to {target} ({scope}, {options.method}, streamed): wrote {output / 'aligned'}")
    print(f"distance to target over the scope: {report.distance['naive']:.4f} -> {report.distance['aligned']:.4f}")
    for alpha in alphas:
        print(f"merged (1 - {alpha:g}) * target + {alpha:g} * aligned source: wrote {output / f'merged_{alpha:g}'}")


def _align_external(
    source: Path,
    target: Path,
    output: Path,
    scope: Scope | None,
    alphas: list[float],
    overwrite: bool,
    checkpoints: tuple[formats.Checkpoint, formats.Checkpoint],
    options: AlignOptions,
) -> None:
    """``lmc align`` of Hugging Face or timm checkpoints: outputs in the inputs' own format, checked when read back."""
    import copy

    import torch

    from lmc.formats import load_external, require_same_architecture
    from lmc.formats.external import alignment_document
    from lmc.io import atomic_output_folder, atomic_write_json
    from lmc.matching import AlignmentError
    from lmc.matching import align as align_models
    from lmc.matching.alignment import target_frame
    from lmc.matching.checks import probe_error
    from lmc.matching.merge import interpolate

    outputs = [output / "aligned", output / "report.json", *(output / f"merged_{a:g}" for a in alphas)]
    check_outputs(outputs, inputs=[source, target], overwrite=overwrite)
    source_model, target_model = load_external(checkpoints[0]), load_external(checkpoints[1])
    require_same_architecture(source_model, target_model)
    scope = scope or "full_model"
    aligned, report = align_models(source_model.model, target_model.model, scope=scope, options=options)
    with atomic_output_folder(outputs[0], inputs=[source, target]) as folder:
        source_model.write(aligned, folder)
        written = source_model.reload(folder)
        written_error = probe_error(source_model.model, written, options.probe_batch_size, options.seed)
        if not written_error <= report.check_rtol:
            raise AlignmentError(
                f"the aligned model written to {outputs[0]} and read back changes the source's outputs by "
                f"{written_error:.3g} > {report.check_rtol:g} (the {report.dtype} tolerance): a bug in lmc's "
                f"{source_model.format} writer; please report it"
            )
    print(f"aligned {source} to {target} ({scope}, {options.method}): wrote {outputs[0]}")
    print(f"distance to target over the scope: {report.distance['naive']:.4f} -> {report.distance['aligned']:.4f}")
    target_in_frame = target_frame(target_model.model, report)
    target_parameters = dict(target_in_frame.named_parameters())
    for alpha, path in zip(alphas, outputs[2:]):
        merged = copy.deepcopy(target_in_frame)
        merged_parameters = dict(merged.named_parameters())
        with torch.no_grad():
            for name, parameter in aligned.named_parameters():
                merged_parameters[name].copy_(interpolate(target_parameters[name], parameter, alpha))
        with atomic_output_folder(path, inputs=[source, target]) as folder:
            source_model.write(merged, folder)
        del merged
        print(f"merged (1 - {alpha:g}) * target + {alpha:g} * aligned source: wrote {path}")
    named = {"aligned": outputs[0], **{f"merged_{a:g}": p for a, p in zip(alphas, outputs[2:])}}
    document = alignment_document(source, target, source_model.format, report, written_error, named)
    atomic_write_json(outputs[1], document)
    remove_other_merges(output, outputs[2:])
