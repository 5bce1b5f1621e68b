"""Loaders for the paper's image-classification data sets: MNIST, CIFAR-10, CIFAR-100 and ImageNet-1k.

Every set is read offline from its usual on-disk format (nothing is downloaded; absent data
raises :class:`~lmc.data.base.DataUnavailableError` saying what to fetch and where to put it).
Images come out as float ``(C, H, W)`` tensors normalised with the data set's customary
per-channel mean and standard deviation. MNIST and CIFAR have no official validation split:
one is carved from the training split with ``seed``; the official test split stays the test set.
ImageNet's official validation images (``val/``) serve as the test set, as in the literature.

MNIST's idx files and CIFAR's pickles are parsed by the small readers below, each documenting
its format; a file that does not follow it raises :class:`~lmc.data.base.CorruptDataError`
naming the file, as does an unreadable ImageNet image.
"""

from __future__ import annotations

import math
import pickle
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import Dataset

from lmc.data.base import (
    CorruptDataError,
    LMCDataModule,
    Part,
    data_root,
    data_unavailable,
    reading,
    split_off_validation,
)
from lmc.tasks import DataInfo

if TYPE_CHECKING:
    from torchvision.datasets import ImageFolder


class NormalizedImages(Dataset):
    """Images kept as compact ``uint8`` and normalised when read.

    Args:
        images: ``(N, C, H, W)`` uint8 pixels.
        labels: ``(N,)`` class indices.
        mean: Per-channel mean of pixels scaled to ``[0, 1]``, length ``C``.
        std: Per-channel standard deviation, length ``C``.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, mean: Sequence[float], std: Sequence[float]):
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images, self.labels = images, labels.long()
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        pixels = self.images[index].float() / 255  # (C, H, W) in [0, 1]
        return {"inputs": (pixels - self.mean) / self.std, "labels": self.labels[index]}


class ImageFiles(Dataset):
    """Images of a torchvision ``ImageFolder`` as lmc dict samples; an unreadable image file is named.

    Args:
        folder: The image folder (with its transform).
        indices: The samples used, in order (``None``: all).
        title: The data set's name, for the error on an unreadable file.
        source: Where a fresh copy comes from, for that error.
    """

    def __init__(self, folder: ImageFolder, indices: Sequence[int] | None, title: str, source: str):
        self.folder, self.title, self.source = folder, title, source
        self.indices = list(range(len(folder))) if indices is None else list(indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sample = self.indices[index]
        with reading(self.title, self.folder.samples[sample][0], self.source):
            image, label = self.folder[sample]
        return {"inputs": image, "labels": torch.tensor(label, dtype=torch.long)}


# ---------------------------------------------------------------------------------------------
# Readers of the official file formats.
# ---------------------------------------------------------------------------------------------


def read_idx(path: Path, sample_shape: tuple[int, ...]) -> torch.Tensor:
    """An idx file of unsigned bytes, the format of LeCun's MNIST files: ``uint8 (N, *sample_shape)``.

    The format: the magic bytes ``00 00 08 ndim`` (``08`` = unsigned byte), then ``ndim`` sizes
    as big-endian int32, then the values in C order. Raises ``ValueError`` saying what is wrong
    with a file that does not follow it (wrap the call in :func:`~lmc.data.base.reading`).
    """
    data = path.read_bytes()
    if len(data) < 4 or data[:3] != b"\x00\x00\x08":
        raise ValueError("not an idx file of unsigned bytes (its first bytes are not 00 00 08)")
    header = 4 + 4 * data[3]
    if len(data) < header:
        raise ValueError(f"the header of {data[3]} sizes is cut off")
    shape = struct.unpack(f">{data[3]}i", data[4:header])
    if tuple(shape[1:]) != sample_shape:
        raise ValueError(f"it holds an array of shape {shape}, not (N, {', '.join(map(str, sample_shape))})")
    if len(data) - header != math.prod(shape):
        raise ValueError(f"{len(data) - header} bytes of values follow the header, which announces {math.prod(shape)}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)[header:].view(shape)


class _CIFARUnpickler(pickle.Unpickler):
    """Unpickles what a CIFAR batch holds (a dict of lists, strings and numpy arrays) and refuses any other object.

    ``pickle.load`` would call whatever a tampered file names; a CIFAR batch names only numpy's
    array reconstruction (under numpy 1 or numpy 2 module names) and, re-pickled by Python 3 with
    protocol 2, ``_codecs.encode``.
    """

    allowed = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.allowed:
            raise pickle.UnpicklingError(f"it refers to {module}.{name}, which no CIFAR batch holds")
        return super().find_class(module, name)


def read_cifar_batch(path: Path, label_key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One pickle of the CIFAR python version: ``(images (N, 3, 32, 32) uint8, labels (N,) long)``.

    The format (https://www.cs.toronto.edu/~kriz/cifar.html): a pickled dict (written by
    Python 2, hence ``latin1``) whose ``data`` is a ``uint8`` array of shape ``(N, 3072)``, each
    row the 1,024 red, then green, then blue values of a 32x32 image in row-major order, and
    whose ``label_key`` (``labels``; ``fine_labels`` or ``coarse_labels`` for CIFAR-100) lists
    ``N`` class indices. Raises ``ValueError`` or an unpickling error on a file that is not one.
    """
    with open(path, "rb") as file:
        batch = _CIFARUnpickler(file, encoding="latin1").load()
    if not isinstance(batch, dict) or "data" not in batch or label_key not in batch:
        raise ValueError(f"it is not a CIFAR batch: a dict with 'data' and {label_key!r} was expected")
    data, labels = batch["data"], batch[label_key]
    if not (isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 2 and data.shape[1] == 3072):
        raise ValueError("its 'data' is not a uint8 array of rows of 3,072 values")
    if len(labels) != len(data):
        raise ValueError(f"it holds {len(data)} images but {len(labels)} labels")
    return torch.from_numpy(data.reshape(-1, 3, 32, 32).copy()), torch.tensor(labels, dtype=torch.long)


