"""One jsonargparse mechanism for the function commands: a typed function's signature and docstring are its parser."""

from __future__ import annotations

import ast
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import fields, is_dataclass
from pathlib import Path

from lmc.training.cli import help_formatter


def summary(name: str) -> str:
    """The first line of the docstring of the function command ``name``, read from its source:
    importing the command imports its types (torch, Lightning), and ``lmc --help`` imports none."""
    source = Path(importlib.util.find_spec(f"lmc.cli.{name}").origin).read_text()
    function = next(node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef) and node.name == name)
    return ast.get_docstring(function).splitlines()[0]


def flattened(function: Callable[..., None]) -> dict[str, type]:
    """The parameters of ``function`` whose default is an options dataclass (``AlignOptions``,
    ``EvaluationDataOptions``): name -> class. Their fields are the command's flags (``--method``,
    not ``--options.method``)."""
    parameters = inspect.signature(function).parameters.items()
    return {
        name: type(p.default) for name, p in parameters if is_dataclass(p.default) and not isinstance(p.default, type)
    }


def parser_for(function: Callable[..., None]):
    """The parser of ``lmc <function>``: required parameters positional, options dataclasses flattened."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    description = inspect.getdoc(function).split("\n\nArgs:")[0]
    groups = flattened(function)
    parameters = inspect.signature(function).parameters.values()
    positional = [p.name for p in parameters if p.default is inspect.Parameter.empty]
    # The options are listed below the description; a usage line of every flag would push it a screen down.
    usage = " ".join(["%(prog)s [-h] [--config CONFIG] [--FLAG VALUE ...]", *positional])
    prog = f"lmc {function.__name__}"
    parser = ArgumentParser(prog=prog, usage=usage, description=description, formatter_class=help_formatter())
    parser.add_argument("--config", action=ActionConfigFile, help="a YAML file of these arguments")
    parser.add_function_arguments(function, as_positional=True, skip=set(groups), as_group=False, sub_configs=True)
    for options in groups.values():
        parser.add_class_arguments(options, None, instantiate=False)
    return parser


def call(function: Callable[..., None], parser, config) -> None:
    """Instantiate the arguments ``parser`` parsed and call ``function`` with them."""
    arguments = parser.instantiate_classes(config)
    groups = flattened(function)
    kwargs = {k: arguments[k] for k in inspect.signature(function).parameters if k not in groups}
    for parameter, options in groups.items():
        kwargs[parameter] = options(**{f.name: arguments[f.name] for f in fields(options)})
    function(**kwargs)


def gathered(function: Callable[..., None], argv: list[str]) -> list[str]:
    """``argv`` with the bare arguments of a command whose one positional parameter is a list (``lmc merge A B C``)
    gathered into the JSON list jsonargparse reads; every ``--flag`` without ``=`` takes the next token."""
    import json

    positional = [p for p in inspect.signature(function).parameters.values() if p.default is inspect.Parameter.empty]
    if len(positional) != 1 or not str(positional[0].annotation).startswith("list["):  # postponed: a string
        return argv
    bare, rest, index = [], [], 0
    while index < len(argv):
        token = argv[index]
        if token in ("-h", "--help") or (token.startswith("--") and "=" in token):
            rest.append(token)
        elif token.startswith("--"):
            rest += argv[index : index + 2]
            index += 1
        else:
            bare.append(token)
        index += 1
    return [json.dumps(bare), *rest] if bare else rest


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


def one_line(message: str) -> str:
    """A user error's message on one line, its reason first.

    jsonargparse explains a value of a ``X | None`` type by every subtype it tried: keep the
    reasons of the subtypes the value was meant for, not ``Expected a <class 'NoneType'>`` or the
    repeated value.
    """
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if lines and lines[0].startswith("Does not validate against any of the Union subtypes"):
        reasons = [line[2:] for line in lines if line.startswith("- ") and "NoneType" not in line]
        lines = reasons or lines
    return " ".join(lines)
