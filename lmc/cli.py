"""The ``lmc`` command (also ``python -m lmc``): one jsonargparse mechanism for every command.

- ``lmc fit|validate|test|predict --config X.yaml [--config Y.yaml] [--key value ...]``: a
  LightningCLI over :class:`~lmc.training.LMCModule` and any :class:`~lmc.data.LMCDataModule`.
- ``lmc run --config configs/experiment/X.yaml [...]``: the whole protocol (pre-train, fine-tune
  seeds, align every pair, sweep, summarize; :mod:`lmc.experiment`).
- ``lmc align``, ``lmc interpolate``, ``lmc equivalent``, ``lmc demo``, ``lmc symmetry``: typed
  functions of :mod:`lmc.commands`; each function's docstring is its ``--help``.

Errors that come from the user's input (a missing checkpoint, a bad value, an unsupported
model) print one line and exit with status 2; ``LMC_DEBUG=1`` shows the traceback.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

TRAINING_COMMANDS = ("fit", "validate", "test", "predict")


def _check_config_files(argv: list[str]) -> None:
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


def _run_command(argv: list[str]) -> None:
    from lmc import experiment

    experiment.run(experiment.lightning_cli(argv, run=False))


def _function_command(argv: list[str]) -> None:
    from jsonargparse import ArgumentParser, set_parsing_settings

    from lmc import commands

    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    parser = ArgumentParser(prog="lmc", description=__doc__, formatter_class=commands.help_formatter())
    subcommands = parser.add_subcommands(required=True, dest="command")
    for name, function in commands.COMMANDS.items():
        subcommands.add_subcommand(name, commands.parser_for(function), help=commands.summary(function))
    config = parser.parse_args(commands.underscored(argv))
    name = config.command
    commands.call(commands.COMMANDS[name], parser, config, name)


def _user_errors() -> tuple[type[BaseException], ...]:
    from lmc.adapters import UnsupportedModelError
    from lmc.checkpoints import CheckpointError
    from lmc.data import DataUnavailableError
    from lmc.matching import AlignmentError

    return (CheckpointError, AlignmentError, DataUnavailableError, UnsupportedModelError, ValueError, OSError)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``lmc`` console script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        _check_config_files(argv)
        if argv and argv[0] in TRAINING_COMMANDS:
            from lmc.experiment import lightning_cli

            lightning_cli(argv)
        elif argv and argv[0] == "run":
            _run_command(argv[1:])
        else:
            _function_command(argv)
    except _user_errors() as error:
        if os.environ.get("LMC_DEBUG"):
            raise
        message = str(error).strip() or type(error).__name__
        print(f"lmc: error: {message} (LMC_DEBUG=1 shows the traceback)", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
