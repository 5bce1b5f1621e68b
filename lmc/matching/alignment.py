"""``align``: bring a source model's weights next to a target's without changing its function.

Attention layers use the two-stage matcher (:mod:`lmc.matching.grams`, Stage 1 in
:mod:`lmc.matching.heads`, Stage 2 in :mod:`lmc.matching.stage2`); FFN and task-head hidden
units and the residual stream use weight matching (:mod:`lmc.matching.permutation`). For
``full_model`` the permutations are found by coordinate descent: the residual permutation is
started from the parameters whose other axes no symmetry moves (embeddings, norms, output
layers, output biases), then FFN and task-head permutations, head orders and the residual
permutation (now also read through the aligned hidden units) are solved in turn until none
changes. Stage 2 then runs on every attention layer with all permutations fixed, so the
distance to the target never rises from ``permutation`` to ``orthogonal`` to ``full``.
Activation matching (``unit_matching="activation"``) instead solves each unit permutation once
from the units' correlations on calibration batches, which no other symmetry changes.
"""

from __future__ import annotations

import copy
import dataclasses
import time

from torch import nn

from lmc.adapters import model_spec, scope_parameters
from lmc.matching.aligner import Aligner
from lmc.matching.calibration import Calibration
from lmc.matching.checks import check_head_orders, check_pair, check_probe, probe_error
from lmc.matching.descent import weight_alignment
from lmc.matching.layers import axes_distance
from lmc.matching.options import AlignOptions, checked_options
from lmc.matching.results import AlignmentReport
from lmc.symmetry import Scope, SymmetrySpec, fold_parameters_, residual_group, scope_blocks


def align(
    source: nn.Module,
    target: nn.Module,
    scope: Scope = "first_attention",
    options: AlignOptions | None = None,
    calibration: Calibration | None = None,
) -> tuple[nn.Module, AlignmentReport]:
    """Align ``source`` to ``target`` within the symmetry group of ``scope``.

    Float16 and bfloat16 models align too: Grams, Stage 2 and the transforms are computed in
    float32 or float64 and the aligned weights are written back in the models' dtype.

    Args:
        source: The model to transform (never modified).
        target: The model to come close to (never modified); same architecture, dtype and device.
        scope: ``"first_attention"``, ``"all_attention"``, ``"first_block"`` or ``"full_model"``.
            Outside ``full_model`` every parameter outside the scope must be identical in both.
        options: Method, head metric, Stage 2 and check settings (:class:`AlignOptions`);
            ``None`` takes the defaults.
        calibration: Training batches the data-aware settings (``method="learned"``, ``objective="data"``,
            ``metric="activation"``) read activations from; its
            first ``options.calibration_batches`` are used. Ignored by weight-only settings. The
            group element is still applied to the weights, so the function stays exact.

    Returns:
        ``(aligned, report)``: a new module computing the same function as ``source``.

    Raises:
        ValueError: Unknown ``scope``; data-aware options without a calibration (or with fewer
            batches than ``options.calibration_batches``).
        AlignmentError: The pair cannot be aligned (architectures, dtypes, devices, frozen
            parameters, NaN/Inf or overflowing weights), or the result is not a symmetry of
            ``source`` on the probe to ``report.check_rtol``.
    """
    options = checked_options(options)
    if options.data_aware:
        if calibration is None:
            raise ValueError(
                f"the alignment options {options.data_settings} read activations, so align needs calibration "
                "batches: pass calibration=lmc.matching.Calibration(...) (lmc.connectivity.training_calibration "
                "builds one from a DataModule's training split), or --data on the command line"
            )
        calibration = calibration.take(options.calibration_batches)
    started = time.perf_counter()
    spec = group_spec(check_pair(source, target, scope), options)
    dtype = next(source.parameters()).dtype
    report = AlignmentReport.start(scope, options, dtype)
    given = source
    if options.unit_scales and scope != "full_model":
        raise ValueError(
            f"unit_scales=True scales the FFN units inside the whole-model descent, which scope {scope!r} does not "
            "run: use scope='full_model', or unit_scales=False"
        )
    if options.residual == "orthogonal":
        source, target = fold_pair(source, target, spec, report)
    rtol = report.check_rtol
    if options.data_aware:
        report.calibration = calibration.identity() | {"batches": len(calibration.batches)}
    aligner = Aligner(source, target, spec, report, calibration if options.data_aware else None)

    attention, feed_forward, whole = scope_blocks(spec, scope)
    check_head_orders(options.head_orders, attention, scope)
    if options.method != "naive":
        start = time.perf_counter()
        aligner.capture(attention)
        report.calibration_seconds = time.perf_counter() - start
        if options.unit_matching == "activation":
            aligner.match_units(feed_forward, whole)
            for index in attention:
                aligner.align_attention(index)
        else:
            weight_alignment(aligner, spec, attention, feed_forward, whole)
        if options.method == "learned" and attention:
            aligner.learn(attention)

    scoped = [(name, 0) for name in scope_parameters(source, scope, spec)]
    report.distance = {
        "naive": axes_distance(aligner.original, aligner.target, scoped),
        "aligned": axes_distance(aligner.parameters, aligner.target, scoped),
    }
    report.probe_relative_error = probe_error(given, aligner.working, options.probe_batch_size, options.seed)
    what = f"model (adapter for {type(source).__name__}, scope {scope!r}, method {options.method!r})"
    check_probe(report.probe_relative_error, rtol, dtype, options.check_rtol is None, what)
    report.seconds = time.perf_counter() - started
    return aligner.working, report


