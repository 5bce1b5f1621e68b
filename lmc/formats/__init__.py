"""External checkpoint formats: Hugging Face model directories and timm checkpoints, in and out.

``detect(path)`` reads what a checkpoint is, once, as a :class:`Checkpoint` (its format and
parsed config); ``load_external(checkpoint)`` reads a ``save_pretrained`` directory or a timm
checkpoint as an :class:`ExternalModel` (the model in its stored dtype, and how to write models
back in the same format);
:mod:`lmc.formats.huggingface` exposes the directory helpers (config, shard index, stored dtype,
tokenizer files); :func:`evaluation_data` reads the user's own evaluation data
(:class:`EvaluationDataOptions`: split, batch size, columns, sequence length). ``transformers``
and ``timm`` are imported only when a checkpoint of theirs is read.
Each name is imported on first use (lmc.lazy): ``EvaluationDataOptions``, whose fields are
``lmc interpolate``'s flags, loads no torch.
"""

from lmc.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "evaluation_data": ("EvaluationData", "evaluation_data", "model_task"),
        "evaluation_options": ("EvaluationDataOptions",),
        "external": ("Checkpoint", "ExternalModel", "Format", "detect", "load_external", "require_same_architecture"),
    },
)

__all__ = [
    "Checkpoint",
    "EvaluationData",
    "EvaluationDataOptions",
    "ExternalModel",
    "Format",
    "detect",
    "evaluation_data",
    "load_external",
    "model_task",
    "require_same_architecture",
]
