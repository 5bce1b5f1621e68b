"""Loaders for the paper's text data sets, byte-level (byte ``b`` is token ``b + 1``, 0 pads).

- Text classification: AG News (4 classes), IMDB (2), DBPedia-14 (14). Read from the HF hub
  parquet export or from the original distributions (the Zhang et al. 2015 CSVs, ``aclImdb``).
  Texts are truncated / right-padded to ``sequence_length`` bytes.
- Causal language modelling: WikiText-103 (raw), enwik8, One Billion Word. Each corpus is read
  once into a ``uint8`` tensor and cut into windows of ``sequence_length + 1`` bytes that are
  converted to ids only when read, so memory stays at one byte per corpus byte.

Where a data set has no official validation split, one is carved from the training split with
``seed``; the official test split is always the test set. Nothing is downloaded: absent data
raises :class:`~lmc.data.base.DataUnavailableError` saying what to fetch and where to put it.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import ConcatDataset, Dataset

from lmc.data.base import (
    BYTE_VOCAB_SIZE,
    LMCDataModule,
    Part,
    TokenWindows,
    data_root,
    data_unavailable,
    encode_bytes,
    pad_texts,
    split_off_validation,
)

if TYPE_CHECKING:
    import datasets

#: A split of a classification set: texts and their 0-based labels.
LabelledTexts = tuple[list[str], list[int]]

# ---------------------------------------------------------------------------------------------
# Finding and reading files.
# ---------------------------------------------------------------------------------------------


def hf_hub_snapshots(repo_ids: Sequence[str]) -> list[Path]:
    """Snapshot folders of HF hub data set repos already in the local hub cache, newest first.

    Only the file system is consulted (no network): ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``,
    else ``~/.cache/huggingface/hub``.
    """
    hf_home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    hub = Path(os.environ.get("HF_HUB_CACHE") or os.path.join(hf_home, "hub")).expanduser()
    found: list[Path] = []
    for repo_id in repo_ids:
        snapshots = hub / f"datasets--{repo_id.replace('/', '--')}" / "snapshots"
        if snapshots.is_dir():
            found += sorted(snapshots.iterdir(), key=lambda path: path.stat().st_mtime, reverse=True)
    return found


def _search_dirs(name: str, root: str | None, hf_repos: Sequence[str]) -> list[Path]:
    """An explicit root alone; otherwise the default root, then any cached HF hub snapshot."""
    if root is not None:
        return [data_root(name, root)]
    return [data_root(name), *hf_hub_snapshots(hf_repos)]


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


def load_parquet(shards: dict[str, list[Path]]) -> dict[str, datasets.Dataset]:
    """Load parquet shards with ``datasets`` (offline: local files only), one data set per split."""
    import datasets

    loaded = datasets.load_dataset(
        "parquet", data_files={split: [str(p) for p in paths] for split, paths in shards.items()}
    )
    return {split: loaded[split] for split in shards}


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
    return _uint8(buffer)


def _uint8(buffer: bytearray) -> torch.Tensor:
    # torch.frombuffer refuses empty buffers; an empty split is reported later with context.
    return torch.frombuffer(buffer, dtype=torch.uint8) if buffer else torch.zeros(0, dtype=torch.uint8)


def joined_text_bytes(dataset: datasets.Dataset, column: str = "text", rows_per_piece: int = 65536) -> torch.Tensor:
    """A text column concatenated as it was split (rows keep their newlines), UTF-8, ``uint8 (N,)``.

    Rows are joined a slice at a time, so no Python list of the whole corpus is ever built.
    """
    buffer = bytearray()
    for chunk in dataset.data.column(column).chunks:
        for start in range(0, len(chunk), rows_per_piece):
            rows = chunk.slice(start, rows_per_piece).to_pylist()
            buffer += "".join(row or "" for row in rows).encode("utf-8")
    return _uint8(buffer)


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


# ---------------------------------------------------------------------------------------------
# Text classification.
# ---------------------------------------------------------------------------------------------


class PaddedByteTexts(Dataset):
    """Fixed-length byte-id texts, stored as ``int16`` (ids reach 256) and widened when read.

    Args:
        ids: ``(N, T)`` byte ids, 0 = padding.
        labels: ``(N,)`` class indices.
    """

    def __init__(self, ids: torch.Tensor, labels: torch.Tensor):
        if len(ids) != len(labels):
            raise ValueError(f"{len(ids)} texts but {len(labels)} labels")
        self.ids, self.labels = ids, labels.long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.ids[index].long()
        return {"inputs": ids, "attention_mask": (ids != 0).long(), "labels": self.labels[index]}


def encode_texts(texts: Sequence[str], length: int, chunk_size: int = 8192) -> torch.Tensor:
    """Byte ids of texts truncated / right-padded to ``length``: ``int16 (N, length)``.

    Texts are cut to ``length`` bytes before encoding and padded a chunk at a time, so the
    ``int64`` intermediates stay small for data sets of half a million texts.
    """
    rows = [torch.zeros(0, length, dtype=torch.int16)]
    for start in range(0, len(texts), chunk_size):
        encoded = []
        for text in texts[start : start + chunk_size]:
            data = text.encode("utf-8")[:length]
            encoded.append(encode_bytes(data) if data else torch.zeros(0, dtype=torch.long))
        ids, _ = pad_texts(encoded, length)
        rows.append(ids.to(torch.int16))
    return torch.cat(rows)


def read_class_csv(path: Path) -> LabelledTexts:
    """A Zhang et al. (2015) CSV (no header; ``class`` 1-based, ``title``, ``body``).

    Returns:
        Texts ``"title body"`` (as the HF hub exports join them) and 0-based labels.
    """
    texts, labels = [], []
    with open(path, newline="", encoding="utf-8") as file:
        for row in csv.reader(file, quotechar='"', delimiter=",", quoting=csv.QUOTE_ALL, skipinitialspace=True):
            if row:
                labels.append(int(row[0]) - 1)
                texts.append(" ".join(row[1:]))
    return texts, labels


class ByteTextClassification(LMCDataModule):
    """Shared loader of the byte-level text-classification sets (AG News, IMDB, DBPedia).

    A subclass names its HF hub parquet layout (:attr:`parquet_subdirs`, :attr:`text_columns`)
    and may read its original distribution in :meth:`read_original`.

    Args:
        root: Data directory; default ``$LMC_DATA/<name>`` or ``~/.cache/lmc/<name>`` (then any
            copy in the local HF hub cache).
        sequence_length: Bytes per text (longer texts are cut, shorter ones padded).
        val_fraction: Share of the training texts held out for validation.
        (others): See :class:`~lmc.data.base.LMCDataModule`.
    """

    task = "text_classification"
    vocab_size = BYTE_VOCAB_SIZE
    #: Directory name under ``$LMC_DATA`` / ``~/.cache/lmc``.
    name: str
    #: Name in messages.
    title: str
    #: HF hub data set repos whose cached snapshots are searched when no root is given.
    hf_repos: tuple[str, ...] = ()
    #: Folders (relative to the root) that may hold ``train-*.parquet`` and ``test-*.parquet``.
    parquet_subdirs: tuple[str, ...] = ("",)
    #: Parquet columns joined with a space into the text.
    text_columns: tuple[str, ...] = ("text",)
    #: What to download from where (for the missing-data message).
    source: str

    def __init__(
        self,
        batch_size: int = 64,
        num_workers: int = 0,
        part: Part = "all",
        seed: int = 0,
        root: str | None = None,
        sequence_length: int = 128,
        val_fraction: float = 0.05,
    ):
        super().__init__(batch_size, num_workers, part, seed)
        self.root, self.sequence_length, self.val_fraction = root, sequence_length, val_fraction

    def read_original(self, directory: Path) -> dict[str, LabelledTexts] | None:
        """The ``train`` / ``test`` splits from the original distribution under ``directory``, or ``None``."""
        return None

    def original_layout(self, root: Path) -> list[str]:
        """The original distribution's paths, for the missing-data message."""
        return []

    def read_splits(self) -> dict[str, LabelledTexts]:
        """The official ``train`` and ``test`` splits, from the first layout found."""
        for directory in _search_dirs(self.name, self.root, self.hf_repos):
            shards = find_parquet(directory, self.parquet_subdirs, ("train", "test"))
            if shards is not None:
                return {split: self._parquet_texts(dataset) for split, dataset in load_parquet(shards).items()}
            original = self.read_original(directory)
            if original is not None:
                return original
        root = data_root(self.name, self.root)
        parquet = [f"{root / subdir}/{{train,test}}-*.parquet" for subdir in self.parquet_subdirs]
        raise data_unavailable(self.title, self.name, root, parquet + self.original_layout(root), self.source)

    def _parquet_texts(self, dataset: datasets.Dataset) -> LabelledTexts:
        table = dataset.data
        columns = [table.column(name).to_pylist() for name in self.text_columns]
        texts = [" ".join(parts) for parts in zip(*columns)] if len(columns) > 1 else columns[0]
        return texts, table.column("label").to_pylist()

    def build(self) -> None:
        splits = self.read_splits()
        texts, labels = splits["train"]
        ids, labels = encode_texts(texts, self.sequence_length), torch.tensor(labels, dtype=torch.long)
        train, val = split_off_validation(len(labels), self.val_fraction, self.seed)
        self.train_set = PaddedByteTexts(ids[train], labels[train])
        self.val_set = PaddedByteTexts(ids[val], labels[val])
        test_texts, test_labels = splits["test"]
        self.test_set = PaddedByteTexts(encode_texts(test_texts, self.sequence_length), torch.tensor(test_labels))

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "vocab_size": self.vocab_size, "sequence_length": self.sequence_length}


