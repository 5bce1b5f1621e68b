"""Weight matching over a whole model, on any mapping of tensors: the coordinate descent of ``full_model``.

:class:`WeightDescent` holds the parameters being aligned, the target's and the group element so far, read by name
from ``Mapping[str, Tensor]``s, so the same solves run in memory (:class:`~lmc.matching.aligner.Aligner`) and on
two checkpoints streamed from disk (:mod:`lmc.matching.streamed`). :func:`coordinate_descent` solves the FFN,
task-head, token, head and residual elements in turn, each with the rest fixed, until none changes
(docs/spec.md, section 3).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lmc.matching.calibration import PairedMoment
from lmc.matching.checks import require_finite
from lmc.matching.grams import LayerGrams
from lmc.matching.layers import (
    align_attention_layer,
    align_feed_forward_layer,
    attention_stage1,
    axes_distance,
    best_rotation,
    layer_distance,
    signed_units,
)
from lmc.matching.permutation import axis_correlation
from lmc.matching.results import AlignmentReport, LayerAlignment
from lmc.matching.scales import SCALE_GAIN, best_scales, signed_parts
from lmc.matching.stage2 import attention_stages
from lmc.symmetry import AxisPermutation, ModelTransform, SymmetrySpec, compute_dtype, residual_group

ROTATION_GAIN = 1e-6
"""A residual rotation step that raises the summed correlation by less than this fraction of it changes nothing: the
coordinate descent stops there. A planted rotation is found to rounding (about 1e-15) in one step; on independent
llama-tiny models (float32), 1e-6 ends the descent after 5 rounds instead of 7, the distance within 3e-6 of 1e-10's."""


@dataclass
class ResidualCorrelation:
    """The residual step's weight correlation ``(d, d)`` (float64) in two parts over disjoint axes.

    Attributes:
        flipped: Over the axes the signs flip (every residual axis without a sign group).
        unsigned: Over the axes the signs leave alone (the norms' gains), ``None`` without any.
    """

    flipped: torch.Tensor
    unsigned: torch.Tensor | None = None

    @property
    def whole(self) -> torch.Tensor:
        """The correlation over every axis."""
        return self.flipped if self.unsigned is None else self.flipped + self.unsigned

    def __add__(self, other: ResidualCorrelation) -> ResidualCorrelation:
        unsigned = [part for part in (self.unsigned, other.unsigned) if part is not None]
        return ResidualCorrelation(self.flipped + other.flipped, sum(unsigned) if unsigned else None)


