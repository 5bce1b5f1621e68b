"""What :func:`~lmc.matching.align` returns besides the aligned model, and the errors it raises."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from lmc.matching.options import AlignOptions
from lmc.symmetry import ModelTransform, Scope, compute_dtype

PROBE_RTOL: dict[torch.dtype, float] = {
    torch.float64: 1e-6,
    torch.float32: 1e-3,
    torch.bfloat16: 1e-1,
    torch.float16: 2e-2,
}
"""Default ``check_rtol`` per stored dtype: the relative output change on the probe that rounding
the aligned weights to that dtype can explain. Observed on the test models, planted and
independent pairs: ~1e-15 in float64, ~1e-6 in float32, at most 3e-3 in float16 and 2e-2 in
bfloat16 (a few units of each dtype's rounding error); the defaults leave a margin of 5x or more
for deeper models. A transform that is not a symmetry changes outputs by O(1)."""


class AlignmentError(ValueError):
    """A pair of models that cannot be aligned, or an alignment that failed its own check."""


@dataclass
class LayerAlignment:
    """What alignment did to one layer.

    Attributes:
        name: Module path (attention, FFN, task head), ``"residual"`` or the learned tokens' name.
        kind: ``"attention"``, ``"feed_forward"``, ``"task_head"``, ``"residual"`` or ``"tokens"``.
        assignment: Target index of each source head / hidden unit / coordinate.
        kv_assignment: Target KV head of each source KV head (attention only).
        stage1_cost: The ``h x h`` Stage 1 cost of the final pass (attention only).
        distance: Parameter distance to the target over this layer's transformed tensors,
            before (``naive``) and after each stage.
        seconds: Time spent per stage.
        flipped: Units whose sign the element flips, for units with a sign group (the residual stream of an
            RMSNorm or LayerNorm model, a tanh pooler's units: docs/spec.md, section 2); ``None`` otherwise.
        rotation: For a residual element with rotations (``residual="orthogonal"``), its Frobenius distance from
            the nearest signed permutation (``assignment`` and ``flipped``) over ``sqrt(d)``: 0 for a signed
            permutation, about 1.4 for a rotation far from every one; ``None`` otherwise.
    """

    name: str
    kind: str
    assignment: list[int]
    kv_assignment: list[int] | None = None
    stage1_cost: list[list[float]] | None = None
    distance: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    flipped: int | None = None
    rotation: float | None = None


@dataclass
class AlignmentReport:
    """Result of :func:`align` besides the aligned model.

    Attributes:
        scope: As requested.
        options: As requested.
        dtype: The models' parameter dtype, e.g. ``"float32"`` (the aligned weights are written back in it).
        compute_dtype: The dtype of the Gram matrices and transforms (``float32`` for half-precision
            weights); Stage 1 costs and the per-head Stage 2 problems are solved in ``float64``.
        check_rtol: The probe tolerance applied: ``options.check_rtol``, or :data:`PROBE_RTOL` of ``dtype``.
        layers: One entry per aligned attention layer, FFN, task head, the residual stream and the learned tokens.
        transform: The group element mapping the source's weights to the aligned ones.
        distance: Distance to the target over the scope's parameters, ``naive`` and ``aligned``.
        probe_relative_error: ``||f_aligned(x) - f_source(x)|| / ||f_source(x)||`` on the probe.
        seconds: Wall time of the whole alignment.
        calibration: What data-aware settings read (split, samples, batches, data identity);
            ``None`` for weight-only settings.
        calibration_seconds: Wall time of the calibration pass (part of ``seconds``).
        learned: What ``method="learned"`` did (:meth:`~lmc.matching.learned.LearnedAlignment.to_dict`:
            the fixed objective at ``full``'s element and at the returned one, its history, steps
            and seconds); ``None`` for the other methods.
        folded: With ``residual="orthogonal"``, the norms folded into their readers in both models before
            aligning (``lmc.adapters.fold_norms``: the aligned model is the folded source transformed, to compare
            with the folded target); ``None`` otherwise.
        residual_group: With ``residual="orthogonal"``, the residual group used (``O(d)``, ``O(d-1) x Z2`` or the
            signed permutations) and, where it has no rotation, why; ``None`` otherwise.
    """

    scope: Scope
    options: AlignOptions
    dtype: str
    check_rtol: float
    compute_dtype: str = ""
    layers: list[LayerAlignment] = field(default_factory=list)
    transform: ModelTransform = field(default_factory=ModelTransform)
    distance: dict[str, float] = field(default_factory=dict)
    probe_relative_error: float = 0.0
    seconds: float = 0.0
    calibration: dict[str, Any] | None = None
    calibration_seconds: float = 0.0
    learned: dict[str, Any] | None = None
    folded: list[str] | None = None
    residual_group: str | None = None

    @classmethod
    def start(cls, scope: Scope, options: AlignOptions, dtype: torch.dtype) -> AlignmentReport:
        """The report of an alignment of models stored in ``dtype``, before any layer is aligned."""
        rtol = PROBE_RTOL[dtype] if options.check_rtol is None else options.check_rtol
        return cls(scope, options, dtype_name(dtype), rtol, dtype_name(compute_dtype(dtype)))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (the transform's matrices are left out)."""
        return {
            "scope": self.scope,
            "options": asdict(self.options),
            "dtype": self.dtype,
            "compute_dtype": self.compute_dtype,
            "check_rtol": self.check_rtol,
            "distance": self.distance,
            "probe_relative_error": self.probe_relative_error,
            "seconds": self.seconds,
            "calibration": self.calibration,
            "calibration_seconds": self.calibration_seconds,
            "learned": self.learned,
            "folded": self.folded,
            "residual_group": self.residual_group,
            "layers": [vars(layer) for layer in self.layers],
        }


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