class _ZhangCSV(ByteTextClassification):
    """A set distributed as Zhang et al. (2015) ``train.csv`` / ``test.csv``, in the root or ``csv_folder``."""

    csv_folder: str

    def _csv_dirs(self, directory: Path) -> list[Path]:
        return [directory, directory / self.csv_folder]

    def read_original(self, directory: Path) -> dict[str, LabelledTexts] | None:
        for folder in self._csv_dirs(directory):
            if (folder / "train.csv").is_file() and (folder / "test.csv").is_file():
                return {split: read_class_csv(folder / f"{split}.csv") for split in ("train", "test")}
        return None

    def original_layout(self, root: Path) -> list[str]:
        return [f"{folder}/{{train,test}}.csv" for folder in self._csv_dirs(root)]


class AGNews(_ZhangCSV):
    """AG News topic classification: 120,000 training and 7,600 test news articles, 4 classes.

    Labels: 0 World, 1 Sports, 2 Business, 3 Sci/Tech. Text is ``title + " " + description``.
    Layouts: HF parquet ``<root>/data/{train,test}-*.parquet`` (or directly in the root), or
    ``<root>/[ag_news_csv/]{train,test}.csv`` (1-based class, title, description).

    Args:
        root: Data directory; default ``$LMC_DATA/ag_news`` or ``~/.cache/lmc/ag_news``.
        (others): See :class:`ByteTextClassification`.
    """

    name, title = "ag_news", "AG News"
    num_classes = 4
    hf_repos = ("fancyzhx/ag_news", "ag_news")
    parquet_subdirs = ("data", "")
    csv_folder = "ag_news_csv"
    source = (
        "the parquet files of https://huggingface.co/datasets/fancyzhx/ag_news (folder data/), or "
        "ag_news_csv.tgz of Zhang et al. 2015 (train.csv, test.csv; e.g. from "
        "https://github.com/mhjabreel/CharCnn_Keras/tree/master/data/ag_news_csv)"
    )


