"""timm checkpoints: a folder in timm's own export layout, or a model name plus a state-dict file.

timm's layout (``timm.models.save_for_hf``) is ``config.json`` (``architecture``,
``num_classes``, ``model_args``, ``pretrained_cfg``) beside ``model.safetensors``; it loads back
with ``timm.create_model("local-dir:FOLDER", pretrained=True)``. lmc writes every timm model in
that layout, whatever form it was read from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from lmc.adapters import adapter_for
from lmc.checkpoints import CheckpointError, load_weights, read_checkpoint
from lmc.formats.huggingface import file_dtype

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "open_clip_pytorch_model.bin")


def is_timm_config(config: dict[str, Any]) -> bool:
    """Whether a parsed ``config.json`` is timm's (it names an ``architecture``)."""
    return isinstance(config.get("architecture"), str)


def weight_file(folder: str | Path) -> Path:
    """The weights of a timm folder (``model.safetensors`` first)."""
    for name in WEIGHT_FILES:
        if (Path(folder) / name).is_file():
            return Path(folder) / name
    raise CheckpointError(f"{folder} has no timm weights ({' or '.join(WEIGHT_FILES)})")


def create_model(name: str, arguments: dict[str, Any], where: str | Path) -> nn.Module:
    """``timm.create_model(name, **arguments)`` without weights, refused unless lmc has its adapter.

    ``where`` names the input in errors.
    """
    import timm

    try:
        model = timm.create_model(name, pretrained=False, **arguments)
    except RuntimeError as error:  # timm: "Unknown model (...)"
        raise CheckpointError(f"{where}: {error}; check the timm model name") from error
    adapter_for(model)  # an unsupported architecture gets its own clear error before any weight is read
    return model


def load_model(path: str | Path, model_name: str | None = None, model_args: dict[str, Any] | None = None) -> nn.Module:
    """A timm model with its checkpoint's weights, in their stored dtype and evaluation mode.

    Args:
        path: A timm folder (``config.json`` naming the ``architecture``), or a state-dict file
            (``.safetensors``, ``.pth``, ``.bin``) when ``model_name`` is given.
        model_name: The timm model the state dict belongs to (``timm.list_models()``).
        model_args: Keyword arguments of ``timm.create_model`` for a state-dict file (e.g.
            ``{"num_classes": 10, "img_size": 64}``); a folder's ``config.json`` holds its own.
    """
    path = Path(path)
    if model_name is None:
        if model_args:
            raise ValueError(f"--timm_args apply to a state-dict file with --timm_model, not to the folder {path}")
        model = create_model(f"local-dir:{path}", {}, path)
        weights = weight_file(path)
    else:
        if path.is_dir():
            raise CheckpointError(f"--timm_model takes a state-dict file, but {path} is a folder")
        if path.suffix != ".safetensors" and "hyper_parameters" in read_checkpoint(path):
            raise CheckpointError(
                f"{path} is an lmc checkpoint (written by lmc fit, lmc run or lmc align): it names its own model, "
                "so drop --timm_model"
            )
        model = create_model(model_name, dict(model_args or {}), path)
        weights = path
    return load_weights(model.to(file_dtype(weights)), weights).eval()


def save_model(model: nn.Module, folder: str | Path) -> None:
    """``model.safetensors`` (in the model's dtype) and timm's ``config.json`` into ``folder``.

    Not atomic by itself: write into :func:`~lmc.formats.atomic_output_folder`.
    """
    from timm.models import save_for_hf

    save_for_hf(model, str(folder), safe_serialization=True)


def architecture_config(model: nn.Module) -> dict[str, Any]:
    """What defines a timm model's function: its architecture, construction arguments and classes."""
    from timm.models import get_model_args

    return {
        "architecture": model.pretrained_cfg.get("architecture"),
        "model_args": json.loads(json.dumps(get_model_args(model), default=str)),
        "num_classes": model.num_classes,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
    }
