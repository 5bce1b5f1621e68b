"""DataModules: offline embedded defaults and loaders for the paper's real data sets."""

from lmc.data.base import (
    BYTE_VOCAB_SIZE,
    DataUnavailableError,
    LMCDataModule,
    TensorDictDataset,
    TokenWindows,
    data_root,
    encode_bytes,
    pad_texts,
)
from lmc.data.embedded import Digits, PythonDocsLM, PythonTextKinds
from lmc.data.text import IMDB, AGNews, DBPedia, Enwik8, OneBillionWord, WikiText103
from lmc.data.vision import CIFAR10, CIFAR100, MNIST, ImageNet

__all__ = [
    "AGNews",
    "BYTE_VOCAB_SIZE",
    "CIFAR10",
    "CIFAR100",
    "DBPedia",
    "DataUnavailableError",
    "Digits",
    "Enwik8",
    "IMDB",
    "ImageNet",
    "LMCDataModule",
    "MNIST",
    "OneBillionWord",
    "PythonDocsLM",
    "PythonTextKinds",
    "TensorDictDataset",
    "TokenWindows",
    "WikiText103",
    "data_root",
    "encode_bytes",
    "pad_texts",
]