def fold_pair(
    source: nn.Module, target: nn.Module, spec: SymmetrySpec, report: AlignmentReport
) -> tuple[nn.Module, nn.Module]:
    """Both models with their foldable norms folded (``residual="orthogonal"``), the fold and the residual group
    recorded in ``report``; refused outside ``full_model``, the only scope that moves the stream."""
    if report.scope != "full_model":
        raise ValueError(
            f"residual='orthogonal' rotates the residual stream by weight, which scope {report.scope!r} does not "
            "align: use scope='full_model', or residual='permutation'"
        )
    (folded_source, folded_norms), (folded_target, _) = folded(source, spec), folded(target, spec)
    record_fold(report, spec, folded_norms)
    return folded_source, folded_target


def record_fold(report: AlignmentReport, spec: SymmetrySpec, folded_norms: list[str]) -> None:
    """Record in ``report`` the norms folded and the residual group the extended group aligns with."""
    group = residual_group(spec)
    report.residual_group = "none" if group is None else group.name + (f" ({group.reason})" if group.reason else "")
    report.folded = folded_norms


def group_spec(spec: SymmetrySpec, options: AlignOptions) -> SymmetrySpec:
    """``spec`` restricted to the group ``options`` align in: ``residual="unsigned"`` leaves out the residual
    stream's signs (the paper's group of permutations)."""
    if options.residual != "unsigned" or spec.residual is None:
        return spec
    return dataclasses.replace(spec, residual=dataclasses.replace(spec.residual, signs="none"))


def target_frame(target: nn.Module, report: AlignmentReport) -> nn.Module:
    """The target in the frame ``report``'s aligned model was brought to: ``target`` itself, or with
    ``residual="orthogonal"`` a copy folded as :func:`align` folded it (the same function), which the merges and the
    aligned interpolation then start from."""
    return target if report.folded is None else folded(target, model_spec(target))[0]


def folded(model: nn.Module, spec: SymmetrySpec) -> tuple[nn.Module, list[str]]:
    """A copy of ``model`` with ``spec``'s foldable norms folded (``lmc.adapters.fold_norms``), and the norms folded."""
    copied = copy.deepcopy(model)
    return copied, fold_parameters_(dict(copied.named_parameters()), spec.folds)