class DBPedia(_ZhangCSV):
    """DBPedia-14 ontology classification: 560,000 training and 70,000 test Wikipedia abstracts, 14 classes.

    Text is ``title + " " + content``. Layouts: HF parquet ``<root>/dbpedia_14/{train,test}-*.parquet``
    (columns ``title``, ``content``, ``label``; or directly in the root), or
    ``<root>/[dbpedia_csv/]{train,test}.csv`` (1-based class, title, content).

    Args:
        root: Data directory; default ``$LMC_DATA/dbpedia`` or ``~/.cache/lmc/dbpedia``.
        (others): See :class:`ByteTextClassification`.
    """

    name, title = "dbpedia", "DBPedia-14"
    num_classes = 14
    hf_repos = ("fancyzhx/dbpedia_14", "dbpedia_14")
    parquet_subdirs = ("dbpedia_14", "")
    text_columns = ("title", "content")
    csv_folder = "dbpedia_csv"
    source = (
        "the parquet files of https://huggingface.co/datasets/fancyzhx/dbpedia_14 (folder dbpedia_14/), or "
        "dbpedia_csv.tar.gz of Zhang et al. 2015 (train.csv, test.csv; linked from "
        "https://github.com/zhangxiangxiao/Crepe)"
    )


class IMDB(ByteTextClassification):
    """IMDB movie-review sentiment: 25,000 training and 25,000 test reviews, 2 classes (0 neg, 1 pos).

    Layouts: HF parquet ``<root>/plain_text/{train,test}-*.parquet`` (or directly in the root;
    the ``unsupervised`` split is ignored), or the original ``<root>/aclImdb/{train,test}/{pos,neg}/*.txt``
    (``root`` may also be the ``aclImdb`` folder itself).

    Args:
        root: Data directory; default ``$LMC_DATA/imdb`` or ``~/.cache/lmc/imdb``.
        (others): See :class:`ByteTextClassification`.
    """

    name, title = "imdb", "IMDB"
    num_classes = 2
    hf_repos = ("stanfordnlp/imdb", "imdb")
    parquet_subdirs = ("plain_text", "")
    source = (
        "https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz and extract it (folder aclImdb/), or the "
        "parquet files of https://huggingface.co/datasets/stanfordnlp/imdb (folder plain_text/)"
    )
    sentiments = ("neg", "pos")  # label = position

    def _acl_dirs(self, directory: Path) -> list[Path]:
        return [directory / "aclImdb", directory]

    def read_original(self, directory: Path) -> dict[str, LabelledTexts] | None:
        for folder in self._acl_dirs(directory):
            split_dirs = [folder / split / sentiment for split in ("train", "test") for sentiment in self.sentiments]
            if all(split_dir.is_dir() for split_dir in split_dirs):
                return {split: self._read_reviews(folder / split) for split in ("train", "test")}
        return None

    def _read_reviews(self, split_dir: Path) -> LabelledTexts:
        texts, labels = [], []
        for label, sentiment in enumerate(self.sentiments):
            for path in sorted((split_dir / sentiment).glob("*.txt")):
                texts.append(path.read_text(encoding="utf-8"))
                labels.append(label)
        return texts, labels

    def original_layout(self, root: Path) -> list[str]:
        return [f"{folder}/{{train,test}}/{{pos,neg}}/*.txt" for folder in self._acl_dirs(root)]


