"""What the checkpoint commands share: required flags, output guards, the checkpoints' format and scope."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the help of lmc equivalent, align and interpolate reads this module: it loads no torch
    from lmc.data import LMCDataModule
    from lmc.formats import Checkpoint
    from lmc.matching import AlignOptions

#: ``--data`` of ``lmc align`` and ``lmc interpolate`` as parsed, before :func:`data_module` (lmc checkpoints) or
#: :func:`user_data` (Hugging Face, timm) reads it: a ``configs/data/*.yaml`` file, a class path such as
#: ``lmc.data.Digits``, a mapping ``{class_path: ..., init_args: {...}}``, or a path to the user's data. A plain
#: value, not ``LMCDataModule``: a Lightning class would make their --help import torch and Lightning.
DataSource = str | dict[str, Any]


def required(value: Any, flag: str) -> Any:
    if value is None:
        raise ValueError(f"{flag} is required")
    return value


def check_outputs(outputs: list[Path], inputs: list[Path], overwrite: bool) -> None:
    """Refuse outputs that would replace (or lie inside, or hold) an input, collide, or replace results without
    ``overwrite``."""
    from lmc.io import overlapping_input

    for path in outputs:
        clash = overlapping_input(path, inputs)
        if clash is not None:
            raise ValueError(f"the output {path} would replace an input ({clash}): choose another output folder")
        if path.parent.exists() and not path.parent.is_dir():
            raise ValueError(f"the output folder {path.parent} is a file: choose a folder")
    existing = [str(p) for p in outputs if p.exists()]
    if existing and not overwrite:
        raise ValueError(f"{', '.join(existing)} already exist: pass --overwrite true to replace them")


def load_pair(a: Path, b: Path) -> tuple[Any, Any, dict[str, Any]]:
    """The models of checkpoints A and B (refused unless of one model), and A's hyper-parameters."""
    from lmc.training.module import load_trained, require_same_model

    module_a, hyperparameters = load_trained(a)
    module_b, hyperparameters_b = load_trained(b)
    require_same_model({a: hyperparameters, b: hyperparameters_b})
    return module_a.model, module_b.model, hyperparameters


def trained_scope(hyperparameters: dict[str, Any]) -> str:
    return hyperparameters.get("reinit") or "full_model"


def external_pair(a: Checkpoint, b: Checkpoint) -> bool:
    """Whether A and B are Hugging Face or timm checkpoints (``False``: lmc checkpoints); mixed formats are refused."""
    from lmc.checkpoints import CheckpointError
    from lmc.formats.external import FORMAT_NAMES

    if (a.format == "lmc") != (b.format == "lmc"):
        raise CheckpointError(
            f"{a.path} is {FORMAT_NAMES[a.format]} but {b.path} is {FORMAT_NAMES[b.format]}: give two checkpoints "
            "of one format"
        )
    return a.format != "lmc"


def refuse_data_aware_external(options: AlignOptions) -> None:
    if options.data_aware:
        raise ValueError(
            f"data-aware alignment settings ({options.data_settings}) calibrate on an lmc DataModule's training "
            "split, which Hugging Face and timm checkpoints do not have here: use the weight settings (the defaults) "
            "for them"
        )


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


def remove_other_merges(output: Path, merges: list[Path]) -> list[Path]:
    """Remove the merges of an earlier ``lmc align`` in ``output`` that this one did not write (an
    ``--overwrite`` with other alphas would leave them beside the new aligned model, unmarked).

    Called once the new outputs are in place; returns what was removed.
    """
    import shutil

    kept = {path.name for path in merges}
    removed = [path for path in sorted(output.glob("merged_*")) if path.name not in kept]
    for path in removed:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return removed
