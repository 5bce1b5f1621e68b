"""``equivalent``: whether two models compute the same function up to the symmetry group.

Four things are compared (docs/spec.md, section 2; the rule is stated in docs/alignment.md):

- *the weights, entry by entry*: :func:`~lmc.matching.align` brings ``a`` next to ``b`` within the
  scope's group. Every entry a permutation alone moves (FFN and task-head units, the residual
  stream, head order), every entry the group does not move and every parameter outside the scope
  must then be bitwise equal to ``b``'s. Only the entries the continuous elements compute (the
  Q/K entries of a layer whose ``C`` is not the identity, the V/O entries of one whose ``B`` is
  not) may differ, by what rounding explains: ``|a_i - b_i| <= rtol (|b_i| + (1 + n u_c / u) s)``
  with ``s`` the RMS of ``b`` over that head's block of that projection, ``n`` the head width,
  ``u`` and ``u_c`` the unit roundoffs of the stored and the compute dtype;
- *the buffers*, bitwise: no group element moves a buffer;
- *the settings* that define the function: the model's config (HF ``config.json`` fields, the
  reference model's ``ReferenceConfig``) and every module's class and plain attributes
  (``eps``, the GELU variant, ...); a difference is never a matter of tolerance;
- *the outputs* on a probe input, to the output tolerance (the function question).

The pair is equivalent when all four agree. Outputs that agree while the weights do not are
reported as such: the pair may be related by a symmetry lmc does not model (without RoPE the key
bias is free, say) or differ where the probe does not look.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from lmc.adapters import scope_parameters
from lmc.matching.alignment import align, folded
from lmc.matching.checks import buffer_differences, check_pair, identical, probe_error, setting_differences
from lmc.matching.options import AlignOptions
from lmc.matching.results import AlignmentReport, dtype_name
from lmc.symmetry import (
    HEAD_ORDER_ONLY,
    AttentionTransform,
    AttentionWeights,
    ModelTransform,
    Scope,
    SymmetrySpec,
    compute_dtype,
    read_attention,
    write_attention,
)

UNIT_ROUNDOFF: dict[torch.dtype, float] = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
}
"""Unit roundoff ``u`` of each stored dtype: half the distance from 1 to the next number."""

ROUNDINGS: dict[torch.dtype, float] = {
    torch.float64: 256.0,
    torch.float32: 32.0,
    torch.float16: 4.0,
    torch.bfloat16: 4.0,
}
"""The constant ``c`` of the per-entry bound, in roundings of the stored dtype (``rtol = c u``).

