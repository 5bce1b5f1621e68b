"""``--data`` of ``lmc align`` and ``lmc interpolate``: parsed as a plain value, read after parsing."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmc.cli.inputs import data_module, user_data
from lmc.data import Digits

CONFIGS = Path(__file__).parents[2] / "configs"


@pytest.mark.parametrize(
    "source",
    [
        "lmc.data.Digits",
        str(CONFIGS / "data" / "digits.yaml"),
        {"class_path": "lmc.data.Digits", "init_args": {"batch_size": 8}},
    ],
    ids=["class-path", "config-file", "mapping"],
)
def test_data_is_a_class_path_a_config_file_or_a_mapping(source):
    data = data_module(source)
    assert isinstance(data, Digits)
    assert data.batch_size == (8 if isinstance(source, dict) else Digits().batch_size)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("eval.txt", "--data eval.txt: not a DataModule config"),
        ("lmc.data.NoSuchData", "--data lmc.data.NoSuchData: not a DataModule config"),
        ({"batch_size": 8}, "a DataModule mapping names its class"),  # --data X --data.batch_size 8
    ],
)
def test_data_that_names_no_data_module_is_one_line_naming_it(source, message):
    with pytest.raises(ValueError) as error:
        data_module(source)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    "source",
    ["lmc.data.Digits", str(CONFIGS / "data" / "digits.yaml"), {"class_path": "lmc.data.Digits"}],
    ids=["class-path", "config-file", "mapping"],
)
def test_data_of_hugging_face_and_timm_checkpoints_is_never_a_data_module(source):
    with pytest.raises(ValueError, match="is a path to your data, not a DataModule"):
        user_data(source)


@pytest.mark.parametrize("source", ["eval.txt", "wiki.data.json", "images/"])  # missing files say so later
def test_data_of_hugging_face_and_timm_checkpoints_is_a_path(source):
    assert user_data(source) == Path(source)
