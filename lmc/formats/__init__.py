"""External checkpoint formats: Hugging Face model directories and timm checkpoints, in and out.

``load_external(path)`` reads a ``save_pretrained`` directory or a timm checkpoint as an
:class:`ExternalModel` (the model in its stored dtype, and how to write models back in the same
format);
:mod:`lmc.formats.huggingface` exposes the directory helpers (config, shard index, stored dtype,
tokenizer files); :func:`evaluation_data` reads the user's own evaluation data. ``transformers``
and ``timm`` are imported only when a checkpoint of theirs is read.
"""

from lmc.formats.evaluation_data import EvaluationData, evaluation_data, model_task
from lmc.formats.external import (
    ExternalModel,
    Format,
    detect_format,
    load_external,
    require_same_architecture,
)

__all__ = [
    "EvaluationData",
    "ExternalModel",
    "Format",
    "detect_format",
    "evaluation_data",
    "load_external",
    "model_task",
    "require_same_architecture",
]
