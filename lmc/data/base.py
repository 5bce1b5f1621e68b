"""The DataModule contract every lmc data set follows.

Batches are dicts, the same for every model (adapters map them to each model's arguments):

- image classification: ``inputs`` float ``(B, C, H, W)``, ``labels`` long ``(B,)``;
- text classification: ``inputs`` long ``(B, T)`` byte ids (0 is padding),
  ``attention_mask`` long ``(B, T)``, ``labels`` long ``(B,)``;
- causal language modelling: ``inputs`` long ``(B, T)``, ``labels`` long ``(B, T)`` (the
  inputs shifted by one);
- masked language modelling (the user's data for BERT masked-LM and pre-training models,
  :mod:`lmc.formats.masked_lm`; no DataModule): ``inputs`` long ``(B, T)`` with the chosen
  tokens masked, ``attention_mask`` long ``(B, T)``, ``labels`` long ``(B, T)`` (the original
  token at chosen positions, :data:`NOT_SCORED` elsewhere); with sentence pairs also
  ``token_type_ids`` long ``(B, T)`` and ``next_sentence_label`` long ``(B,)``.

``part`` selects the data a run trains on: ``"all"``, or one of two disjoint halves ``"A"``
and ``"B"`` of the training split, so that "pre-train on A, fine-tune on B" works on any data
set; ``train_samples`` trains on fewer samples of that part, a seeded subset that grows with it
(a smaller size is a subset of a larger one). Validation and test splits are the same for every
part and size.

A DataModule's :attr:`~LMCDataModule.info` (a :class:`~lmc.tasks.DataInfo`) tells models its
task and sizes. Data that is not on disk raises :class:`DataUnavailableError`; a file that is
on disk but unreadable raises its subclass :class:`CorruptDataError`, naming the file.
"""

from __future__ import annotations

import csv
import os
import pickle
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Literal, get_args

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Subset

from lmc.tasks import DataInfo, Task

#: The three splits of every data set.
Split = Literal["train", "val", "test"]
SPLITS: tuple[Split, ...] = get_args(Split)
#: The training data a run uses: all of it, or one of two disjoint halves.
Part = Literal["all", "A", "B"]
PARTS: tuple[Part, ...] = get_args(Part)

#: Byte-level tokens: byte ``b`` is id ``b + 1``; id 0 pads.
BYTE_VOCAB_SIZE = 257
#: The label of a token that is not scored: torch's ``cross_entropy`` ``ignore_index``, HF's ``labels=`` convention.
NOT_SCORED = -100


class DataUnavailableError(FileNotFoundError):
    """A data set is not on disk (and cannot be downloaded here); the message says what to fetch."""


class CorruptDataError(DataUnavailableError):
    """A data-set file is on disk but unreadable (truncated, garbage); the message names it and its source."""


def data_root(name: str, root: str | os.PathLike | None = None) -> Path:
    """The directory a data set is read from.

    Args:
        name: The data set's directory name (e.g. ``"cifar10"``).
        root: An explicit directory; wins when given.

    Returns:
        ``root`` if given, else ``$LMC_DATA/<name>`` if ``LMC_DATA`` is set, else ``~/.cache/lmc/<name>``.
    """
    if root is not None:
        return Path(root).expanduser()
    if os.environ.get("LMC_DATA"):
        return Path(os.environ["LMC_DATA"]).expanduser() / name
    return Path.home() / ".cache" / "lmc" / name


def data_unavailable(
    title: str, name: str, root: Path, expected: Sequence[str | Path], source: str
) -> DataUnavailableError:
    """The error for a data set that is not on disk.

    Args:
        title: The data set's name as people write it (``"CIFAR-10"``).
        name: Its directory name under the default roots (``"cifar10"``).
        root: The root that was searched.
        expected: Every path (or pattern) that was looked for; any one layout suffices.
        source: What to download, from where, and how to unpack it.

    Returns:
        A :class:`~lmc.data.base.DataUnavailableError` (raise it).
    """
    looked_for = " or ".join(str(path) for path in expected)
    how = (
        f"Download {source}; put it under {root} (the default root is $LMC_DATA/{name} if LMC_DATA is set, else "
        f"~/.cache/lmc/{name}; pass root=... to read another directory). Nothing is downloaded automatically."
    )
    return DataUnavailableError(f"{title} was not found: expected {looked_for}. {how}")


#: What parsing a damaged file raises (``PermissionError``, an ``OSError`` too, is not damage).
_PARSE_ERRORS = (ValueError, EOFError, pickle.UnpicklingError, KeyError, IndexError, TypeError, csv.Error, OSError)


@contextmanager
def reading(title: str, path: str | os.PathLike, source: str) -> Iterator[None]:
    """Report any error of parsing ``path`` inside the block as a :class:`CorruptDataError` naming the file.

    Args:
        title: The data set's name as people write it (``"CIFAR-10"``).
        path: The file being read.
        source: Where a fresh copy comes from (as for :func:`data_unavailable`).
    """
    try:
        yield
    except PermissionError:
        raise
    except _PARSE_ERRORS as error:
        raise CorruptDataError(
            f"{title}: cannot read {path} ({type(error).__name__}: {error}); the file is corrupt or truncated. "
            f"Delete it and download it again: {source}"
        ) from error


