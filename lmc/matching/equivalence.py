"""``equivalent``: whether two models compute the same function up to the symmetry group.

Two questions are asked and both answers reported (docs/spec.md, section 2):

- *the group question*: after :func:`~lmc.matching.align` brings ``a`` next to ``b`` within the
  scope's group, does every parameter of ``a`` equal ``b``'s (relative residual per parameter
  within the weight tolerance)? Parameters outside the scope are never moved, so they must be
  equal already.
- *the function question*: do ``a`` and ``b`` give the same outputs on a probe input (relative
  difference within the output tolerance)?

The pair is equivalent when both hold. Outputs that agree while the weights do not are reported
as such: the pair may be related by a symmetry lmc does not model (without RoPE the key bias is
free, say) or differ where the probe does not look.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from lmc.adapters import scope_parameters
from lmc.matching.alignment import align
from lmc.matching.checks import check_pair, identical, probe_error
from lmc.matching.options import AlignOptions
from lmc.matching.results import AlignmentReport, dtype_name
from lmc.symmetry import ModelTransform, Scope

EQUIVALENCE_RTOL: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 1e-4,
    torch.float16: 1e-2,
    torch.bfloat16: 5e-2,
}
"""Default weight tolerance per stored dtype: the largest relative residual ``||a_p - b_p|| / ||b_p||``
of any parameter ``p`` after alignment that still counts as equal. Measured on planted pairs
(``b = random_symmetry(a, "full_model")``) of the 13 test architectures, the worst parameter
reached 8e-16 in float64, 1.9e-7 in float32, 2.1e-4 in float16 and 1.7e-3 in bfloat16: the
rounding of the transformed weights, about one unit of the dtype's precision. Ill-conditioned
weights make Stage 2 less exact: with every matrix's singular values spread over 4 decades
(condition number 1e4, worse than most trained layers) the worst was 1.9e-12 in float64 and
6.4e-6 in float32. The defaults stay above those by 50x and 15x (30x or more in half
precision), and still catch a change of one parameter by 1e-3 of its norm (float32) or 1e-9
(float64)."""


@dataclass(frozen=True)
class EquivalenceTolerance:
    """The tolerances a verdict used.

    Attributes:
        weight: Largest relative residual of one parameter after alignment (``rtol``).
        output: Largest relative output difference on the probe (``options.check_rtol``).
        weight_origin: ``"given"`` or ``"<dtype> default"`` (:data:`EQUIVALENCE_RTOL`).
        output_origin: ``"given"`` or ``"<dtype> default"`` (:data:`~lmc.matching.PROBE_RTOL`).
    """

    weight: float
    output: float
    weight_origin: str
    output_origin: str


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
            (``0`` where both are zero, ``inf`` where only ``b_p`` is); the verdict reads its largest.
        output_residual: ``||f_a(x) - f_b(x)|| / ||f_b(x)||`` on the probe input. The aligned model
            computes ``a``'s function (``align`` checks it), so this is the function question alone.
        tolerance: The tolerances applied and where they come from.
        transform: The group element found, mapping ``a``'s weights to the aligned ones.
        report: :func:`~lmc.matching.align`'s report.
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

    @property
    def worst_parameter(self) -> str:
        """The parameter that differs most after alignment (relative to its norm in ``b``)."""
        return max(self.parameter_residual, key=self.parameter_residual.__getitem__)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (the transform's matrices are left out; the report lists its permutations)."""
        return {
            "equivalent": self.equivalent,
            "reason": self.reason,
            "scope": self.scope,
            "dtype": self.report.dtype,
            "weight_residual": self.weight_residual,
            "worst_parameter": self.worst_parameter,
            "output_residual": self.output_residual,
            "tolerance": asdict(self.tolerance),
            "parameter_residual": self.parameter_residual,
            "alignment": self.report.to_dict(),
        }


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


