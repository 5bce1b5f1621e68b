"""The ``lmc`` command (also ``python -m lmc``): one module per command.

- ``lmc fit|validate|test|predict``: Lightning's commands over an experiment config (lmc.cli.train);
- ``lmc run``: the paper's protocol from one experiment config (lmc.cli.run);
- ``lmc align``, ``interpolate``, ``equivalent``, ``demo``, ``repro``, ``symmetry``: typed
  functions, one per module of this package, whose docstrings are their ``--help`` (lmc.cli.parsing).

``lmc --help`` and ``--version`` import no command, and each command imports only its own modules,
so the help of the function commands loads no torch: their options are plain values and
dataclasses. align's and interpolate's ``--data`` is parsed as a plain value
(:data:`lmc.cli.inputs.DataSource`: a ``configs/data/*.yaml`` file, a class path, a
``{class_path, init_args}`` mapping, or a path to the user's data) and read into a DataModule by
the command, after parsing (:func:`lmc.cli.inputs.data_module`); a command's module has no
``TYPE_CHECKING`` block, which jsonargparse would run. The options of ``run`` and the training
commands are Lightning's Trainer's and the model's, which only Lightning can list: their plain
``--help`` is rendered once and kept (:mod:`lmc.cli.help_cache`; :func:`keep_help`, which
``make install`` runs), so that it too prints without torch.

Errors that come from the user's input (a missing checkpoint, a bad value, an unsupported
model) print one line and exit with status 2; ``LMC_DEBUG=1`` shows the traceback.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys
from collections.abc import Callable

import lmc
from lmc.cli import help_cache
from lmc.cli.train import TRAINING_COMMANDS

#: The typed function commands: each is the function of that name in ``lmc.cli.<name>``.
FUNCTION_COMMANDS = ("align", "merge", "interpolate", "equivalent", "demo", "repro", "symmetry")
#: Every command of ``lmc``, in the order ``--help`` lists them.
COMMANDS = (*TRAINING_COMMANDS, "run", *FUNCTION_COMMANDS)

_DESCRIPTION = """Weight-space symmetry and linear mode connectivity of Transformers.

commands:
  fit, validate, test, predict
                Lightning's commands over an experiment config (lmc fit --config X.yaml)
  run           The paper's protocol from one experiment config: pre-train, fine-tune
                seeds, align and sweep every pair, summarize (lmc run --config X.yaml)
{functions}"""

_EPILOG = """`lmc COMMAND --help` shows a command's options. Errors in the input print one line and
exit with status 2; LMC_DEBUG=1 shows the traceback."""


def command(name: str) -> Callable[..., None]:
    """The function of a function command (``align`` -> ``lmc.cli.align.align``)."""
    return getattr(importlib.import_module(f"lmc.cli.{name}"), name)


def _parser() -> argparse.ArgumentParser:
    """``lmc`` before its command: ``--help`` and ``--version``, which import none of the commands."""
    from lmc.cli import parsing

    listed = "\n".join(f"  {name:13s} {parsing.summary(name)}" for name in FUNCTION_COMMANDS)
    parser = argparse.ArgumentParser(
        prog="lmc",
        usage="lmc [-h] [--version] COMMAND ...",
        description=_DESCRIPTION.format(functions=listed),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"lmc {lmc.__version__}")
    parser.add_argument("command", choices=COMMANDS, metavar="COMMAND", help=argparse.SUPPRESS)
    return parser


def _function_command(name: str, argv: list[str]) -> None:
    from jsonargparse import set_parsing_settings

    from lmc.cli import parsing

    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    function = command(name)
    parser = parsing.parser_for(function)
    parsing.call(function, parser, parser.parse_args(parsing.gathered(function, parsing.underscored(argv))))


def _run_command(name: str, argv: list[str]) -> None:
    """Parse and run ``lmc NAME ARGV...``: only the named command's modules are imported."""
    if name in TRAINING_COMMANDS:
        from lmc.cli import train

        train.main([name, *argv])
    elif name == "run":
        from lmc.cli import run

        run.main(argv)
    else:
        _function_command(name, argv)


def keep_help() -> None:
    """Render and keep the help of every command whose help needs Lightning (lmc.cli.help_cache), unless kept
    already: ``make install`` runs it, so that a new user's first ``lmc run --help`` is fast too."""
    for name in help_cache.KEPT_HELP_COMMANDS:
        help_cache.keep_help(name, functools.partial(_run_command, name, ["--help"]))


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
    if help_cache.kept_help_asked(argv):
        help_cache.show_help(argv[0], functools.partial(_run_command, argv[0], argv[1:]))
    try:
        parsing.check_config_files(argv)
        if argv and argv[0] in COMMANDS:
            _run_command(argv[0], argv[1:])
        else:  # --help, --version, or the one line that says what is wrong
            _run_command(_parser().parse_args(argv).command, [])
    except Exception as error:  # not `except _user_errors()`: --help's SystemExit would import them all
        if os.environ.get("LMC_DEBUG") or not isinstance(error, _user_errors()):
            raise
        from lmc.cli.parsing import one_line

        message = one_line(str(error)) or type(error).__name__
        print(f"lmc: error: {message} (LMC_DEBUG=1 shows the traceback)", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
