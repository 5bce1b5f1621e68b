"""What a data set tells a model: its task and the sizes the model is built to fit.

Every :class:`~lmc.data.LMCDataModule` produces a :class:`DataInfo` (``datamodule.info``) and
every model factory of :mod:`lmc.models` reads one (``create_model(name, data=info)``); the CLI
links the first into the second. This module imports nothing of lmc, Lightning or torch, so
both sides can depend on it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, get_args

Task = Literal["image_classification", "text_classification", "causal_lm"]
TASKS: tuple[Task, ...] = get_args(Task)
#: Where interpolation curves are measured (never the training split).
CurveSplit = Literal["val", "test"]
CURVE_SPLITS: tuple[str, ...] = get_args(CurveSplit)


def check_curve_split(split: str) -> None:
    """Refuse a split that curves are not measured on, naming the choices."""
    if split not in CURVE_SPLITS:
        raise ValueError(f"unknown split {split!r} for interpolation curves; choose one of {', '.join(CURVE_SPLITS)}")


#: The size fields each task needs, and those it may also set; any other size field is refused.
_REQUIRED: dict[str, tuple[str, ...]] = {
    "image_classification": ("num_classes", "image_size", "in_channels"),
    "text_classification": ("num_classes", "vocab_size"),
    "causal_lm": ("vocab_size",),
}
_OPTIONAL: dict[str, tuple[str, ...]] = {
    "image_classification": (),
    "text_classification": ("sequence_length",),
    "causal_lm": ("sequence_length",),
}


@dataclass(frozen=True)
class DataInfo:
    """The task of a data set and the sizes a model needs to fit it.

    Which sizes are set depends on the task (others stay ``None``):

    - ``image_classification``: ``num_classes``, ``image_size``, ``in_channels``;
    - ``text_classification``: ``num_classes``, ``vocab_size``, optionally ``sequence_length``;
    - ``causal_lm``: ``vocab_size``, optionally ``sequence_length`` (the model predicts tokens,
      so its output size is ``vocab_size``: there is no ``num_classes``).

    Raises:
        ValueError: On an unknown task, a missing size, a size the task has no use for, or a
            size that is not a positive integer.
    """

    task: Task
    """What the model does with a batch (see :mod:`lmc.data.base` for each task's batches)."""
    num_classes: int | None = None
    """Classes of a classification task: the size of the model's output."""
    vocab_size: int | None = None
    """Token ids of a text task lie in ``[0, vocab_size)``; a language model predicts one of them."""
    sequence_length: int | None = None
    """Tokens per sample of a text task: the positions a model must cover."""
    image_size: int | None = None
    """Side of the square input images, in pixels."""
    in_channels: int | None = None
    """Channels of the input images."""

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"DataInfo(task={self.task!r}): choose one of {', '.join(TASKS)}")
        sizes = {field.name: getattr(self, field.name) for field in dataclasses.fields(self) if field.name != "task"}
        for name, value in sizes.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"DataInfo({name}={value!r}): sizes are positive integers")
        required, allowed = _REQUIRED[self.task], _REQUIRED[self.task] + _OPTIONAL[self.task]
        missing = [name for name in required if sizes[name] is None]
        if missing:
            raise ValueError(f"DataInfo(task={self.task!r}) needs {', '.join(missing)}; set it from the data set")
        if self.task == "causal_lm" and self.num_classes is not None:
            raise ValueError(
                "DataInfo(task='causal_lm') takes the vocabulary size as vocab_size, not num_classes: "
                "leave num_classes unset"
            )
        extra = [name for name, value in sizes.items() if value is not None and name not in allowed]
        if extra:
            raise ValueError(
                f"DataInfo(task={self.task!r}) has no use for {', '.join(extra)}; it takes {', '.join(allowed)}"
            )