def equivalent(
    a: nn.Module,
    b: nn.Module,
    scope: Scope = "full_model",
    options: AlignOptions | None = None,
    rtol: float | None = None,
) -> Equivalence:
    """Whether ``a`` and ``b`` compute the same function up to the symmetry group of ``scope``.

    ``a`` is aligned to ``b`` with :func:`~lmc.matching.align` (``options``); the pair is equivalent
    when every parameter then matches ``b``'s to ``rtol`` (relative to its norm) *and* the outputs
    agree on the probe input to the output tolerance. The default options converge on planted
    pairs: the least-squares start of Stage 2 is exact for them, and 30 L-BFGS steps with
    gradient tolerance 1e-12 change nothing measurable (worst parameter residual 8e-16 in float64
    on the test architectures).

    Args:
        a: The model aligned (never modified); "source" in :class:`AlignmentError` messages.
        b: The model compared with (never modified; "target"); same architecture, dtype and device.
        scope: ``"first_attention"``, ``"all_attention"``, ``"first_block"`` or ``"full_model"``:
            the group asked about. A parameter outside it that differs makes the pair not
            equivalent (a verdict naming it, not an error).
        options: Alignment settings; ``options.check_rtol`` is also the output tolerance
            (``None``: :data:`~lmc.matching.PROBE_RTOL` of the dtype, what rounding the forward pass
            explains; 1e-6 in float64 because HF Llama normalizes in float32). ``None`` takes the defaults.
        rtol: Weight tolerance; ``None`` takes :data:`EQUIVALENCE_RTOL` of the dtype.

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
    aligned, report = align(_with_frozen_from(a, b, free), b, scope=scope, options=options)
    dtype = next(a.parameters()).dtype
    default = f"{dtype_name(dtype)} default"
    tolerance = EquivalenceTolerance(
        weight=EQUIVALENCE_RTOL[dtype] if rtol is None else float(rtol),
        output=report.check_rtol,
        weight_origin=default if rtol is None else "given",
        output_origin=default if options.check_rtol is None else "given",
    )

    moved, original = dict(aligned.named_parameters()), dict(a.named_parameters())
    squared: dict[str, tuple[float, float]] = {}  # parameter -> (squared difference, squared norm of b's)
    for n, target in b.named_parameters():
        value = moved[n] if n in free else original[n]
        squared[n] = (
            float((value.detach().double() - target.detach().double()).pow(2).sum()),
            float(target.detach().double().pow(2).sum()),
        )
    parameter_residual = {n: _relative(d**0.5, t**0.5) for n, (d, t) in squared.items()}
    weight_residual = {
        part: _relative(sum(squared[n][0] for n in names) ** 0.5, sum(squared[n][1] for n in names) ** 0.5)
        for part, names in (("scope", [n for n in squared if n in free]), ("all", list(squared)))
    }
    output_residual = probe_error(b, a, options.probe_batch_size, options.seed, role="b")

    worst = max(parameter_residual, key=parameter_residual.__getitem__)
    where = "" if worst in free else f" (outside scope {scope!r}, so never aligned)"
    weights = f"{worst}{where} differs by {parameter_residual[worst]:.2g} of its norm"
    outputs = f"{output_residual:.2g} on the probe"
    weights_match = parameter_residual[worst] <= tolerance.weight
    outputs_match = output_residual <= tolerance.output
    if weights_match and outputs_match:
        reason = (
            f"related by the {scope} group: after alignment every parameter is within rtol {tolerance.weight:g} "
            f"(largest: {weights}) and the outputs agree ({outputs} <= {tolerance.output:g})"
        )
    elif outputs_match:
        reason = (
            f"same outputs on the probe ({outputs} <= {tolerance.output:g}) but not related by the {scope} group: "
            f"after alignment {weights} (> rtol {tolerance.weight:g}); a symmetry lmc does not model, or a "
            "difference too small or too hidden for the probe input to show"
        )
    elif weights_match:
        reason = (
            f"different outputs ({outputs} > {tolerance.output:g}) although every parameter is within rtol "
            f"{tolerance.weight:g} after alignment (largest: {weights}): the remaining differences change the "
            "function; lower rtol"
        )
    else:
        reason = (
            f"different functions: the outputs differ by {outputs} (> {tolerance.output:g}) and after alignment "
            f"{weights} (> rtol {tolerance.weight:g})"
        )
    return Equivalence(
        equivalent=weights_match and outputs_match,
        reason=reason,
        scope=scope,
        weight_residual=weight_residual,
        parameter_residual=parameter_residual,
        output_residual=output_residual,
        tolerance=tolerance,
        transform=report.transform,
        report=report,
    )
