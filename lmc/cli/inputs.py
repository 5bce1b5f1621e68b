"""What the checkpoint commands share: required flags, the lmc checkpoints' models, the data of a sweep."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # lmc equivalent's --help reads this module: it loads no torch
    from lmc.data import LMCDataModule


def required(value: Any, flag: str) -> Any:
    if value is None:
        raise ValueError(f"{flag} is required")
    return value


def load_pair(a: Path, b: Path) -> tuple[Any, Any, dict[str, Any]]:
    """The models of checkpoints A and B (refused unless of one model), and A's hyper-parameters."""
    from lmc.training.module import load_trained, require_same_model

    module_a, hyperparameters = load_trained(a)
    module_b, hyperparameters_b = load_trained(b)
    require_same_model({a: hyperparameters, b: hyperparameters_b})
    return module_a.model, module_b.model, hyperparameters


def data_module(path: Path, overrides: Sequence[str] = ()) -> LMCDataModule:
    """The DataModule of a ``configs/data/*.yaml`` group file, with ``--data.init_args.<name>=<value>`` overrides."""
    from lmc.training.cli import data_parser

    parser = data_parser()
    try:
        return parser.instantiate_classes(parser.parse_args(["--data", str(path), *overrides])).data
    except Exception as error:  # jsonargparse's ArgumentError and whatever the DataModule raises
        first = " ".join(str(error).split()) or type(error).__name__
        raise ValueError(
            f"--data {path}: not a DataModule config ({first}); lmc checkpoints evaluate on a DataModule "
            "(configs/data/*.yaml or a class path such as lmc.data.Digits)"
        ) from error
