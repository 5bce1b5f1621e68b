"""Safetensors checkpoints read lazily: a folder's tensors as a ``Mapping[str, Tensor]``.

Every read copies one tensor (or one chunk of its rows) from its shard straight into memory of
its own with a plain file read: no memory map, whose touched pages would count in the process's
resident memory beside the copy, and no second copy. The matcher's per-layer solves take such a
mapping as they take a model's parameters.
"""

from __future__ import annotations

import copy
import json
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lmc.checkpoints import CheckpointError

#: The floating-point dtypes of safetensors headers, by name.
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
#: Every dtype of safetensors headers that torch holds, by name (the bytes are little-endian, as torch's on the
#: machines it runs on).
STORED_DTYPES = {
    **SAFETENSORS_DTYPES,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}

#: Largest piece of a tensor held at once while it is copied, compared or merged (bytes): the write pass
#: holds some four pieces at once (the source's, its moved copy and the copy's temporary, the target's).
CHUNK_BYTES = 1 << 24


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor is stored: its shard file and its safetensors header entry."""

    shard: str
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, int]

    @property
    def is_float(self) -> bool:
        return self.dtype in SAFETENSORS_DTYPES


def read_header(path: Path) -> tuple[bytes, dict]:
    """The raw header prefix (length and JSON) of a safetensors file, and the parsed header.

    Raises:
        CheckpointError: The file is not a safetensors file (naming it).
    """
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise CheckpointError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        (length,) = struct.unpack("<Q", prefix)
        text = handle.read(length)
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path} is not a safetensors file: unreadable header ({error})") from error
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is not a safetensors file: its header is not a JSON object")
    return prefix + text, header


class SafetensorsCheckpoint(Mapping[str, torch.Tensor]):
    """The tensors of one or several safetensors files, each read when it is looked up.

    Tensors are looked up by the model's parameter names; :meth:`renamed` maps names its files
    store otherwise.

    Args:
        folder: The checkpoint's folder.
        files: Its weight files in order (the shards of a sharded checkpoint).

    Raises:
        CheckpointError: A file is not a safetensors file.
    """

    def __init__(self, folder: str | Path, files: Sequence[Path]):
        self.folder = Path(folder)
        not_safetensors = [path.name for path in files if path.suffix != ".safetensors"]
        if not_safetensors:
            raise CheckpointError(
                f"{self.folder} stores its weights as {not_safetensors[0]}; streamed alignment reads safetensors: "
                "save the model with save_pretrained(..., safe_serialization=True)"
            )
        self.shards = [path.name for path in files]
        self.headers: dict[str, bytes] = {}
        self.entries: dict[str, TensorEntry] = {}
        for shard in self.shards:
            self.headers[shard], header = read_header(self.folder / shard)
            for name, entry in header.items():
                if name != "__metadata__":
                    self.entries[name] = TensorEntry(
                        shard, entry["dtype"], tuple(entry["shape"]), tuple(entry["data_offsets"])
                    )

    def renamed(self, saved_names: Mapping[str, str]) -> SafetensorsCheckpoint:
        """This checkpoint with each tensor stored as ``saved_names[parameter]`` looked up as ``parameter``.

        A pair applies only where the files hold the stored name and not the parameter's, so a
        folder saved either way reads alike. The files and their headers are unchanged.
        """
        view = copy.copy(self)
        view.entries = dict(self.entries)
        for parameter, stored in saved_names.items():
            if stored in view.entries and parameter not in view.entries:
                view.entries[parameter] = view.entries.pop(stored)  # read by its offsets, whatever its name
        return view

    def __getitem__(self, name: str) -> torch.Tensor:
        """Tensor ``name`` in its stored dtype, in memory of its own."""
        return self.rows(name, None, None)

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def layout(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Every tensor's stored dtype and shape, by name (from the headers: nothing is read)."""
        return {name: (entry.dtype, entry.shape) for name, entry in self.entries.items()}

    def names(self, shard: str) -> list[str]:
        """The tensors of ``shard`` in file order."""
        return sorted((n for n, e in self.entries.items() if e.shard == shard), key=lambda n: self.entries[n].offsets)

    def rows(self, name: str, start: int | None, stop: int | None) -> torch.Tensor:
        """Rows ``start:stop`` of tensor ``name`` (all of it for ``None``; a scalar whole).

        Raises:
            CheckpointError: The shard holding it is truncated or corrupted (naming the file), or stores
                it in a dtype torch does not hold.
        """
        entry = self.entries[name]
        path = self.folder / entry.shard
        if entry.dtype not in STORED_DTYPES:
            raise CheckpointError(f"{path} stores {name} as {entry.dtype}, which torch does not hold")
        rows = entry.shape[0] if entry.shape else 1
        begin, end, _ = slice(start, stop).indices(rows) if entry.shape else (0, 1, 1)  # as a slice of it would
        end = max(begin, end)
        tensor = torch.empty((end - begin, *entry.shape[1:]) if entry.shape else (), dtype=STORED_DTYPES[entry.dtype])
        data = tensor.reshape(-1).view(torch.uint8).numpy()
        row_bytes = (entry.offsets[1] - entry.offsets[0]) // max(1, rows)
        if data.size != (end - begin) * row_bytes:
            raise CheckpointError(f"cannot read {name} from {path}: truncated or corrupted (its header's offsets)")
        with open(path, "rb") as handle:
            handle.seek(len(self.headers[entry.shard]) + entry.offsets[0] + begin * row_bytes)
            if handle.readinto(data) != data.size:
                raise CheckpointError(f"cannot read {name} from {path}: truncated or corrupted (the file ends early)")
        return tensor

    def same_values(self, name: str, other: str) -> bool:
        """Whether tensors ``name`` and ``other`` are stored alike: dtype, shape and every value (``torch.equal``,
        as ``from_pretrained`` compares a tied pair stored twice), read a chunk of rows at a time."""
        first, second = self.entries[name], self.entries[other]
        if (first.dtype, first.shape) != (second.dtype, second.shape):
            return False
        return all(torch.equal(self.rows(name, *rows), self.rows(other, *rows)) for rows in self.chunks(name))

    def chunks(self, name: str) -> Iterator[tuple[int, int]]:
        """Row ranges of ``name`` of at most :data:`CHUNK_BYTES` each (one range for a scalar)."""
        entry = self.entries[name]
        if len(entry.shape) == 0:
            yield 0, 0
            return
        row_bytes = max(1, (entry.offsets[1] - entry.offsets[0]) // max(1, entry.shape[0]))
        step = max(1, CHUNK_BYTES // row_bytes)
        for start in range(0, entry.shape[0], step):
            yield start, min(start + step, entry.shape[0])


def tied_names(model: nn.Module) -> dict[str, str]:
    """Each other name of a tied parameter (an LM head tied to the embedding), mapped to the name
    ``model.named_parameters()`` gives it."""
    first: dict[int, str] = {}
    aliases = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(parameter), name) != name:
            aliases[name] = first[id(parameter)]
    return aliases


def loaded_ties(weights: SafetensorsCheckpoint, tied: Mapping[str, str]) -> dict[str, bool]:
    """Whether the model's loader ties each name of ``tied`` that ``weights`` stores to its parameter.

    ``from_pretrained`` ties a pair its config ties only where the files store one of them, or both
    with equal values; stored with other values, it loads them untied (and warns), so the model
    computes with the stored head, not the embedding.

    Args:
        weights: The checkpoint's tensors, by parameter name.
        tied: :func:`tied_names` of the model its config builds.
    """
    return {alias: weights.same_values(alias, name) for alias, name in tied.items() if alias in weights.entries}


def write_tensor(handle, tensor: torch.Tensor) -> None:
    """Append ``tensor``'s bytes to an open safetensors file being written after its header."""
    handle.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
