"""The real-data loaders read tiny files written in each data set's real on-disk format.

Every test writes its files under ``tmp_path`` (idx-ubyte, CIFAR pickles, JPEG/PNG folders,
parquet, CSV, aclImdb, raw text/bytes), builds the DataModule offline and checks what comes
back: sample counts per split, decoded pixels / bytes / labels, batch shapes and dtypes. A
corrupted copy of each format must raise ``CorruptDataError`` naming the file.
"""

from __future__ import annotations

import csv
import inspect
import pickle
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import lmc.data
from lmc.data import (
    CIFAR10,
    CIFAR100,
    IMDB,
    MNIST,
    AGNews,
    CorruptDataError,
    DataUnavailableError,
    DBPedia,
    Digits,
    Enwik8,
    ImageNet,
    LMCDataModule,
    OneBillionWord,
    WikiText103,
    data_root,
)
from lmc.tasks import DataInfo

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "data"


@pytest.fixture(autouse=True)
def _isolated_data_roots(tmp_path, monkeypatch):
    """No data from the user's ``$LMC_DATA`` or hub cache (``huggingface_hub`` fixes its cache path at import)."""
    import huggingface_hub.constants

    monkeypatch.delenv("LMC_DATA", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf_home" / "hub"))


def _built(module: LMCDataModule) -> LMCDataModule:
    module.setup()
    return module


def _samples(dataset) -> list[dict[str, torch.Tensor]]:
    return [dataset[i] for i in range(len(dataset))]


def _ids(text: str | bytes) -> torch.Tensor:
    data = text.encode() if isinstance(text, str) else text
    return torch.tensor(list(data)) + 1


# ---------------------------------------------------------------------------------------------
# Writers of the real formats.
# ---------------------------------------------------------------------------------------------


def _write_idx(path: Path, array: np.ndarray) -> None:
    """An idx-ubyte file: magic (0, 0, 0x08 = uint8, ndim), big-endian int32 dims, raw bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(struct.pack(">i", size) for size in array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def _mnist_files(directory: Path, n_train: int = 12, n_test: int = 5) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28)),
        "train-labels-idx1-ubyte": np.arange(n_train) % 10,
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28)),
        "t10k-labels-idx1-ubyte": (np.arange(n_test) * 3 + 1) % 10,
    }
    for name, array in arrays.items():
        _write_idx(directory / name, array)
    return arrays


def _pickle(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(obj))


def _cifar10_files(root: Path) -> dict[str, np.ndarray]:
    """Five training batches of 2 images and a test batch of 3, rows of 3,072 bytes in (C, H, W) order."""
    rng = np.random.default_rng(1)
    folder = root / "cifar-10-batches-py"
    train = rng.integers(0, 256, (10, 3072), dtype=np.uint8)
    test = rng.integers(0, 256, (3, 3072), dtype=np.uint8)
    for batch in range(5):
        rows = train[2 * batch : 2 * batch + 2]
        _pickle(folder / f"data_batch_{batch + 1}", {"data": rows, "labels": [2 * batch, 2 * batch + 1]})
    _pickle(folder / "test_batch", {"data": test, "labels": [7, 8, 9]})
    _pickle(folder / "batches.meta", {"label_names": [f"class{i}" for i in range(10)]})
    return {"train": train, "test": test}


def _cifar100_files(root: Path) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(2)
    folder = root / "cifar-100-python"
    train = rng.integers(0, 256, (8, 3072), dtype=np.uint8)
    test = rng.integers(0, 256, (4, 3072), dtype=np.uint8)
    # Coarse labels differ from fine ones: the loader must return the fine ones.
    _pickle(folder / "train", {"data": train, "fine_labels": [90 + i for i in range(8)], "coarse_labels": [0] * 8})
    _pickle(folder / "test", {"data": test, "fine_labels": [99, 50, 0, 42], "coarse_labels": [1] * 4})
    _pickle(folder / "meta", {"fine_label_names": [f"f{i}" for i in range(100)], "coarse_label_names": ["c"] * 20})
    return {"train": train, "test": test}


def _parquet(path: Path, columns: dict[str, list]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)


# ---------------------------------------------------------------------------------------------
# Vision.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["", "MNIST/raw"])
def test_mnist_reads_idx_files_and_carves_validation(tmp_path, layout):
    arrays = _mnist_files(tmp_path / layout)
    module = _built(MNIST(root=str(tmp_path), val_fraction=0.25, batch_size=4))

    assert (len(module.train_set), len(module.val_set), len(module.test_set)) == (9, 3, 5)
    sample = module.test_set[2]
    expected = (torch.tensor(arrays["t10k-images-idx3-ubyte"][2], dtype=torch.float32) / 255 - 0.1307) / 0.3081
    torch.testing.assert_close(sample["inputs"], expected.unsqueeze(0))
    assert sample["labels"].item() == arrays["t10k-labels-idx1-ubyte"][2] == 7
    # Train and validation together are exactly the official training images.
    labels = sorted(s["labels"].item() for s in _samples(module.train_set) + _samples(module.val_set))
    assert labels == sorted(arrays["train-labels-idx1-ubyte"].tolist())
    batch = next(iter(module.train_dataloader()))
    assert batch["inputs"].shape == (4, 1, 28, 28) and batch["inputs"].dtype == torch.float32
    assert batch["labels"].shape == (4,) and batch["labels"].dtype == torch.long
    assert module.info == DataInfo("image_classification", num_classes=10, image_size=28, in_channels=1)


def test_mnist_validation_split_depends_on_the_seed_only(tmp_path):
    _mnist_files(tmp_path)
    val = [_built(MNIST(root=str(tmp_path), seed=seed, val_fraction=0.5)).val_set.images for seed in (0, 0, 1)]
    assert torch.equal(val[0], val[1]) and not torch.equal(val[0], val[2])


def test_cifar10_reads_the_python_pickles(tmp_path):
    written = _cifar10_files(tmp_path)
    module = _built(CIFAR10(root=str(tmp_path), val_fraction=0.2, batch_size=3))

    assert (len(module.train_set), len(module.val_set), len(module.test_set)) == (8, 2, 3)
    sample = module.test_set[1]
    pixels = torch.tensor(written["test"][1], dtype=torch.float32).view(3, 32, 32) / 255
    mean, std = torch.tensor([0.4914, 0.4822, 0.4465]), torch.tensor([0.2470, 0.2435, 0.2616])
    torch.testing.assert_close(sample["inputs"], (pixels - mean.view(3, 1, 1)) / std.view(3, 1, 1))
    assert sample["labels"].item() == 8
    # Labels 0..9 were written one per training image: train + val hold each exactly once.
    labels = sorted(s["labels"].item() for s in _samples(module.train_set) + _samples(module.val_set))
    assert labels == list(range(10))
    batch = next(iter(module.test_dataloader()))
    assert batch["inputs"].shape == (3, 3, 32, 32) and batch["labels"].tolist() == [7, 8, 9]


def test_cifar10_accepts_the_extracted_folder_as_root(tmp_path):
    _cifar10_files(tmp_path)
    module = _built(CIFAR10(root=str(tmp_path / "cifar-10-batches-py"), val_fraction=0.2))
    assert len(module.test_set) == 3


def test_cifar100_returns_fine_labels(tmp_path):
    written = _cifar100_files(tmp_path)
    module = _built(CIFAR100(root=str(tmp_path), val_fraction=0.25))

    assert (len(module.train_set), len(module.val_set), len(module.test_set)) == (6, 2, 4)
    assert [s["labels"].item() for s in _samples(module.test_set)] == [99, 50, 0, 42]
    raw = torch.tensor(written["test"][3], dtype=torch.float32).view(3, 32, 32)[2, 5, 7] / 255
    assert module.test_set[3]["inputs"][2, 5, 7].item() == pytest.approx((raw.item() - 0.4409) / 0.2762, abs=1e-5)
    assert module.info.num_classes == 100


def _imagenet_folder(root: Path) -> dict[str, tuple[int, int, int]]:
    """3 classes; 4 JPEGs each in train/, 2 images each in val/ (one a solid-colour PNG)."""
    from PIL import Image

    colours = {"n01440764": (200, 30, 10), "n01443537": (10, 180, 40), "n01484850": (20, 40, 220)}
    for wnid, colour in colours.items():
        for index in range(4):
            path = root / "train" / wnid / f"{wnid}_{index}.JPEG"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (40 + index, 30), colour).save(path, format="JPEG", quality=95)
        (root / "val" / wnid).mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (30, 50), colour).save(root / "val" / wnid / f"ILSVRC2012_val_{wnid}.JPEG", format="JPEG")
        Image.new("RGB", (24, 24), colour).save(root / "val" / wnid / f"ILSVRC2012_val_{wnid}_z.png")
    return colours


def test_imagenet_reads_an_image_folder_resized_and_normalised(tmp_path):
    colours = _imagenet_folder(tmp_path)
    module = _built(ImageNet(root=str(tmp_path), image_size=16, val_fraction=0.25, batch_size=5))

    assert (len(module.train_set), len(module.val_set), len(module.test_set)) == (9, 3, 6)
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    for label, colour in enumerate(colours.values()):  # labels index the sorted wnids
        png = module.test_set[2 * label + 1]  # sorted file names: the .JPEG, then the _z.png
        expected = ((torch.tensor(colour) / 255 - mean) / std).view(3, 1, 1).expand(3, 16, 16)
        torch.testing.assert_close(png["inputs"], expected)
        assert png["labels"].item() == label
        jpeg = module.test_set[2 * label]
        assert jpeg["labels"].item() == label
        assert (jpeg["inputs"] - expected).abs().max() < 4 / 255 / 0.224  # JPEG is lossy
    batch = next(iter(module.train_dataloader()))
    assert batch["inputs"].shape == (5, 3, 16, 16) and batch["inputs"].dtype == torch.float32
    assert batch["labels"].dtype == torch.long
    assert module.info.image_size == 16 and module.info.num_classes == 1000


# ---------------------------------------------------------------------------------------------
# Text classification.
# ---------------------------------------------------------------------------------------------

AG_TRAIN = [(3, "Wall St. Bears", 'Short-sellers, "Wall St"\'s band'), (1, "Caf\u00e9", "news")] * 5
AG_TEST = [(4, "Sci title", "A description that is far longer than forty-eight bytes"), (2, "Sports", "x")]


def _ag_news_files(root: Path, layout: str) -> None:
    if layout == "csv":  # as released: every field quoted, quotes doubled, class 1-based
        (root / "ag_news_csv").mkdir(parents=True, exist_ok=True)
        for split, rows in (("train", AG_TRAIN), ("test", AG_TEST)):
            with open(root / "ag_news_csv" / f"{split}.csv", "w", newline="", encoding="utf-8") as file:
                csv.writer(file, quoting=csv.QUOTE_ALL).writerows(rows)
    else:  # HF hub layout: text = title + " " + description, 0-based labels
        for split, rows in (("train", AG_TRAIN), ("test", AG_TEST)):
            texts, labels = [f"{title} {body}" for _, title, body in rows], [label - 1 for label, _, _ in rows]
            _parquet(root / "data" / f"{split}-00000-of-00001.parquet", {"text": texts, "label": labels})


@pytest.mark.parametrize("layout", ["csv", "parquet"])
def test_ag_news_bytes_and_zero_based_labels(tmp_path, layout):
    _ag_news_files(tmp_path, layout)
    module = _built(AGNews(root=str(tmp_path), sequence_length=48, val_fraction=0.2, batch_size=4))

    assert (len(module.train_set), len(module.val_set), len(module.test_set)) == (8, 2, 2)
    long_text, short_text = module.test_set[0], module.test_set[1]
    assert long_text["labels"].item() == 3 and short_text["labels"].item() == 1  # classes 4 and 2, 1-based
    assert torch.equal(long_text["inputs"], _ids("Sci title A description that is far longer than forty-eight")[:48])
    assert torch.equal(short_text["inputs"][:8], _ids("Sports x")) and short_text["inputs"][8:].eq(0).all()
    assert short_text["attention_mask"].tolist() == [1] * 8 + [0] * 40
    assert long_text["attention_mask"].eq(1).all()
    # The quoted CSV field and the two-byte UTF-8 character come back intact.
    texts = {bytes((s["inputs"][s["attention_mask"].bool()] - 1).tolist()) for s in _samples(module.train_set)}
    assert texts == {b'Wall St. Bears Short-sellers, "Wall St"\'s band', "Caf\u00e9 news".encode()}
    labels = sorted(s["labels"].item() for s in _samples(module.train_set) + _samples(module.val_set))
    assert labels == [0] * 5 + [2] * 5
    batch = next(iter(module.train_dataloader()))
    assert {name: (tuple(t.shape), t.dtype) for name, t in batch.items()} == {
        "inputs": ((4, 48), torch.long),
        "attention_mask": ((4, 48), torch.long),
        "labels": ((4,), torch.long),
    }
    assert module.info == DataInfo("text_classification", num_classes=4, vocab_size=257, sequence_length=48)


def _hub_snapshot(repo: Path, commit: str) -> Path:
    """A hub cache entry as ``huggingface-cli download`` leaves it: the ref ``main`` names the snapshot."""
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return repo / "snapshots" / commit


def test_ag_news_found_in_the_hf_hub_cache_when_no_root_is_given(tmp_path, monkeypatch):
    monkeypatch.setenv("LMC_DATA", str(tmp_path / "empty"))
    repo = tmp_path / "hf_home" / "hub" / "datasets--fancyzhx--ag_news"
    _ag_news_files(_hub_snapshot(repo, "0123abcd"), "parquet")
    _ag_news_files(repo / "snapshots" / "0ld0", "parquet")  # newer on disk, but main does not name it
    (repo / "snapshots" / "0ld0" / "data" / "test-00000-of-00001.parquet").write_bytes(b"not parquet")
    module = _built(AGNews(sequence_length=32, val_fraction=0.2))
    assert len(module.test_set) == 2 and module.test_set[0]["labels"].item() == 3


@pytest.mark.parametrize("layout", ["aclImdb", "parquet"])
def test_imdb_pos_reviews_get_label_one(tmp_path, layout):
    reviews = {
        "train": {"pos": ["Great film.<br />Loved it", "A joy"], "neg": ["Dull", "Awful", "Bad acting"]},
        "test": {"pos": ["Superb"], "neg": ["Boring plot"]},
    }
    for split, by_sentiment in reviews.items():
        if layout == "aclImdb":
            for sentiment, texts in by_sentiment.items():
                for index, text in enumerate(texts):
                    path = tmp_path / "aclImdb" / split / sentiment / f"{index}_{7 + index}.txt"
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(text, encoding="utf-8")
        else:
            rows = [(text, int(sentiment == "pos")) for sentiment, texts in by_sentiment.items() for text in texts]
            columns = {"text": [text for text, _ in rows], "label": [label for _, label in rows]}
            _parquet(tmp_path / "plain_text" / f"{split}-00000-of-00001.parquet", columns)
    if layout == "parquet":  # unlabelled reviews must not leak into training
        _parquet(
            tmp_path / "plain_text" / "unsupervised-00000-of-00001.parquet", {"text": ["?"] * 3, "label": [-1] * 3}
        )
    if layout == "aclImdb":
        (tmp_path / "aclImdb" / "train" / "unsup").mkdir()
        (tmp_path / "aclImdb" / "train" / "unsup" / "0_0.txt").write_text("unlabelled")

    module = _built(IMDB(root=str(tmp_path), sequence_length=32, val_fraction=0.2))
    assert (len(module.train_set), len(module.val_set), len(module.test_set)) == (4, 1, 2)
    by_text = {
        bytes((s["inputs"][s["attention_mask"].bool()] - 1).tolist()).decode(): s["labels"].item()
        for s in _samples(module.test_set)
    }
    assert by_text == {"Superb": 1, "Boring plot": 0}
    labels = sorted(s["labels"].item() for s in _samples(module.train_set) + _samples(module.val_set))
    assert labels == [0, 0, 0, 1, 1]
    assert module.info.num_classes == 2


@pytest.mark.parametrize("layout", ["csv", "parquet"])
def test_dbpedia_joins_title_and_content(tmp_path, layout):
    train = [(label, f"Title{label}", f"Content of {label}") for label in range(1, 15)]
    test = [(14, "Zebra Film", "A 1990 film."), (1, "Acme", "A company.")]
    for split, rows in (("train", train), ("test", test)):
        if layout == "csv":
            (tmp_path / "dbpedia_csv").mkdir(exist_ok=True)
            lines = [f'{label},"{title}","{content}"' for label, title, content in rows]
            (tmp_path / "dbpedia_csv" / f"{split}.csv").write_text("\n".join(lines) + "\n")
        else:
            columns = {
                "label": [label - 1 for label, _, _ in rows],
                "title": [title for _, title, _ in rows],
                "content": [content for _, _, content in rows],
            }
            _parquet(tmp_path / "dbpedia_14" / f"{split}-00000-of-00001.parquet", columns)

    module = _built(DBPedia(root=str(tmp_path), sequence_length=24, val_fraction=2 / 14))
    assert (len(module.train_set), len(module.val_set), len(module.test_set)) == (12, 2, 2)
    first = module.test_set[0]
    assert first["labels"].item() == 13
    assert torch.equal(first["inputs"][:23], _ids("Zebra Film A 1990 film.")) and first["inputs"][23] == 0
    labels = sorted(s["labels"].item() for s in _samples(module.train_set) + _samples(module.val_set))
    assert labels == list(range(14))
    assert module.info.num_classes == 14


# ---------------------------------------------------------------------------------------------
# Language modelling.
# ---------------------------------------------------------------------------------------------


def _check_windows(dataset, stream: bytes, length: int) -> None:
    """Windows tile the stream: inputs are ``byte + 1``, labels the inputs shifted by one."""
    assert len(dataset) == (len(stream) - 1) // length
    ids = _ids(stream)
    for index in (0, len(dataset) - 1):
        sample = dataset[index]
        assert sample["inputs"].dtype == sample["labels"].dtype == torch.long
        assert torch.equal(sample["inputs"], ids[index * length : index * length + length])
        assert torch.equal(sample["labels"], ids[index * length + 1 : index * length + length + 1])


def _wiki_text(split: str, lines: int) -> list[str]:
    return [" = Heading = \n", " \n"] + [f" {split} line {i}: caf\u00e9 & co . \n" for i in range(lines)]


@pytest.mark.parametrize("layout", ["wikitext-103-raw", "", "parquet"])
def test_wikitext103_windows_from_raw_or_parquet(tmp_path, layout):
    texts = {"train": _wiki_text("train", 40), "valid": _wiki_text("valid", 6), "test": _wiki_text("test", 5)}
    for split, lines in texts.items():
        if layout == "parquet":
            name = {"valid": "validation"}.get(split, split)
            _parquet(tmp_path / "wikitext-103-raw-v1" / f"{name}-00000-of-00001.parquet", {"text": lines})
        else:
            (tmp_path / layout).mkdir(exist_ok=True)
            (tmp_path / layout / f"wiki.{split}.raw").write_text("".join(lines), encoding="utf-8")

    module = _built(WikiText103(root=str(tmp_path), sequence_length=16, batch_size=8))
    for split, dataset in (("train", module.train_set), ("valid", module.val_set), ("test", module.test_set)):
        _check_windows(dataset, "".join(texts[split]).encode(), 16)
    batch = next(iter(module.train_dataloader()))
    assert batch["inputs"].shape == batch["labels"].shape == (8, 16)
    assert module.info == DataInfo("causal_lm", vocab_size=257, sequence_length=16)


def test_enwik8_splits_90_5_5(tmp_path):
    stream = bytes(np.random.default_rng(3).integers(0, 256, 2000, dtype=np.uint8))
    (tmp_path / "enwik8").write_bytes(stream)
    module = _built(Enwik8(root=str(tmp_path), sequence_length=8))
    _check_windows(module.train_set, stream[:1800], 8)
    _check_windows(module.val_set, stream[1800:1900], 8)
    _check_windows(module.test_set, stream[1900:], 8)


def test_enwik8_uses_the_first_standard_size_bytes_of_a_longer_file(tmp_path, monkeypatch):
    stream = bytes(range(256)) * 5  # 1,280 bytes
    (tmp_path / "enwik8").write_bytes(stream)
    monkeypatch.setattr(Enwik8, "standard_size", 1000)  # stands in for 100M: splits at 900 / 950 / 1000
    module = _built(Enwik8(root=str(tmp_path / "enwik8"), sequence_length=7))  # the file itself as root
    _check_windows(module.train_set, stream[:900], 7)
    _check_windows(module.val_set, stream[900:950], 7)
    _check_windows(module.test_set, stream[950:1000], 7)


def _one_billion_word_files(root: Path) -> dict[str, bytes]:
    release = root / "1-billion-word-language-modeling-benchmark-r13output"
    train, heldout = (
        release / "training-monolingual.tokenized.shuffled",
        release / "heldout-monolingual.tokenized.shuffled",
    )
    train.mkdir(parents=True)
    heldout.mkdir(parents=True)
    data = {
        "news.en-00001-of-00100": b"".join(b"The first shard , sentence %d .\n" % i for i in range(30)),
        "news.en-00002-of-00100": b"".join(b"Second shard says %d things .\n" % i for i in range(30)),
        "heldout-00000": b"".join(b"Held out sentence %d .\n" % i for i in range(10)),
    }
    for name in ("news.en-00001-of-00100", "news.en-00002-of-00100"):
        (train / name).write_bytes(data[name])
    (heldout / "news.en.heldout-00000-of-00050").write_bytes(data["heldout-00000"])
    (heldout / "news.en.heldout-00001-of-00050").write_bytes(b"Not the test shard .\n" * 50)
    return data


@pytest.mark.parametrize("train_shards", [None, 1])
def test_one_billion_word_test_shard_and_seeded_validation_stretch(tmp_path, train_shards):
    data = _one_billion_word_files(tmp_path)
    shards = [data["news.en-00001-of-00100"], data["news.en-00002-of-00100"]][:train_shards]
    train_bytes = b"".join(shards)
    module = _built(OneBillionWord(root=str(tmp_path), sequence_length=12, val_fraction=0.1, train_shards=train_shards))

    _check_windows(module.test_set, data["heldout-00000"], 12)
    val_ids = torch.cat([module.val_set[i]["inputs"] for i in range(len(module.val_set))])
    n_val = int(len(train_bytes) * 0.1)
    assert len(module.val_set) == (n_val - 1) // 12
    start = train_bytes.find(bytes((val_ids - 1).tolist()))
    assert start >= 0  # a contiguous stretch of the training bytes
    # Training windows tile what is left on both sides of the stretch, and never cover it.
    before, after = train_bytes[:start], train_bytes[start + n_val :]
    assert len(module.train_set) == sum((len(piece) - 1) // 12 for piece in (before, after) if len(piece) > 12)
    train_text = b"".join(bytes((s["inputs"] - 1).tolist()) for s in _samples(module.train_set))
    assert bytes((val_ids - 1).tolist())[:24] not in train_text


def test_one_billion_word_validation_position_follows_the_seed(tmp_path):
    _one_billion_word_files(tmp_path)
    val = [
        _built(OneBillionWord(root=str(tmp_path), seed=seed, sequence_length=12, val_fraction=0.1)).val_set[0]["inputs"]
        for seed in (0, 0, 1)
    ]
    assert torch.equal(val[0], val[1]) and not torch.equal(val[0], val[2])


# ---------------------------------------------------------------------------------------------
# Corrupted files: CorruptDataError naming the file and where to download it again.
# ---------------------------------------------------------------------------------------------


def _corrupt_mnist_truncated(root: Path) -> Path:
    _mnist_files(root)
    path = root / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-100])  # a download cut short
    return path


def _corrupt_mnist_garbage(root: Path) -> Path:
    _mnist_files(root)
    (root / "t10k-labels-idx1-ubyte").write_bytes(b"<html>404 Not Found</html>")  # an error page saved as the file
    return root / "t10k-labels-idx1-ubyte"


def _corrupt_mnist_gzipped(root: Path) -> Path:
    _mnist_files(root)
    import gzip

    path = root / "train-labels-idx1-ubyte"
    path.write_bytes(gzip.compress(path.read_bytes()))  # not gunzipped
    return path


def _corrupt_cifar_truncated(root: Path) -> Path:
    _cifar10_files(root)
    path = root / "cifar-10-batches-py" / "data_batch_3"
    path.write_bytes(path.read_bytes()[:500])
    return path


def _corrupt_cifar_garbage(root: Path) -> Path:
    _cifar10_files(root)
    path = root / "cifar-10-batches-py" / "test_batch"
    path.write_bytes(bytes(range(256)) * 4)
    return path


def _corrupt_cifar_wrong_content(root: Path) -> Path:
    _cifar100_files(root)
    path = root / "cifar-100-python" / "train"
    _pickle(path, {"data": np.zeros((8, 1024), dtype=np.uint8), "fine_labels": list(range(8))})  # grey, not RGB
    return path


def _corrupt_ag_news_parquet(root: Path) -> Path:
    _ag_news_files(root, "parquet")
    path = root / "data" / "train-00000-of-00001.parquet"
    path.write_bytes(path.read_bytes()[:-40])  # the footer is gone
    return path


def _corrupt_ag_news_csv(root: Path) -> Path:
    _ag_news_files(root, "csv")
    path = root / "ag_news_csv" / "test.csv"
    path.write_text('"3","title","body"\n"World","title","the class column is a name"\n')
    return path


def _corrupt_imdb_review(root: Path) -> Path:
    for split in ("train", "test"):
        for index, sentiment in enumerate(("neg", "pos")):
            path = root / "aclImdb" / split / sentiment / f"{index}_1.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("A fine review")
    path = root / "aclImdb" / "test" / "pos" / "0_1.txt"
    path.write_bytes(b"\xff\xfe\x00garbled")
    return path


def _corrupt_wikitext_parquet(root: Path) -> Path:
    for split in ("train", "validation", "test"):
        _parquet(root / "wikitext-103-raw-v1" / f"{split}-00000-of-00001.parquet", {"text": _wiki_text(split, 30)})
    path = root / "wikitext-103-raw-v1" / "validation-00000-of-00001.parquet"
    path.write_bytes(b"PAR1" + bytes(300))
    return path


CORRUPTED = {
    "mnist-truncated": (_corrupt_mnist_truncated, MNIST, "announces 9408"),
    "mnist-garbage": (_corrupt_mnist_garbage, MNIST, "not an idx file"),
    "mnist-gzipped": (_corrupt_mnist_gzipped, MNIST, "not an idx file"),
    "cifar-truncated": (_corrupt_cifar_truncated, CIFAR10, "UnpicklingError"),
    "cifar-garbage": (_corrupt_cifar_garbage, CIFAR10, "invalid load key"),
    "cifar-wrong-content": (_corrupt_cifar_wrong_content, CIFAR100, "not a uint8 array of rows of 3,072 values"),
    "ag-news-parquet": (_corrupt_ag_news_parquet, AGNews, "ArrowInvalid"),
    "ag-news-csv": (_corrupt_ag_news_csv, AGNews, "line 2 starts with 'World', not a class number"),
    "imdb-review": (_corrupt_imdb_review, IMDB, "UnicodeDecodeError"),
    "wikitext-parquet": (_corrupt_wikitext_parquet, WikiText103, "ArrowInvalid"),
}


@pytest.mark.parametrize("case", list(CORRUPTED))
def test_a_corrupt_file_is_named_with_the_advice_to_download_it_again(tmp_path, case):
    corrupt, loader, reason = CORRUPTED[case]
    path = corrupt(tmp_path)
    with pytest.raises(CorruptDataError) as error:
        loader(root=str(tmp_path)).setup()
    message = str(error.value)
    assert str(path) in message and reason in message
    assert "corrupt or truncated" in message and "download it again: " + loader.source in message
    assert isinstance(error.value, DataUnavailableError)  # caught wherever missing data is


def test_mnist_images_and_labels_of_different_counts_name_both_files(tmp_path):
    _mnist_files(tmp_path)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.arange(4))  # 5 test images
    with pytest.raises(CorruptDataError, match="t10k-images-idx3-ubyte holds 5 images but .*t10k-labels-idx1-ubyte 4"):
        MNIST(root=str(tmp_path)).setup()


def test_a_cifar_pickle_is_not_allowed_to_run_code(tmp_path):
    """``pickle.load`` would call any function a file names; the CIFAR reader accepts numpy arrays only."""
    _cifar10_files(tmp_path)
    witness = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (witness,))

    _pickle(tmp_path / "cifar-10-batches-py" / "test_batch", {"data": Payload(), "labels": [0]})
    with pytest.raises(CorruptDataError, match="refers to pathlib.*which no CIFAR batch holds"):
        CIFAR10(root=str(tmp_path)).setup()
    assert not witness.exists()


def test_a_corrupt_imagenet_image_is_named_when_read(tmp_path):
    _imagenet_folder(tmp_path)
    broken = tmp_path / "val" / "n01443537" / "ILSVRC2012_val_n01443537.JPEG"
    broken.write_bytes(broken.read_bytes()[:30])
    module = _built(ImageNet(root=str(tmp_path), image_size=16))
    assert module.test_set[0]["labels"].item() == 0  # the intact images still load
    with pytest.raises(CorruptDataError, match=re.escape(f"ImageNet: cannot read {broken} (")):
        module.test_set[2]


# ---------------------------------------------------------------------------------------------
# Shared behaviour: parts, splits, missing data, default roots, configs.
# ---------------------------------------------------------------------------------------------


def _mnist(root: Path, **kwargs) -> MNIST:
    return MNIST(root=str(root), val_fraction=0.25, **kwargs)


def _ag_news(root: Path, **kwargs) -> AGNews:
    return AGNews(root=str(root), sequence_length=16, val_fraction=0.2, **kwargs)


def _enwik8(root: Path, **kwargs) -> Enwik8:
    return Enwik8(root=str(root), sequence_length=8, **kwargs)


def _write_for(name: str, root: Path) -> None:
    if name == "mnist":
        _mnist_files(root, n_train=40)
    elif name == "ag_news":
        _ag_news_files(root, "csv")
    else:
        (root / "enwik8").write_bytes(bytes(np.random.default_rng(4).integers(0, 256, 800, dtype=np.uint8)))


@pytest.mark.parametrize("name, make", [("mnist", _mnist), ("ag_news", _ag_news), ("enwik8", _enwik8)])
def test_parts_a_and_b_are_disjoint_halves_of_training(tmp_path, name, make):
    _write_for(name, tmp_path)
    full = _built(make(tmp_path, part="all"))
    halves = {part: _built(make(tmp_path, part=part)) for part in ("A", "B")}
    a, b = halves["A"].train_set.indices, halves["B"].train_set.indices
    assert not set(a) & set(b) and sorted(a + b) == list(range(len(full.train_set)))
    assert abs(len(a) - len(b)) <= 1
    sample = halves["B"].train_set[0]
    assert all(torch.equal(sample[key], full.train_set[b[0]][key]) for key in sample)
    # Validation and test are the same for every part.
    assert torch.equal(halves["A"].val_set[0]["inputs"], full.val_set[0]["inputs"])
    assert len(halves["B"].test_set) == len(full.test_set)


def test_split_returns_the_named_dataset_and_refuses_other_names():
    module = Digits()
    assert module.split("val") is module.val_set and module.split("test") is module.test_set
    assert module.split("train") is module.train_set and len(module.train_set) > len(module.val_set)
    with pytest.raises(ValueError, match="unknown split 'validation'; choose one of train, val, test"):
        module.split("validation")


def test_a_bad_part_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="part='C'; choose one of all, A, B"):
        Digits(part="C")


ALL_LOADERS = {
    "MNIST": MNIST,
    "CIFAR-10": CIFAR10,
    "CIFAR-100": CIFAR100,
    "ImageNet": ImageNet,
    "AG News": AGNews,
    "IMDB": IMDB,
    "DBPedia-14": DBPedia,
    "WikiText-103": WikiText103,
    "enwik8": Enwik8,
    "One Billion Word": OneBillionWord,
}

EXPECTED_PATH = {
    "MNIST": "absent/MNIST/raw/{train-images-idx3-ubyte",
    "CIFAR-10": "absent/cifar-10-batches-py/{data_batch_1,data_batch_2,data_batch_3,data_batch_4,data_batch_5,test_",
    "CIFAR-100": "absent/cifar-100-python/{train,test}",
    "ImageNet": "absent/train/<wnid>/*.JPEG",
    "AG News": "absent/ag_news_csv/{train,test}.csv",
    "IMDB": "absent/aclImdb/{train,test}/{pos,neg}/*.txt",
    "DBPedia-14": "absent/dbpedia_14/{train,test}-*.parquet",
    "WikiText-103": "absent/wikitext-103-raw/wiki.{train,valid,test}.raw",
    "enwik8": "absent/enwik8",
    "One Billion Word": "absent/1-billion-word-language-modeling-benchmark-r13output/training-monolingual",
}


@pytest.mark.parametrize("title", list(ALL_LOADERS))
def test_missing_data_names_the_set_the_path_and_the_source(tmp_path, title):
    root = tmp_path / "absent"
    with pytest.raises(DataUnavailableError) as error:
        ALL_LOADERS[title](root=str(root)).setup()
    message = str(error.value)
    assert message.startswith(f"{title} was not found: expected ")
    assert str(tmp_path / EXPECTED_PATH[title]) in message
    assert "http" in message and "Nothing is downloaded" in message
    assert not root.exists()  # nothing was created, let alone downloaded


def test_an_empty_or_partial_root_is_missing_data_too(tmp_path):
    (tmp_path / "train" / "n01440764").mkdir(parents=True)  # ImageNet without val/
    with pytest.raises(DataUnavailableError, match="ImageNet"):
        ImageNet(root=str(tmp_path)).setup()
    _write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros((2, 28, 28)))  # MNIST without the other three
    with pytest.raises(DataUnavailableError, match="MNIST"):
        MNIST(root=str(tmp_path)).setup()


def test_default_root_is_lmc_data_then_the_user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert data_root("cifar10") == tmp_path / "home" / ".cache" / "lmc" / "cifar10"
    monkeypatch.setenv("LMC_DATA", str(tmp_path / "store"))
    assert data_root("cifar10") == tmp_path / "store" / "cifar10"
    assert data_root("cifar10", str(tmp_path / "explicit")) == tmp_path / "explicit"
    with pytest.raises(DataUnavailableError, match=re.escape(str(tmp_path / "store" / "enwik8" / "enwik8"))):
        Enwik8().setup()
    (tmp_path / "store" / "enwik8").mkdir(parents=True)
    (tmp_path / "store" / "enwik8" / "enwik8").write_bytes(b"abcdefgh" * 100)
    assert len(_built(Enwik8(sequence_length=8)).test_set) == (40 - 1) // 8


def test_every_config_instantiates_its_data_module_with_the_constructor_defaults():
    names = {path.stem for path in CONFIGS.glob("*.yaml")}
    assert names >= {
        "mnist", "cifar10", "cifar100", "imagenet", "ag_news", "imdb", "dbpedia", "wikitext103", "enwik8",
        "one_billion_word", "digits", "python_docs_lm", "python_text_kinds", "bible_divisions",
    }  # fmt: skip
    for path in sorted(CONFIGS.glob("*.yaml")):
        data = yaml.safe_load(path.read_text())  # a group file: the data group itself
        module_name, class_name = data["class_path"].rsplit(".", 1)
        assert module_name == "lmc.data" and class_name in lmc.data.__all__, path
        cls = getattr(lmc.data, class_name)
        assert issubclass(cls, LMCDataModule)
        defaults = {name: p.default for name, p in inspect.signature(cls).parameters.items()}
        assert set(data["init_args"]) <= set(defaults), path
        overridden = {k: v for k, v in data["init_args"].items() if defaults[k] != v}
        # A data set's own config shows the defaults; a variant (``<data set>_<variant>.yaml``) changes some.
        variant = any(path.stem.startswith(f"{name}_") for name in names)
        assert variant or set(overridden) <= {"num_workers"}, (path, overridden)
        cls(**data["init_args"])  # constructs without touching the disk
