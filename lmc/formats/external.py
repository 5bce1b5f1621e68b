"""Detect a checkpoint's format, load it as a model, write models back in the same format.

Three formats: ``lmc`` (a checkpoint written by ``lmc fit`` / ``lmc run`` / ``lmc align``),
``huggingface`` (a ``save_pretrained`` directory) and ``timm`` (timm's export folder, or a
state-dict file with ``--timm_model NAME``). The architecture always comes from the checkpoint's
own config; lmc checkpoints are read by :mod:`lmc.training`, the other two here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from lmc.checkpoints import CheckpointError
from lmc.formats import huggingface, timm_files

Format = Literal["lmc", "huggingface", "timm"]
FORMAT_NAMES = {
    "lmc": "an lmc checkpoint",
    "huggingface": "a Hugging Face model directory",
    "timm": "a timm checkpoint",
}


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint as detected once: where it is, its format and what it says about its model.

    Built by :func:`detect`; every later step (:func:`load_external`, the commands' checks) reads
    this value instead of the files again.

    Attributes:
        path: The checkpoint file or folder.
        format: ``"lmc"``, ``"huggingface"`` or ``"timm"``.
        config: The parsed ``config.json`` of a Hugging Face or timm folder; empty for a timm
            state-dict file (its model is ``timm_model``) and for an lmc checkpoint (whose
            hyper-parameters :func:`lmc.training.module.load_trained` reads with its weights).
        timm_model: The timm model name of a timm state-dict file (``timm.list_models()``).
        timm_args: ``timm.create_model`` arguments of a timm state-dict file.
    """

    path: Path
    format: Format
    config: dict[str, Any] = field(default_factory=dict)
    timm_model: str | None = None
    timm_args: dict[str, Any] | None = None


def detect(path: str | Path, timm_model: str | None = None, timm_args: dict[str, Any] | None = None) -> Checkpoint:
    """The checkpoint at ``path``: a HF model directory, a timm folder or state dict, or an lmc checkpoint file.

    A folder's ``config.json`` is parsed here, once (timm's names an ``architecture``, a
    transformers one a ``model_type`` or ``architectures``); any other file is an lmc checkpoint.

    Args:
        path: The checkpoint file or folder.
        timm_model: The timm model of a state-dict file (the file is then a timm checkpoint).
        timm_args: ``timm.create_model`` arguments of that state-dict file.

    Raises:
        CheckpointError: ``path`` does not exist, or is a folder of neither format.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if timm_model is not None:
        return Checkpoint(path, "timm", timm_model=timm_model, timm_args=timm_args)
    if not path.is_dir():
        return Checkpoint(path, "lmc")
    try:
        config = huggingface.read_config(path)
    except CheckpointError:  # no readable config.json: neither format
        config = {}
    if timm_files.is_timm_config(config):
        return Checkpoint(path, "timm", config, timm_args=timm_args)
    if huggingface.is_model_config(config):
        return Checkpoint(path, "huggingface", config)
    raise CheckpointError(
        f"{path} is a folder but neither a Hugging Face model directory (config.json with architectures, "
        "written by save_pretrained) nor a timm folder (config.json with architecture): give one of those, "
        "an lmc checkpoint file, or a timm state-dict file with --timm_model NAME"
    )


@dataclass
class ExternalModel:
    """A model read from a Hugging Face directory or a timm checkpoint, and how to write others like it.

    Attributes:
        path: What was read.
        format: ``"huggingface"`` or ``"timm"``.
        model: The model, in its stored dtype and evaluation mode.
    """

    path: Path
    format: Format
    model: nn.Module

    @property
    def dtype(self) -> torch.dtype:
        """The stored dtype of the weights (written models keep it)."""
        return next(self.model.parameters()).dtype

    def architecture(self) -> dict[str, Any]:
        """The config fields that fix the model's function and shapes."""
        if self.format == "huggingface":
            return huggingface.architecture_config(self.model)
        return timm_files.architecture_config(self.model)

    def write(self, model: nn.Module, folder: str | Path) -> None:
        """Write ``model`` (of this architecture) into the existing empty ``folder``, in this format.

        HF models: ``save_pretrained`` (sharded like the input) and the input's tokenizer files; timm
        models: ``model.safetensors`` and timm's ``config.json``. Use
        :func:`~lmc.formats.atomic_output_folder` so that no half-written folder is ever seen.
        """
        if self.format == "huggingface":
            huggingface.save_model(model, folder, like=self.path)
        else:
            timm_files.save_model(model, folder)

    def reload(self, folder: str | Path) -> nn.Module:
        """A model written by :meth:`write`, read back with the format's own loader."""
        if self.format == "huggingface":
            return huggingface.load_model(folder)
        return timm_files.load_model(folder)


