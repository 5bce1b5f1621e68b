"""Finding and reading the files of on-disk data sets: search roots, the local HF hub cache, parquet, raw bytes.

Nothing here downloads: the Hugging Face hub cache is consulted with ``local_files_only=True``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lmc.data.base import data_root, reading

if TYPE_CHECKING:
    import pyarrow


def hf_hub_snapshot(repo_id: str) -> Path | None:
    """The folder of a HF hub data set repo in the local hub cache, or ``None`` when it is not cached.

    ``huggingface_hub`` resolves the cache (``$HF_HUB_CACHE``, ``$HF_HOME/hub`` or
    ``~/.cache/huggingface/hub``) and the ``main`` revision; the network is never used. A
    partial download (e.g. ``--include "data/*"``) is returned too: it may hold the files read.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, repo_type="dataset", local_files_only=True))
    except IncompleteSnapshotError as error:
        return Path(error.snapshot_path)
    except LocalEntryNotFoundError:
        return None


def search_dirs(name: str, root: str | None, hf_repos: Sequence[str]) -> Iterator[Path]:
    """Where a data set may lie: an explicit root alone; otherwise the default root, then cached HF hub repos.

    Lazy: the hub cache is consulted only when the folders before it did not hold the data.

    Args:
        name: The data set's directory name under the default roots.
        root: An explicit directory (``None``: the default root and the hub cache).
        hf_repos: HF hub data set repos that may hold it, in order of preference.
    """
    if root is not None:
        yield data_root(name, root)
        return
    yield data_root(name)
    for repo_id in hf_repos:
        snapshot = hf_hub_snapshot(repo_id)
        if snapshot is not None:
            yield snapshot


def find_parquet(directory: Path, subdirs: Sequence[str], splits: Sequence[str]) -> dict[str, list[Path]] | None:
    """HF-hub-style parquet shards ``<directory>/<subdir>/<split>-*.parquet`` for every split.

    Args:
        directory: Where to look.
        subdirs: Sub-folders to try in order (``""`` is the directory itself); the first that
            has shards for every split wins (HF repos hold several configs side by side).
        splits: Split names as the files spell them.

    Returns:
        ``{split: sorted shard paths}``, or ``None`` when no sub-folder has them all.
    """
    for subdir in subdirs:
        folder = directory / subdir if subdir else directory
        shards = {split: sorted(folder.glob(f"{split}-*.parquet")) for split in splits}
        if all(shards.values()):
            return shards
    return None


def read_parquet(shards: Sequence[Path], columns: Sequence[str], title: str, source: str) -> pyarrow.Table:
    """The given columns of parquet shards, concatenated in order.

    Args:
        shards: The parquet files of one split.
        columns: The columns to read (the others are skipped).
        title: The data set's name, for the error on an unreadable shard.
        source: Where a fresh copy comes from, for that error.

    Raises:
        CorruptDataError: A shard is not parquet (truncated, garbage) or lacks a column; names it.
    """
    import pyarrow
    import pyarrow.parquet

    tables = []
    for path in shards:
        with reading(title, path, source):
            tables.append(pyarrow.parquet.read_table(path, columns=list(columns)))
    return pyarrow.concat_tables(tables)


def read_bytes(paths: Sequence[Path]) -> torch.Tensor:
    """The concatenated bytes of files as one ``uint8`` tensor of shape ``(total_bytes,)``.

    The files are read straight into one preallocated buffer: no intermediate copies, which
    matters for multi-GB corpora.
    """
    sizes = [path.stat().st_size for path in paths]
    buffer = bytearray(sum(sizes))
    view, position = memoryview(buffer), 0
    for path, size in zip(paths, sizes):
        with open(path, "rb") as file:
            end = position + size
            while position < end:
                read = file.readinto(view[position:end])
                if not read:
                    raise OSError(f"{path} shrank while being read")
                position += read
    view.release()
    return as_uint8(buffer)


def as_uint8(buffer: bytearray) -> torch.Tensor:
    """``buffer`` as a ``uint8`` tensor sharing its memory, shape ``(len(buffer),)``."""
    # torch.frombuffer refuses empty buffers; an empty split is reported later with context.
    return torch.frombuffer(buffer, dtype=torch.uint8) if buffer else torch.zeros(0, dtype=torch.uint8)
