"""Hugging Face model directories (``save_pretrained``): config, weights (single or sharded), tokenizer files.

The small functions here (config, weight files and shards, stored dtype, tokenizer files) are
public so that other readers of such directories (e.g. a streaming aligner) reuse them.
Nothing is downloaded: every ``from_pretrained`` call passes ``local_files_only=True``.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmc.adapters import UnsupportedModelError, adapter_for_class
from lmc.checkpoints import CheckpointError, read_state_dict
from lmc.formats.safetensors import SAFETENSORS_DTYPES

CONFIG_FILE = "config.json"
#: Single-file weights, then the index of sharded weights, in the order transformers prefers them.
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
#: Files a model directory may carry besides config and weights, copied unchanged beside written models.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "preprocessor_config.json",
)
#: Config fields that do not change the function (bookkeeping, label names, runtime switches).
NON_ARCHITECTURE_FIELDS = frozenset(
    {
        "_name_or_path",
        "transformers_version",
        "_commit_hash",
        "id2label",
        "label2id",
        "finetuning_task",
        "problem_type",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "_attn_implementation_autoset",
    }
)


def read_config(folder: str | Path) -> dict[str, Any]:
    """The ``config.json`` of a model directory as a dict.

    Raises:
        CheckpointError: No ``config.json`` or not a JSON object; the message names the file.
    """
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{folder} has no {CONFIG_FILE}: give a folder written by save_pretrained")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"cannot read {path}: {error}") from error
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} holds no JSON object")
    return config


def is_model_config(config: dict[str, Any]) -> bool:
    """Whether a parsed ``config.json`` is a transformers one (it has ``model_type`` or ``architectures``)."""
    return "model_type" in config or "architectures" in config


def weight_index(folder: str | Path) -> dict[str, Any] | None:
    """The shard index (``model.safetensors.index.json`` or the PyTorch one) of a sharded directory, else ``None``."""
    for name in INDEX_FILES:
        path = Path(folder) / name
        if path.is_file():
            try:
                index = json.loads(path.read_text())
            except (OSError, ValueError) as error:
                raise CheckpointError(f"cannot read the shard index {path}: {error}") from error
            if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
                raise CheckpointError(f"{path} has no weight_map: it is not a shard index")
            return index
    return None


def weight_files(folder: str | Path) -> list[Path]:
    """The weight files of a model directory: its shards in index order, or its single file.

    Raises:
        CheckpointError: No weights, or a shard the index names is missing.
    """
    folder = Path(folder)
    index = weight_index(folder)
    if index is not None:
        shards = [folder / name for name in dict.fromkeys(index["weight_map"].values())]
        missing = [str(p.name) for p in shards if not p.is_file()]
        if missing:
            raise CheckpointError(f"{folder} misses shard(s) {missing[:3]} named by its index: copy them all")
        _check_every_shard_listed(folder, [shard.name for shard in shards])
        return shards
    for name in WEIGHT_FILES:
        if (folder / name).is_file():
            return [folder / name]
    raise CheckpointError(f"{folder} has no weights ({' or '.join(WEIGHT_FILES + INDEX_FILES)})")


#: A shard's name as ``save_pretrained`` writes it: ``model-00002-of-00005.safetensors``.
SHARD_NAME = re.compile(r"(?P<stem>.+)-(?P<number>\d+)-of-(?P<total>\d+)(?P<suffix>\.[a-z]+)")


def _check_every_shard_listed(folder: Path, listed: list[str]) -> None:
    """Refuse an index that leaves out shards of its own series (``-0000i-of-0000n``): their tensors would not be
    read, and a model missing them is initialized at random or fits no config.

    Raises:
        CheckpointError: Naming the index, the shards it leaves out and the fix.
    """
    series = {(m["stem"], m["total"], m["suffix"]): m for m in map(SHARD_NAME.fullmatch, listed) if m is not None}
    expected = {
        f"{stem}-{number:0{len(match['number'])}d}-of-{total}{suffix}"
        for (stem, total, suffix), match in series.items()
        for number in range(1, int(total) + 1)
    }
    left_out = sorted(expected - set(listed))
    if left_out:
        index = next(folder / name for name in INDEX_FILES if (folder / name).is_file())
        present = [name for name in left_out if (folder / name).is_file()]
        state = f"which {folder} holds" if present == left_out else f"of which {folder} holds {present or 'none'}"
        raise CheckpointError(
            f"{index} names no tensor of shard(s) {left_out[:3]}, {state}: the index is incomplete, so their "
            f"tensors would not be read; write the folder again with save_pretrained (or copy its index "
            f"from where the shards came from)"
        )


def largest_shard_bytes(folder: str | Path) -> int | None:
    """Size of the largest weight file of a sharded directory (written models are sharded alike), else ``None``."""
    if weight_index(folder) is None:
        return None
    return max(p.stat().st_size for p in weight_files(folder))


def stored_dtype(folder: str | Path) -> torch.dtype:
    """The dtype a model directory's floating-point weights are stored in (from its first weight file)."""
    return file_dtype(weight_files(folder)[0])


