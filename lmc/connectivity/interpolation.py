"""Linear interpolation between two models and its barriers (docs/spec.md, section 4).

``theta(alpha) = (1 - alpha) theta_A + alpha theta_B`` is evaluated at evenly spaced alphas.
The sweep writes each interpolated point into one model in place (no copy per alpha), keeps
exact named sums (``{"count", "loss", "accuracy", ...}``, see ``LMCModule.metric_sums``) so
that shards of a distributed run reduce exactly, and records finished points in a resumable file.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from lmc.io import atomic_write_json, nan_for_null
from lmc.matching.merge import check_alphas as check_alphas  # its public name here before lmc.matching.merge
from lmc.matching.merge import interpolate

#: Named float64 sums of one batch: ``{"count": ..., "loss": ..., ...}``, each a ``(B,)`` vector of
#: per-sample sums (a sample's tokens, for language modelling) or a scalar over the whole batch.
MetricSums = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
#: The metrics whose barriers are measured (every metric is swept and recorded).
BARRIER_METRICS = ("loss", "accuracy")
#: Consecutive evaluated samples per bootstrap cluster (:func:`evaluate`). Fixed, so that the
#: clusters do not depend on the batch size; small, so that 250 samples still give 32 clusters.
CLUSTER_SAMPLES = 8


def evenly_spaced(count: int = 25) -> list[float]:
    """``count`` alphas from 0 to 1 inclusive."""
    if count < 2:
        raise ValueError(f"an interpolation needs at least 2 points, got {count}")
    return [k / (count - 1) for k in range(count)]


def barriers(points: list[dict[str, float]]) -> dict[str, float]:
    """The loss and accuracy barriers of one curve of ``{"alpha", "loss", "accuracy", ...}`` points.

    ``loss_barrier`` and ``accuracy_barrier`` are the paper's (largest gap to the straight line
    between the end points); ``*_barrier_rebasin`` are Git Re-Basin's (largest gap to the mean
    of the end points).
    """
    a, loss, accuracy = (
        torch.tensor([p[k] for p in points], dtype=torch.float64) for k in ("alpha", "loss", "accuracy")
    )
    loss_line = (1 - a) * loss[0] + a * loss[-1]
    accuracy_line = (1 - a) * accuracy[0] + a * accuracy[-1]
    return {
        "loss_barrier": float((loss - loss_line).max()),
        "accuracy_barrier": float((accuracy_line - accuracy).max()),
        "loss_barrier_rebasin": float(loss.max() - (loss[0] + loss[-1]) / 2),
        "accuracy_barrier_rebasin": float((accuracy[0] + accuracy[-1]) / 2 - accuracy.min()),
    }


def recorded_cluster_sums(
    state_path: str | Path, curve: str = "aligned", alphas: list[float] | None = None
) -> list[list[dict[str, float]]] | None:
    """The per-cluster sums a finished sweep state file (:class:`SweepStore`) holds for ``curve``,
    one list per alpha of ``alphas`` (``None``: every recorded alpha) in order; ``None`` when the
    file or any of those points' clusters are missing."""
    path = Path(state_path)
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    if saved.get("format") != SweepStore.FORMAT:  # another layout: its points are not named by alpha
        return None
    return SweepStore(path, saved["key"], saved["points"], saved.get("clusters", {})).cluster_sums(curve, alphas)


def bootstrap_barriers(
    curves: dict[str, list[list[dict[str, float]]]], alphas: list[float], resamples: int = 1000, seed: int = 0
) -> dict[str, dict[str, torch.Tensor]]:
    """The loss and accuracy barriers of each curve on ``resamples`` bootstrap draws of its evaluated clusters.

    Every curve must have been evaluated on the same clusters (:func:`evaluate`): each draw picks
    ``C`` of the ``C`` clusters with replacement and is shared by all curves, so differences
    between curves are paired (the noise of the evaluation data, not of the models). A cluster of
    consecutive samples, not a sample, is the unit, so that neighbouring samples that resemble
    each other (windows of one text) are not counted as independent.

    Args:
        curves: Per curve, the per-cluster sums of each alpha (:func:`recorded_cluster_sums`).
        alphas: The curves' alphas.
        resamples: Bootstrap draws.
        seed: Seed of the draws.

    Returns:
        ``{curve: {"loss_barrier": (resamples,), "accuracy_barrier": (resamples,)}}``, float64.
    """
    clusters = {len(per_alpha) for points in curves.values() for per_alpha in points}
    if len(clusters) != 1 or any(len(points) != len(alphas) for points in curves.values()):
        raise ValueError("bootstrapped curves need the same clusters at every alpha and one point per alpha")
    generator = torch.Generator().manual_seed(seed)
    (count,) = clusters
    draws = torch.randint(count, (resamples, count), generator=generator)
    weights = torch.zeros(resamples, count, dtype=torch.float64).scatter_add_(
        1, draws, torch.ones(resamples, count, dtype=torch.float64)
    )
    return {name: weighted_barriers(points, alphas, weights) for name, points in curves.items()}