def split_off_validation(count: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministically carve a validation split from a training split.

    Args:
        count: Samples in the training split.
        val_fraction: Share of them held out for validation (at least one sample).
        seed: Seed of the permutation.

    Returns:
        ``(train_indices, val_indices)``, disjoint, each sorted (sequential reads stay local).
    """
    n_val = max(1, int(count * val_fraction))
    if not 0 < val_fraction < 1 or n_val >= count:
        raise ValueError(f"val_fraction={val_fraction} leaves no training or no validation data out of {count}")
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
    return order[n_val:].sort().values.tolist(), order[:n_val].sort().values.tolist()


# ---------------------------------------------------------------------------------------------
# Datasets yielding lmc's dict batches.
# ---------------------------------------------------------------------------------------------


def encode_bytes(text: str | bytes) -> torch.Tensor:
    """Byte-level ids (``byte + 1``), shape ``(len,)``."""
    data = text.encode("utf-8") if isinstance(text, str) else text
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long() + 1


class TensorDictDataset(Dataset):
    """A dataset of dict samples backed by tensors with one row per sample."""

    def __init__(self, **tensors: torch.Tensor):
        lengths = {len(t) for t in tensors.values()}
        if len(lengths) != 1:
            raise ValueError(f"all tensors need one row per sample, got lengths {sorted(lengths)}")
        self.tensors = tensors

    def __len__(self) -> int:
        return len(next(iter(self.tensors.values())))

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {name: t[index] for name, t in self.tensors.items()}


class TokenWindows(Dataset):
    """Causal-LM samples: windows of ``length + 1`` tokens from one token stream.

    Windows start every ``length`` tokens (non-overlapping targets), so an evaluation visits
    each token once. Large corpora can stay compact: pass raw bytes as ``uint8`` with
    ``offset=1`` and each window is converted to byte ids when read.

    Args:
        tokens: The stream, shape ``(N,)``, any integer dtype.
        length: Tokens per window (the model's sequence length).
        offset: Added to every token when a window is read.
    """

    def __init__(self, tokens: torch.Tensor, length: int, offset: int = 0):
        if len(tokens) < length + 1:
            raise ValueError(f"a stream of {len(tokens)} tokens is shorter than one window of {length + 1}")
        self.tokens, self.length, self.offset = tokens, length, offset

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = self.tokens[index * self.length : index * self.length + self.length + 1].long() + self.offset
        return {"inputs": window[:-1], "labels": window[1:]}


def pad_texts(texts: Sequence[torch.Tensor], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncate or right-pad byte-id sequences to ``length``: ``(ids, attention_mask)``, each ``(N, length)``."""
    ids = torch.zeros(len(texts), length, dtype=torch.long)
    for row, text in enumerate(texts):
        ids[row, : min(length, len(text))] = text[:length]
    return ids, (ids != 0).long()


class LMCDataModule(L.LightningDataModule):
    """Base of every lmc DataModule.

    Subclasses set :attr:`task`, report their sizes in :attr:`info` and build
    ``self.train_set``, ``self.val_set`` and ``self.test_set`` in :meth:`build`; this class
    handles parts and loaders.

    Args:
        batch_size: Samples per batch.
        num_workers: DataLoader worker processes.
        part: ``"all"``, ``"A"`` or ``"B"`` (disjoint halves of the training split).
        seed: Seed of the splits (and of the A/B halving and the ``train_samples`` subset).
        train_samples: Train on only this many samples of the part's training split: the first
            ``train_samples`` of a shuffle seeded by ``seed`` (``None``: all of them).
    """

    #: What a model does with the batches (see :mod:`lmc.tasks`).
    task: Task

    def __init__(
        self,
        batch_size: int = 64,
        num_workers: int = 0,
        part: Part = "all",
        seed: int = 0,
        train_samples: int | None = None,
    ):
        super().__init__()
        if part not in PARTS:
            raise ValueError(f"part={part!r}; choose one of {', '.join(PARTS)}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if train_samples is not None and train_samples < 1:
            raise ValueError(f"train_samples must be at least 1 (None: the whole training split), got {train_samples}")
        self.batch_size, self.num_workers, self.part, self.seed = batch_size, num_workers, part, seed
        self.train_samples = train_samples
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None

    def build(self) -> None:
        """Create ``train_set``, ``val_set`` and ``test_set`` (the full training split)."""
        raise NotImplementedError(f"{type(self).__name__} must implement build()")

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        self.build()
        # One generator draws the halving, then the subset: the subset's draw is the same for
        # every size (so sizes are nested) and independent of the halving's.
        generator = torch.Generator().manual_seed(self.seed)
        kept = torch.arange(len(self.train_set))
        if self.part != "all":
            order = torch.randperm(len(kept), generator=generator)
            half = len(order) // 2
            kept = order[:half] if self.part == "A" else order[half:]
        if self.train_samples is not None:
            if self.train_samples > len(kept):
                raise ValueError(
                    f"train_samples={self.train_samples} is more than the {len(kept)} training samples of part "
                    f"{self.part!r} of {type(self).__name__}: give at most {len(kept)}, or None for all of them"
                )
            kept = kept[torch.randperm(len(kept), generator=generator)[: self.train_samples]]
        if self.part != "all" or self.train_samples is not None:
            self.train_set = Subset(self.train_set, kept.sort().values.tolist())

    def _loader(self, dataset: Dataset, shuffle: bool) -> DataLoader:
        # Each loader draws its order and worker seeds from its own generator, seeded by the run's
        # seed: otherwise every validation pass consumes the global generator and changes the
        # shuffle of all later epochs (and dropout), so results would depend on validation settings.
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            generator=torch.Generator().manual_seed(torch.initial_seed()),
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, shuffle=False)

    def split(self, name: Split) -> Dataset:
        """The ``"train"``, ``"val"`` or ``"test"`` dataset (after :meth:`setup`)."""
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}; choose one of {', '.join(SPLITS)}")
        self.setup()
        return {"train": self.train_set, "val": self.val_set, "test": self.test_set}[name]

    @property
    def info(self) -> DataInfo:
        """The task and sizes models are built to fit (the CLI links it into ``model.data``)."""
        raise NotImplementedError(f"{type(self).__name__} must define the property info")
