"""Measure linear mode connectivity between a model and a reference, naive and aligned.

Shared by the ``AlignAndInterpolate`` callback, ``lmc interpolate`` and the main job.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmc.checkpoints import atomic_write, atomic_write_json, atomic_write_text
from lmc.interpolation import SweepStore, barriers, fingerprint, sweep
from lmc.matching import align

CURVES = ("naive", "aligned")
BARRIERS = ("loss_barrier", "accuracy_barrier", "loss_barrier_rebasin", "accuracy_barrier_rebasin")


def measure_connectivity(
    model: nn.Module,
    reference: nn.Module,
    evaluate_point: Callable[[], torch.Tensor],
    alphas: list[float],
    scope: str,
    method: str = "full",
    metric: str = "invariant",
    state_path: Path | None = None,
    write: bool = True,
    synchronize: Callable[[], None] = lambda: None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Align ``reference`` to ``model``, then sweep the naive and the aligned interpolation.

    Args:
        model: End point A; receives the interpolated weights during the sweep and ends with its own.
        reference: End point B before alignment (never modified).
        evaluate_point: ``(loss, correct, count)`` sums of ``model``'s current weights (reduced
            over processes when distributed).
        alphas: Interpolation coefficients.
        scope, method, metric: Passed to :func:`lmc.matching.align`.
        state_path: Resumable record of finished points (``None``: not persisted).
        write: Whether this process writes ``state_path`` (rank 0).
        synchronize: A barrier between processes (after every rank has read the state).
        progress: Called with a short message after each point.

    Returns:
        ``{"curves": {curve: {"points": [...], <barriers>}}, "barrier_ratio": {...}, "alignment": {...}}``.
    """
    aligned, report = align(reference, model, scope=scope, method=method, metric=metric)
    endpoint_a = [p.detach().clone() for p in model.parameters()]
    endpoints = {"naive": list(reference.parameters()), "aligned": list(aligned.parameters())}
    key = fingerprint(endpoint_a, endpoints["naive"], extra=[scope, method, metric, alphas])
    store = SweepStore.open(state_path, key)
    synchronize()
    curves = {}
    for curve in CURVES:
        points = sweep(model, endpoint_a, endpoints[curve], evaluate_point, alphas, store, curve, write, progress)
        curves[curve] = {
            "points": points,
            **barriers(alphas, [p["loss"] for p in points], [p["accuracy"] for p in points]),
        }
    return {"curves": curves, "barrier_ratio": barrier_ratios(curves), "alignment": report.to_dict()}


def barrier_ratios(curves: dict[str, Any]) -> dict[str, float]:
    """Aligned barrier as a percentage of the naive one (SPEC section 4); NaN without a naive barrier."""
    ratios = {}
    for name in ("loss_barrier", "accuracy_barrier"):
        naive = curves["naive"][name]
        ratios[name] = 100.0 * curves["aligned"][name] / naive if naive > 0 else float("nan")
    return ratios


def curve_figure(curves: dict[str, Any], title: str):
    """Naive vs aligned loss and accuracy against alpha (a matplotlib figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (loss_axis, accuracy_axis) = plt.subplots(1, 2, figsize=(9, 3.5))
    for curve, data in curves.items():
        alphas = [p["alpha"] for p in data["points"]]
        loss_axis.plot(alphas, [p["loss"] for p in data["points"]], marker=".", label=curve)
        accuracy_axis.plot(alphas, [p["accuracy"] for p in data["points"]], marker=".", label=curve)
    loss_axis.set(xlabel="alpha", ylabel="loss", title=title)
    accuracy_axis.set(xlabel="alpha", ylabel="accuracy")
    loss_axis.legend()
    figure.tight_layout()
    return figure


def write_results(folder: Path, results: dict[str, Any]) -> None:
    """``lmc_results.json``, ``lmc_results.csv`` and one ``lmc_interpolation_<i>.png`` per reference, atomically.

    ``results["references"]`` maps a reference name to :func:`measure_connectivity`'s output.
    """
    import matplotlib.pyplot as plt

    folder = Path(folder)
    atomic_write_json(folder / "lmc_results.json", results)
    rows = io.StringIO()
    writer = csv.writer(rows)
    writer.writerow(["reference", "curve", "alpha", "loss", "accuracy"])
    for name, result in results["references"].items():
        for curve, data in result["curves"].items():
            for point in data["points"]:
                writer.writerow(
                    [name, curve, f"{point['alpha']:.6f}", f"{point['loss']:.8f}", f"{point['accuracy']:.8f}"]
                )
    atomic_write_text(folder / "lmc_results.csv", rows.getvalue())
    for index, (name, result) in enumerate(results["references"].items()):
        figure = curve_figure(result["curves"], Path(name).name)
        atomic_write(folder / f"lmc_interpolation_{index}.png", lambda p: figure.savefig(p, format="png", dpi=100))
        plt.close(figure)
