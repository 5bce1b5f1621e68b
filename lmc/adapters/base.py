"""The adapter interface and registry: the only place that knows a model's storage layout.

An adapter turns a model into a :class:`~lmc.symmetry.spec.SymmetrySpec` (which parameter
axes each group acts on) and knows how to feed the model a probe input. Adapters are
registered by class name, so matching a model never imports ``transformers`` or ``timm``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
from torch import nn

from lmc.symmetry.spec import AttentionSpec, SymmetrySpec


class UnsupportedModelError(TypeError):
    """Raised for a model that no adapter supports (or an unsupported configuration of one)."""


class ModelAdapter(ABC):
    """How lmc reads one family of models."""

    #: Registry key, ``"<top-level package>:<class name>"``.
    name: str = ""

    @abstractmethod
    def spec(self, model: nn.Module) -> SymmetrySpec:
        """Describe the model's symmetries as data."""

    @abstractmethod
    def example_inputs(self, model: nn.Module, batch_size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """A random valid input batch (keyword arguments of ``model.forward``)."""

    @abstractmethod
    def model_inputs(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Map an lmc batch (``inputs``, optional ``attention_mask``; see :mod:`lmc.data.base`)
        to the keyword arguments of ``model.forward``."""

    def forward(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The model's output tensor on ``inputs`` (logits for every model lmc supports)."""
        output = model(**inputs)
        return output if isinstance(output, torch.Tensor) else output.logits

    def saved_names(self, model: nn.Module) -> dict[str, str]:
        """Parameters that the model's saved files store under another name: parameter -> stored name.

        Read where lmc opens weight files itself (streamed alignment); empty for most models.
        """
        return {}

    def attention_input_module(self, model: nn.Module, layer: AttentionSpec) -> nn.Module:
        """The module whose first positional argument is ``layer``'s input ``x``, ``(B, T, d)`` or ``(B, d)``.

        Every query, key and value weight multiplies that input, so by default it is the module
        owning the query weight (a query Linear, a fused ``qkv`` or ``c_attn``); a model that
        reads that weight without calling its module names another one.
        """
        return model.get_submodule(layer.query.parameter.rpartition(".")[0])

    def attention_output_module(self, model: nn.Module, layer: AttentionSpec) -> nn.Module:
        """The module whose first positional argument is what ``W_O`` reads: the heads' outputs
        concatenated head-major, ``(B, T, h * d_h)``. By default the module owning ``W_O``."""
        return model.get_submodule(layer.out.parameter.rpartition(".")[0])


_REGISTRY: dict[str, ModelAdapter] = {}


def register_adapter(key: str) -> Callable[[type[ModelAdapter]], type[ModelAdapter]]:
    """Class decorator: register an adapter for models whose class (or a base) is ``key``.

    Args:
        key: ``"<top-level package>:<class name>"``, e.g. ``"transformers:GPT2LMHeadModel"``.
    """

    def decorate(cls: type[ModelAdapter]) -> type[ModelAdapter]:
        if key in _REGISTRY:
            raise ValueError(f"an adapter for {key} is already registered ({type(_REGISTRY[key]).__name__})")
        adapter = cls()
        adapter.name = key
        _REGISTRY[key] = adapter
        return cls

    return decorate


def _class_key(cls: type) -> str:
    return f"{cls.__module__.split('.')[0]}:{cls.__name__}"


def adapter_for(model: nn.Module) -> ModelAdapter:
    """The adapter for ``model`` (matched on its class, then its base classes).

    Raises:
        UnsupportedModelError: No adapter is registered; the message lists the supported models.
    """
    return adapter_for_class(type(model))


def adapter_for_class(model_class: type) -> ModelAdapter:
    """The adapter for models of ``model_class`` (or a base class), checked before any model is built.

    Raises:
        UnsupportedModelError: No adapter is registered; the message lists the supported models.
    """
    for cls in model_class.__mro__:
        if (key := _class_key(cls)) in _REGISTRY:
            return _REGISTRY[key]
    raise UnsupportedModelError(
        f"lmc has no adapter for {_class_key(model_class)}. Supported models: {', '.join(list_adapters())}. "
        "To add one, subclass lmc.adapters.ModelAdapter and decorate it with @register_adapter('<package>:<Class>')."
    )


def list_adapters() -> list[str]:
    """Registry keys of every supported model class."""
    return sorted(_REGISTRY)
