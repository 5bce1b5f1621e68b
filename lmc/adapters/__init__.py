"""Model adapters: the registry and one adapter per supported model family.

``transformers`` and ``timm`` are imported only when one of their models is described.
"""

from lmc.adapters import huggingface, reference, timm_vision  # noqa: F401  (registration)
from lmc.adapters.base import ModelAdapter, UnsupportedModelError, adapter_for, list_adapters, register_adapter

__all__ = ["ModelAdapter", "UnsupportedModelError", "adapter_for", "list_adapters", "register_adapter"]