def weighted_barriers(
    cluster_sums: list[list[dict[str, float]]], alphas: list[float], weights: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The loss and accuracy barriers of one curve on each row of cluster weights.

    Args:
        cluster_sums: Per alpha, the per-cluster sums (:func:`recorded_cluster_sums`).
        alphas: The curve's alphas.
        weights: ``(rows, clusters)``, how often each row counts each cluster: a bootstrap draw's
            multiplicities (:func:`bootstrap_barriers`), or a 0/1 mask of a subset of the clusters.

    Returns:
        ``{"loss_barrier": (rows,), "accuracy_barrier": (rows,)}``, float64.
    """
    if any(len(per_alpha) != weights.shape[1] for per_alpha in cluster_sums) or len(cluster_sums) != len(alphas):
        raise ValueError(
            f"weights over {weights.shape[1]} clusters need a curve with that many clusters at each of its "
            f"{len(alphas)} alphas"
        )
    sums = {
        metric: torch.tensor(
            [[cluster[metric] for cluster in per_alpha] for per_alpha in cluster_sums], dtype=torch.float64
        )
        for metric in ("count", *BARRIER_METRICS)
    }  # (alphas, clusters)
    weights = weights.to(torch.float64)
    means = {metric: (weights @ sums[metric].T) / (weights @ sums["count"].T) for metric in BARRIER_METRICS}
    loss, accuracy = means["loss"], means["accuracy"]  # (rows, alphas)
    a = torch.tensor(alphas, dtype=torch.float64)
    loss_line = (1 - a) * loss[:, :1] + a * loss[:, -1:]
    accuracy_line = (1 - a) * accuracy[:, :1] + a * accuracy[:, -1:]
    return {
        "loss_barrier": (loss - loss_line).max(1).values,
        "accuracy_barrier": (accuracy_line - accuracy).max(1).values,
    }


class _ClusterRecorder:
    """Cuts an evaluation's sums into the clusters :func:`bootstrap_barriers` resamples.

    Per-sample sums (``(B,)`` vectors) are grouped into clusters of :data:`CLUSTER_SAMPLES`
    consecutive samples in evaluation order across batches, the last one possibly smaller:
    the clusters are the same whatever the batch size. Sums of a whole batch (scalars) make
    the batch one cluster.
    """

    def __init__(self, clusters: list[dict[str, float]]):
        self.clusters = clusters
        self.names: list[str] | None = None
        self.per_sample: bool | None = None
        self.pending: torch.Tensor | None = None  # (names, samples) not yet in a full cluster

    def add(self, sums: dict[str, torch.Tensor]) -> None:
        names = sorted(sums)
        stacked = torch.stack([sums[name].double() for name in names]).cpu()  # (names,) or (names, B)
        per_sample = stacked.ndim == 2
        if self.names is not None and (names, per_sample) != (self.names, self.per_sample):
            raise ValueError(
                "every batch's metric sums must name the same sums and be per-sample (B,) vectors in every "
                f"batch or scalars in every batch, got {names} ({'per sample' if per_sample else 'per batch'}) "
                f"after {self.names} ({'per sample' if self.per_sample else 'per batch'})"
            )
        self.names, self.per_sample = names, per_sample
        if not per_sample:
            self.clusters.append(dict(zip(names, stacked.tolist())))
            return
        pending = stacked if self.pending is None else torch.cat([self.pending, stacked], 1)
        full = pending.shape[1] // CLUSTER_SAMPLES * CLUSTER_SAMPLES
        cluster_sums = pending[:, :full].reshape(len(names), -1, CLUSTER_SAMPLES).sum(2)  # (names, clusters)
        self.clusters.extend(dict(zip(names, cluster)) for cluster in cluster_sums.T.tolist())
        self.pending = pending[:, full:]

    def finish(self) -> None:
        if self.pending is not None and self.pending.shape[1]:
            self.clusters.append(dict(zip(self.names, self.pending.sum(1).tolist())))


@torch.no_grad()
def evaluate(
    metric_sums: MetricSums,
    batches: Iterable[dict[str, torch.Tensor]],
    device: torch.device,
    per_cluster: list[dict[str, float]] | None = None,
) -> dict[str, torch.Tensor]:
    """Each of ``metric_sums``'s sums added over ``batches``: float64 scalars on ``device``.

    Args:
        metric_sums: A batch's named sums: per-sample ``(B,)`` vectors, or scalars over the batch.
        per_cluster: Receives the sums of each cluster of :data:`CLUSTER_SAMPLES` consecutive
            samples (or of each batch, for scalar sums), in order: what a bootstrap over the
            evaluated samples resamples (:func:`bootstrap_barriers`).

    Raises:
        ValueError: The sums are neither all scalars nor all ``(B,)`` vectors of one length, or
            nothing was evaluated.
    """
    totals: dict[str, torch.Tensor] = {}
    recorder = None if per_cluster is None else _ClusterRecorder(per_cluster)
    for batch in batches:
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        sums = metric_sums(batch)
        shapes = {tuple(value.shape) for value in sums.values()}
        if len(shapes) > 1 or any(len(shape) > 1 for shape in shapes):
            raise ValueError(
                f"a batch's metric sums must be all scalars or all per-sample (B,) vectors, got shapes "
                f"{ {name: tuple(value.shape) for name, value in sums.items()} }"
            )
        if recorder is not None:
            recorder.add(sums)
        for name, value in sums.items():
            totals[name] = totals.get(name, 0) + value.double().sum()
    if recorder is not None:
        recorder.finish()
    if "count" not in totals:
        raise ValueError("nothing was evaluated: the batches are empty or the metric sums have no 'count'")
    return totals


def reduce_sums(
    sums: dict[str, torch.Tensor], all_reduce: Callable[[torch.Tensor], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``sums`` added over processes with one collective (stacked in sorted name order, the same on every rank)."""
    names = sorted(sums)
    reduced = dict(zip(names, all_reduce(torch.stack([sums[name] for name in names])).unbind()))
    return {name: reduced[name] for name in sums}


def point_metrics(sums: dict[str, float]) -> dict[str, float]:
    """Every metric of a point: its sum over the samples (or tokens) divided by their ``count``.

    A sum named ``<head>/<metric>`` is divided by ``<head>/count`` instead: a second head scored
    on samples of its own (BERT pre-training's next-sentence pairs beside its masked tokens).
    """

    def count(name: str) -> float:
        head = name.rpartition("/")[0]
        return sums[f"{head}/count"] if head else sums["count"]

    return {name: value / count(name) for name, value in sums.items() if name.rpartition("/")[2] != "count"}


def fingerprint(*tensor_lists: Iterable[torch.Tensor], extra: object = None) -> str:
    """A short hash of the exact bytes, dtypes and shapes of tensors, and of JSON-able settings ``extra``.

    Any change of a weight, including a permutation, changes it. One tensor at a time is
    copied to the CPU, so the memory used stays that of the largest tensor.
    """
    digest = hashlib.sha256(json.dumps(extra, sort_keys=True, default=str).encode())
    for tensors in tensor_lists:
        for tensor in tensors:
            tensor = tensor.detach().cpu().contiguous()
            digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()[:16]


def alpha_key(alpha: float) -> str:
    """How a sweep record names the point at ``alpha``: the float's shortest exact text, so that a
    grid of 13 alphas finds its points in one of 25 (``k / 12`` is ``2k / 24``, bit for bit)."""
    return repr(float(alpha))


@dataclass
class SweepStore:
    """Finished points of sweeps, persisted atomically after each point.

    The file holds ``{"format": ..., "key": ..., "points": {curve: {alpha: point}}, "clusters": ...}``
    with points named by :func:`alpha_key`, so sweeps of one curve on several grids share them. It is
    only a cache: a file of another sweep (another key) or format is ignored, an unreadable one too
    (with a warning naming it), and its points are evaluated again.
    """

    path: Path | None
    key: str
    points: dict[str, dict[str, dict[str, float]]]
    clusters: dict[str, dict[str, list[dict[str, float]]]] = field(default_factory=dict)
    """Each point's sums per evaluated cluster (``curve -> alpha -> [sums, ...]``), where the
    evaluation recorded them (one process): what :func:`bootstrap_barriers` resamples."""

    #: Version of the file's layout (2: points named by alpha, not by their index in the grid).
    FORMAT = 2

    @classmethod
    def open(cls, path: str | Path | None, key: str) -> SweepStore:
        path = None if path is None else Path(path)
        points, clusters = {}, {}
        if path is not None and path.is_file():
            try:
                saved = json.loads(path.read_text())
            except ValueError as error:  # a truncated or garbled file
                warnings.warn(f"ignoring the unreadable sweep state {path} ({error}); its points are evaluated again")
                saved = None
            if (
                isinstance(saved, dict)
                and saved.get("key") == key
                and saved.get("format") == cls.FORMAT
                and isinstance(saved.get("points"), dict)
            ):
                points = nan_for_null(saved["points"])
                clusters = nan_for_null(saved.get("clusters", {}))
        return cls(path, key, points, clusters)

    def get(self, curve: str, alpha: float) -> dict[str, float] | None:
        return self.points.get(curve, {}).get(alpha_key(alpha))

    def clusters_at(self, curve: str, alpha: float) -> list[dict[str, float]]:
        """The recorded per-cluster sums of the point at ``alpha`` (empty where none were recorded)."""
        return self.clusters.get(curve, {}).get(alpha_key(alpha), [])

    def cluster_sums(self, curve: str, alphas: list[float] | None = None) -> list[list[dict[str, float]]] | None:
        """The per-cluster sums of ``curve``'s points at ``alphas`` (``None``: every recorded point) in
        alpha order, ``None`` unless each of them has them."""
        recorded = self.clusters.get(curve, {})
        keys = sorted(self.points.get(curve, {}), key=float) if alphas is None else [alpha_key(a) for a in alphas]
        if not keys or any(key not in recorded for key in keys):
            return None
        return [recorded[key] for key in keys]

    def put(
        self,
        curve: str,
        alpha: float,
        point: dict[str, float],
        write: bool,
        clusters: list[dict[str, float]] | None = None,
    ) -> None:
        self.points.setdefault(curve, {})[alpha_key(alpha)] = point
        if clusters:
            self.clusters.setdefault(curve, {})[alpha_key(alpha)] = clusters
        if write and self.path is not None:
            atomic_write_json(
                self.path, {"format": self.FORMAT, "key": self.key, "points": self.points, "clusters": self.clusters}
            )


@torch.no_grad()
def sweep(
    model: nn.Module,
    endpoint_a: list[torch.Tensor],
    endpoint_b: list[torch.Tensor],
    evaluate_point: Callable[[list[dict[str, float]]], dict[str, torch.Tensor]],
    alphas: list[float],
    store: SweepStore,
    curve: str,
    write: bool = True,
    progress: Callable[[str], None] | None = None,
    start: tuple[SweepStore, str] | None = None,
) -> list[dict[str, float]]:
    """Evaluate ``curve`` at every alpha, writing ``lerp(a, b, alpha)`` into ``model`` in place.

    Args:
        model: Receives the interpolated weights (its parameters, in ``named_parameters`` order,
            match ``endpoint_a`` and ``endpoint_b``). Left holding ``endpoint_a`` afterwards.
        endpoint_a, endpoint_b: The end points' parameters.
        evaluate_point: The (reduced) metric sums of the current weights, ``count`` included;
            it may append each cluster's sums to the list it is given, which the store then keeps.
        alphas: Interpolation coefficients.
        store: Finished points; those already there are not evaluated again.
        curve: Name of the curve in ``store``.
        write: Whether this process persists the store (rank 0 only).
        progress: Called with a short message after each point.
        start: ``(store, curve)`` of another curve from the same ``endpoint_a``, evaluated the same
            way: its point at alpha 0 is taken instead of evaluating it again (the weights there are
            ``endpoint_a`` bit for bit, since ``lerp(a, b, 0) == a``).

    Returns:
        One ``{"alpha", <metric>: sum / count, ...}`` per alpha.
    """
    parameters = list(model.parameters())
    if not (len(parameters) == len(endpoint_a) == len(endpoint_b)):
        raise ValueError("the end points must list one tensor per model parameter")
    points = []
    try:
        for alpha in alphas:
            point = store.get(curve, alpha)
            if point is None and alpha == 0 and start is not None:
                other, name = start
                if (point := other.get(name, alpha)) is not None:
                    store.put(curve, alpha, point, write, other.clusters_at(name, alpha))
            if point is None:
                for target, a, b in zip(parameters, endpoint_a, endpoint_b):
                    target.copy_(interpolate(a, b, alpha))
                per_cluster: list[dict[str, float]] = []
                sums = {name: float(value) for name, value in evaluate_point(per_cluster).items()}
                point = {"alpha": alpha, **point_metrics(sums)}
                store.put(curve, alpha, point, write, per_cluster)
            points.append(point)
            if progress is not None:
                progress(f"{curve} " + " ".join(f"{name}={value:.4f}" for name, value in point.items()))
    finally:
        for target, a in zip(parameters, endpoint_a):
            target.copy_(a)
    return points
