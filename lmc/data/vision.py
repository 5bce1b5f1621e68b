"""Loaders for the paper's image-classification data sets: MNIST, CIFAR-10, CIFAR-100 and ImageNet-1k.

Every set is read offline from its usual on-disk format (nothing is downloaded; absent data
raises :class:`~lmc.data.base.DataUnavailableError` saying what to fetch and where to put it).
Images come out as float ``(C, H, W)`` tensors normalised with the data set's customary
per-channel mean and standard deviation. MNIST and CIFAR have no official validation split:
one is carved from the training split with ``seed``; the official test split stays the test set.
ImageNet's official validation images (``val/``) serve as the test set, as in the literature.
"""

from __future__ import annotations

import functools
import os
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, Subset

from lmc.data.base import LMCDataModule, Part, data_root, data_unavailable, split_off_validation


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


class ImageLabelDicts(Dataset):
    """Turns a torchvision-style ``(image, label)`` dataset into lmc dict samples."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        image, label = self.dataset[index]
        return {"inputs": image, "labels": torch.tensor(label, dtype=torch.long)}


@functools.cache
def _torchvision_readers() -> dict[str, type]:
    """torchvision's MNIST / CIFAR classes, adjusted to read local files without a download step.

    torchvision's CIFAR classes verify md5 sums, which only the official files pass; these
    subclasses only require the files to be present, so the real pickle format is still what
    is parsed. The MNIST subclass reads the idx-ubyte files from ``root`` itself instead of
    ``root/MNIST/raw``.
    """
    from torchvision import datasets

    class LocalMNIST(datasets.MNIST):
        @property
        def raw_folder(self) -> str:
            return str(self.root)

        def _check_legacy_exist(self) -> bool:
            return False

    class PresentFilesMixin:
        base_folder: str
        meta: dict
        root: str

        def _check_integrity(self) -> bool:
            return _cifar_files_present(type(self), Path(self.root))

        def _load_meta(self) -> None:
            with open(os.path.join(self.root, self.base_folder, self.meta["filename"]), "rb") as file:
                self.classes = pickle.load(file, encoding="latin1")[self.meta["key"]]
            self.class_to_idx = {name: index for index, name in enumerate(self.classes)}

    class LocalCIFAR10(PresentFilesMixin, datasets.CIFAR10):
        pass

    class LocalCIFAR100(PresentFilesMixin, datasets.CIFAR100):
        pass

    return {"MNIST": LocalMNIST, "CIFAR10": LocalCIFAR10, "CIFAR100": LocalCIFAR100}


def _cifar_file_names(reader: type) -> list[str]:
    """The pickles a torchvision CIFAR class reads: training batches, test batch, metadata."""
    return [name for name, _ in reader.train_list + reader.test_list] + [reader.meta["filename"]]


def _cifar_files_present(reader: type, parent: Path) -> bool:
    return all((parent / reader.base_folder / name).is_file() for name in _cifar_file_names(reader))


# ---------------------------------------------------------------------------------------------
# DataModules.
# ---------------------------------------------------------------------------------------------


class _SmallImageSet(LMCDataModule):
    """Shared parts of the in-memory image sets (MNIST, CIFAR): root, validation carving, metadata."""

    task = "image_classification"
    #: Directory name under ``$LMC_DATA`` / ``~/.cache/lmc``.
    name: str
    image_size: int
    in_channels: int
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __init__(
        self,
        batch_size: int = 128,
        num_workers: int = 0,
        part: Part = "all",
        seed: int = 0,
        root: str | None = None,
        val_fraction: float = 0.1,
    ):
        super().__init__(batch_size, num_workers, part, seed)
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

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "image_size": self.image_size, "in_channels": self.in_channels}


class MNIST(_SmallImageSet):
    """MNIST handwritten digits: 60,000 training and 10,000 test images, ``(B, 1, 28, 28)``, 10 classes.

    Reads the four uncompressed idx-ubyte files (``train-images-idx3-ubyte``,
    ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``) from
    ``root``, ``root/raw`` or torchvision's ``root/MNIST/raw``.

    Args:
        root: Data directory; default ``$LMC_DATA/mnist`` or ``~/.cache/lmc/mnist``.
        val_fraction: Share of the training images held out for validation.
        (others): See :class:`~lmc.data.base.LMCDataModule`.
    """

    name = "mnist"
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
        raise data_unavailable(
            "MNIST",
            self.name,
            root,
            [f"{directory}/{{{','.join(self.files)}}}" for directory in candidates],
            "the four files from https://ossci-datasets.s3.amazonaws.com/mnist/ (or http://yann.lecun.com/exdb/mnist/)"
            ", gunzip them (the .gz archives are not read)",
        )

    def read_split(self, root: Path, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
        dataset = _torchvision_readers()["MNIST"](str(self._directory(root)), train=train, download=False)
        return dataset.data.unsqueeze(1), dataset.targets.long()  # (N, 1, 28, 28) uint8, (N,)


class CIFAR10(_SmallImageSet):
    """CIFAR-10: 50,000 training and 10,000 test colour images, ``(B, 3, 32, 32)``, 10 classes.

    Reads the python pickles of ``cifar-10-python.tar.gz`` (``root/cifar-10-batches-py/``:
    ``data_batch_1`` ... ``data_batch_5``, ``test_batch``, ``batches.meta``).

    Args:
        root: Data directory (holding ``cifar-10-batches-py``); default ``$LMC_DATA/cifar10``
            or ``~/.cache/lmc/cifar10``.
        val_fraction: Share of the training images held out for validation.
        (others): See :class:`~lmc.data.base.LMCDataModule`.
    """

    name = "cifar10"
    num_classes = 10
    image_size = 32
    in_channels = 3
    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    title = "CIFAR-10"
    reader = "CIFAR10"
    archive = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"

    def read_split(self, root: Path, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
        reader = _torchvision_readers()[self.reader]
        # Accept root pointing at the extracted folder itself as well as at its parent.
        for parent in (root, root.parent):
            if _cifar_files_present(reader, parent):
                dataset = reader(str(parent), train=train, download=False)
                images = torch.from_numpy(dataset.data).permute(0, 3, 1, 2).contiguous()  # HWC -> (N, C, H, W)
                return images, torch.tensor(dataset.targets, dtype=torch.long)
        raise data_unavailable(
            self.title,
            self.name,
            root,
            [f"{root / reader.base_folder}/{{{','.join(_cifar_file_names(reader))}}}"],
            f"{self.archive} and extract it (tar xzf) so that the folder {reader.base_folder} lies in the root",
        )


class CIFAR100(CIFAR10):
    """CIFAR-100: 50,000 training and 10,000 test colour images, ``(B, 3, 32, 32)``, 100 fine classes.

    Reads the python pickles of ``cifar-100-python.tar.gz`` (``root/cifar-100-python/``:
    ``train``, ``test``, ``meta``); labels are the fine labels.

    Args:
        root: Data directory (holding ``cifar-100-python``); default ``$LMC_DATA/cifar100`` or
            ``~/.cache/lmc/cifar100``.
        val_fraction: Share of the training images held out for validation.
        (others): See :class:`~lmc.data.base.LMCDataModule`.
    """

    name = "cifar100"
    num_classes = 100
    mean, std = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
    title = "CIFAR-100"
    reader = "CIFAR100"
    archive = "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz"


class ImageNet(LMCDataModule):
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
        (others): See :class:`~lmc.data.base.LMCDataModule`.
    """

    task = "image_classification"
    name = "imagenet"
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
    ):
        super().__init__(batch_size, num_workers, part, seed)
        self.root, self.image_size, self.val_fraction = root, image_size, val_fraction

    def build(self) -> None:
        from torchvision import transforms
        from torchvision.datasets import ImageFolder

        root = data_root(self.name, self.root)
        folders = {split: root / split for split in ("train", "val")}
        if not all(folder.is_dir() and any(p.is_dir() for p in folder.iterdir()) for folder in folders.values()):
            raise data_unavailable(
                "ImageNet",
                self.name,
                root,
                [f"{folders['train']}/<wnid>/*.JPEG and {folders['val']}/<wnid>/*.JPEG"],
                "ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar from https://image-net.org/download.php "
                "(account needed; or the Kaggle 'imagenet-object-localization-challenge' copy), extract the "
                "per-class train tars into train/<wnid>/ and sort the validation images into val/<wnid>/ "
                "(e.g. with the widely used valprep.sh)",
            )
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
        self.train_set = ImageLabelDicts(Subset(train_images, train))
        self.val_set = ImageLabelDicts(Subset(train_images, val))
        self.test_set = ImageLabelDicts(test_images)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "image_size": self.image_size, "in_channels": self.in_channels}