# ---------------------------------------------------------------------------------------------
# Causal language modelling.
# ---------------------------------------------------------------------------------------------


class ByteLanguageModelling(LMCDataModule):
    """Shared loader of the byte-level language-modelling corpora.

    A subclass returns the ``train`` / ``val`` / ``test`` byte streams in :meth:`read_streams`.

    Args:
        root: Data directory; default ``$LMC_DATA/<name>`` or ``~/.cache/lmc/<name>``.
        sequence_length: Tokens (bytes) per window.
        (others): See :class:`~lmc.data.base.LMCDataModule`.
    """

    task = "causal_lm"
    num_classes = BYTE_VOCAB_SIZE
    vocab_size = BYTE_VOCAB_SIZE
    #: Directory name under ``$LMC_DATA`` / ``~/.cache/lmc``.
    name: str
    #: Name in messages.
    title: str

    def __init__(
        self,
        batch_size: int = 32,
        num_workers: int = 0,
        part: Part = "all",
        seed: int = 0,
        root: str | None = None,
        sequence_length: int = 256,
    ):
        super().__init__(batch_size, num_workers, part, seed)
        self.root, self.sequence_length = root, sequence_length

    def read_streams(self) -> dict[str, torch.Tensor | list[torch.Tensor]]:
        """``{"train", "val", "test"}`` -> ``uint8`` byte streams (a list: pieces that windows must not straddle)."""
        raise NotImplementedError

    def build(self) -> None:
        streams = self.read_streams()
        self.train_set = byte_windows(streams["train"], self.sequence_length, "train")
        self.val_set = byte_windows(streams["val"], self.sequence_length, "val")
        self.test_set = byte_windows(streams["test"], self.sequence_length, "test")

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "sequence_length": self.sequence_length}


