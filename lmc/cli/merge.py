"""``lmc merge``: align k checkpoints into one frame; write each aligned model, their weighted average and the report.

A thin layer over :func:`lmc.checkpoint_merge.merge_checkpoints`: it reads the flags and prints what was written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmc.cli.inputs import required
from lmc.matching import AlignOptions
from lmc.symmetry import Scope


def merge(
    checkpoints: list[Path],
    output: Path | None = None,
    weights: list[float] | None = None,
    scope: Scope | None = None,
    max_rounds: int = 10,
    overwrite: bool = False,
    timm_model: str | None = None,
    timm_args: dict[str, Any] | None = None,
    options: AlignOptions = AlignOptions(),
) -> None:
    """Align CHECKPOINTS (two or more) into one frame and write their weighted average into OUTPUT.

    Writes OUTPUT/aligned_<i> (checkpoint i's function, moved into the common frame by its own group element),
    OUTPUT/merged (the weighted average of the aligned models) and OUTPUT/report.json, in the inputs' own format:
    lmc checkpoints (.ckpt), save_pretrained folders, or timm folders. Each model is aligned to the mean of the
    others, round after round, until no permutation changes (docs/alignment.md, "Many models at once").

    Args:
        checkpoints: The checkpoints, two or more, of one model and format: lmc checkpoints, Hugging Face model
            directories, timm folders, or timm state-dict files with --timm_model.
        output: Folder for the outputs (required; created; never one of the inputs).
        weights: One non-negative weight per checkpoint ('[1, 1, 2]'), normalized to sum to one; default: equal.
        scope: Symmetries to align; default: the re-initialization lmc checkpoints were fine-tuned with,
            full_model for other formats.
        max_rounds: Most rounds of aligning each model to the mean of the others.
        overwrite: Replace outputs that already exist.
        timm_model: The timm model name of state-dict files (timm.list_models()).
        timm_args: timm.create_model arguments of state-dict files, e.g. '{num_classes: 10}'.
        options: Alignment settings (weight settings only).
    """
    from lmc.checkpoint_merge import MergeOptions, merge_checkpoints

    output = required(output, "--output DIR")
    settings = MergeOptions(weights, max_rounds, overwrite, timm_model, timm_args)
    written = merge_checkpoints(checkpoints, output, scope, options, settings)
    result = written.result
    state = "converged" if result.converged else "stopped at --max_rounds"
    print(f"aligned {len(written.inputs)} checkpoints into one frame ({result.rounds} rounds, {state})")
    for source, aligned in zip(written.inputs, written.aligned):
        print(f"  {source} -> {aligned}")
    shown = ", ".join(f"{weight:.3g}" for weight in written.weights)
    print(f"merged with weights [{shown}]: wrote {written.merged}")
