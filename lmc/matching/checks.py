"""The checks of every alignment: a pair that can be aligned, finite quantities, a result that keeps the function.

In-memory and streamed alignment, ``equivalent`` and the commands share them, so one pair is
refused with one message whichever path reads it.
"""

from __future__ import annotations

import torch
from torch import nn

from lmc.adapters import adapter_for, model_spec, scope_parameters
from lmc.matching.results import PROBE_RTOL, AlignmentError, dtype_name
from lmc.symmetry import Scope, SymmetrySpec, check_scope


def check_storage(source: nn.Module, target: nn.Module) -> None:
    """Raise :class:`AlignmentError` unless both models are stored in one supported dtype on one device."""
    for what in ("dtype", "device"):
        found = {}
        for role, model in (("source", source), ("target", target)):
            values = {getattr(p, what) for p in model.parameters()}
            if len(values) > 1:
                raise AlignmentError(
                    f"the {role} model's parameters mix {what}s ({', '.join(sorted(map(str, values)))}); "
                    f"move the whole model to one with model.to(...)"
                )
            found[role] = values.pop()
        if found["source"] != found["target"]:
            raise AlignmentError(
                f"source and target differ in {what}: source is {found['source']}, target is {found['target']}; "
                f"put both on one with target.to({str(found['source'])!r})"
            )
    dtype = next(source.parameters()).dtype
    if dtype not in PROBE_RTOL:
        supported = ", ".join(dtype_name(d) for d in PROBE_RTOL)
        raise AlignmentError(f"lmc aligns {supported} models, not {dtype_name(dtype)}; cast both with model.to(...)")


def check_same_attention(spec: SymmetrySpec, target_spec: SymmetrySpec) -> None:
    """Raise :class:`AlignmentError` unless both specs' attention layers have one shape and one RoPE."""
    for layer, other in zip(spec.attention, target_spec.attention):
        fields = ("num_heads", "num_kv_heads", "head_dim", "width", "pe")
        if any(getattr(layer, f) != getattr(other, f) for f in fields):
            described = {f: (getattr(layer, f), getattr(other, f)) for f in fields}
            raise AlignmentError(f"{layer.name}: source and target attention differ (source, target): {described}")
        if layer.rotary is not None and not (
            torch.equal(layer.rotary.pairs, other.rotary.pairs)
            and torch.allclose(layer.rotary.angles, other.rotary.angles, atol=1e-6)
        ):
            raise AlignmentError(f"{layer.name}: source and target use different rotary positional encodings")


def check_pair(source: nn.Module, target: nn.Module, scope: Scope) -> SymmetrySpec:
    """Raise :class:`AlignmentError` unless the two models can be aligned at ``scope``."""
    check_scope(scope)
    if type(source) is not type(target):
        raise AlignmentError(
            f"different architectures: source is {type(source).__name__}, target is {type(target).__name__}"
        )
    adapter_for(source)  # an unsupported model raises its own clear error
    shapes = {name: tuple(p.shape) for name, p in source.named_parameters()}
    target_shapes = {name: tuple(p.shape) for name, p in target.named_parameters()}
    if shapes != target_shapes:
        differing = sorted(set(shapes.items()) ^ set(target_shapes.items()))[:3]
        raise AlignmentError(
            f"different architectures: parameters differ in name or shape, e.g. {differing}; "
            "build both models from the same config"
        )
    check_storage(source, target)
    spec = model_spec(source)
    check_same_attention(spec, model_spec(target))
    for role, model in (("source", source), ("target", target)):
        for name, parameter in model.named_parameters():
            if not all_finite(parameter):
                raise AlignmentError(
                    f"the {role} model's {name} holds NaN or Inf values; align finite checkpoints only"
                )
    if scope != "full_model":
        free = set(scope_parameters(source, scope, spec))
        parameters = dict(target.named_parameters())
        for name, parameter in source.named_parameters():
            if name not in free and not identical(parameter, parameters[name]):
                gap = float((parameter - parameters[name]).detach().abs().max())
                raise AlignmentError(
                    f"scope {scope!r} aligns only its re-initialized parameters, so everything else must be identical, "
                    f"but {name} differs (max abs difference {gap:.3g}). Use the scope the checkpoints were fine-tuned "
                    "with (a wider one, or 'full_model'), or check that both come from the same pre-trained model."
                )
    return spec


# Whole-tensor checks run in chunks: no temporary the size of an embedding matrix.
_CHUNK = 1 << 22


def identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    return a.shape == b.shape and all(
        torch.equal(a[i : i + _CHUNK], b[i : i + _CHUNK]) for i in range(0, len(a), _CHUNK)
    )


def all_finite(a: torch.Tensor) -> bool:
    a = a.detach().reshape(-1)
    return all(bool(torch.isfinite(a[i : i + _CHUNK]).all()) for i in range(0, len(a), _CHUNK))


def require_finite(finite: bool, what: str, dtype: torch.dtype) -> None:
    """Refuse a quantity that overflowed: the weights (stored in ``dtype``) are too large to align."""
    if not finite:
        fix = "cast both models to float64 (model.double())" if dtype != torch.float64 else "rescale them"
        raise AlignmentError(f"{what} overflows: the weights are too large to align in {dtype_name(dtype)}; {fix}")


def probe_error(source: nn.Module, aligned: nn.Module, batch_size: int, seed: int, role: str = "source") -> float:
    """``||f_aligned(x) - f_source(x)|| / ||f_source(x)||`` on the probe; ``role`` names ``source`` in errors."""
    adapter = adapter_for(source)
    inputs = adapter.example_inputs(source, batch_size, torch.Generator().manual_seed(seed))
    modes = source.training, aligned.training
    source.eval(), aligned.eval()
    try:
        with torch.no_grad():
            reference, output = adapter.forward(source, inputs), adapter.forward(aligned, inputs)
    finally:
        source.train(modes[0]), aligned.train(modes[1])
    if not all_finite(reference):
        raise AlignmentError(
            f"the {role} model's outputs on the probe input are not finite in {dtype_name(reference.dtype)}, so no "
            "alignment can be checked; its weights overflow the forward pass (cast both models to float64 or rescale)"
        )
    return float((output - reference).double().norm() / reference.double().norm())
