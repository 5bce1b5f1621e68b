"""What the checkpoint commands share: required flags and the ``--data`` they read after parsing."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the help of lmc equivalent, align and interpolate reads this module: it loads no torch
    from lmc.data import LMCDataModule

#: ``--data`` of ``lmc align`` and ``lmc interpolate`` as parsed, before :func:`data_module` (lmc checkpoints) or
#: :func:`user_data` (Hugging Face, timm) reads it: a ``configs/data/*.yaml`` file, a class path such as
#: ``lmc.data.Digits``, a mapping ``{class_path: ..., init_args: {...}}``, or a path to the user's data. A plain
#: value, not ``LMCDataModule``: a Lightning class would make their --help import torch and Lightning.
DataSource = str | dict[str, Any]


def required(value: Any, flag: str) -> Any:
    if value is None:
        raise ValueError(f"{flag} is required")
    return value


def data_module(source: DataSource | Path, overrides: Sequence[str] = ()) -> LMCDataModule:
    """The DataModule of a ``configs/data/*.yaml`` group file, a class path or a ``{class_path, init_args}``
    mapping, with ``--data.init_args.<name>=<value>`` overrides.

    Raises:
        ValueError: ``source`` is none of them, or its DataModule refuses its arguments (one line naming it).
    """
    import json

    from lmc.training.cli import data_parser

    value = json.dumps(source) if isinstance(source, dict) else str(source)
    if isinstance(source, dict) and "class_path" not in source:  # what --data X --data.NAME V parses into
        raise ValueError(
            f"--data {value}: a DataModule mapping names its class: '{{class_path: lmc.data.Digits, init_args: "
            "{...}}'; --data.NAME flags replace a --data file or class path here, so give the arguments in it"
        )
    parser = data_parser()
    try:
        return parser.instantiate_classes(parser.parse_args(["--data", value, *overrides])).data
    except Exception as error:  # jsonargparse's ArgumentError and whatever the DataModule raises
        first = " ".join(str(error).split()) or type(error).__name__
        raise ValueError(
            f"--data {value}: not a DataModule config ({first}); lmc checkpoints evaluate on a DataModule "
            "(configs/data/*.yaml, a class path such as lmc.data.Digits, or '{class_path: ..., init_args: {...}}')"
        ) from error


def user_data(source: DataSource) -> Path:
    """``--data`` of Hugging Face and timm checkpoints: a path to the user's own data, never a DataModule.

    Raises:
        ValueError: ``source`` names a DataModule (a mapping, a class path or a ``configs/data/*.yaml`` file).
    """
    if isinstance(source, dict) or _names_a_class(source) or Path(source).suffix in (".yaml", ".yml"):
        raise ValueError("--data of Hugging Face and timm models is a path to your data, not a DataModule")
    return Path(source)


def _names_a_class(source: str) -> bool:
    """Whether ``source`` is no path but the class path of an importable class (``lmc.data.Digits``)."""
    import importlib

    module, _, name = source.rpartition(".")
    if not module or Path(source).exists():
        return False
    try:
        return isinstance(getattr(importlib.import_module(module), name, None), type)
    except ImportError:  # eval.txt: no module eval
        return False
