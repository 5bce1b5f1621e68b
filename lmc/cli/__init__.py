"""The ``lmc`` command (also ``python -m lmc``): one module per command.

- ``lmc fit|validate|test|predict``: Lightning's commands over an experiment config (lmc.cli.train);
- ``lmc run``: the paper's protocol from one experiment config (lmc.cli.run);
- ``lmc align``, ``interpolate``, ``equivalent``, ``demo``, ``repro``, ``symmetry``: typed
  functions, one per module of this package, whose docstrings are their ``--help`` (lmc.cli.parsing).

Errors that come from the user's input (a missing checkpoint, a bad value, an unsupported
model) print one line and exit with status 2; ``LMC_DEBUG=1`` shows the traceback.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable

from lmc.cli.train import TRAINING_COMMANDS

#: The typed function commands: each is the function of that name in ``lmc.cli.<name>``.
FUNCTION_COMMANDS = ("align", "interpolate", "equivalent", "demo", "repro", "symmetry")
#: Every command of ``lmc``, in the order ``--help`` lists them.
COMMANDS = (*TRAINING_COMMANDS, "run", *FUNCTION_COMMANDS)

_DESCRIPTION = """Weight-space symmetry and linear mode connectivity of Transformers.

Commands:
  fit, validate, test, predict
                Lightning's commands over an experiment config (lmc fit --config X.yaml)
  run           The paper's protocol from one experiment config: pre-train, fine-tune
                seeds, align and sweep every pair, summarize (lmc run --config X.yaml)
{functions}

`lmc COMMAND --help` shows a command's options. Errors in the input print one line and
exit with status 2; LMC_DEBUG=1 shows the traceback."""


def command(name: str) -> Callable[..., None]:
    """The function of a function command (``align`` -> ``lmc.cli.align.align``)."""
    return getattr(importlib.import_module(f"lmc.cli.{name}"), name)


def _function_command(argv: list[str]) -> None:
    from jsonargparse import ArgumentParser, set_parsing_settings

    from lmc.cli import parsing

    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    functions = {name: command(name) for name in FUNCTION_COMMANDS}
    listed = "\n".join(f"  {name:13s} {parsing.summary(function)}" for name, function in functions.items())
    parser = ArgumentParser(
        prog="lmc",
        usage=f"lmc {{{','.join(COMMANDS)}}} ...",
        description=_DESCRIPTION.format(functions=listed),
        formatter_class=parsing.help_formatter(),
    )
    subcommands = parser.add_subcommands(required=True, dest="command")
    for name, function in functions.items():
        subcommands.add_subcommand(name, parsing.parser_for(function), help=parsing.summary(function))
    config = parser.parse_args(parsing.underscored(argv))
    parsing.call(functions[config.command], parser, config, config.command)


def _user_errors() -> tuple[type[BaseException], ...]:
    from lmc.adapters import UnsupportedModelError
    from lmc.checkpoints import CheckpointError
    from lmc.data import DataUnavailableError
    from lmc.experiments.jobs import JobFailedError
    from lmc.matching import AlignmentError

    errors = (CheckpointError, AlignmentError, DataUnavailableError, UnsupportedModelError, JobFailedError)
    return (*errors, ValueError, OSError)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``lmc`` console script."""
    from lmc.cli import parsing

    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        parsing.check_config_files(argv)
        if argv and argv[0] in TRAINING_COMMANDS:
            from lmc.cli import train

            train.main(argv)
        elif argv and argv[0] == "run":
            from lmc.cli import run

            run.main(argv[1:])
        else:
            _function_command(argv)
    except _user_errors() as error:
        if os.environ.get("LMC_DEBUG"):
            raise
        from lmc.cli.parsing import one_line

        message = one_line(str(error)) or type(error).__name__
        print(f"lmc: error: {message} (LMC_DEBUG=1 shows the traceback)", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