class WeightDescent:
    """The state weight matching works on: the parameters being aligned, the target's, the group element so far.

    Every tensor is read by name from a ``Mapping[str, Tensor]``, so the same solves run on a
    model in memory (:class:`Aligner`) and on two checkpoints streamed from disk
    (:mod:`lmc.matching.streamed`, whose ``parameters`` read the source through the transform so far).

    Args:
        parameters: The source's tensors with :attr:`report`'s transform applied.
        target: The target's tensors.
        original: The source's tensors as given (read only).
        spec: The model's symmetries.
        report: The alignment's report; its ``transform`` accumulates what :meth:`apply` is given.
    """

    def __init__(self, parameters, target, original, spec: SymmetrySpec, report: AlignmentReport, dtype):
        self.parameters, self.target, self.original = parameters, target, original
        self.spec, self.report, self.options, self.dtype = spec, report, report.options, dtype
        self.moments: dict[str, PairedMoment] = {}
        group = residual_group(spec) if self.options.residual == "orthogonal" else None
        self.rotation = group if group is not None and group.rotates else None

    def require_finite(self, finite: bool, what: str) -> None:
        require_finite(finite, what, self.dtype)

    def apply(self, transform: ModelTransform) -> None:
        """Move :attr:`parameters` by ``transform`` and add it to the report's."""
        self.transform_parameters(transform)
        self.report.transform = self.report.transform.compose(transform, self.spec)

    def transform_parameters(self, transform: ModelTransform) -> None:
        """Apply ``transform`` to :attr:`parameters` in place (a streamed view re-reads through the report's)."""
        with torch.no_grad():
            transform.apply_(self.parameters, self.spec)

    def layer_moments(self, index: int) -> tuple[PairedMoment | None, PairedMoment | None]:
        """The captured input and output moments of attention layer ``index`` (``None`` when not captured)."""
        return self.moments.get(f"input:{index}"), self.moments.get(f"output:{index}")

    def stage1_cost(self, index: int) -> Callable[[LayerGrams], torch.Tensor] | None:
        """The Stage 1 cost of layer ``index`` where it needs more than the Grams (``None``: from the Grams)."""
        return None

    def permute_heads(self, index: int) -> bool:
        """Stage 1 only; returns whether the head order changed."""
        layer = self.spec.blocks[index].attention
        order = (self.options.head_orders or {}).get(index)
        grams, _, _, match, kv_match, _ = attention_stage1(
            self.parameters,
            self.target,
            layer,
            self.options,
            order,
            *self.layer_moments(index),
            self.stage1_cost(index),
        )
        if torch.equal(match, torch.arange(len(match))):
            return False
        stages = attention_stages(grams, layer, match, kv_match, "permutation", self.options)
        self.apply(ModelTransform(attention={index: stages["permutation"]}))
        return True

    def align_attention(self, index: int) -> None:
        """Both stages on one layer, recording distances after each stage."""
        layer = self.spec.blocks[index].attention
        order = (self.options.head_orders or {}).get(index)
        naive = layer_distance(self.original, self.target, layer)
        element, record = align_attention_layer(
            self.parameters,
            self.target,
            layer,
            self.options,
            order,
            naive,
            *self.layer_moments(index),
            self.stage1_cost(index),
        )
        self.apply(ModelTransform(attention={index: element}))
        overall = self.report.transform.attention[index]
        record.assignment = torch.argsort(overall.query_permutation).tolist()
        record.kv_assignment = torch.argsort(overall.kv_permutation).tolist()
        self.report.layers.append(record)

    def residual_correlation(self, axes) -> ResidualCorrelation:
        """Weight correlation ``(d, d)`` of the residual stream over ``axes`` (:func:`axis_correlation`), in
        float64 (it adds up products over most of the model's tensors), apart over the axes the signs leave
        alone: each tensor is read once."""
        residual = self.spec.residual.restricted(axes)
        flipped = residual.restricted([axis for axis in residual.axes if axis not in residual.unsigned])
        unsigned = None
        if residual.unsigned:
            unsigned = axis_correlation(self.parameters, self.target, residual.restricted(residual.unsigned))
        return ResidualCorrelation(axis_correlation(self.parameters, self.target, flipped), unsigned)

    def unit_correlation(self, permutation: AxisPermutation) -> torch.Tensor:
        """Weight correlation ``(size, size)`` of a unit permutation (an FFN's, a task head's, the tokens') over its
        own few tensors, in the weights' compute dtype (:func:`axis_correlation`)."""
        return axis_correlation(self.parameters, self.target, permutation, compute_dtype(self.dtype))

    def best_units(
        self, permutation: AxisPermutation, correlation: torch.Tensor, unsigned: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The permutation and signs of ``permutation``'s units maximizing their summed ``correlation``
        ``(size, size)``, of which ``unsigned`` is the part over the axes the signs leave alone
        (:func:`~lmc.matching.layers.signed_units`); each ``None`` if it does nothing."""
        perm, signs = signed_units(correlation, unsigned, permutation, self.dtype)
        perm = None if torch.equal(perm, torch.arange(permutation.size)) else perm
        return perm, None if signs is None or bool((signs > 0).all()) else signs

    def permute_feed_forward(self, index: int) -> bool:
        feed_forward = self.spec.blocks[index].feed_forward
        if self.options.unit_scales and feed_forward.scales is not None:
            return self.scale_feed_forward(index)
        hidden = feed_forward.hidden
        perm, _ = self.best_units(hidden, self.unit_correlation(hidden))  # FFN units have no sign group
        if perm is not None:
            self.apply(ModelTransform(feed_forward={index: perm}))
        return perm is not None

    def scale_feed_forward(self, index: int) -> bool:
        """The FFN step with the units' scales (``unit_scales``): the assignment with their signs (a sign flips the
        value branch's and the down projection's entries, not the gate's), then each unit's scale in closed form
        (:func:`~lmc.matching.scales.best_scales`); whether the element changed."""
        feed_forward = self.spec.blocks[index].feed_forward
        flipped, fixed = signed_parts(feed_forward)
        unsigned = self.unit_correlation(fixed)
        signs = "each" if feed_forward.scales.group == "nonzero" else "none"
        units = dataclasses.replace(feed_forward.hidden, signs=signs, unsigned=())
        perm, flips = self.best_units(units, self.unit_correlation(flipped) + unsigned, unsigned)
        changed = perm is not None or flips is not None
        if changed:
            scaled = {} if flips is None else {index: flips}
            self.apply(ModelTransform(feed_forward={} if perm is None else {index: perm}, feed_forward_scales=scaled))
        factors, gain = best_scales(self.parameters, self.target, feed_forward)
        if gain > SCALE_GAIN:
            self.apply(ModelTransform(feed_forward_scales={index: factors}))
        return changed or gain > SCALE_GAIN

    def permute_task_head(self, index: int) -> bool:
        hidden = self.spec.task_heads[index]
        unsigned = None
        if hidden.signs != "none" and hidden.unsigned:  # a LayerNorm's gain: one small tensor read again
            unsigned = axis_correlation(self.parameters, self.target, hidden.restricted(hidden.unsigned))
        perm, signs = self.best_units(hidden, self.unit_correlation(hidden), unsigned)
        if perm is None and signs is None:
            return False
        transform = ModelTransform()
        if perm is not None:
            transform.task_heads[index] = perm
        if signs is not None:
            transform.task_head_signs[index] = signs
        self.apply(transform)
        return True

    def permute_tokens(self) -> bool:
        tokens = self.spec.tokens
        perm, _ = self.best_units(tokens, self.unit_correlation(tokens))  # tokens have no sign group
        if perm is not None:
            self.apply(ModelTransform(tokens=perm))
        return perm is not None

    def permute_residual(self, correlation: ResidualCorrelation) -> bool:
        """The residual step on its weight ``correlation`` (over the axes the caller chose, summed as it reads
        them: a streamed round adds it up block by block), signs included where the stream has them; whether the
        element changed. With rotations (``residual="orthogonal"``) the step is orthogonal Procrustes on the part of
        the correlation over every axis but the folded gains, which no rotation moves; it counts as a change when it
        raises the summed correlation by more than :data:`ROTATION_GAIN` of it."""
        if self.rotation is not None:
            rotation, gain = best_rotation(correlation.flipped, self.rotation, self.dtype)
            if gain > ROTATION_GAIN:
                self.apply(ModelTransform(residual_rotation=rotation))
            return gain > ROTATION_GAIN
        perm, signs = self.best_units(self.spec.residual, correlation.whole, correlation.unsigned)
        if perm is not None or signs is not None:
            self.apply(ModelTransform(residual=perm, residual_signs=signs))
        return perm is not None or signs is not None

    def descent_round(
        self, spec: SymmetrySpec, attention: list[int], feed_forward: list[int], residual_axes: list
    ) -> bool:
        """One round of :func:`coordinate_descent`: the FFN, task-head, token and head permutations, each with
        the residual one fixed, then the residual one over ``residual_axes``; whether any changed."""
        changed = False
        for index in feed_forward:
            changed |= self.permute_feed_forward(index)
        for index in range(len(spec.task_heads)):
            changed |= self.permute_task_head(index)
        if spec.tokens is not None:
            changed |= self.permute_tokens()
        for index in attention:
            changed |= self.permute_heads(index)
        if spec.residual is not None:
            changed |= self.permute_residual(self.residual_correlation(residual_axes))
        return changed

    def record_tokens(self, seconds: float) -> None:
        """Report the token permutation found so far (the identity if none)."""
        tokens, perm = self.spec.tokens, self.report.transform.tokens
        perm = torch.arange(tokens.size) if perm is None else perm
        self.record_permutation(tokens, "tokens", perm, seconds)

    def record_permutation(
        self,
        permutation: AxisPermutation,
        kind: str,
        perm: torch.Tensor | None,
        seconds: float,
        signs: torch.Tensor | None = None,
    ) -> None:
        """Report one permutation (``None``: the identity), the units it flips where it has a sign group, and the
        distance over its axes before and after it."""
        perm = torch.arange(permutation.size) if perm is None else perm
        distance = {
            "naive": axes_distance(self.original, self.target, permutation.axes),
            "permutation": axes_distance(self.parameters, self.target, permutation.axes),
        }
        flipped = None if permutation.signs == "none" else (0 if signs is None else int((signs < 0).sum()))
        assignment = torch.argsort(perm).tolist()
        seconds_taken = {"match": seconds}
        self.report.layers.append(
            LayerAlignment(
                permutation.name, kind, assignment, distance=distance, seconds=seconds_taken, flipped=flipped
            )
        )

    def record_rotation(self, seconds: float) -> None:
        """Report the residual element found with rotations: its nearest signed permutation (assignment, flips)
        and how far the element is from it (:attr:`LayerAlignment.rotation`)."""
        residual = self.spec.residual
        matrix = self.report.transform.residual_matrix(residual.size)
        perm = matrix.abs().argmax(dim=1)
        signs = torch.sign(matrix[torch.arange(residual.size), perm])
        nearest = torch.zeros_like(matrix)
        nearest[torch.arange(residual.size), perm] = signs
        distance = {
            "naive": axes_distance(self.original, self.target, residual.axes),
            "permutation": axes_distance(self.parameters, self.target, residual.axes),
        }
        record = LayerAlignment(
            residual.name,
            "residual",
            torch.argsort(perm).tolist(),
            distance=distance,
            seconds={"match": seconds},
            flipped=int((signs < 0).sum()),
            rotation=float(torch.linalg.matrix_norm(matrix - nearest)) / residual.size**0.5,
        )
        self.report.layers.append(record)


def residual_axes(spec: SymmetrySpec) -> tuple[list, list]:
    """Residual axes of parameters no other symmetry moves (anchors), and those of parameters an FFN, task-head
    or token permutation also moves."""
    moved = {slot.parameter for layer in spec.attention for slot in layer.slots}
    hidden = [block.feed_forward.hidden for block in spec.blocks if block.feed_forward] + list(spec.task_heads)
    hidden += [spec.tokens] if spec.tokens is not None else []
    through_hidden = {name for permutation in hidden for name, _ in permutation.axes}
    anchors = [(n, a) for n, a in spec.residual.axes if n not in moved and n not in through_hidden]
    if stray := [axis for axis in spec.residual.unsigned if axis not in anchors]:
        # The residual step reads the signs' correlation as its whole one less that of the unsigned axes.
        raise ValueError(f"residual: unsigned axes {stray} are moved by another group too, which lmc does not solve")
    return anchors, [(n, a) for n, a in spec.residual.axes if n in through_hidden]


def coordinate_descent(
    aligner: WeightDescent, spec: SymmetrySpec, attention: list[int], feed_forward: list[int]
) -> None:
    """Residual, FFN, task-head, token and head permutations for ``full_model``, each solved with the rest fixed."""
    start = time.perf_counter()
    anchors, through_hidden = residual_axes(spec) if spec.residual is not None else ([], [])
    if spec.residual is not None:
        aligner.permute_residual(aligner.residual_correlation(anchors))
    for _ in range(aligner.options.max_iterations):
        if not aligner.descent_round(spec, attention, feed_forward, anchors + through_hidden):
            break
    seconds = time.perf_counter() - start
    transform = aligner.report.transform
    for index in feed_forward:
        hidden = spec.blocks[index].feed_forward.hidden
        aligner.record_permutation(hidden, "feed_forward", transform.feed_forward.get(index), seconds)
    for index, hidden in enumerate(spec.task_heads):
        perm, signs = transform.task_heads.get(index), transform.task_head_signs.get(index)
        aligner.record_permutation(hidden, "task_head", perm, seconds, signs)
    if spec.tokens is not None:
        aligner.record_tokens(seconds)
    if spec.residual is not None and transform.residual_rotation is not None:
        aligner.record_rotation(seconds)
    elif spec.residual is not None:
        aligner.record_permutation(spec.residual, "residual", transform.residual, seconds, transform.residual_signs)


def weight_alignment(
    aligner: WeightDescent, spec: SymmetrySpec, attention: list[int], feed_forward: list[int], whole: bool
) -> None:
    """Weight matching of the scope's units (coordinate descent for the whole model), then both stages per
    attention layer with every permutation fixed; in memory and streamed alike."""
    if whole:
        coordinate_descent(aligner, spec, attention, feed_forward)
    else:
        for index in feed_forward:
            perm, record = align_feed_forward_layer(aligner.parameters, aligner.target, spec, index)
            aligner.apply(ModelTransform(feed_forward={index: perm}))
            aligner.report.layers.append(record)
    for index in attention:
        aligner.align_attention(index)
