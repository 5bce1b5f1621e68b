"""Byte-level text classification: AG News (4 classes), IMDB (2), DBPedia-14 (14).

Each set is read from the HF hub parquet export or from its original distribution (the Zhang
et al. 2015 CSVs, ``aclImdb``); texts are truncated / right-padded to ``sequence_length`` bytes
(byte ``b`` is token ``b + 1``, 0 pads). A validation split is carved from the training split
with ``seed``; the official test split is the test set. Nothing is downloaded: absent data
raises :class:`~lmc.data.base.DataUnavailableError` saying what to fetch and where to put it,
an unreadable file :class:`~lmc.data.base.CorruptDataError` naming it.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.utils.data import Dataset

from lmc.data.base import (
    BYTE_VOCAB_SIZE,
    LMCDataModule,
    Part,
    data_root,
    data_unavailable,
    encode_bytes,
    pad_texts,
    reading,
    split_off_validation,
)
from lmc.data.files import find_parquet, read_parquet, search_dirs
from lmc.tasks import DataInfo

if TYPE_CHECKING:
    import pyarrow

#: A split of a classification set: texts and their 0-based labels.
LabelledTexts = tuple[list[str], list[int]]


class PaddedTokenTexts(Dataset):
    """Fixed-length token-id texts, stored as ``int16`` (byte ids reach 256, word ids stay below
    32,768) and widened when read.

    Args:
        ids: ``(N, T)`` token ids (byte or word ids), 0 = padding.
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

    Raises:
        ValueError: A row's class is not a number (wrap the call in :func:`~lmc.data.base.reading`).
    """
    texts, labels = [], []
    with open(path, newline="", encoding="utf-8") as file:
        rows = csv.reader(file, quotechar='"', delimiter=",", quoting=csv.QUOTE_ALL, skipinitialspace=True)
        for row in rows:
            if not row:
                continue
            if not row[0].isdigit():
                raise ValueError(f"line {rows.line_num} starts with {row[0][:20]!r}, not a class number")
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
        train_samples: Train on only this many samples of the part's training split (``None``: all of
            them); see :class:`~lmc.data.base.LMCDataModule`.
        (others): See :class:`~lmc.data.base.LMCDataModule`.
    """

    task = "text_classification"
    num_classes: int
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
    #: What to download from where (for the messages on missing or corrupt files).
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
        train_samples: int | None = None,
    ):
        super().__init__(batch_size, num_workers, part, seed, train_samples)
        self.root, self.sequence_length, self.val_fraction = root, sequence_length, val_fraction

    @property
    def info(self) -> DataInfo:
        return DataInfo(
            self.task, num_classes=self.num_classes, vocab_size=BYTE_VOCAB_SIZE, sequence_length=self.sequence_length
        )

    def read_original(self, directory: Path) -> dict[str, LabelledTexts] | None:
        """The ``train`` / ``test`` splits from the original distribution under ``directory``, or ``None``."""
        return None

    def original_layout(self, root: Path) -> list[str]:
        """The original distribution's paths, for the missing-data message."""
        return []

    def read_splits(self) -> dict[str, LabelledTexts]:
        """The official ``train`` and ``test`` splits, from the first layout found."""
        for directory in search_dirs(self.name, self.root, self.hf_repos):
            shards = find_parquet(directory, self.parquet_subdirs, ("train", "test"))
            if shards is not None:
                columns = (*self.text_columns, "label")
                return {
                    split: self._parquet_texts(read_parquet(paths, columns, self.title, self.source))
                    for split, paths in shards.items()
                }
            original = self.read_original(directory)
            if original is not None:
                return original
        root = data_root(self.name, self.root)
        parquet = [f"{root / subdir}/{{train,test}}-*.parquet" for subdir in self.parquet_subdirs]
        raise data_unavailable(self.title, self.name, root, parquet + self.original_layout(root), self.source)

    def _parquet_texts(self, table: pyarrow.Table) -> LabelledTexts:
        columns = [table.column(name).to_pylist() for name in self.text_columns]
        texts = [" ".join(parts) for parts in zip(*columns)] if len(columns) > 1 else columns[0]
        return texts, table.column("label").to_pylist()

    def build(self) -> None:
        splits = self.read_splits()
        texts, labels = splits["train"]
        ids, labels = encode_texts(texts, self.sequence_length), torch.tensor(labels, dtype=torch.long)
        train, val = split_off_validation(len(labels), self.val_fraction, self.seed)
        self.train_set = PaddedTokenTexts(ids[train], labels[train])
        self.val_set = PaddedTokenTexts(ids[val], labels[val])
        test_texts, test_labels = splits["test"]
        self.test_set = PaddedTokenTexts(encode_texts(test_texts, self.sequence_length), torch.tensor(test_labels))


class _ZhangCSV(ByteTextClassification):
    """A set distributed as Zhang et al. (2015) ``train.csv`` / ``test.csv``, in the root or ``csv_folder``."""

    csv_folder: str

    def _csv_dirs(self, directory: Path) -> list[Path]:
        return [directory, directory / self.csv_folder]

    def read_original(self, directory: Path) -> dict[str, LabelledTexts] | None:
        for folder in self._csv_dirs(directory):
            if (folder / "train.csv").is_file() and (folder / "test.csv").is_file():
                splits = {}
                for split in ("train", "test"):
                    with reading(self.title, folder / f"{split}.csv", self.source):
                        splits[split] = read_class_csv(folder / f"{split}.csv")
                return splits
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
        train_samples: Train on only this many samples of the part's training split (``None``: all of
            them); see :class:`~lmc.data.base.LMCDataModule`.
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
        train_samples: Train on only this many samples of the part's training split (``None``: all of
            them); see :class:`~lmc.data.base.LMCDataModule`.
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
        train_samples: Train on only this many samples of the part's training split (``None``: all of
            them); see :class:`~lmc.data.base.LMCDataModule`.
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
                with reading(self.title, path, self.source):
                    texts.append(path.read_text(encoding="utf-8"))
                labels.append(label)
        return texts, labels

    def original_layout(self, root: Path) -> list[str]:
        return [f"{folder}/{{train,test}}/{{pos,neg}}/*.txt" for folder in self._acl_dirs(root)]