Measured on planted pairs (``b = random_symmetry(a, "full_model", seed=100 + k)`` of
``a = build(key, seed=k)``, ``k = 0, 1, 2``) of the 13 test architectures in 4 dtypes
(``tests/matching/test_equivalent.py`` runs ``k = 0``), the largest ratio
``|a_i - b_i| / (u (|b_i| + (1 + n u_c / u) s))`` was 6.24 in float64, 2.18 in float32, 1.47 in
bfloat16 and float16. Half precision computes in float32, so its ratio is the rounding of ``b``'s
entry and of the aligned one (at most about 2); float32 and float64 add the Stage 2 solve, which
grows with the weights' condition: with every matrix's singular values spread over 2 decades
(``k = 0``) the worst was 82 in float64, 9.5 in float32 and 1.56 in half precision. ``c`` covers
those by 3.1x, 3.4x and 2.6x (41x, 15x and 2.7x over the plain pairs). Over 4 decades the float64
ratio reaches about 3e3: such a twin is reported as "same outputs on the probe but not related"."""

EQUIVALENCE_RTOL: dict[torch.dtype, float] = {dtype: ROUNDINGS[dtype] * UNIT_ROUNDOFF[dtype] for dtype in ROUNDINGS}
"""Default per-entry tolerance ``rtol = c u`` per stored dtype (:data:`ROUNDINGS` times
:data:`UNIT_ROUNDOFF`): 2.8e-14 in float64, 1.9e-6 in float32, 2e-3 in float16 and 1.6e-2 in
bfloat16, applied to the entries the continuous group elements compute."""


@dataclass(frozen=True)
class EquivalenceTolerance:
    """The tolerances a verdict used.

    Attributes:
        weight: Per-entry tolerance ``rtol`` of the entries the continuous elements compute
            (``|a_i - b_i| <= rtol (|b_i| + (1 + n u_c / u) s)``); every other entry is bitwise.
        output: Largest relative output difference on the probe (``options.check_rtol``).
        weight_origin: ``"given"`` or ``"<dtype> default"`` (:data:`EQUIVALENCE_RTOL`).
        output_origin: ``"given"`` or ``"<dtype> default"`` (:data:`~lmc.matching.PROBE_RTOL`).
        roundings: ``weight`` in units of the stored dtype's rounding, ``rtol / u`` (the ``c`` that
            :attr:`Equivalence.rounding_ratio` is compared with).
    """

    weight: float
    output: float
    weight_origin: str
    output_origin: str
    roundings: float = math.nan


@dataclass(frozen=True)
class Equivalence:
    """The answer of :func:`equivalent`.

    Attributes:
        equivalent: Whether ``a`` and ``b`` compute the same function up to the scope's group.
        reason: One line saying why.
        scope: The group asked about.
        weight_residual: ``||aligned(a) - b|| / ||b||`` over the scope's parameters (``"scope"``)
            and over every parameter (``"all"``, parameters outside the scope as they are).
        parameter_residual: The same per parameter, ``||aligned(a)_p - b_p|| / ||b_p||``
            (``0`` where both are zero, ``inf`` where only ``b_p`` is). Informative: the verdict
            reads :attr:`beyond_bound`.
        output_residual: ``||f_a(x) - f_b(x)|| / ||f_b(x)||`` on the probe input. The aligned model
            computes ``a``'s function (``align`` checks it), so this is the function question alone.
        tolerance: The tolerances applied and where they come from.
        transform: The group element judged, mapping ``a``'s weights to the aligned ones: the one
            :func:`~lmc.matching.align` found, or the identity where that is no nearer ``b``.
        report: :func:`~lmc.matching.align`'s report.
        beyond_bound: Per parameter, its entries beyond their bound after alignment (bitwise
            entries that differ, computed entries beyond ``rtol``); all ``0`` for a twin.
        rounding_ratio: Per parameter holding computed entries, the largest
            ``|a_i - b_i| / (u (|b_i| + (1 + n u_c / u) s))``: the entry passes when it is at most
            ``tolerance.roundings``.
        buffer_differences: Buffers that are not bitwise equal -> their differing entries.
        setting_differences: Settings that differ -> ``(a's value, b's value)``.
    """

    equivalent: bool
    reason: str
    scope: Scope
    weight_residual: dict[str, float]
    parameter_residual: dict[str, float]
    output_residual: float
    tolerance: EquivalenceTolerance
    transform: ModelTransform
    report: AlignmentReport
    beyond_bound: dict[str, int] = dataclasses.field(default_factory=dict)
    rounding_ratio: dict[str, float] = dataclasses.field(default_factory=dict)
    buffer_differences: dict[str, int] = dataclasses.field(default_factory=dict)
    setting_differences: dict[str, tuple[Any, Any]] = dataclasses.field(default_factory=dict)

    @property
    def worst_parameter(self) -> str:
        """The parameter furthest from ``b``'s after alignment.

        Among parameters with entries beyond their bound, the largest relative residual; if
        none, the largest rounding ratio; if no entry is computed, the largest residual.
        """
        failing = [n for n, count in self.beyond_bound.items() if count]
        if failing:
            return max(failing, key=self.parameter_residual.__getitem__)
        if self.rounding_ratio:
            return max(self.rounding_ratio, key=self.rounding_ratio.__getitem__)
        return max(self.parameter_residual, key=self.parameter_residual.__getitem__)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary: valid JSON (a non-finite number is ``None``), matrices left out."""
        return {
            "equivalent": self.equivalent,
            "reason": self.reason,
            "scope": self.scope,
            "dtype": self.report.dtype,
            "weight_residual": _finite(self.weight_residual),
            "worst_parameter": self.worst_parameter,
            "output_residual": _finite(self.output_residual),
            "tolerance": _finite(asdict(self.tolerance)),
            "beyond_bound": self.beyond_bound,
            "rounding_ratio": _finite(self.rounding_ratio),
            "buffer_differences": self.buffer_differences,
            "setting_differences": {k: [repr(a), repr(b)] for k, (a, b) in self.setting_differences.items()},
            "parameter_residual": _finite(self.parameter_residual),
            "alignment": self.report.to_dict(),
        }