# ---------------------------------------------------------------------------------------------
# DataModules.
# ---------------------------------------------------------------------------------------------


class _ImageSet(LMCDataModule):
    """What every image-classification set declares: names, source, classes and image sizes."""

    task = "image_classification"
    #: Directory name under ``$LMC_DATA`` / ``~/.cache/lmc``.
    name: str
    #: Name in messages.
    title: str
    #: What to download from where (for the messages on missing or corrupt files).
    source: str
    num_classes: int
    image_size: int
    in_channels: int
    #: Per-channel mean and standard deviation of pixels scaled to ``[0, 1]``.
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @property
    def info(self) -> DataInfo:
        return DataInfo(
            self.task, num_classes=self.num_classes, image_size=self.image_size, in_channels=self.in_channels
        )


class _SmallImageSet(_ImageSet):
    """Shared parts of the in-memory image sets (MNIST, CIFAR): root and validation carving."""

    def __init__(
        self,
        batch_size: int = 128,
        num_workers: int = 0,
        part: Part = "all",
        seed: int = 0,
        root: str | None = None,
        val_fraction: float = 0.1,
        train_samples: int | None = None,
    ):
        super().__init__(batch_size, num_workers, part, seed, train_samples)
        self.root, self.val_fraction = root, val_fraction

    def read_split(self, root: Path, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The official train or test split: ``(images (N, C, H, W) uint8, labels (N,) long)``."""
        raise NotImplementedError

    def build(self) -> None:
        root = data_root(self.name, self.root)
        images, labels = self.read_split(root, train=True)
        train, val = split_off_validation(len(labels), self.val_fraction, self.seed)
        self.train_set = NormalizedImages(images[train], labels[train], self.mean, self.std)
        self.val_set = NormalizedImages(images[val], labels[val], self.mean, self.std)
        self.test_set = NormalizedImages(*self.read_split(root, train=False), self.mean, self.std)


class MNIST(_SmallImageSet):
    """MNIST handwritten digits: 60,000 training and 10,000 test images, ``(B, 1, 28, 28)``, 10 classes.

    Reads the four uncompressed idx-ubyte files (``train-images-idx3-ubyte``,
    ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``) from
    ``root``, ``root/raw`` or torchvision's ``root/MNIST/raw``.

    Args:
        root: Data directory; default ``$LMC_DATA/mnist`` or ``~/.cache/lmc/mnist``.
        val_fraction: Share of the training images held out for validation.
        train_samples: Train on only this many samples of the part's training split (``None``: all of
            them); see :class:`~lmc.data.base.LMCDataModule`.
        (others): See :class:`~lmc.data.base.LMCDataModule`.
    """

    name, title = "mnist", "MNIST"
    source = (
        "the four files from https://ossci-datasets.s3.amazonaws.com/mnist/ (or http://yann.lecun.com/exdb/mnist/), "
        "gunzip them (the .gz archives are not read)"
    )
    num_classes = 10
    image_size = 28
    in_channels = 1
    mean, std = (0.1307,), (0.3081,)
    files = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")

    def _directory(self, root: Path) -> Path:
        candidates = [root, root / "raw", root / "MNIST" / "raw"]
        for directory in candidates:
            if all((directory / name).is_file() for name in self.files):
                return directory
        expected = [f"{directory}/{{{','.join(self.files)}}}" for directory in candidates]
        raise data_unavailable(self.title, self.name, root, expected, self.source)

    def read_split(self, root: Path, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
        directory = self._directory(root)
        prefix = "train" if train else "t10k"
        images_path, labels_path = directory / f"{prefix}-images-idx3-ubyte", directory / f"{prefix}-labels-idx1-ubyte"
        with reading(self.title, images_path, self.source):
            images = read_idx(images_path, (self.image_size, self.image_size))
        with reading(self.title, labels_path, self.source):
            labels = read_idx(labels_path, ())
        if len(images) != len(labels):
            raise CorruptDataError(
                f"{self.title}: {images_path} holds {len(images)} images but {labels_path} {len(labels)} labels; "
                f"one of them is corrupt or truncated. Delete both and download them again: {self.source}"
            )
        return images.unsqueeze(1), labels.long()  # (N, 1, 28, 28) uint8, (N,)


class CIFAR10(_SmallImageSet):
    """CIFAR-10: 50,000 training and 10,000 test colour images, ``(B, 3, 32, 32)``, 10 classes.

    Reads the python pickles of ``cifar-10-python.tar.gz`` (``root/cifar-10-batches-py/``:
    ``data_batch_1`` ... ``data_batch_5``, ``test_batch``) with :func:`read_cifar_batch`.

    Args:
        root: Data directory (holding ``cifar-10-batches-py``, or that folder itself); default
            ``$LMC_DATA/cifar10`` or ``~/.cache/lmc/cifar10``.
        val_fraction: Share of the training images held out for validation.
        train_samples: Train on only this many samples of the part's training split (``None``: all of
            them); see :class:`~lmc.data.base.LMCDataModule`.
        (others): See :class:`~lmc.data.base.LMCDataModule`.
    """

    name, title = "cifar10", "CIFAR-10"
    source = (
        "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz and extract it (tar xzf) so that the folder "
        "cifar-10-batches-py lies in the root"
    )
    num_classes = 10
    image_size = 32
    in_channels = 3
    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    #: The extracted folder and its training and test pickles.
    folder = "cifar-10-batches-py"
    train_files = ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5")
    test_files = ("test_batch",)
    #: The labels read from each pickle.
    label_key = "labels"

    def read_split(self, root: Path, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
        files = self.train_files + self.test_files
        # Accept root pointing at the extracted folder itself as well as at its parent.
        directory = next((parent / self.folder for parent in (root, root.parent) if self._holds_all(parent)), None)
        if directory is None:
            expected = [f"{root / self.folder}/{{{','.join(files)}}}"]
            raise data_unavailable(self.title, self.name, root, expected, self.source)
        batches = []
        for name in self.train_files if train else self.test_files:
            with reading(self.title, directory / name, self.source):
                batches.append(read_cifar_batch(directory / name, self.label_key))
        images, labels = zip(*batches)
        return torch.cat(images), torch.cat(labels)

    def _holds_all(self, parent: Path) -> bool:
        return all((parent / self.folder / name).is_file() for name in self.train_files + self.test_files)


class CIFAR100(CIFAR10):
    """CIFAR-100: 50,000 training and 10,000 test colour images, ``(B, 3, 32, 32)``, 100 fine classes.

    Reads the python pickles of ``cifar-100-python.tar.gz`` (``root/cifar-100-python/``:
    ``train``, ``test``); labels are the fine labels.

    Args:
        root: Data directory (holding ``cifar-100-python``, or that folder itself); default
            ``$LMC_DATA/cifar100`` or ``~/.cache/lmc/cifar100``.
        val_fraction: Share of the training images held out for validation.
        train_samples: Train on only this many samples of the part's training split (``None``: all of
            them); see :class:`~lmc.data.base.LMCDataModule`.
        (others): See :class:`~lmc.data.base.LMCDataModule`.
    """

    name, title = "cifar100", "CIFAR-100"
    source = (
        "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz and extract it (tar xzf) so that the folder "
        "cifar-100-python lies in the root"
    )
    num_classes = 100
    mean, std = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
    folder = "cifar-100-python"
    train_files, test_files = ("train",), ("test",)
    label_key = "fine_labels"


class ImageNet(_ImageSet):
    """ImageNet-1k (ILSVRC-2012) from an image folder, ``(B, 3, image_size, image_size)``, 1,000 classes.

    Expects ``root/train/<wnid>/*.JPEG`` and ``root/val/<wnid>/*.JPEG`` (the validation images
    sorted into class folders). Images are resized to ``image_size * 256 / 224`` on the short
    side, center-cropped to ``image_size`` and normalised with the ImageNet mean / std; labels
    index the sorted wnids. The official validation images are the test set; a validation
    split is carved from the training images with ``seed``.

    Args:
        root: Data directory; default ``$LMC_DATA/imagenet`` or ``~/.cache/lmc/imagenet``.
        image_size: Side of the square crop.
        val_fraction: Share of the training images held out for validation.
        train_samples: Train on only this many samples of the part's training split (``None``: all of
            them); see :class:`~lmc.data.base.LMCDataModule`.
        (others): See :class:`~lmc.data.base.LMCDataModule`.
    """

    name, title = "imagenet", "ImageNet"
    source = (
        "ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar from https://image-net.org/download.php "
        "(account needed; or the Kaggle 'imagenet-object-localization-challenge' copy), extract the "
        "per-class train tars into train/<wnid>/ and sort the validation images into val/<wnid>/ "
        "(e.g. with the widely used valprep.sh)"
    )
    num_classes = 1000
    in_channels = 3
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)

    def __init__(
        self,
        batch_size: int = 128,
        num_workers: int = 0,
        part: Part = "all",
        seed: int = 0,
        root: str | None = None,
        image_size: int = 224,
        val_fraction: float = 0.01,
        train_samples: int | None = None,
    ):
        super().__init__(batch_size, num_workers, part, seed, train_samples)
        self.root, self.image_size, self.val_fraction = root, image_size, val_fraction

    def build(self) -> None:
        from torchvision import transforms
        from torchvision.datasets import ImageFolder

        root = data_root(self.name, self.root)
        folders = {split: root / split for split in ("train", "val")}
        if not all(folder.is_dir() and any(p.is_dir() for p in folder.iterdir()) for folder in folders.values()):
            expected = [f"{folders['train']}/<wnid>/*.JPEG and {folders['val']}/<wnid>/*.JPEG"]
            raise data_unavailable(self.title, self.name, root, expected, self.source)
        transform = transforms.Compose(
            [
                transforms.Resize(round(self.image_size * 256 / 224)),
                transforms.CenterCrop(self.image_size),
                transforms.ToTensor(),
                transforms.Normalize(self.mean, self.std),
            ]
        )
        train_images = ImageFolder(str(folders["train"]), transform=transform)
        test_images = ImageFolder(str(folders["val"]), transform=transform)
        if train_images.classes != test_images.classes:
            raise ValueError(
                f"ImageNet train/ and val/ hold different class folders ({len(train_images.classes)} vs "
                f"{len(test_images.classes)}); labels would not match"
            )
        train, val = split_off_validation(len(train_images), self.val_fraction, self.seed)
        self.train_set = ImageFiles(train_images, train, self.title, self.source)
        self.val_set = ImageFiles(train_images, val, self.title, self.source)
        self.test_set = ImageFiles(test_images, None, self.title, self.source)
