"""The LightningCLI of lmc (``lmc fit|validate|test|predict``): ``LMCModule`` and any ``LMCDataModule``."""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

from lmc.tasks import DataInfo

if TYPE_CHECKING:
    from lmc.data import LMCDataModule


def data_info(data) -> DataInfo:
    """What a DataModule tells the model about itself (linked into ``model.data``)."""
    return data.info


def data_parser():
    """A parser of the ``data`` group alone, as :func:`lightning_cli` has it: any ``LMCDataModule``
    subclass, as a class path (with ``init_args``) or a ``configs/data/*.yaml`` file."""
    from jsonargparse import ArgumentParser

    from lmc.data import LMCDataModule

    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(LMCDataModule, "data")
    return parser


def instantiate_data(config) -> LMCDataModule:
    """The DataModule of a parsed experiment config (its ``data`` group), without its model or trainer."""
    from jsonargparse import Namespace

    return data_parser().instantiate_classes(Namespace(data=config.data)).data


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


@contextmanager
def _info_hidden(*loggers: str):
    """The INFO lines of ``loggers`` (Lightning's) hidden meanwhile; their warnings still show."""
    levels = {name: logging.getLogger(name).level for name in loggers}
    for name in loggers:
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


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


#: The config groups LightningCLI makes of Lightning's classes; a command's --help lists its own options first.
_LIGHTNING_GROUPS = ("trainer", "model", "data")


def _usage(command: str) -> str:
    """``lmc COMMAND``'s usage line: its options are listed below its description, not in this line."""
    return f"lmc {command} [-h] [-c CONFIG] [--print_config[=flags]] [--KEY VALUE ...]"


def _parser_kwargs(run: bool, description: str | None, subcommands: list[str]) -> dict[str, object]:
    """The LightningCLI parsers' settings: plain-text help, the command's name and a short usage line, on the
    main parser (``lmc run``'s) or on each subcommand's (``lmc fit``, ...)."""
    plain = {"formatter_class": help_formatter()}
    if run:
        return {**plain, "prog": "lmc", **{name: {**plain, "usage": _usage(name)} for name in subcommands}}
    return {
        **plain,
        "prog": "lmc run",
        "usage": _usage("run"),
        **({} if description is None else {"description": description}),
    }


def _own_options_first():
    """LightningCLI's parser, whose --help lists the command's own options (``protocol``, ``cluster``,
    ``ckpt_path``, ...) before the trainer's, the model's and the data's."""
    from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

    class OwnOptionsFirst(LightningArgumentParser):
        def format_help(self, *args, **kwargs) -> str:
            keys = [key for key in self.groups if key.split(".")[0] not in _LIGHTNING_GROUPS]
            # lmc fit's own (ckpt_path) before the protocol and cluster groups it ignores
            own = [self.groups[key] for key in sorted(keys, key=lambda key: key not in LightningCLI.subcommands())]
            rest = [group for group in self._action_groups if group not in own]
            at = rest.index(self._optionals) + 1
            listed, self._action_groups = self._action_groups, [*rest[:at], *own, *rest[at:]]
            try:
                return super().format_help(*args, **kwargs)
            finally:
                self._action_groups = listed

    return OwnOptionsFirst


def lightning_cli(
    args: list[str] | None = None,
    run: bool = True,
    groups: Mapping[str, type] | None = None,
    description: str | None = None,
):
    """The LightningCLI of lmc: model ``LMCModule``, data any ``LMCDataModule`` subclass.

    The DataModule's sizing metadata is linked into ``model.data`` so a model is always sized to
    its data. The resolved config is saved into the run's log folder, never elsewhere.

    Args:
        args: The arguments (``None``: the command line).
        run: Run the subcommand (``fit``, ``validate``, ...); ``False`` only parses and instantiates.
        groups: Further config groups, each a dataclass instantiated into ``cli.config_init``
            (``lmc run``'s ``protocol``).
        description: The parser's ``--help`` description when ``run`` is ``False``.
    """
    from lightning.pytorch.cli import LightningCLI, SaveConfigCallback

    from lmc.data import LMCDataModule
    from lmc.training import LMCModule
    from lmc.training.module import require_an_end

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
        def parse_arguments(self, parser, args) -> None:
            """Parse, then refuse trainer settings the schedule cannot run under before anything prints."""
            super().parse_arguments(parser, args)
            subcommand = self.config.get("subcommand")
            trainer = (self.config[subcommand] if subcommand else self.config).get("trainer")
            if trainer is not None:
                require_an_end(trainer.get("max_epochs"), trainer.get("max_steps", -1))

        def _set_seed(self) -> None:
            # The seed is in the saved config; Lightning's "Seed set to" line would come before any one-line error.
            with _info_hidden("lightning.fabric.utilities.seed"):
                super()._set_seed()

        def add_arguments_to_parser(self, parser) -> None:
            parser.link_arguments("data", "model.data", compute_fn=data_info, apply_on="instantiate")
            for name, group in (groups or {}).items():
                parser.add_class_arguments(group, name, instantiate=True)

    # Parsed only (lmc run, a study's runs): the trainer's "GPU available" lines would come before a one-line
    # refusal of the config (Experiment.check_before_work); each stage's fit shows its own in its log.
    quiet = _info_hidden("lightning.pytorch", "lightning.fabric") if not run else nullcontext()
    with _program_arguments_only() if args is not None else nullcontext(), quiet:
        return LMCLightningCLI(
            LMCModule,
            LMCDataModule,
            subclass_mode_data=True,
            save_config_callback=SaveConfigIntoTheRunFolder,
            save_config_kwargs={"overwrite": True},
            args=args,
            run=run,
            auto_configure_optimizers=False,
            parser_class=_own_options_first(),
            # Without subcommands this parser is lmc run's: say so in its --help.
            parser_kwargs=_parser_kwargs(run, description, list(LightningCLI.subcommands())),
        )