def file_dtype(path: str | Path) -> torch.dtype:
    """The dtype of the first floating-point tensor of a weight file (a safetensors header is read alone)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), "pt") as handle:
                for key in handle.keys():
                    dtype = SAFETENSORS_DTYPES.get(handle.get_slice(key).get_dtype())
                    if dtype is not None:
                        return dtype
        except SafetensorError as error:
            raise CheckpointError(f"cannot read {path}: truncated or not a safetensors file ({error})") from error
    else:
        for value in read_state_dict(path).values():
            if value.is_floating_point():
                return value.dtype
    raise CheckpointError(f"{path} holds no floating-point weights")


def copy_tokenizer_files(source: str | Path, destination: str | Path) -> list[str]:
    """Copy :data:`TOKENIZER_FILES` present in ``source`` and absent from ``destination``; returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(source) / name).is_file() and not (Path(destination) / name).exists():
            shutil.copy2(Path(source) / name, Path(destination) / name)
            copied.append(name)
    return copied


def model_class(config: dict[str, Any], folder: str | Path) -> type[nn.Module]:
    """The transformers class named by ``config["architectures"]``, refused unless lmc has its adapter.

    Raises:
        CheckpointError: The config names no architecture.
        UnsupportedModelError: lmc has no adapter for it (the message lists the supported models).
    """
    import transformers

    architectures = config.get("architectures") or []
    if len(architectures) != 1:
        raise CheckpointError(
            f"{Path(folder) / CONFIG_FILE} names {len(architectures)} architectures ({architectures}); lmc needs "
            "exactly one: save the model with save_pretrained"
        )
    cls = getattr(transformers, architectures[0], None)
    if not isinstance(cls, type):
        raise UnsupportedModelError(f"transformers has no model class {architectures[0]} (from {folder})")
    adapter_for_class(cls)
    return cls


def load_model(folder: str | Path, config: dict[str, Any] | None = None) -> nn.Module:
    """The model of a ``save_pretrained`` directory, in its stored dtype and evaluation mode.

    Args:
        folder: The model directory.
        config: Its parsed ``config.json`` when already read (:func:`read_config`); ``None`` reads it.
    """
    cls = model_class(read_config(folder) if config is None else config, folder)
    with _quiet():
        model, loading = cls.from_pretrained(
            str(folder), local_files_only=True, dtype=stored_dtype(folder), output_loading_info=True
        )
    if loading["missing_keys"]:  # from_pretrained initializes them at random, with a warning only
        missing = sorted(loading["missing_keys"])
        raise CheckpointError(
            f"{folder} does not fit its {CONFIG_FILE}'s {cls.__name__}: its weights lack {missing[:3]}"
            f"{' ...' if len(missing) > 3 else ''}; save the model with save_pretrained"
        )
    return model.eval()


def save_model(model: nn.Module, folder: str | Path, like: str | Path) -> None:
    """``model.save_pretrained(folder)`` sharded like the directory ``like``, plus ``like``'s tokenizer files.

    Not atomic by itself: write into :func:`~lmc.formats.atomic_output_folder`.
    """
    shard = largest_shard_bytes(like)
    with _quiet():
        model.save_pretrained(str(folder), **({} if shard is None else {"max_shard_size": shard}))
    copy_tokenizer_files(like, folder)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No per-shard progress bars of transformers: lmc prints one line per model it writes."""
    from transformers.utils import logging

    enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            logging.enable_progress_bar()


def architecture_config(model: nn.Module) -> dict[str, Any]:
    """The config fields that define ``model``'s function and shapes (label names and bookkeeping left out)."""
    config = {k: v for k, v in model.config.to_dict().items() if k not in NON_ARCHITECTURE_FIELDS}
    config["num_labels"] = model.config.num_labels
    return config
