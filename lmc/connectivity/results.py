"""Results of connectivity sweeps: files written atomically, TensorBoard scalars and figures, run identity.

A results folder belongs to one run (:func:`run_record`'s key); results of another run are moved
aside (:func:`retire_stale_results`) before anything is written.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import time
from pathlib import Path
from typing import Any

from torch import nn

from lmc.connectivity.interpolation import BARRIER_METRICS, fingerprint
from lmc.connectivity.measure import BARRIERS
from lmc.io import atomic_write, atomic_write_json, atomic_write_text

log = logging.getLogger(__name__)


#: The files :func:`write_results` writes (glob patterns), moved aside by :func:`retire_stale_results`.
RESULT_FILES = ("lmc_results.json", "lmc_results.csv", "lmc_interpolation_*.png")


STALE_FOLDER = "stale"


def log_to_tensorboard(experiment, results: dict[str, Any]) -> None:
    """Curves (step ``= 1000 * alpha``), barriers, barrier ratios and figures of :func:`write_results`'s
    ``results`` as TensorBoard scalars under ``lmc/reference_<i>/``.

    Args:
        experiment: A ``torch.utils.tensorboard.SummaryWriter`` (a TensorBoard logger's ``experiment``).
        results: ``{"references": {name: measure_connectivity's output}, ...}``.
    """
    for index, (path, result) in enumerate(results["references"].items()):
        tag = f"lmc/reference_{index}"
        for curve, data in result["curves"].items():
            for point in data["points"]:
                step = round(1000 * point["alpha"])
                for metric, value in point.items():
                    if metric != "alpha":
                        experiment.add_scalar(f"{tag}/{curve}/{metric}", value, step)
            for name in BARRIERS:
                experiment.add_scalar(f"{tag}/{curve}/{name}", data[name], 0)
        for name, value in result["barrier_ratio"].items():
            experiment.add_scalar(f"{tag}/barrier_ratio/{name}", value, 0)
        experiment.add_figure(f"{tag}/interpolation", curve_figure(result["curves"], Path(path).name), 0)
    experiment.flush()


def curve_figure(curves: dict[str, Any], title: str):
    """Naive vs aligned loss and accuracy against alpha (a matplotlib figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(BARRIER_METRICS), figsize=(9, 3.5))
    for curve, data in curves.items():
        alphas = [p["alpha"] for p in data["points"]]
        for axis, metric in zip(axes, BARRIER_METRICS):
            axis.plot(alphas, [p[metric] for p in data["points"]], marker=".", label=curve)
    for axis, metric in zip(axes, BARRIER_METRICS):
        axis.set(xlabel="alpha", ylabel=metric)
    axes[0].set(title=title)
    axes[0].legend()
    figure.tight_layout()
    return figure


def run_record(model: nn.Module, checkpoint: str | None, references: list[Path], settings: dict[str, Any]) -> dict:
    """The identity of a run's results: the model's checkpoint and fingerprint, the references, the settings.

    ``key`` changes with the model's weights, the settings and any reference file (its path,
    size or modification time); the references' weights are fingerprinted by each sweep.
    """
    record = {
        "model": {"checkpoint": checkpoint, "fingerprint": fingerprint(model.parameters())},
        "references": {str(p): {"bytes": p.stat().st_size, "modified_ns": p.stat().st_mtime_ns} for p in references},
        "settings": settings,
    }
    return {"key": fingerprint(extra=record), **record, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def results_key(folder: Path) -> str | None:
    """The run key of the results in ``folder`` (``None``: none, unreadable, or written before keys existed)."""
    path = Path(folder) / RESULT_FILES[0]
    try:
        return json.loads(path.read_text())["run"]["key"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def retire_stale_results(folder: Path, key: str) -> list[Path]:
    """Move results of another run out of ``folder`` into ``folder/stale/``, before this run writes anything.

    Results are another run's when ``lmc_results.json`` carries another key, or is missing
    beside other results files. Older files in ``stale/`` are replaced; sweep states stay (each
    is reused only by its own sweep). Logs one line when something moved.

    Returns:
        The moved files, at their new place.
    """
    folder = Path(folder)
    found = sorted(p for pattern in RESULT_FILES for p in folder.glob(pattern))
    if not found or results_key(folder) == key:
        return []
    stale = folder / STALE_FOLDER
    for old in (p for pattern in RESULT_FILES for p in stale.glob(pattern)):
        old.unlink()
    stale.mkdir(exist_ok=True)
    moved = [p.replace(stale / p.name) for p in found]
    log.warning(f"moved {len(moved)} results file(s) of another run from {folder} to {stale}")
    return moved


def write_results(folder: Path, results: dict[str, Any], figures: bool = True) -> None:
    """``lmc_results.json``, ``lmc_results.csv`` and one ``lmc_interpolation_<i>.png`` per reference, atomically.

    ``results["references"]`` maps a reference name to :func:`measure_connectivity`'s output;
    ``results["run"]`` (:func:`run_record`) says which run they belong to. The CSV has one
    column per metric of the points. ``figures=False`` leaves out the PNGs (about a second each),
    for the many sweeps of a study that only enter its summary.
    """
    import matplotlib.pyplot as plt

    folder = Path(folder)
    atomic_write_json(folder / RESULT_FILES[0], results)
    rows = io.StringIO()
    writer = csv.writer(rows)
    metrics = None
    for name, result in results["references"].items():
        for curve, data in result["curves"].items():
            for point in data["points"]:
                if metrics is None:
                    metrics = list(point)
                    writer.writerow(["reference", "curve", *metrics])
                writer.writerow([name, curve, *(f"{point[m]:.8f}" for m in metrics)])
    atomic_write_text(folder / RESULT_FILES[1], rows.getvalue())
    for index, (name, result) in enumerate(results["references"].items() if figures else []):
        figure = curve_figure(result["curves"], Path(name).name)
        atomic_write(folder / f"lmc_interpolation_{index}.png", lambda p: figure.savefig(p, format="png", dpi=100))
        plt.close(figure)
