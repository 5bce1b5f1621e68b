"""The user's data options: one typed value (EvaluationDataOptions), flattened into lmc interpolate's flags."""

from __future__ import annotations

import inspect

import pytest

from lmc.formats import EvaluationDataOptions
from lmc.matching import AlignOptions


def test_interpolate_takes_its_data_flags_as_one_value_under_their_old_names():
    from lmc.cli.interpolate import interpolate
    from lmc.cli.parsing import flattened, parser_for

    assert flattened(interpolate) == {"data_options": EvaluationDataOptions, "options": AlignOptions}
    assert len(inspect.signature(interpolate).parameters) == 11  # was 15
    parser = parser_for(interpolate)
    flags = ["--split", "test", "--batch_size", "4", "--text_column", "body", "--label_column", "y"]
    flags += ["--pair_column", "second", "--mask_seed", "7", "--sequence_length", "8"]
    config = parser.parse_args(["a", "b", *flags, "--method", "orthogonal"])
    arguments = parser.instantiate_classes(config)
    assert EvaluationDataOptions(**{k: arguments[k] for k in vars(EvaluationDataOptions())}) == EvaluationDataOptions(
        split="test",
        batch_size=4,
        text_column="body",
        label_column="y",
        pair_column="second",
        mask_seed=7,
        sequence_length=8,
    )
    assert arguments["method"] == "orthogonal" and "data_options" not in arguments


def test_the_data_flags_help_is_the_options_attribute_docstrings(capsys):
    from lmc.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["interpolate", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--text_column TEXT_COLUMN The text column of the user's tables." in text
    assert "--split {val,test} The split the curves are measured on" in text


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"split": "train"}, "unknown split 'train'"),
        ({"batch_size": 0}, "--batch_size must be positive, got 0"),
        ({"sequence_length": -1}, "--sequence_length must be positive, got -1"),
    ],
)
def test_bad_data_options_are_refused_by_name(settings, message):
    with pytest.raises(ValueError, match=message):
        EvaluationDataOptions(**settings)


def test_a_bad_data_flag_is_one_line(tmp_path, capsys):
    from tests.cli import fails

    argv = ["interpolate", "a.ckpt", "b.ckpt", "--data", str(tmp_path), "--output-dir", str(tmp_path / "o")]
    assert "--batch_size must be positive, got 0" in fails([*argv, "--batch-size", "0"], capsys)
