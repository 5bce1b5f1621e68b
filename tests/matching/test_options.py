"""AlignOptions is one typed contract: jsonargparse reads its choices and help from the class itself."""

from __future__ import annotations

import pytest
from jsonargparse import ArgumentError, ArgumentParser, set_parsing_settings

from lmc.matching import AlignOptions


@pytest.fixture
def parser():
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    try:
        parser = ArgumentParser(exit_on_error=False)
        parser.add_class_arguments(AlignOptions, "options")
        yield parser
    finally:
        set_parsing_settings(docstring_parse_attribute_docstrings=False)


def test_a_parser_rejects_bad_choices_and_builds_the_options(parser):
    with pytest.raises(ArgumentError, match="options.method"):
        parser.parse_args(["--options.method=sinkhorn"])
    config = parser.parse_args(["--options.metric=weight", "--options.check_rtol=0"])
    options = parser.instantiate(config).options
    assert options == AlignOptions(metric="weight", check_rtol=0.0)


def test_the_attribute_docstrings_are_the_help(parser):
    text = " ".join(parser.format_help().split())
    assert "Most L-BFGS iterations of Stage 2" in text
    assert "Random inputs in the probe" in text
