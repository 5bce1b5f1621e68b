"""What the checkpoint commands share: required flags, output guards, the checkpoints' format and scope."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # lmc equivalent's --help reads this module: it loads no torch
    from lmc.data import LMCDataModule
    from lmc.formats import Checkpoint
    from lmc.matching import AlignOptions


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
