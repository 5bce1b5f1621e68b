"""Byte-level causal language modelling: WikiText-103 (raw), enwik8, One Billion Word.

Each corpus is read once into a ``uint8`` tensor and cut into windows of ``sequence_length + 1``
bytes that are converted to ids (byte ``b`` is token ``b + 1``) only when read, so memory stays
at one byte per corpus byte. Where a corpus has no official validation split, one is carved
from the training split with ``seed``; the official test split is always the test set. Nothing
is downloaded: absent data raises :class:`~lmc.data.base.DataUnavailableError` saying what to
fetch and where to put it, an unreadable parquet shard :class:`~lmc.data.base.CorruptDataError`
naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch.utils.data import ConcatDataset, Dataset

from lmc.data.base import BYTE_VOCAB_SIZE, LMCDataModule, Part, TokenWindows, data_root, data_unavailable
from lmc.data.files import as_uint8, find_parquet, read_bytes, read_parquet, search_dirs
from lmc.tasks import DataInfo

if TYPE_CHECKING:
    import pyarrow


def joined_text_bytes(table: pyarrow.Table, column: str = "text", rows_per_piece: int = 65536) -> torch.Tensor:
    """A text column concatenated as it was split (rows keep their newlines), UTF-8, ``uint8 (N,)``.

    Rows are joined a slice at a time, so no Python list of the whole corpus is ever built.
    """
    buffer = bytearray()
    for chunk in table.column(column).chunks:
        for start in range(0, len(chunk), rows_per_piece):
            rows = chunk.slice(start, rows_per_piece).to_pylist()
            buffer += "".join(row or "" for row in rows).encode("utf-8")
    return as_uint8(buffer)


def byte_windows(pieces: torch.Tensor | Sequence[torch.Tensor], length: int, split: str) -> Dataset:
    """Causal-LM windows over raw bytes (ids are ``byte + 1``), ``inputs``/``labels`` of shape ``(length,)``.

    Args:
        pieces: One ``uint8`` stream, or several whose windows are concatenated (windows never
            straddle two pieces).
        length: Tokens per window.
        split: Name used in the error when the data is shorter than one window.
    """
    pieces = [pieces] if isinstance(pieces, torch.Tensor) else list(pieces)
    windows = [TokenWindows(piece, length, offset=1) for piece in pieces if len(piece) > length]
    if not windows:
        total = sum(len(piece) for piece in pieces)
        raise ValueError(f"the {split} split has {total} bytes, fewer than one window of {length + 1}")
    return windows[0] if len(windows) == 1 else ConcatDataset(windows)


class ByteLanguageModelling(LMCDataModule):
    """Shared loader of the byte-level language-modelling corpora.

    A subclass returns the ``train`` / ``val`` / ``test`` byte streams in :meth:`read_streams`.

    Args:
        root: Data directory; default ``$LMC_DATA/<name>`` or ``~/.cache/lmc/<name>``.
        sequence_length: Tokens (bytes) per window.
        train_samples: Train on only this many samples of the part's training split (``None``: all of
            them); see :class:`~lmc.data.base.LMCDataModule`.
        (others): See :class:`~lmc.data.base.LMCDataModule`.
    """

    task = "causal_lm"
    #: Directory name under ``$LMC_DATA`` / ``~/.cache/lmc``.
    name: str
    #: Name in messages.
    title: str
    #: What to download from where (for the messages on missing or corrupt files).
    source: str

    def __init__(
        self,
        batch_size: int = 32,
        num_workers: int = 0,
        part: Part = "all",
        seed: int = 0,
        root: str | None = None,
        sequence_length: int = 256,
        train_samples: int | None = None,
    ):
        super().__init__(batch_size, num_workers, part, seed, train_samples)
        self.root, self.sequence_length = root, sequence_length

    @property
    def info(self) -> DataInfo:
        return DataInfo(self.task, vocab_size=BYTE_VOCAB_SIZE, sequence_length=self.sequence_length)

    def read_streams(self) -> dict[str, torch.Tensor | list[torch.Tensor]]:
        """``{"train", "val", "test"}`` -> ``uint8`` byte streams (a list: pieces that windows must not straddle)."""
        raise NotImplementedError

    def build(self) -> None:
        streams = self.read_streams()
        self.train_set = byte_windows(streams["train"], self.sequence_length, "train")
        self.val_set = byte_windows(streams["val"], self.sequence_length, "val")
        self.test_set = byte_windows(streams["test"], self.sequence_length, "test")


class WikiText103(ByteLanguageModelling):
    """WikiText-103 (raw, character-level version): ~540 MB of Wikipedia articles, official splits.

    Layouts: ``wiki.{train,valid,test}.raw`` in the root or in ``<root>/wikitext-103-raw/``, or
    the HF parquet export ``<root>/wikitext-103-raw-v1/{train,validation,test}-*.parquet``
    (column ``text``, one line per row with its newline; the rows are joined back).

    Args:
        root: Data directory; default ``$LMC_DATA/wikitext103`` or ``~/.cache/lmc/wikitext103``
            (then any copy in the local HF hub cache).
        train_samples: Train on only this many samples of the part's training split (``None``: all of
            them); see :class:`~lmc.data.base.LMCDataModule`.
        (others): See :class:`ByteLanguageModelling`.
    """

    name, title = "wikitext103", "WikiText-103"
    source = (
        "https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-raw-v1.zip and unzip it (folder "
        "wikitext-103-raw/), or the folder wikitext-103-raw-v1/ of https://huggingface.co/datasets/Salesforce/wikitext"
    )
    hf_repos = ("Salesforce/wikitext", "wikitext")
    raw_files = {"train": "wiki.train.raw", "val": "wiki.valid.raw", "test": "wiki.test.raw"}
    parquet_splits = {"train": "train", "val": "validation", "test": "test"}

    def read_streams(self) -> dict[str, torch.Tensor | list[torch.Tensor]]:
        for directory in search_dirs(self.name, self.root, self.hf_repos):
            for folder in (directory, directory / "wikitext-103-raw"):
                if all((folder / file).is_file() for file in self.raw_files.values()):
                    return {split: read_bytes([folder / file]) for split, file in self.raw_files.items()}
            shards = find_parquet(directory, ("wikitext-103-raw-v1", ""), tuple(self.parquet_splits.values()))
            if shards is not None:
                return {
                    split: joined_text_bytes(read_parquet(shards[name], ("text",), self.title, self.source))
                    for split, name in self.parquet_splits.items()
                }
        root = data_root(self.name, self.root)
        expected = [
            f"{root}/wiki.{{train,valid,test}}.raw",
            f"{root}/wikitext-103-raw/wiki.{{train,valid,test}}.raw",
            f"{root}/wikitext-103-raw-v1/{{train,validation,test}}-*.parquet",
        ]
        raise data_unavailable(self.title, self.name, root, expected, self.source)


class Enwik8(ByteLanguageModelling):
    """enwik8: the first 100,000,000 bytes of an English Wikipedia XML dump (Hutter Prize).

    Split as is standard: the first 90M bytes train, the next 5M validate, the last 5M test;
    a shorter file is split 90 / 5 / 5 % alike.

    Args:
        root: Data directory holding the file ``enwik8`` (or the file itself); default
            ``$LMC_DATA/enwik8`` or ``~/.cache/lmc/enwik8``.
        train_samples: Train on only this many samples of the part's training split (``None``: all of
            them); see :class:`~lmc.data.base.LMCDataModule`.
        (others): See :class:`ByteLanguageModelling`.
    """

    name, title = "enwik8", "enwik8"
    source = "http://mattmahoney.net/dc/enwik8.zip and unzip it (one file, enwik8, of 100,000,000 bytes)"
    standard_size = 100_000_000

    def read_streams(self) -> dict[str, torch.Tensor | list[torch.Tensor]]:
        root = data_root(self.name, self.root)
        path = root if root.is_file() else root / "enwik8"
        if not path.is_file():
            raise data_unavailable(self.title, self.name, root, [path], self.source)
        stream = read_bytes([path])
        total = min(len(stream), self.standard_size)  # 90M / 5M / 5M of the real file is 90 / 5 / 5 %
        train_end, val_end = int(total * 0.9), int(total * 0.95)
        return {"train": stream[:train_end], "val": stream[train_end:val_end], "test": stream[val_end:total]}


class OneBillionWord(ByteLanguageModelling):
    """One Billion Word benchmark (Chelba et al. 2013): ~4.2 GB of shuffled news sentences, one per line.

    Training reads ``training-monolingual.tokenized.shuffled/news.en-000??-of-00100`` (all 99
    shards, ~4.2 GB of RAM, unless ``train_shards`` limits them); the test set is the standard
    ``heldout-monolingual.tokenized.shuffled/news.en.heldout-00000-of-00050``. Validation is a
    contiguous stretch of ``val_fraction`` of the training bytes at a ``seed``-chosen position
    (the sentences are shuffled, so a stretch is a random sample), cut out of training.

    Args:
        root: Data directory holding the two folders directly or in
            ``1-billion-word-language-modeling-benchmark-r13output/``; default
            ``$LMC_DATA/one_billion_word`` or ``~/.cache/lmc/one_billion_word``.
        train_shards: Read only the first this many training shards (``None``: all).
        val_fraction: Share of the training bytes held out for validation (the default, 0.02 %,
            is ~0.8 MB, about the size of the test shard).
        train_samples: Train on only this many samples of the part's training split (``None``: all of
            them); see :class:`~lmc.data.base.LMCDataModule`.
        (others): See :class:`ByteLanguageModelling`.
    """

    name, title = "one_billion_word", "One Billion Word"
    release_folder = "1-billion-word-language-modeling-benchmark-r13output"
    source = (
        "http://www.statmt.org/lm-benchmark/1-billion-word-language-modeling-benchmark-r13output.tar.gz "
        f"and extract it (folder {release_folder}/)"
    )
    train_glob = "training-monolingual.tokenized.shuffled/news.en-000??-of-00100"
    test_file = "heldout-monolingual.tokenized.shuffled/news.en.heldout-00000-of-00050"

    def __init__(
        self,
        batch_size: int = 32,
        num_workers: int = 0,
        part: Part = "all",
        seed: int = 0,
        root: str | None = None,
        sequence_length: int = 256,
        train_shards: int | None = None,
        val_fraction: float = 0.0002,
        train_samples: int | None = None,
    ):
        super().__init__(batch_size, num_workers, part, seed, root, sequence_length, train_samples)
        if train_shards is not None and train_shards < 1:
            raise ValueError(f"train_shards must be positive or None, got {train_shards}")
        if not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        self.train_shards, self.val_fraction = train_shards, val_fraction

    def read_streams(self) -> dict[str, torch.Tensor | list[torch.Tensor]]:
        root = data_root(self.name, self.root)
        folders = [root, root / self.release_folder]
        for folder in folders:
            train_files = sorted(folder.glob(self.train_glob))
            if train_files and (folder / self.test_file).is_file():
                break
        else:
            expected = [f"{folder}/{self.train_glob} and {folder}/{self.test_file}" for folder in folders]
            raise data_unavailable(self.title, self.name, root, expected, self.source)
        train = read_bytes(train_files[: self.train_shards])
        n_val = max(1, int(len(train) * self.val_fraction))
        start = int(torch.randint(len(train) - n_val + 1, (1,), generator=torch.Generator().manual_seed(self.seed)))
        return {
            # Slices are views: the training stream is not copied around the cut-out stretch.
            "train": [train[:start], train[start + n_val :]],
            "val": train[start : start + n_val],
            "test": read_bytes([folder / self.test_file]),
        }
