"""Models: the in-house reference Transformer and named (tiny) variants of every supported family."""

from lmc.models.reference import ReferenceConfig, ReferenceTransformer
from lmc.models.zoo import create_model, list_models, randomize_parameters_, register_model

__all__ = [
    "ReferenceConfig",
    "ReferenceTransformer",
    "create_model",
    "list_models",
    "randomize_parameters_",
    "register_model",
]
