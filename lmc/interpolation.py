"""Linear interpolation between two models and its barriers (SPEC section 4).

``theta(alpha) = (1 - alpha) theta_A + alpha theta_B`` is evaluated at evenly spaced alphas.
The sweep writes each interpolated point into one model in place (no copy per alpha), keeps
exact sums (loss, correct, count) so that shards of a distributed run reduce exactly, and
records finished points in a resumable file.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lmc.checkpoints import atomic_write_json

#: ``(summed loss, correct, count)`` of one batch.
BatchSums = Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def evenly_spaced(count: int = 25) -> list[float]:
    """``count`` alphas from 0 to 1 inclusive."""
    if count < 2:
        raise ValueError(f"an interpolation needs at least 2 points, got {count}")
    return [k / (count - 1) for k in range(count)]


def barriers(alphas: list[float], losses: list[float], accuracies: list[float]) -> dict[str, float]:
    """The barriers of one curve.

    ``loss_barrier`` and ``accuracy_barrier`` are the paper's (largest gap to the straight line
    between the end points); ``*_barrier_rebasin`` are Git Re-Basin's (largest gap to the mean
    of the end points).
    """
    a = torch.tensor(alphas, dtype=torch.float64)
    loss = torch.tensor(losses, dtype=torch.float64)
    accuracy = torch.tensor(accuracies, dtype=torch.float64)
    loss_line = (1 - a) * loss[0] + a * loss[-1]
    accuracy_line = (1 - a) * accuracy[0] + a * accuracy[-1]
    return {
        "loss_barrier": float((loss - loss_line).max()),
        "accuracy_barrier": float((accuracy_line - accuracy).max()),
        "loss_barrier_rebasin": float(loss.max() - (loss[0] + loss[-1]) / 2),
        "accuracy_barrier_rebasin": float((accuracy[0] + accuracy[-1]) / 2 - accuracy.min()),
    }


@torch.no_grad()
def evaluate(batch_sums: BatchSums, batches: Iterable[dict[str, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """Summed ``(loss, correct, count)`` over ``batches``, float64, shape ``(3,)``."""
    total = torch.zeros(3, dtype=torch.float64, device=device)
    for batch in batches:
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        total += torch.stack(batch_sums(batch))
    return total


def fingerprint(*tensor_lists: list[torch.Tensor], extra: object = None) -> str:
    """A short hash of weights and settings: a resumed sweep must be the same sweep."""
    digest = hashlib.sha256(json.dumps(extra, sort_keys=True, default=str).encode())
    for tensors in tensor_lists:
        for t in tensors:
            digest.update(t.detach().double().sum().cpu().numpy().tobytes())
            digest.update(t.detach().double().pow(2).sum().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


@dataclass
class SweepStore:
    """Finished points of sweeps, persisted atomically after each point.

    The file maps ``curve -> {alpha index: {"alpha", "loss", "accuracy"}}`` and carries the
    fingerprint of the sweep; a file from another sweep is ignored.
    """

    path: Path | None
    key: str
    points: dict[str, dict[str, dict[str, float]]]

    @classmethod
    def open(cls, path: str | Path | None, key: str) -> SweepStore:
        points = {}
        if path is not None and Path(path).is_file():
            saved = json.loads(Path(path).read_text())
            if saved.get("fingerprint") == key:
                points = saved["points"]
        return cls(None if path is None else Path(path), key, points)

    def get(self, curve: str, index: int) -> dict[str, float] | None:
        return self.points.get(curve, {}).get(str(index))

    def put(self, curve: str, index: int, point: dict[str, float], write: bool) -> None:
        self.points.setdefault(curve, {})[str(index)] = point
        if write and self.path is not None:
            atomic_write_json(self.path, {"fingerprint": self.key, "points": self.points})


@torch.no_grad()
def sweep(
    model: nn.Module,
    endpoint_a: list[torch.Tensor],
    endpoint_b: list[torch.Tensor],
    evaluate_point: Callable[[], torch.Tensor],
    alphas: list[float],
    store: SweepStore,
    curve: str,
    write: bool = True,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, float]]:
    """Evaluate ``curve`` at every alpha, writing ``lerp(a, b, alpha)`` into ``model`` in place.

    Args:
        model: Receives the interpolated weights (its parameters, in ``named_parameters`` order,
            match ``endpoint_a`` and ``endpoint_b``). Left holding ``endpoint_a`` afterwards.
        endpoint_a, endpoint_b: The end points' parameters.
        evaluate_point: Returns the (reduced) ``(loss, correct, count)`` sums of the current weights.
        alphas: Interpolation coefficients.
        store: Finished points; those already there are not evaluated again.
        curve: Name of the curve in ``store``.
        write: Whether this process persists the store (rank 0 only).
        progress: Called with a short message after each point.

    Returns:
        One ``{"alpha", "loss", "accuracy"}`` per alpha.
    """
    parameters = list(model.parameters())
    if not (len(parameters) == len(endpoint_a) == len(endpoint_b)):
        raise ValueError("the end points must list one tensor per model parameter")
    points = []
    try:
        for index, alpha in enumerate(alphas):
            point = store.get(curve, index)
            if point is None:
                for target, a, b in zip(parameters, endpoint_a, endpoint_b):
                    target.copy_(torch.lerp(a, b, alpha))
                loss_sum, correct, count = evaluate_point().tolist()
                point = {"alpha": alpha, "loss": loss_sum / count, "accuracy": correct / count}
                store.put(curve, index, point, write)
            points.append(point)
            if progress is not None:
                progress(f"{curve} alpha={alpha:.3f} loss={point['loss']:.4f} acc={point['accuracy']:.4f}")
    finally:
        for target, a in zip(parameters, endpoint_a):
            target.copy_(a)
    return points
