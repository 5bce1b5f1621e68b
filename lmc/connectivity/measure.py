"""Measure linear mode connectivity between a model and a reference, naive and aligned.

Shared by the ``AlignAndInterpolate`` callback, ``lmc interpolate`` and the main job. A sweep
is identified by a key over everything that changes a point (both models' exact weights, the
scope, every alignment option, the alphas, the split, the data and the model's architecture),
so that finished points are reused only by the very same sweep; results record that identity.
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import json
import math
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from lmc.connectivity.interpolation import (
    CLUSTER_SAMPLES,
    MetricSums,
    SweepStore,
    barriers,
    evaluate,
    fingerprint,
    reduce_sums,
    sweep,
)
from lmc.matching import AlignmentReport, AlignOptions, Calibration, align
from lmc.matching.alignment import target_frame
from lmc.matching.options import ALL_BATCHES, DATA_FIELDS, LEARNED_FIELDS

CURVES = ("naive", "aligned")
BARRIERS = ("loss_barrier", "accuracy_barrier", "loss_barrier_rebasin", "accuracy_barrier_rebasin")


@dataclass(frozen=True)
class Evaluation:
    """How each interpolated point is evaluated, and what identifies it.

    ``split``, ``data`` and ``architecture`` enter the sweep's key. The batch size and the number of
    processes do not: they regroup the same samples, which changes a point only by
    floating-point rounding.

    Attributes:
        metric_sums: Named float64 sums of one batch, ``count`` included: per-sample ``(B,)``
            vectors (:meth:`lmc.training.LMCModule.sample_sums`) or scalars over the batch.
        batches: This process's batches (its shard when distributed), iterated once per point.
        split: The split evaluated (``"val"`` or ``"test"``).
        data: Identity of the data: the DataModule's class and settings (:func:`data_identity`).
        architecture: The model's construction settings (name and config): weights alone do not
            fix the function (a rotary layout, a positional encoding).
        all_reduce: Sums a tensor over processes (``None``: a single process).
    """

    metric_sums: MetricSums
    batches: Iterable[dict[str, torch.Tensor]]
    split: str
    data: Mapping[str, Any]
    architecture: Mapping[str, Any]
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def identity(self) -> dict[str, Any]:
        """What this evaluation contributes to a sweep's key: the cluster size too, which changes
        what a sweep records for the bootstrap (not its points)."""
        return {
            "split": self.split,
            "data": dict(self.data),
            "architecture": dict(self.architecture),
            "cluster_samples": CLUSTER_SAMPLES,
        }

    def sums(self, device: torch.device, per_cluster: list[dict[str, float]] | None = None) -> dict[str, torch.Tensor]:
        """The metric sums of the model's current weights over every process's batches.

        Args:
            per_cluster: Receives each cluster's sums in a single process (:func:`evaluate`; a
                distributed evaluation's samples are split over processes, so it records none).
        """
        if self.all_reduce is not None:
            return reduce_sums(evaluate(self.metric_sums, self.batches, device), self.all_reduce)
        return evaluate(self.metric_sums, self.batches, device, per_cluster)


def _nothing() -> None:
    pass


@dataclass(frozen=True)
class SweepHooks:
    """Persistence and coordination of a sweep between processes.

    Attributes:
        state_path: Resumable record of finished points (``None``: not persisted).
        naive_state_path: A separate record for the naive curve, which depends on neither the
            scope, the alignment options nor the grid: sweeps of one pair with several alignments
            or grids that share it evaluate each naive point and end point A once (``None``: kept
            in ``state_path``).
        write: Whether this process writes the records (rank 0 only).
        barrier: Waits for every process; called after each has read the state, before it changes.
        progress: Called with a short message after each point.
    """

    state_path: Path | None = None
    naive_state_path: Path | None = None
    write: bool = True
    barrier: Callable[[], None] = _nothing
    progress: Callable[[str], None] | None = None


def keyed_data_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """A DataModule's constructor settings as the keys of runs and sweeps record them.

    ``train_samples`` at ``None`` (the whole training split) is left out, and so is ``tokens`` at
    ``"bytes"`` with the ``vocabulary_size`` that only words use: keys made before these settings
    existed meant the same data, and stay valid.
    """
    left_out = {"tokens", "vocabulary_size"} if settings.get("tokens") == "bytes" else set()
    if settings.get("train_samples") is None:
        left_out.add("train_samples")
    return {name: value for name, value in settings.items() if name not in left_out}


def data_identity(datamodule: object) -> dict[str, Any]:
    """A DataModule's class and the constructor settings it keeps, but the batch size and workers
    (:func:`keyed_data_settings`).

    Two DataModules of the same class and settings give the same samples in every split.
    """
    kind = type(datamodule)
    names = inspect.signature(kind.__init__).parameters
    settings = {
        name: getattr(datamodule, name)
        for name in names
        if name not in ("self", "batch_size", "num_workers") and hasattr(datamodule, name)
    }
    return {"class": f"{kind.__module__}.{kind.__qualname__}", **keyed_data_settings(settings)}


CALIBRATION_SPLIT = "train"
"""Where data-aware alignment reads its calibration batches: the training split, never a curve split."""

LEAK_FRACTION = 0.1
"""Share of the calibration's samples found among the evaluated ones from which a sweep is refused.

