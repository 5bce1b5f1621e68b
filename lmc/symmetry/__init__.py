"""Exact weight-space symmetries of Transformers (paper Sections 2-4; SPEC section 2).

``describe(model)`` lists each attention layer's group; ``random_symmetry(model, scope, seed)``
returns a transformed copy that computes the same function. Specs (:mod:`lmc.symmetry.spec`)
say where each group acts; :mod:`lmc.symmetry.groups` holds ``GL`` and RoPE's ``H``;
:mod:`lmc.symmetry.transforms` applies, inverts and composes elements.
"""

from lmc.symmetry.api import (
    apply_transform,
    describe,
    model_spec,
    random_symmetry,
    sample_transform,
    scope_blocks,
    scope_parameters,
)
from lmc.symmetry.groups import TiedGroup, general_linear, other_pair_layout, rotary_commutant
from lmc.symmetry.spec import SCOPES, AttentionSpec, AxisPermutation, HeadSlot, RotaryLayout, Scope, SymmetrySpec
from lmc.symmetry.transforms import (
    AttentionTransform,
    ModelTransform,
    qk_group,
    sample_attention_transform,
    transform_attention,
    vo_group,
)
from lmc.symmetry.weights import AttentionWeights, head_rows, read_attention, write_attention

__all__ = [
    "SCOPES",
    "Scope",
    "apply_transform",
    "AttentionSpec",
    "AttentionTransform",
    "AttentionWeights",
    "AxisPermutation",
    "HeadSlot",
    "ModelTransform",
    "RotaryLayout",
    "SymmetrySpec",
    "TiedGroup",
    "describe",
    "general_linear",
    "head_rows",
    "model_spec",
    "other_pair_layout",
    "qk_group",
    "random_symmetry",
    "read_attention",
    "rotary_commutant",
    "sample_attention_transform",
    "sample_transform",
    "scope_blocks",
    "scope_parameters",
    "transform_attention",
    "vo_group",
    "write_attention",
]
