"""Reading and writing model weights: Lightning checkpoints, safetensors; always atomically."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

#: Prefix of the wrapped model's weights inside an :class:`~lmc.training.LMCModule` checkpoint.
MODEL_PREFIX = "model."


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable or does not fit the model."""


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(temporary_path)`` then move the file into place, so no reader sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(handle)
    try:
        write(Path(temporary))
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda p: p.write_text(text))


def atomic_write_json(path: str | Path, data: object) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=2, default=float) + "\n")


def read_checkpoint(path: str | Path) -> dict:
    """The whole content of a Lightning ``.ckpt`` or ``.pt`` file, read without unpickling code."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # unpickling errors have many types
        raise CheckpointError(f"cannot read checkpoint {path}: {error}") from error
    return loaded


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Model weights from a Lightning ``.ckpt`` (an ``LMCModule``'s), a ``.safetensors`` or a ``.pt`` file."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    loaded = read_checkpoint(path)
    state = loaded.get("state_dict", loaded) if isinstance(loaded, dict) else None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds no state dict (found {type(loaded).__name__})")
    if any(key.startswith(MODEL_PREFIX) for key in state):  # a Lightning checkpoint of LMCModule
        state = {key[len(MODEL_PREFIX) :]: value for key, value in state.items() if key.startswith(MODEL_PREFIX)}
    return state


def load_weights(model: nn.Module, path: str | Path) -> nn.Module:
    """Load ``path`` into ``model`` in place, refusing any mismatch with a precise message."""
    state = read_state_dict(path)
    expected = model.state_dict()
    # Tied weights (GPT-2's lm_head and wte) are stored once: fill the alias from its twin.
    storage = {expected[k].data_ptr(): k for k in state if k in expected}
    for key in expected.keys() - state.keys():
        twin = storage.get(expected[key].data_ptr())
        if twin is not None:
            state[key] = state[twin]
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    wrong_shape = [k for k in expected.keys() & state.keys() if expected[k].shape != state[k].shape]
    if missing or unexpected or wrong_shape:
        details = []
        if missing:
            details.append(f"missing {missing[:3]}{' ...' if len(missing) > 3 else ''}")
        if unexpected:
            details.append(f"unexpected {unexpected[:3]}{' ...' if len(unexpected) > 3 else ''}")
        if wrong_shape:
            shapes = [(k, tuple(state[k].shape), tuple(expected[k].shape)) for k in wrong_shape[:3]]
            details.append(f"shape (checkpoint, model) {shapes}")
        raise CheckpointError(
            f"checkpoint {path} does not fit {type(model).__name__}: {'; '.join(details)}. "
            "Build the model from the config the checkpoint was trained with."
        )
    model.load_state_dict(state)
    return model


def save_weights(model: nn.Module, path: str | Path) -> Path:
    """Write ``model``'s weights as safetensors, atomically (tied tensors are stored once)."""
    from safetensors.torch import save_model

    return atomic_write(path, lambda p: save_model(model, str(p)))