A calibration drawn from the curve split has all its samples there (or the share the curves
measure, when they measure the first samples only); one drawn from the training split has none,
but for the samples a data set holds in two splits by accident (none in the embedded digits),
which only warn.
"""


def sample_keys(batch: Mapping[str, Any]) -> list[bytes]:
    """A digest of each sample of an lmc batch: the bytes of its ``inputs``, the same in any batch.

    Where the batch has an ``attention_mask``, only the sample's real tokens enter (its padding
    depends on the batch it was collated in); floating inputs enter as float64 and integer ones as
    int64, so neither the batch's dtype nor its device changes a key.
    """
    inputs, mask = batch["inputs"].detach().cpu(), batch.get("attention_mask")
    mask = None if mask is None else mask.detach().cpu()
    keys = []
    for i, sample in enumerate(inputs):
        if mask is not None:
            sample = sample[mask[i] != 0]
        sample = (sample.double() if sample.is_floating_point() else sample.long()).contiguous()
        digest = hashlib.blake2b(str(tuple(sample.shape)).encode(), digest_size=16)
        digest.update(sample.numpy().tobytes())
        keys.append(digest.digest())
    return keys


def calibration_overlap(calibration: Calibration, evaluation: Evaluation, device: torch.device) -> int:
    """How many of the calibration's samples are among the samples the curves are measured on.

    Compares the samples themselves (:func:`sample_keys`), not the splits' names: validation
    batches labelled ``"train"`` are found. One pass over this process's evaluation batches;
    the count is summed over processes (``evaluation.all_reduce``, a tensor on ``device``), so
    every process reaches the same verdict.
    """
    ours: dict[bytes, int] = {}
    for batch in calibration.batches:
        for key in sample_keys(batch):
            ours[key] = ours.get(key, 0) + 1
    found: set[bytes] = set()
    for batch in evaluation.batches:
        found.update(key for key in sample_keys(batch) if key in ours)
    count = sum(ours[key] for key in found)
    if evaluation.all_reduce is not None:
        count = int(evaluation.all_reduce(torch.tensor([float(count)], dtype=torch.float64, device=device))[0])
    return count


def refuse_calibration_leak(calibration: Calibration, evaluation: Evaluation, device: torch.device) -> None:
    """Raise ``ValueError`` if the calibration comes from the data the curves are measured on.

    Refused: a calibration labelled with the curves' split, or one with :data:`LEAK_FRACTION` or
    more of its samples among the evaluated samples, whatever its label (a smaller share warns).
    """
    if calibration.split == evaluation.split:
        raise ValueError(
            f"the calibration batches come from the {calibration.split!r} split the curves are measured on: "
            f"calibrate on the training split ({CALIBRATION_SPLIT!r})"
        )
    total = sum(len(batch["inputs"]) for batch in calibration.batches)
    leaked = calibration_overlap(calibration, evaluation, device)
    where = (
        f"{leaked} of the {total} calibration samples (labelled {calibration.split!r}) are among the "
        f"{evaluation.split!r} samples the curves are measured on"
    )
    if leaked >= LEAK_FRACTION * total:
        raise ValueError(
            f"{where}: calibrate on the training split ({CALIBRATION_SPLIT!r}), e.g. with "
            "lmc.connectivity.training_calibration"
        )
    if leaked:
        warnings.warn(f"{where}: samples the data set holds in both splits?", stacklevel=3)


def training_calibration(
    datamodule: Any,
    forward: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor],
    batches: int | str,
    seed: int = 0,
) -> Calibration:
    """The first ``batches`` batches of a seeded shuffle of a DataModule's training split (``"all"``: every batch).

    Args:
        datamodule: An :class:`~lmc.data.LMCDataModule` (its ``part`` picks the half: a fine-tuned
            pair calibrates on the fine-tuning half ``B``); batches of its ``batch_size``.
        forward: Runs a model on a batch and returns its loss (``LMCModule.model_loss``).
        batches: How many batches (``AlignOptions.calibration_batches``), or ``"all"``.
        seed: Seed of the shuffle (recorded in the calibration's identity).

    Raises:
        ValueError: The training split holds fewer batches.
    """
    dataset = datamodule.split(CALIBRATION_SPLIT)
    loader = DataLoader(
        dataset, batch_size=datamodule.batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed)
    )
    chosen = list(loader) if batches == ALL_BATCHES else list(itertools.islice(loader, batches))
    if batches != ALL_BATCHES and len(chosen) < batches:
        raise ValueError(
            f"calibration_batches={batches} but the training split holds {len(chosen)} batches of "
            f"{datamodule.batch_size}: lower calibration_batches"
        )
    identity = {**data_identity(datamodule), "batch_size": datamodule.batch_size, "shuffle_seed": seed}
    return Calibration(chosen, forward, CALIBRATION_SPLIT, sum(len(b["inputs"]) for b in chosen), identity)


def sweep_settings(
    scope: str,
    options: AlignOptions,
    alphas: list[float],
    evaluation: Evaluation,
    calibration: Calibration | None = None,
) -> dict[str, Any]:
    """Every setting that changes a point of a sweep, besides the two models' weights (as JSON values).

    Data-aware options add the calibration's identity (split, samples, data) of the batches they
    read; weight-only options leave out the calibration settings, which do not change them, and
    methods other than ``learned`` its settings.
    """
    chosen = asdict(options)
    settings = {"scope": scope, "options": chosen, "alphas": list(alphas), **evaluation.identity()}
    if options.data_aware:
        if calibration is None:
            raise ValueError("data-aware alignment options need a calibration (see training_calibration)")
        settings["calibration"] = calibration.take(options.calibration_batches).identity()
    else:
        for name in DATA_FIELDS:
            del chosen[name]
    if options.method != "learned":
        for name in LEARNED_FIELDS:
            del chosen[name]
    return json.loads(json.dumps(settings, default=str))


def measure_connectivity(
    model: nn.Module,
    reference: nn.Module,
    scope: str,
    options: AlignOptions,
    alphas: list[float],
    evaluation: Evaluation,
    hooks: SweepHooks = SweepHooks(),
    calibration: Calibration | None = None,
    alignment: tuple[nn.Module, AlignmentReport] | None = None,
) -> dict[str, Any]:
    """Align ``reference`` to ``model``, then sweep the naive and the aligned interpolation.

    Args:
        model: End point A; receives the interpolated weights during the sweep and ends with its own.
        reference: End point B before alignment (never modified).
        scope: Alignment scope (see :func:`lmc.matching.align`).
        options: Passed unchanged to :func:`lmc.matching.align`.
        alphas: Interpolation coefficients.
        evaluation: How every point is evaluated.
        hooks: Where finished points persist, and the coordination between processes.
        calibration: The batches data-aware options read (:func:`training_calibration`); never
            from the data the curves are measured on (:func:`refuse_calibration_leak` compares the
            samples, not only the splits' names).
        alignment: ``align(reference, model, scope, options, calibration)``'s result when the caller
            already has it (to use the aligned model elsewhere too): used instead of aligning again.

    Returns:
        ``{"model_fingerprint", "reference_fingerprint", "settings", "key", "curves": {curve:
        {"points": [...], <barriers>}}, "barrier_ratio": {...}, "alignment": {...}}``; ``key``
        identifies the sweep (weights and settings).

    Raises:
        ValueError: The calibration of data-aware options comes from the evaluated data.
    """
    if calibration is not None:
        refuse_calibration_leak(calibration, evaluation, next(model.parameters()).device)
    settings = sweep_settings(scope, options, alphas, evaluation, calibration)
    if alignment is None:
        alignment = align(reference, model, scope, options=options, calibration=calibration)
    aligned, report = alignment
    if report.scope != scope or report.options != options:
        raise ValueError(
            f"the alignment passed was made with scope {report.scope!r} and {report.options}, not with the "
            f"sweep's scope {scope!r} and {options}: pass the alignment of the sweep's settings"
        )
    endpoint_a = [p.detach().clone() for p in model.parameters()]
    endpoints = {"naive": list(reference.parameters()), "aligned": list(aligned.parameters())}
    # With the extended group the aligned model is folded: its curve starts from end point A folded alike.
    starts = {"naive": endpoint_a, "aligned": endpoint_a}
    if report.folded is not None:
        starts["aligned"] = [p.detach() for p in target_frame(model, report).parameters()]  # a copy of A
    identity = {
        "model_fingerprint": fingerprint(endpoint_a),
        "reference_fingerprint": fingerprint(endpoints["naive"]),
        "settings": settings,
    }
    # The aligned model itself is part of the aligned curve's key: a matcher that changed since a
    # killed sweep (same options, another element) never resumes its stale points.
    key = fingerprint(extra={**identity, "aligned_fingerprint": fingerprint(endpoints["aligned"])})
    stores = {"aligned": SweepStore.open(hooks.state_path, key)}
    if hooks.naive_state_path is None:
        stores["naive"] = stores["aligned"]
    else:  # the naive curve's own identity: the two models and the evaluation (its points, by alpha,
        # serve sweeps of the pair on every grid)
        naive = {
            **identity,
            "settings": {
                k: v for k, v in identity["settings"].items() if k not in ("scope", "options", "calibration", "alphas")
            },
        }
        stores["naive"] = SweepStore.open(hooks.naive_state_path, fingerprint(extra=naive))
    hooks.barrier()
    device = endpoint_a[0].device
    curves = {}
    for curve in CURVES:
        points = sweep(
            model,
            starts[curve],
            endpoints[curve],
            lambda per_cluster: evaluation.sums(device, per_cluster),
            alphas,
            stores[curve],
            curve,
            hooks.write,
            hooks.progress,
            # end point A is the naive curve's first point: each aligned curve from the same weights reuses it
            start=None if curve == "naive" or report.folded is not None else (stores["naive"], "naive"),
        )
        curves[curve] = {"points": points, **barriers(points)}
    if report.folded is not None:  # the last curve left model holding A folded: give it its own weights back
        with torch.no_grad():
            for parameter, own in zip(model.parameters(), endpoint_a):
                parameter.copy_(own)
    return {
        **identity,
        "key": key,
        "curves": curves,
        "barrier_ratio": barrier_ratios(curves),
        "alignment": report.to_dict(),
    }


#: The naive barrier (loss in nats, accuracy as a fraction) below which a pair has no barrier to
#: remove: its ratio would be a quotient of rounding-sized numbers, so it is NaN and the pair is
#: excluded (by name) from every mean ratio.
NO_BARRIER = {"loss_barrier": 0.01, "accuracy_barrier": 0.01}


def barrier_ratios(curves: dict[str, Any]) -> dict[str, float]:
    """Aligned barrier as a percentage of the naive one (docs/spec.md, section 4); NaN where the naive
    barrier is below :data:`NO_BARRIER`."""
    ratios = {}
    for name, floor in NO_BARRIER.items():
        naive = curves["naive"][name]
        ratios[name] = 100.0 * curves["aligned"][name] / naive if naive >= floor else float("nan")
    return ratios


def with_perplexity(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` (of :func:`measure_connectivity`) with each point's ``perplexity = exp(loss)``.

    For language models, where ``loss`` is the mean cross-entropy per token. Perplexity is not a
    summed metric: it is derived from the point's mean loss where results are reported.
    """
    curves = {
        curve: {**data, "points": [{**p, "perplexity": math.exp(p["loss"])} for p in data["points"]]}
        for curve, data in result["curves"].items()
    }
    return {**result, "curves": curves}
