"""One jsonargparse mechanism for the function commands: a typed function's signature and docstring are its parser."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from pathlib import Path

from lmc.matching import AlignOptions


def summary(function: Callable[..., None]) -> str:
    """The first line of a command's docstring."""
    return inspect.getdoc(function).splitlines()[0]


def parser_for(function: Callable[..., None]):
    """A jsonargparse parser of ``function``: required parameters positional, AlignOptions flattened."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    description = inspect.getdoc(function).split("\n\nArgs:")[0]
    parser = ArgumentParser(description=description, formatter_class=help_formatter())
    parser.add_argument("--config", action=ActionConfigFile, help="a YAML file of these arguments")
    takes_options = "options" in inspect.signature(function).parameters
    parser.add_function_arguments(function, as_positional=True, skip={"options"}, as_group=False, sub_configs=True)
    if takes_options:
        parser.add_class_arguments(AlignOptions, None, instantiate=False)
    return parser


#: reStructuredText markup of docstrings (``code``, :func:`~lmc.x.y`), shown as plain text in --help.
_ROLE = re.compile(r":(?:mod|func|class|meth|attr|data):`~?([^`]+)`")


def plain_text(text: str) -> str:
    """A docstring's text without its reStructuredText markup."""
    return _ROLE.sub(r"\1", text).replace("``", "")


def help_formatter():
    """jsonargparse's help formatter: plain text, keeping the line breaks of descriptions (docstrings)."""
    import argparse

    from jsonargparse import DefaultHelpFormatter

    class Formatter(DefaultHelpFormatter, argparse.RawDescriptionHelpFormatter):
        def format_help(self) -> str:
            return plain_text(super().format_help())

    return Formatter


def call(function: Callable[..., None], parser, config, name: str) -> None:
    """Instantiate the parsed arguments of ``name`` and call ``function`` with them."""
    from dataclasses import fields

    arguments = parser.instantiate_classes(config)[name]
    parameters = inspect.signature(function).parameters
    kwargs = {k: arguments[k] for k in parameters if k != "options"}
    if "options" in parameters:
        kwargs["options"] = AlignOptions(**{f.name: arguments[f.name] for f in fields(AlignOptions)})
    function(**kwargs)


def underscored(argv: list[str]) -> list[str]:
    """``--merge-alpha 0.5`` -> ``--merge_alpha 0.5``: flags are Python names; both spellings work."""
    result = []
    for token in argv:
        if token.startswith("--"):
            flag, equals, value = token.partition("=")
            token = "--" + flag[2:].replace("-", "_") + equals + value
        result.append(token)
    return result


def check_config_files(argv: list[str]) -> None:
    """Name the file of a YAML syntax error (jsonargparse reports it as ``<unicode string>``)."""
    import yaml

    for flag, value in zip(argv, argv[1:]):
        if flag == "--config" and Path(value).is_file():
            try:
                yaml.safe_load(Path(value).read_text())
            except yaml.YAMLError as error:
                where = getattr(error, "problem_mark", None)
                line = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
                problem = getattr(error, "problem", None) or error
                raise ValueError(f"{value}: YAML syntax error{line}: {problem}") from error
