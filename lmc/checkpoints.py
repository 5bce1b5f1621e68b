"""Reading and writing model weights: Lightning checkpoints, safetensors; always atomically."""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path

import torch
from torch import nn

from lmc.io import atomic_write

#: Prefix of the wrapped model's weights inside an :class:`~lmc.training.LMCModule` checkpoint.
MODEL_PREFIX = "model."


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable or does not fit the model."""


def checkpoint_file(path: str | Path) -> Path:
    """``path`` if it is a readable, non-empty file; else a :class:`CheckpointError` saying what it is."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"checkpoint {path} is a folder: give the .ckpt, .safetensors or .pt file inside it")
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not os.access(path, os.R_OK):
        raise CheckpointError(f"checkpoint {path} is not readable: check its permissions")
    if path.stat().st_size == 0:
        raise CheckpointError(f"checkpoint {path} is empty (0 bytes): it was not written completely; write it again")
    return path


def read_checkpoint(path: str | Path) -> dict:
    """The content of a Lightning ``.ckpt`` or ``.pt`` file, unpickling only tensors and plain containers.

    A checkpoint is never allowed to run code (``weights_only=True``).

    Raises:
        CheckpointError: The file is missing, a folder, empty, truncated, not a checkpoint, or
            holds objects other than weights; the message names the file.
    """
    path = checkpoint_file(path)
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:  # torch's message would advise the unsafe weights_only=False
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
        detail = f" (found {found.group(1)})" if found else ""
        raise CheckpointError(
            f"checkpoint {path} holds Python objects besides weights{detail}, which lmc does not unpickle: "
            "save the model's state_dict (lmc.checkpoints.save_weights) and give that file"
        ) from error
    except Exception as error:  # truncated archives raise RuntimeError, OSError, EOFError, KeyError, ...
        text = str(error).strip()
        detail = f"{type(error).__name__}: {text.split('. ')[0]}" if text else type(error).__name__
        raise CheckpointError(
            f"cannot read checkpoint {path}: truncated or not a PyTorch checkpoint ({detail})"
        ) from error
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{path} holds no checkpoint dict (found {type(loaded).__name__})")
    return loaded


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Model weights from a Lightning ``.ckpt`` (an ``LMCModule``'s), a ``.safetensors`` or a ``.pt`` file.

    Raises:
        CheckpointError: As :func:`read_checkpoint`, for safetensors files too.
    """
    path = checkpoint_file(path)
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except SafetensorError as error:
            raise CheckpointError(f"cannot read {path}: truncated or not a safetensors file ({error})") from error
    loaded = read_checkpoint(path)
    state = loaded.get("state_dict", loaded)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds no state dict (found {type(state).__name__})")
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
