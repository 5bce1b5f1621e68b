"""Safetensors folders as the streamed alignment reads them: their weight files, their model's layout.

:func:`open_folder` reads a Hugging Face ``save_pretrained`` folder (``model.safetensors`` or sharded
``model-0000x-of-0000y.safetensors`` with their index) or a timm folder (``model.safetensors`` beside
timm's ``config.json``) as a lazy mapping (:class:`~lmc.formats.safetensors.SafetensorsCheckpoint`);
:func:`skeleton` builds its model with the parameters on the ``meta`` device (the layout, no
weights); :func:`copy_other_files` copies the files besides the weights into an output folder. The
search that aligns two such folders is :mod:`lmc.matching.streamed`.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from lmc.checkpoints import CheckpointError
from lmc.formats import huggingface, timm_files
from lmc.formats.external import FORMAT_NAMES, Checkpoint, detect
from lmc.formats.safetensors import SafetensorsCheckpoint, loaded_ties, tied_names


def weight_files(checkpoint: Checkpoint) -> list[Path] | None:
    """The weight files of a Hugging Face or timm folder (shards in order); ``None`` for other checkpoints."""
    if checkpoint.format == "timm" and checkpoint.path.is_dir():
        return [timm_files.weight_file(checkpoint.path)]
    if checkpoint.format == "huggingface":
        return huggingface.weight_files(checkpoint.path)
    return None


def streamable(checkpoint: Checkpoint) -> bool:
    """Whether ``lmc align`` streams ``checkpoint`` (:mod:`lmc.matching.streamed_write`): a Hugging Face or timm folder
    of safetensors."""
    files = weight_files(checkpoint)
    return files is not None and all(path.suffix == ".safetensors" for path in files)


def open_folder(checkpoint: Checkpoint | str | Path) -> tuple[Checkpoint, SafetensorsCheckpoint]:
    """A Hugging Face or timm folder (detected, or as :func:`~lmc.formats.detect` found it) and its weights as a
    lazy mapping.

    Raises:
        CheckpointError: It is not such a folder, or stores its weights in another format.
    """
    checkpoint = checkpoint if isinstance(checkpoint, Checkpoint) else detect(checkpoint)
    files = weight_files(checkpoint)
    if files is None:
        raise CheckpointError(
            f"{checkpoint.path} is {FORMAT_NAMES[checkpoint.format]}, not a folder: streamed alignment reads Hugging "
            "Face (save_pretrained) or timm folders of safetensors"
        )
    return checkpoint, SafetensorsCheckpoint(checkpoint.path, files)


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Build modules with their parameters on the ``meta`` device and their buffers (RoPE tables) on the CPU."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, parameter: nn.Parameter | None) -> None:
        register(module, name, parameter)
        if parameter is not None and not parameter.is_meta:  # a tied parameter is registered again as it is
            module._parameters[name] = nn.Parameter(parameter.to("meta"), requires_grad=parameter.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def skeleton(checkpoint: Checkpoint | str | Path, weights: Mapping[str, torch.Tensor] | None = None) -> nn.Module:
    """The model of a Hugging Face or timm folder with its parameters on ``meta``: its layout, no weights.

    Buffers are computed as the model builds them; frozen parameters (constants such as
    RoFormer's sinusoidal table, which the symmetry spec reads) are loaded from ``weights``.

    Raises:
        CheckpointError: The folder's config names no single architecture.
        UnsupportedModelError: lmc has no adapter for it.
    """
    checkpoint = checkpoint if isinstance(checkpoint, Checkpoint) else detect(checkpoint)
    folder = checkpoint.path
    with _parameters_on_meta():
        if checkpoint.format == "timm":
            model = timm_files.create_model(f"local-dir:{folder}", {}, folder)
        else:
            cls = huggingface.model_class(checkpoint.config, folder)
            model = cls(cls.config_class.from_dict(checkpoint.config))
    for name, parameter in list(model.named_parameters()):
        if not parameter.requires_grad and weights is not None and name in weights:
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner)._parameters[leaf] = nn.Parameter(weights[name], requires_grad=False)
    return model


def tie_as_loaded(
    models: tuple[nn.Module, nn.Module], checkpoints: tuple[SafetensorsCheckpoint, SafetensorsCheckpoint]
) -> tuple[dict[str, str], dict[str, bool]]:
    """Tie the skeletons' parameters as the model's loader ties them (:func:`~lmc.formats.safetensors.loaded_ties`):
    a tied name the files store with other values than its parameter's is given a parameter of its own.

    Returns:
        The models' :func:`~lmc.formats.safetensors.tied_names` as built, and whether the loader ties
        each one the files store (the aligned folder is read back the same way).

    Raises:
        CheckpointError: One folder stores such a tensor tied and the other untied: two functions of different form.
    """
    tied = tied_names(models[0])
    ties = [loaded_ties(checkpoint, tied) for checkpoint in checkpoints]
    if ties[0] != ties[1]:
        name = next(n for n in ties[0].keys() | ties[1].keys() if ties[0].get(n) != ties[1].get(n))
        described = [{True: "equal to", False: "apart from", None: "without"}[t.get(name)] for t in ties]
        raise CheckpointError(
            f"{checkpoints[0].folder} stores {name} {described[0]} {tied[name]} and {checkpoints[1].folder} "
            f"{described[1]} it, so from_pretrained loads one model tied and the other untied: give two "
            f"checkpoints saved alike (save both with save_pretrained)"
        )
    for model in models:
        for name in (name for name, kept in ties[0].items() if not kept):
            owner, _, leaf = name.rpartition(".")
            shared = model.get_submodule(owner)._parameters[leaf]
            untied = nn.Parameter(torch.empty_like(shared, device="meta"), requires_grad=shared.requires_grad)
            model.get_submodule(owner)._parameters[leaf] = untied
    return tied, ties[0]


def copy_other_files(source: Path, folder: Path) -> None:
    """The folder's files besides the weights: configs, the shard index, tokenizer files."""
    names = [huggingface.CONFIG_FILE] + [name for name in huggingface.INDEX_FILES[:1] if (source / name).is_file()]
    for name in names:
        shutil.copyfile(source / name, folder / name)
    huggingface.copy_tokenizer_files(source, folder)