def load_external(checkpoint: Checkpoint | str | Path) -> ExternalModel:
    """The model of a Hugging Face model directory or a timm checkpoint (a path is :func:`detect`-ed first).

    Raises:
        CheckpointError: Not one of these formats, or unreadable weights.
        UnsupportedModelError: lmc has no adapter for the checkpoint's architecture.
    """
    if not isinstance(checkpoint, Checkpoint):
        checkpoint = detect(checkpoint)
    path = checkpoint.path
    if checkpoint.format == "huggingface":
        return ExternalModel(path, checkpoint.format, huggingface.load_model(path, checkpoint.config))
    if checkpoint.format == "timm":
        model = timm_files.load_model(path, checkpoint.timm_model, checkpoint.timm_args)
        return ExternalModel(path, checkpoint.format, model)
    raise CheckpointError(f"{path} is an lmc checkpoint, not a Hugging Face or timm one")


def require_same_architecture(source: ExternalModel, target: ExternalModel) -> None:
    """Refuse a pair of different formats, architectures, configs or dtypes, naming the first differing field."""
    if source.format != target.format:
        raise CheckpointError(
            f"{source.path} is {FORMAT_NAMES[source.format]} but {target.path} is {FORMAT_NAMES[target.format]}: "
            "give two checkpoints of the same model"
        )
    if type(source.model) is not type(target.model):
        raise CheckpointError(
            f"the checkpoints are of different architectures: {source.path} holds a {type(source.model).__name__}, "
            f"{target.path} a {type(target.model).__name__}; give two checkpoints of the same architecture"
        )
    mine, theirs = source.architecture(), target.architecture()
    for name in sorted(mine.keys() | theirs.keys()):
        if mine.get(name) != theirs.get(name):
            raise CheckpointError(
                f"the checkpoints are of different models: {name} is {mine.get(name)!r} in {source.path} but "
                f"{theirs.get(name)!r} in {target.path}; give two checkpoints of the same architecture and config"
            )


def external_pair(a: Checkpoint, b: Checkpoint) -> bool:
    """Whether A and B are Hugging Face or timm checkpoints (``False``: lmc checkpoints); mixed formats are refused."""
    if (a.format == "lmc") != (b.format == "lmc"):
        raise CheckpointError(
            f"{a.path} is {FORMAT_NAMES[a.format]} but {b.path} is {FORMAT_NAMES[b.format]}: give two checkpoints "
            "of one format"
        )
    return a.format != "lmc"


def alignment_document(
    source: Path, target: Path, format: str, report, written_error: float, outputs: dict[str, Path]
) -> dict[str, Any]:
    """The ``report.json`` of ``lmc align`` on external checkpoints, in memory or streamed alike.

    Args:
        source, target: The input checkpoints.
        format: Their format (``Checkpoint.format``).
        report: The :class:`~lmc.matching.AlignmentReport`.
        written_error: The relative output change of the aligned model as written and read back.
        outputs: Output name (``aligned``, ``merged_<a>``) -> its path.
    """
    checks = {
        "aligned_model": {"relative_output_change": report.probe_relative_error, "rtol": report.check_rtol},
        "written_and_read_back": {"relative_output_change": written_error, "rtol": report.check_rtol},
    }
    return {
        "source": str(source),
        "target": str(target),
        "format": format,
        "stored_dtype": report.dtype,
        "compute_dtype": report.compute_dtype,
        "per_head_problem_dtype": "float64",
        "checks": checks,
        "outputs": {name: str(path) for name, path in outputs.items()},
        "alignment": report.to_dict(),
    }
