"""Model adapters: the registry, one adapter per supported model family, and the model-level API.

``model_spec``, ``describe``, ``describe_scopes``, ``scope_parameters``, ``random_symmetry``, ``fold_norms`` and
``apply_transform`` take a model and read it through its adapter. ``transformers`` and ``timm`` are imported only
when one of their models is described.
"""

from lmc.adapters import decoders, huggingface, reference, timm_vision  # noqa: F401  (registration)
from lmc.adapters.api import (
    apply_transform,
    describe,
    describe_scopes,
    fold_norms,
    model_spec,
    random_symmetry,
    scope_parameters,
)
from lmc.adapters.base import (
    ModelAdapter,
    UnsupportedModelError,
    adapter_for,
    adapter_for_class,
    list_adapters,
    register_adapter,
)

__all__ = [
    "ModelAdapter",
    "UnsupportedModelError",
    "adapter_for",
    "adapter_for_class",
    "apply_transform",
    "describe",
    "describe_scopes",
    "fold_norms",
    "list_adapters",
    "model_spec",
    "random_symmetry",
    "register_adapter",
    "scope_parameters",
]
