"""Exact weight-space symmetries of Transformers as data and math (paper Sections 2-4; docs/spec.md, section 2).

Specs (:mod:`lmc.symmetry.spec`) say where each group acts, which axes no group acts on and why, and which blocks
a scope covers; :mod:`lmc.symmetry.axes` checks that every parameter axis is explained;
:mod:`lmc.symmetry.groups` holds ``GL``, RoPE's ``H`` and the sign flips left by per-head QK-norms;
:mod:`lmc.symmetry.transforms` samples, applies, inverts and composes elements. Nothing here knows a model class: the
model-level entry points (``model_spec``, ``describe``, ``random_symmetry``, ...) live in
:mod:`lmc.adapters`, which turns models into specs.
Each name is imported on first use (lmc.lazy): the ``Scope`` literal loads no torch.
"""

from lmc.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "axes": ("REASONS", "AxisRole", "explain_axes", "unexplained_axes"),
        "folds": ("NormFold", "Reader", "fold_parameters_"),
        "groups": (
            "QKGroup",
            "SignFlips",
            "TiedGroup",
            "general_linear",
            "other_pair_layout",
            "rotary_commutant",
            "sign_flips",
        ),
        "rotations": (
            "ResidualGroup",
            "centered_basis",
            "in_group",
            "residual_group",
            "rotate_axes",
            "sample_rotation",
        ),
        "spec": (
            "HEAD_ORDER_ONLY",
            "SCOPES",
            "AttentionSpec",
            "AxisPermutation",
            "FixedAxes",
            "FixedReason",
            "HeadSlot",
            "RotaryLayout",
            "Scope",
            "SignGroup",
            "SymmetrySpec",
            "check_scope",
            "scope_blocks",
            "scope_parameter_names",
        ),
        "transforms": (
            "AttentionTransform",
            "ModelTransform",
            "compute_dtype",
            "qk_group",
            "sample_attention_transform",
            "sample_signs",
            "sample_transform",
            "transform_attention",
            "vo_group",
        ),
        "weights": (
            "AttentionWeights",
            "attention_parameters",
            "head_rows",
            "per_query_head",
            "read_attention",
            "write_attention",
        ),
    },
)

__all__ = [
    "HEAD_ORDER_ONLY",
    "REASONS",
    "SCOPES",
    "AttentionSpec",
    "AttentionTransform",
    "AttentionWeights",
    "AxisPermutation",
    "AxisRole",
    "FixedAxes",
    "FixedReason",
    "HeadSlot",
    "ModelTransform",
    "NormFold",
    "QKGroup",
    "Reader",
    "ResidualGroup",
    "RotaryLayout",
    "Scope",
    "SignFlips",
    "SignGroup",
    "SymmetrySpec",
    "TiedGroup",
    "attention_parameters",
    "centered_basis",
    "check_scope",
    "compute_dtype",
    "explain_axes",
    "fold_parameters_",
    "general_linear",
    "head_rows",
    "in_group",
    "other_pair_layout",
    "per_query_head",
    "qk_group",
    "read_attention",
    "residual_group",
    "rotate_axes",
    "rotary_commutant",
    "sample_attention_transform",
    "sample_rotation",
    "sample_signs",
    "sample_transform",
    "scope_blocks",
    "scope_parameter_names",
    "sign_flips",
    "transform_attention",
    "unexplained_axes",
    "vo_group",
    "write_attention",
]
