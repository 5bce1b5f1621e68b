"""Detect a checkpoint's format, load it as a model, write models back in the same format.

Three formats: ``lmc`` (a checkpoint written by ``lmc fit`` / ``lmc run`` / ``lmc align``),
``huggingface`` (a ``save_pretrained`` directory) and ``timm`` (timm's export folder, or a
state-dict file with ``--timm_model NAME``). The architecture always comes from the checkpoint's
own config; lmc checkpoints are read by :mod:`lmc.training`, the other two here.
"""

from __future__ import annotations

from dataclasses import dataclass
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


def detect_format(path: str | Path, timm_model: str | None = None) -> Format:
    """The format of ``path``: a HF model directory, a timm folder or state dict, or an lmc checkpoint file.

    Raises:
        CheckpointError: ``path`` does not exist, or is a folder of neither format.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if timm_model is not None:
        return "timm"
    if path.is_dir():
        if timm_files.is_timm_directory(path):
            return "timm"
        if huggingface.is_model_directory(path):
            return "huggingface"
        raise CheckpointError(
            f"{path} is a folder but neither a Hugging Face model directory (config.json with architectures, "
            "written by save_pretrained) nor a timm folder (config.json with architecture): give one of those, "
            "an lmc checkpoint file, or a timm state-dict file with --timm_model NAME"
        )
    return "lmc"


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


def load_external(
    path: str | Path, timm_model: str | None = None, timm_args: dict[str, Any] | None = None
) -> ExternalModel:
    """Read a Hugging Face model directory or a timm checkpoint (see :func:`detect_format`).

    Raises:
        CheckpointError: Not one of these formats, or unreadable weights.
        UnsupportedModelError: lmc has no adapter for the checkpoint's architecture.
    """
    path = Path(path)
    kind = detect_format(path, timm_model)
    if kind == "huggingface":
        return ExternalModel(path, kind, huggingface.load_model(path))
    if kind == "timm":
        return ExternalModel(path, kind, timm_files.load_model(path, timm_model, timm_args))
    raise CheckpointError(f"{path} is an lmc checkpoint, not a Hugging Face or timm one")


def require_same_architecture(source: ExternalModel, target: ExternalModel) -> None:
    """Refuse a pair of different formats, architectures, configs or dtypes, naming the first differing field."""
    if source.format != target.format:
        raise CheckpointError(
            f"{source.path} is {FORMAT_NAMES[source.format]} but {target.path} is {FORMAT_NAMES[target.format]}: "
            "give two checkpoints of the same model"
        )
    mine, theirs = source.architecture(), target.architecture()
    for field in sorted(mine.keys() | theirs.keys()):
        if mine.get(field) != theirs.get(field):
            raise CheckpointError(
                f"the checkpoints are of different models: {field} is {mine.get(field)!r} in {source.path} but "
                f"{theirs.get(field)!r} in {target.path}; give two checkpoints of the same architecture and config"
            )
