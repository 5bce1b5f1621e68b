"""``lmc align``: align one checkpoint to another; write the aligned model, its merges and the report.

A thin layer over :func:`lmc.checkpoint_alignment.align_checkpoints`: it reads the flags and prints what was written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmc.cli.inputs import DataSource, data_module, required
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
    from lmc.checkpoint_alignment import CheckpointOptions, align_checkpoints

    output = required(output, "--output DIR")
    alphas = [merge_alpha] if isinstance(merge_alpha, (int, float)) else merge_alpha or []
    # --data is read after parsing (a DataModule imports Lightning), and only where data-aware settings read it.
    calibration_data = data_module(data) if data is not None and options.data_aware else None
    settings = CheckpointOptions(
        merge_alphas=alphas,
        overwrite=overwrite,
        timm_model=timm_model,
        timm_args=timm_args,
        data=calibration_data,
        device=device,
    )
    written = align_checkpoints(source, target, output, scope, options, settings)
    report = written.report
    how = f"{report.scope}, {report.options.method}" + (", streamed" if written.streamed else "")
    print(f"aligned {source} to {target} ({how}): wrote {written.aligned}")
    print(f"distance to target over the scope: {report.distance['naive']:.4f} -> {report.distance['aligned']:.4f}")
    for alpha, path in written.merges.items():
        print(f"merged (1 - {alpha:g}) * target + {alpha:g} * aligned source: wrote {path}")
