"""The ``lmc`` command (also ``python -m lmc``): one jsonargparse mechanism for every command.

- ``lmc fit|validate|test|predict --config X.yaml [--config Y.yaml] [--key value ...]``: a
  LightningCLI over :class:`~lmc.training.LMCModule` and any :class:`~lmc.data.LMCDataModule`.
- ``lmc run --config configs/experiment/X.yaml [...]``: the whole protocol (pre-train, fine-tune
  seeds, align every pair, sweep, summarize; :mod:`lmc.experiment`).
- ``lmc align``, ``lmc interpolate``, ``lmc demo``, ``lmc symmetry``: typed functions of
  :mod:`lmc.commands`; each function's docstring is its ``--help``.

Errors that come from the user's input (a missing checkpoint, a bad value, an unsupported
model) print one line and exit with status 2; ``LMC_DEBUG=1`` shows the traceback.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any

TRAINING_COMMANDS = ("fit", "validate", "test", "predict")


def data_info(data) -> Any:
    """What a DataModule tells the model about itself (linked into ``model.data``)."""
    return data.info


@contextmanager
def _program_arguments_only():
    """Hide the process's own arguments while LightningCLI parses explicit ``args``.

    LightningCLI warns whenever both are present (a guard for notebooks); ``lmc run`` and the
    Python API always pass the arguments explicitly.
    """
    saved = sys.argv
    sys.argv = saved[:1]
    try:
        yield
    finally:
        sys.argv = saved


def lightning_cli(args: list[str] | None = None, run: bool = True):
    """The LightningCLI of lmc: model ``LMCModule``, data any ``LMCDataModule`` subclass.

    ``args`` ``None`` reads the command line. The DataModule's sizing metadata is linked into
    ``model.data`` so a model is always sized to its data; the ``protocol`` group is read by
    ``lmc run`` only. The resolved config is saved into the run's log folder, never elsewhere.
    """
    from lightning.pytorch.cli import LightningCLI, SaveConfigCallback

    from lmc.data import LMCDataModule
    from lmc.experiment import Protocol
    from lmc.training import LMCModule

    class SaveConfigIntoTheRunFolder(SaveConfigCallback):
        """Save the config only where the run keeps its logs, and never over an input file."""

        def setup(self, trainer, pl_module, stage: str) -> None:
            if trainer.logger is None or trainer.logger.log_dir is None:
                return  # no run folder: the working directory is the user's, not ours
            inputs = {Path(str(c)).resolve() for c in self.config.get("config") or []}
            if (Path(trainer.logger.log_dir) / self.config_filename).resolve() in inputs:
                return
            super().setup(trainer, pl_module, stage)

    class LMCLightningCLI(LightningCLI):
        def add_arguments_to_parser(self, parser) -> None:
            parser.link_arguments("data", "model.data", compute_fn=data_info, apply_on="instantiate")
            parser.add_class_arguments(Protocol, "protocol", instantiate=True)

    with _program_arguments_only() if args is not None else _no_op():
        return LMCLightningCLI(
            LMCModule,
            LMCDataModule,
            subclass_mode_data=True,
            save_config_callback=SaveConfigIntoTheRunFolder,
            save_config_kwargs={"overwrite": True},
            args=args,
            run=run,
            auto_configure_optimizers=False,
        )


@contextmanager
def _no_op():
    yield


def _run_command(argv: list[str]) -> None:
    from lmc import experiment

    experiment.run(lightning_cli(argv, run=False))


def _function_command(argv: list[str]) -> None:
    from jsonargparse import ArgumentParser, set_parsing_settings

    from lmc import commands

    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    parser = ArgumentParser(prog="lmc", description=__doc__)
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
        if argv and argv[0] in TRAINING_COMMANDS:
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