def _finite(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _relative(difference: float, norm: float) -> float:
    if norm > 0:
        return difference / norm
    return 0.0 if difference == 0 else math.inf


def _with_frozen_from(source: nn.Module, target: nn.Module, free: set[str]) -> nn.Module:
    """``source``, or a copy whose parameters outside the scope are ``target``'s where they differ.

    ``align`` refuses a pair whose frozen parameters differ; they are compared apart, and the copy
    lets the scope's parameters be aligned all the same. The transform never touches them.
    """
    targets = dict(target.named_parameters())
    differing = [n for n, p in source.named_parameters() if n not in free and not identical(p, targets[n])]
    if not differing:
        return source
    grafted = copy.deepcopy(source)
    parameters = dict(grafted.named_parameters())
    with torch.no_grad():
        for name in differing:
            parameters[name].copy_(targets[name])
    return grafted


_QUERY_KEY = frozenset({"query", "key", "query_bias", "key_bias"})  # moved by C; the others by B (or permuted only)


def _is_identity(matrices: torch.Tensor) -> bool:
    eye = torch.eye(matrices.shape[-1], dtype=matrices.dtype, device=matrices.device)
    return torch.equal(matrices, eye.expand_as(matrices))


def rounding_ratio(value: torch.Tensor, target: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """``|a_i - b_i| / (u (|b_i| + (1 + n u_c / u) s))`` per entry of per-head blocks (float64).

    Args:
        value: Aligned entries, one head per row of the first axis, e.g. ``(heads, d, head_dim)``.
        target: ``b``'s entries, the same shape; ``s`` is the RMS of each head's block.
        head_dim: ``n``, the length of the sums that compute each entry.
        dtype: The stored dtype (``u``); ``u_c`` is that of its compute dtype.
    """
    u, u_compute = UNIT_ROUNDOFF[dtype], UNIT_ROUNDOFF[compute_dtype(dtype)]
    value, target = value.double(), target.double()
    scale = target.pow(2).mean(dim=tuple(range(1, target.ndim)), keepdim=True).sqrt()
    unit = u * target.abs() + (u + head_dim * u_compute) * scale
    difference = (value - target).abs()
    return torch.where(difference == 0, 0.0, difference / unit)


def _entry_checks(
    values: dict[str, torch.Tensor],
    targets: dict[str, torch.Tensor],
    spec: SymmetrySpec,
    transform: ModelTransform,
    dtype: torch.dtype,
    roundings: float,
    summed: int | None = None,
) -> tuple[dict[str, int], dict[str, float]]:
    """Per parameter, entries beyond their bound and the largest rounding ratio of its computed entries; with
    ``summed`` (the extended group: folded norms and a rotation of the stream) every entry may be computed, by sums
    of that many terms, and is held to its rounding bound with ``s`` the RMS of the whole parameter."""
    beyond = dict.fromkeys(targets, 0)
    ratios: dict[str, float] = {}
    patched: dict[str, torch.Tensor] = {}  # values whose computed entries are replaced by b's
    for index, element in transform.attention.items():
        layer = spec.blocks[index].attention
        continuous = [
            field.name
            for field in dataclasses.fields(AttentionWeights)
            if getattr(layer, field.name) is not None
            and field.name not in HEAD_ORDER_ONLY  # permuted copies: compared entry by entry below
            and not _is_identity(_matrices(element, field.name))
        ]
        if not continuous:
            continue
        copies = {slot.parameter: patched.get(slot.parameter, values[slot.parameter]).clone() for slot in layer.slots}
        mine, theirs = read_attention(copies, layer), read_attention(targets, layer)
        for name in continuous:
            ratio = rounding_ratio(getattr(mine, name), getattr(theirs, name), layer.head_dim, dtype)
            parameter = getattr(layer, name).parameter
            ratios[parameter] = max(ratios.get(parameter, 0.0), float(ratio.max()))
            beyond[parameter] += int((ratio > roundings).sum())
        write_attention(copies, layer, dataclasses.replace(mine, **{n: getattr(theirs, n) for n in continuous}))
        patched.update(copies)
    for name, target in targets.items():
        value = patched.get(name, values[name])
        if identical(value, target):
            continue
        if summed is None:
            beyond[name] += int((value.detach() != target.detach()).sum())
            continue
        ratio = rounding_ratio(value.detach()[None], target[None], summed, dtype)
        ratios[name] = max(ratios.get(name, 0.0), float(ratio.max()))
        beyond[name] += int((ratio > roundings).sum())
    return beyond, ratios


def _matrices(element: AttentionTransform, field: str) -> torch.Tensor:
    return element.qk if field in _QUERY_KEY else element.vo


def equivalent(
    a: nn.Module,
    b: nn.Module,
    scope: Scope = "full_model",
    options: AlignOptions | None = None,
    rtol: float | None = None,
) -> Equivalence:
    """Whether ``a`` and ``b`` compute the same function up to the symmetry group of ``scope``.

    ``a`` is aligned to ``b`` with :func:`~lmc.matching.align` (``options``); where the element found
    is no nearer ``b`` than the identity (two equal models: the solves round), the identity is
    judged instead, so that equal models are equivalent at any tolerance. They are equivalent
    when every entry of every parameter then equals ``b``'s bitwise, except the entries the
    continuous elements compute, which may differ by ``rtol (|b_i| + (1 + n u_c / u) s)`` (the
    module docstring); when every buffer is bitwise equal; when every setting agrees
    (:func:`~lmc.matching.checks.model_settings`); and when the outputs agree on the probe input
    to the output tolerance. The default options converge on planted pairs: the least-squares
    start of Stage 2 is exact for them.

    Args:
        a: The model aligned (never modified); "source" in :class:`AlignmentError` messages.
        b: The model compared with (never modified; "target"); same architecture, dtype and device.
        scope: ``"first_attention"``, ``"all_attention"``, ``"first_block"`` or ``"full_model"``:
            the group asked about. A parameter outside it must be bitwise equal as it is (a
            verdict naming it, not an error).
        options: Alignment settings; ``options.check_rtol`` is also the output tolerance
            (``None``: :data:`~lmc.matching.PROBE_RTOL` of the dtype, what rounding the forward pass
            explains; 1e-6 in float64 because HF Llama normalizes in float32). ``None`` takes the defaults.
        rtol: Per-entry tolerance of the computed entries; ``None`` takes :data:`EQUIVALENCE_RTOL`
            of the dtype; ``0`` demands bitwise equality everywhere. Bitwise entries stay bitwise.

    Returns:
        The verdict with its residuals, tolerances, group element and alignment report.

    Raises:
        ValueError: Unknown ``scope`` or a negative or non-finite ``rtol``.
        AlignmentError: The pair cannot be compared (architectures, dtypes, devices, NaN/Inf weights).
    """
    options = AlignOptions() if options is None else options
    if rtol is not None and not (isinstance(rtol, int | float) and 0 <= rtol < math.inf):
        raise ValueError(f"rtol must be None (the dtype's default) or a finite number >= 0, got {rtol!r}")
    spec = check_pair(a, b, "full_model")  # the scope's frozen parameters are compared below, not refused
    free = set(scope_parameters(a, scope, spec))
    grafted = _with_frozen_from(a, b, free)
    aligned, report = align(grafted, b, scope=scope, options=options)
    transform, rotated = report.transform, report.folded is not None
    if rotated:  # the extended group compares the folded models: the fold is part of the alignment
        (grafted, _), (b_compared, _) = folded(grafted, spec), folded(b, spec)
    if report.distance["aligned"] >= report.distance["naive"]:
        # The search came no nearer b than the identity, which is in every group: judge the identity, so that
        # equal weights stay bitwise equal (the solves would round them) and are equivalent at any tolerance.
        aligned, transform = grafted, ModelTransform()
    dtype = next(a.parameters()).dtype
    default = f"{dtype_name(dtype)} default"
    weight = EQUIVALENCE_RTOL[dtype] if rtol is None else float(rtol)
    tolerance = EquivalenceTolerance(
        weight=weight,
        output=report.check_rtol,
        weight_origin=default if rtol is None else "given",
        output_origin=default if options.check_rtol is None else "given",
        roundings=weight / UNIT_ROUNDOFF[dtype],
    )

    moved, original = dict(aligned.named_parameters()), dict(a.named_parameters())
    targets = {n: p.detach() for n, p in (b_compared if rotated else b).named_parameters()}
    values = {n: (moved[n] if n in free else original[n]).detach() for n in targets}
    # A rotation of the stream (or the fold) computes every entry it moves, sums over the stream's width; a unit's
    # scale computes each of its entries with one product.
    summed = spec.residual.size if rotated and spec.residual is not None else None
    if summed is None and transform.feed_forward_scales:
        summed = 1
    beyond, ratios = _entry_checks(values, targets, spec, transform, dtype, tolerance.roundings, summed)
    squared = {  # parameter -> (squared difference, squared norm of b's)
        n: (float((values[n].double() - t.double()).pow(2).sum()), float(t.double().pow(2).sum()))
        for n, t in targets.items()
    }
    parameter_residual = {n: _relative(d**0.5, t**0.5) for n, (d, t) in squared.items()}
    weight_residual = {
        part: _relative(sum(squared[n][0] for n in names) ** 0.5, sum(squared[n][1] for n in names) ** 0.5)
        for part, names in (("scope", [n for n in squared if n in free]), ("all", list(squared)))
    }
    output_residual = probe_error(b, a, options.probe_batch_size, options.seed, role="b")
    result = Equivalence(
        equivalent=False,
        reason="",
        scope=scope,
        weight_residual=weight_residual,
        parameter_residual=parameter_residual,
        output_residual=output_residual,
        tolerance=tolerance,
        transform=transform,
        report=report,
        beyond_bound=beyond,
        rounding_ratio=ratios,
        buffer_differences=buffer_differences(a, b),
        setting_differences=setting_differences(a, b),
    )
    same, reason = _verdict(result, values, targets, free)
    return dataclasses.replace(result, equivalent=same, reason=reason)


def _verdict(
    result: Equivalence, values: dict[str, torch.Tensor], targets: dict[str, torch.Tensor], free: set[str]
) -> tuple[bool, str]:
    """Whether the pair is equivalent, and the one line saying why."""
    tolerance, scope = result.tolerance, result.scope
    if result.report.folded is not None:  # the extended group: named with its residual part
        scope = f"{scope} (folded, residual {result.report.residual_group})"
    weights_match = not any(result.beyond_bound.values())
    outputs_match = result.output_residual <= tolerance.output
    outputs = f"{result.output_residual:.2g} on the probe"
    worst = result.worst_parameter
    if weights_match:
        largest = (
            f"largest rounding ratio {result.rounding_ratio[worst]:.2g} <= {tolerance.roundings:.3g}, in {worst}"
            if result.rounding_ratio
            else "every entry bitwise equal"
        )
        weights = f"every entry is within its bound ({largest})"
    else:
        weights = _weight_difference(result, worst, values[worst], targets[worst], worst in free)
    if result.setting_differences or result.buffer_differences:
        parts = []
        if result.setting_differences:
            shown = [f"{n} ({x!r} in a, {y!r} in b)" for n, (x, y) in result.setting_differences.items()]
            parts.append(f"the settings differ: {_listed(shown)}")
        if result.buffer_differences:
            shown = [f"{n} ({k} entries)" for n, k in result.buffer_differences.items()]
            parts.append(f"buffers differ (the group moves no buffer, so they must be bitwise equal): {_listed(shown)}")
        after = "after alignment " + (weights if weights_match else f"the weights differ too: {weights}")
        return False, (
            f"different models: {'; '.join(parts)}. No group element changes a setting or a buffer, so no "
            f"tolerance makes them equivalent ({after}; outputs {outputs})"
        )
    if weights_match and outputs_match:
        return True, (
            f"related by the {scope} group: after alignment {weights}, the buffers and settings are equal, and "
            f"the outputs agree ({outputs} <= {tolerance.output:g})"
        )
    if outputs_match:
        return False, (
            f"same outputs on the probe ({outputs} <= {tolerance.output:g}) but not related by the {scope} group: "
            f"after alignment {weights}; a symmetry lmc does not model, or a difference too small or too hidden "
            "for the probe input to show"
        )
    if weights_match:
        return False, (
            f"different outputs ({outputs} > {tolerance.output:g}) although after alignment {weights} and the "
            "buffers and settings are equal: the output tolerance is tighter than the forward pass keeps in "
            f"{result.report.dtype}, or the models differ in something lmc does not compare"
        )
    return False, (
        f"different functions: the outputs differ by {outputs} (> {tolerance.output:g}) and after alignment {weights}"
    )


def _weight_difference(result: Equivalence, name: str, value: torch.Tensor, target: torch.Tensor, free: bool) -> str:
    """What is wrong with parameter ``name`` after alignment, for the verdict."""
    if not free:
        rule = f" (outside scope {result.scope!r}, so never aligned: it must be bitwise equal)"
    elif name in result.rounding_ratio:
        rule = (
            f" (computed by the group's continuous elements: largest rounding ratio "
            f"{result.rounding_ratio[name]:.3g} > {result.tolerance.roundings:.3g})"
        )
    else:
        rule = " (moved by permutations only, so bitwise equal in a twin)"
    gap = float((value.double() - target.double()).abs().max())
    return (
        f"{name}{rule} has {result.beyond_bound[name]} of {target.numel()} entries beyond their bound "
        f"(largest difference {gap:.3g}, {result.parameter_residual[name]:.2g} of its norm)"
    )


def _listed(items: list[str], shown: int = 3) -> str:
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more
