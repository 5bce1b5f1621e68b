"""The checks of every alignment: a pair that can be aligned, finite quantities, a result that keeps the function.

In-memory and streamed alignment, ``equivalent`` and the commands share them, so one pair is
refused with one message whichever path reads it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from lmc.adapters import adapter_for, model_spec, scope_parameters
from lmc.matching.options import AlignOptions
from lmc.matching.results import PROBE_RTOL, AlignmentError, dtype_name
from lmc.symmetry import AttentionSpec, Scope, SymmetrySpec, check_scope, head_rows


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
    check_dtype(next(source.parameters()).dtype)


def check_same_attention(spec: SymmetrySpec, target_spec: SymmetrySpec) -> None:
    """Raise :class:`AlignmentError` unless both specs' attention layers have one shape and one RoPE."""
    for layer, other in zip(spec.attention, target_spec.attention):
        fields = ("num_heads", "num_kv_heads", "head_dim", "width", "pe")
        if any(getattr(layer, f) != getattr(other, f) for f in fields):
            described = {f: (getattr(layer, f), getattr(other, f)) for f in fields}
            raise AlignmentError(f"{layer.name}: source and target attention differ (source, target): {described}")
        if layer.rotary is not None and not (
            torch.equal(layer.rotary.pairs, other.rotary.pairs)
            and layer.rotary.angles.shape == other.rotary.angles.shape
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
    check_same_tensors(
        {name: tuple(p.shape) for name, p in source.named_parameters()},
        {name: tuple(p.shape) for name, p in target.named_parameters()},
    )
    check_storage(source, target)
    spec = model_spec(source)
    check_same_attention(spec, model_spec(target))
    for role, model in (("source", source), ("target", target)):
        for name, parameter in model.named_parameters():
            check_finite(role, name, parameter)
    if scope != "full_model":
        free = set(scope_parameters(source, scope, spec))
        parameters = dict(target.named_parameters())
        for name, parameter in source.named_parameters():
            if name not in free:
                check_unchanged(scope, name, parameter, parameters[name])
    return spec


def check_same_tensors(source: Mapping[str, object], target: Mapping[str, object]) -> None:
    """Raise :class:`AlignmentError` unless both models hold the same tensors: names to shapes (or layouts)."""
    if source != target:
        differing = sorted(set(source.items()) ^ set(target.items()))[:3]
        raise AlignmentError(
            f"different architectures: parameters differ in name or shape, e.g. {differing}; "
            "build both models from the same config"
        )


def check_dtype(dtype: torch.dtype) -> None:
    """Raise :class:`AlignmentError` unless lmc aligns models stored in ``dtype``."""
    if dtype not in PROBE_RTOL:
        supported = ", ".join(dtype_name(d) for d in PROBE_RTOL)
        raise AlignmentError(f"lmc aligns {supported} models, not {dtype_name(dtype)}; cast both with model.to(...)")


def check_finite(role: str, name: str, tensor: torch.Tensor) -> None:
    """Raise :class:`AlignmentError` if ``tensor`` (a whole parameter or a piece of one) holds NaN or Inf."""
    if not all_finite(tensor):
        raise AlignmentError(f"the {role} model's {name} holds NaN or Inf values; align finite checkpoints only")


def check_unchanged(scope: Scope, name: str, source: torch.Tensor, target: torch.Tensor) -> None:
    """Raise :class:`AlignmentError` unless a parameter outside ``scope`` (or a piece of it) is equal in both."""
    if not identical(source, target):
        gap = float((source - target).detach().abs().max())
        raise AlignmentError(
            f"scope {scope!r} aligns only its re-initialized parameters, so everything else must be identical, "
            f"but {name} differs (max abs difference {gap:.3g}). Use the scope the checkpoints were fine-tuned "
            "with (a wider one, or 'full_model'), or check that both come from the same pre-trained model."
        )


# Whole-tensor comparisons run in chunks: no temporary the size of an embedding matrix.
_CHUNK = 1 << 22


def identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    return a.shape == b.shape and all(
        torch.equal(a[i : i + _CHUNK], b[i : i + _CHUNK]) for i in range(0, len(a), _CHUNK)
    )


def all_finite(a: torch.Tensor) -> bool:
    """Whether ``a`` holds no NaN or Inf: its smallest and largest entries are finite (both propagate NaN).

    One reduction, no temporary: about ten times faster than ``isfinite`` on a CPU in bf16.
    """
    if a.numel() == 0 or not a.is_floating_point():
        return True
    low, high = torch.aminmax(a.detach())
    return bool(torch.isfinite(low) & torch.isfinite(high))


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


def refuse_data_aware_external(options: AlignOptions) -> None:
    """Refuse settings that read activations for Hugging Face and timm checkpoints (in memory or streamed): they
    calibrate on an lmc DataModule's training split, which lmc does not have for those formats."""
    if options.data_aware:
        raise ValueError(
            f"data-aware alignment settings ({options.data_settings}) calibrate on an lmc DataModule's training "
            "split, which Hugging Face and timm checkpoints do not have here: use the weight settings (the defaults) "
            "for them"
        )


def check_head_orders(head_orders: dict[int, list[int]] | None, attention: list[int], scope: Scope) -> None:
    """Refuse head orders for attention layers the scope does not align (they would be ignored, yet recorded)."""
    unknown = sorted(set(head_orders or {}) - set(attention))
    if unknown:
        raise AlignmentError(
            f"head_orders names attention layer(s) {unknown}, but scope {scope!r} aligns layers {attention}: "
            "give orders only for those"
        )


def check_probe(error: float, rtol: float, dtype: torch.dtype, default_rtol: bool, what: str) -> None:
    """Raise :class:`AlignmentError` unless the aligned ``what`` keeps the source's outputs to ``rtol``.

    Args:
        error: The relative output change on the probe (:func:`probe_error`, :meth:`AttentionProbe.error`).
        rtol: The tolerance applied.
        dtype: The stored dtype, whose rounding :data:`PROBE_RTOL` explains.
        default_rtol: Whether ``rtol`` is the dtype's default (a miss is then a bug of lmc, not of the setting).
        what: What was checked, e.g. ``"model"`` or ``"layer h.0.attn"``, and the context of a bug report.
    """
    if error <= rtol:
        return
    change = f"relative output change {error:.3g} on the probe input"
    if default_rtol:
        raise AlignmentError(
            f"the aligned {what} does not compute the source's function: {change} > {rtol:g} (the "
            f"{dtype_name(dtype)} tolerance). This is a bug in lmc; please report it."
        )
    raise AlignmentError(
        f"the aligned {what} misses check_rtol={rtol:g}: {change}. Rounding in {dtype_name(dtype)} alone reaches "
        f"about {PROBE_RTOL[dtype]:g} (the default); raise check_rtol or leave it None."
    )


#: Rows of a projection converted to float64 at once by :class:`AttentionProbe` (2 MB of float64 at width
#: 1,024): the probe reads the stored weights through views, and no copy of a layer is made.
PROBE_ROWS = 256


class AttentionProbe:
    """One attention layer's output on a fixed random input ``x``, ``(T, d)``: the probe of a layer's function.

    The output (docs/spec.md, section 1, RoPE included, no mask) is computed in float64 from the
    stored weights, so the rounding of aligned weights to their dtype is measured. The weights
    are read through views of the stored tensors (:func:`~lmc.symmetry.head_rows`), a block of
    :data:`PROBE_ROWS` rows converted at a time. Every layer keeping its function keeps the
    whole model's.

    Args:
        layer: The layer.
        seed: Seed of ``x``: 16 tokens (fewer if the RoPE table is shorter) of width ``d``.
    """

    def __init__(self, layer: AttentionSpec, seed: int = 0):
        self.layer = layer
        length = 16 if layer.rotary is None else min(16, layer.rotary.angles.shape[0])
        self.x = torch.randn(length, layer.width, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)

    def output(
        self,
        tensors: Mapping[str, torch.Tensor],
        residual: torch.Tensor | None = None,
        signs: torch.Tensor | None = None,
        rotation: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The layer's output ``(T, d)`` with the weights ``tensors`` (by spec name), in float64.

        Args:
            tensors: The layer's tensors.
            residual: A residual-stream permutation the weights carry (``full_model``): the layer
                reads ``x`` permuted by it.
            signs: The residual signs ``(d,)`` the weights carry after ``residual``: the layer reads ``x`` so flipped.
            rotation: The residual rotation ``(d, d)`` the weights carry after both (``residual="orthogonal"``).
        """
        layer, x = self.layer, _moved(self.x, residual, signs, rotation)
        length, head_dim = len(x), layer.head_dim

        def project(name: str, heads: int) -> torch.Tensor:  # (heads, T, d_h)
            rows = head_rows(tensors, layer, name)
            states = torch.cat([x @ block.double().T for block in rows.split(PROBE_ROWS)], dim=1)
            bias = head_rows(tensors, layer, f"{name}_bias")
            if bias is not None:
                states = states + bias.double()
            states = states.unflatten(1, (heads, head_dim)).transpose(0, 1)
            if layer.rotary is None or name == "value":
                return states
            first, second = layer.rotary.pairs.T  # pair p turns by angles[t, p]
            angles = layer.rotary.angles[:length].double()  # a table read off a model may be float32
            cos, sin = angles.cos(), angles.sin()
            a, b = states[..., first], states[..., second]
            rotated = states.clone()
            rotated[..., first], rotated[..., second] = a * cos - b * sin, a * sin + b * cos
            return rotated

        queries, kv = layer.num_heads, layer.num_kv_heads
        q = project("query", queries)
        k = project("key", kv).repeat_interleave(layer.queries_per_kv, 0)
        v = project("value", kv).repeat_interleave(layer.queries_per_kv, 0)
        weights = (q @ k.mT / math.sqrt(head_dim)).softmax(-1)
        heads = (weights @ v).transpose(0, 1).reshape(length, -1)  # (T, heads * d_h), head by head
        out = head_rows(tensors, layer, "out")  # (heads * d_h, d)
        output = torch.zeros(length, out.shape[1], dtype=torch.float64)
        for start, block in zip(range(0, len(out), PROBE_ROWS), out.split(PROBE_ROWS)):
            output += heads[:, start : start + len(block)] @ block.double()
        return output

    def error(
        self,
        reference: torch.Tensor,
        tensors: Mapping[str, torch.Tensor],
        residual: torch.Tensor | None = None,
        signs: torch.Tensor | None = None,
        rotation: torch.Tensor | None = None,
    ) -> float:
        """``||f_tensors(x) - f_source(x)|| / ||f_source(x)||`` given ``reference = f_source(x)`` (:meth:`output`
        of the source): with ``residual``, ``signs`` and ``rotation``, the output must come back moved by them."""
        moved = self.output(tensors, residual, signs, rotation)
        return float((moved - _moved(reference, residual, signs, rotation)).norm() / reference.norm())


def _moved(
    stream: torch.Tensor,
    residual: torch.Tensor | None,
    signs: torch.Tensor | None,
    rotation: torch.Tensor | None = None,
) -> torch.Tensor:
    """Residual-stream rows ``(T, d)`` permuted by ``residual``, flipped by ``signs``, then rotated by ``rotation``
    (coordinate ``i`` becomes ``sum_j Q[i, j] x_j``; each optional)."""
    stream = stream if residual is None else stream[:, residual]
    stream = stream if signs is None else stream * signs.to(stream)
    return stream if rotation is None else stream @ rotation.to(stream).T


# What ``equivalent`` compares besides the weights: the buffers (bitwise) and the settings.

# Settings that do not change the function: bookkeeping, label names, runtime switches, token ids
# the supported models' forward passes do not read, initialization, dropout (never applied in eval).
_NOT_FUNCTIONAL = frozenset(
    (
        "training name_or_path transformers_version architectures dtype torch_dtype id2label label2id "
        "finetuning_task problem_type use_cache output_attentions output_hidden_states return_dict "
        "torchscript tokenizer_class task_specific_params prefix bos_token_id eos_token_id pad_token_id "
        "sep_token_id decoder_start_token_id padding_idx loss_type kernel_config gradient_checkpointing "
        "grad_checkpointing fused_attn inplace sparse scale_grad_by_freq "
    ).split()
)
_PLAIN = (bool, int, float, str, type(None))


def model_settings(model: nn.Module) -> dict[str, object]:
    """What defines ``model``'s function besides its tensors, by name.

    ``config.<field>`` for its config (a Hugging Face ``PretrainedConfig``, a dataclass such as
    ``ReferenceConfig``), and for every module ``<module>: class`` and ``<module>.<attribute>``
    for its plain attributes (numbers, strings, tuples of them). Bookkeeping, label names, runtime
    switches and dropout rates are left out.
    """
    import dataclasses

    settings: dict[str, object] = {}
    config = getattr(model, "config", None)
    if hasattr(config, "to_dict"):
        fields = config.to_dict()
    elif dataclasses.is_dataclass(config) and not isinstance(config, type):
        fields = dataclasses.asdict(config)
    else:
        fields = {}
    settings.update({f"config.{k}": v for k, v in fields.items() if _functional(k)})
    for name, module in model.named_modules():
        if "drop" in f"{name.rpartition('.')[2]}{type(module).__name__}".lower():
            continue  # dropout (an Identity where the rate is 0): never applied in eval
        where = name or "<model>"
        settings[f"{where}: class"] = f"{type(module).__module__}.{type(module).__qualname__}"
        for key, value in vars(module).items():
            plain = isinstance(value, _PLAIN) or (
                isinstance(value, tuple | list) and all(isinstance(v, _PLAIN) for v in value)
            )
            if plain and _functional(key):
                settings[f"{where}.{key}"] = value
    return settings


def _functional(name: str) -> bool:
    return not name.startswith(("_", "init")) and "drop" not in name and name not in _NOT_FUNCTIONAL


def _same(x: object, y: object) -> bool:
    return x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))


def setting_differences(a: nn.Module, b: nn.Module) -> dict[str, tuple[object, object]]:
    """The settings (:func:`model_settings`) that differ -> ``(a's, b's)``; the config's first."""
    mine, theirs = model_settings(a), model_settings(b)
    names = sorted(mine.keys() | theirs.keys(), key=lambda n: (not n.startswith("config."), n))
    return {n: (mine.get(n), theirs.get(n)) for n in names if not _same(mine.get(n), theirs.get(n))}


def buffer_differences(a: nn.Module, b: nn.Module) -> dict[str, int]:
    """Buffers of ``b`` that ``a`` does not hold bitwise equal -> their differing entries."""
    mine = dict(a.named_buffers())
    differing = {}
    for name, theirs in b.named_buffers():
        buffer = mine.get(name)
        if buffer is None or buffer.shape != theirs.shape or buffer.dtype != theirs.dtype:
            differing[name] = theirs.numel()
        elif not identical(buffer, theirs):
            differing[name] = int((buffer != theirs).sum())
    return differing