class WikiText103(ByteLanguageModelling):
    """WikiText-103 (raw, character-level version): ~540 MB of Wikipedia articles, official splits.

    Layouts: ``wiki.{train,valid,test}.raw`` in the root or in ``<root>/wikitext-103-raw/``, or
    the HF parquet export ``<root>/wikitext-103-raw-v1/{train,validation,test}-*.parquet``
    (column ``text``, one line per row with its newline; the rows are joined back).

    Args:
        root: Data directory; default ``$LMC_DATA/wikitext103`` or ``~/.cache/lmc/wikitext103``
            (then any copy in the local HF hub cache).
        (others): See :class:`ByteLanguageModelling`.
    """

    name, title = "wikitext103", "WikiText-103"
    hf_repos = ("Salesforce/wikitext", "wikitext")
    raw_files = {"train": "wiki.train.raw", "val": "wiki.valid.raw", "test": "wiki.test.raw"}
    parquet_splits = {"train": "train", "val": "validation", "test": "test"}

    def read_streams(self) -> dict[str, torch.Tensor | list[torch.Tensor]]:
        for directory in _search_dirs(self.name, self.root, self.hf_repos):
            for folder in (directory, directory / "wikitext-103-raw"):
                if all((folder / file).is_file() for file in self.raw_files.values()):
                    return {split: read_bytes([folder / file]) for split, file in self.raw_files.items()}
            shards = find_parquet(directory, ("wikitext-103-raw-v1", ""), tuple(self.parquet_splits.values()))
            if shards is not None:
                loaded = load_parquet(shards)
                return {split: joined_text_bytes(loaded[name]) for split, name in self.parquet_splits.items()}
        root = data_root(self.name, self.root)
        raise data_unavailable(
            self.title,
            self.name,
            root,
            [
                f"{root}/wiki.{{train,valid,test}}.raw",
                f"{root}/wikitext-103-raw/wiki.{{train,valid,test}}.raw",
                f"{root}/wikitext-103-raw-v1/{{train,validation,test}}-*.parquet",
            ],
            "https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-raw-v1.zip and unzip it (folder "
            "wikitext-103-raw/), or the folder wikitext-103-raw-v1/ of https://huggingface.co/datasets/Salesforce/wikitext",
        )


class Enwik8(ByteLanguageModelling):
    """enwik8: the first 100,000,000 bytes of an English Wikipedia XML dump (Hutter Prize).

    Split as is standard: the first 90M bytes train, the next 5M validate, the last 5M test;
    a shorter file is split 90 / 5 / 5 % alike.

    Args:
        root: Data directory holding the file ``enwik8`` (or the file itself); default
            ``$LMC_DATA/enwik8`` or ``~/.cache/lmc/enwik8``.
        (others): See :class:`ByteLanguageModelling`.
    """

    name, title = "enwik8", "enwik8"
    standard_size = 100_000_000

    def read_streams(self) -> dict[str, torch.Tensor | list[torch.Tensor]]:
        root = data_root(self.name, self.root)
        path = root if root.is_file() else root / "enwik8"
        if not path.is_file():
            raise data_unavailable(
                self.title,
                self.name,
                root,
                [path],
                "http://mattmahoney.net/dc/enwik8.zip and unzip it (one file, enwik8, of 100,000,000 bytes)",
            )
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
        (others): See :class:`ByteLanguageModelling`.
    """

    name, title = "one_billion_word", "One Billion Word"
    release_folder = "1-billion-word-language-modeling-benchmark-r13output"
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
    ):
        super().__init__(batch_size, num_workers, part, seed, root, sequence_length)
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
            raise data_unavailable(
                self.title,
                self.name,
                root,
                [f"{folder}/{self.train_glob} and {folder}/{self.test_file}" for folder in folders],
                "http://www.statmt.org/lm-benchmark/1-billion-word-language-modeling-benchmark-r13output.tar.gz "
                f"and extract it (folder {self.release_folder}/)",
            )
        train = read_bytes(train_files[: self.train_shards])
        n_val = max(1, int(len(train) * self.val_fraction))
        start = int(torch.randint(len(train) - n_val + 1, (1,), generator=torch.Generator().manual_seed(self.seed)))
        return {
            # Slices are views: the training stream is not copied around the cut-out stretch.
            "train": [train[:start], train[start + n_val :]],
            "val": train[start : start + n_val],
            "test": read_bytes([folder / self.test_file]),
        }
