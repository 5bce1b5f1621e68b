"""Results of connectivity sweeps: files written atomically, TensorBoard scalars and figures, run identity.

A results folder belongs to one run (:func:`run_record`'s key); results of another run are moved
aside (:func:`retire_stale_results`) before anything is written. :func:`sweep_and_write` is the
whole pipeline (record the run, sweep each reference, write and log the results) that the
``AlignAndInterpolate`` callback, ``lmc interpolate`` and ``lmc run`` share.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import logging
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from torch import nn

from lmc.connectivity.interpolation import BARRIER_METRICS, fingerprint
from lmc.connectivity.measure import (
    BARRIERS,
    Evaluation,
    SweepHooks,
    measure_connectivity,
    sweep_settings,
    with_perplexity,
)
from lmc.io import atomic_write, atomic_write_json, atomic_write_text
from lmc.matching import AlignmentReport, AlignOptions, Calibration

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


class OtherResultsError(ValueError):
    """A results folder holds the results of another run, which the caller asked not to replace."""


@dataclass(frozen=True)
class ResultsOutput:
    """Where :func:`sweep_and_write` puts a run's results, and what else it does with them.

    Attributes:
        folder: The results folder: :data:`RESULT_FILES` and each reference's resumable sweep
            state ``lmc_sweep_state_<i>.json``.
        checkpoint: The model's checkpoint, recorded in the run's identity (``None``: none saved).
        other_results: What happens to results of another run found in ``folder`` before the
            sweeps: ``"retire"`` moves them to ``stale/`` (:func:`retire_stale_results`),
            ``"refuse"`` raises :class:`OtherResultsError`, ``"replace"`` writes over them.
        figures: Also write each reference's figure ``lmc_interpolation_<i>.png``.
        perplexity: Add each point's ``perplexity = exp(loss)`` (language models; :func:`with_perplexity`).
        tensorboard: Also log the results as TensorBoard scalars (:func:`log_to_tensorboard`): into
            this ``SummaryWriter`` (a TensorBoard logger's ``experiment``), or into this folder,
            written anew (a rerun does not stack copies); ``None``: not logged.
        progress: Description of a progress bar over every point (``None``: no bar).
        timed: Record the seconds the sweeps took as ``results["seconds"]``.
    """

    folder: Path
    checkpoint: str | None = None
    other_results: Literal["retire", "refuse", "replace"] = "retire"
    figures: bool = True
    perplexity: bool = False
    tensorboard: Any = None
    progress: str | None = None
    timed: bool = False


def sweep_and_write(
    output: ResultsOutput,
    model: nn.Module,
    references: Mapping[Path, Callable[[], nn.Module]],
    scope: str,
    options: AlignOptions,
    alphas: list[float],
    evaluation: Evaluation,
    hooks: SweepHooks = SweepHooks(),
    calibration: Calibration | None = None,
    alignment: tuple[nn.Module, AlignmentReport] | None = None,
) -> dict[str, Any]:
    """Record the run, measure ``model``'s connectivity to each reference, then write and log the results.

    The run's identity (:func:`run_record`) is fixed before any sweep, so that results of another
    run are dealt with (``output.other_results``) before anything is computed; then each
    reference is aligned and swept (:func:`~lmc.connectivity.measure_connectivity`), resuming from
    its sweep state, and this process writes the results when ``hooks.write``.

    Args:
        output: Where the results go and what else is done with them.
        model: End point A (see :func:`~lmc.connectivity.measure_connectivity`).
        references: Each reference's checkpoint -> a function giving its model (called when its
            sweep starts, so that one reference is held at a time), in the order they are swept.
        scope, options, alphas, evaluation, calibration: As for
            :func:`~lmc.connectivity.measure_connectivity`.
        hooks: The processes' coordination (``write``, ``barrier``) and the shared naive state;
            each reference's ``state_path`` and ``progress`` are set here.
        alignment: The alignment of the only reference, when the caller already has it.

    Returns:
        ``{"run": run_record(...), "references": {str(checkpoint): measure_connectivity's output}}``
        (and ``"seconds"`` when ``output.timed``), on every process.

    Raises:
        OtherResultsError: ``output.other_results`` is ``"refuse"`` and ``output.folder`` holds
            results of another run.
    """
    from tqdm.auto import tqdm

    if alignment is not None and len(references) != 1:
        raise ValueError(f"an alignment is the alignment of one reference, but {len(references)} were given")
    started = time.perf_counter()
    folder = Path(output.folder)
    settings = sweep_settings(scope, options, alphas, evaluation, calibration)
    results: dict[str, Any] = {"run": run_record(model, output.checkpoint, list(references), settings)}
    key = results["run"]["key"]
    if output.other_results == "refuse" and results_key(folder) not in (None, key):
        raise OtherResultsError(f"{folder} holds the results of another run")
    if output.other_results == "retire" and hooks.write:
        retire_stale_results(folder, key)
    results["references"] = {}
    shown = output.progress is not None and hooks.write
    with tqdm(total=2 * len(alphas) * len(references), desc=output.progress, disable=not shown) as bar:
        for index, (path, reference) in enumerate(references.items()):
            state = folder / f"lmc_sweep_state_{index}.json"
            its_hooks = dataclasses.replace(hooks, state_path=state, progress=lambda message: bar.update(1))
            result = measure_connectivity(
                model, reference(), scope, options, alphas, evaluation, its_hooks, calibration, alignment
            )
            results["references"][str(path)] = with_perplexity(result) if output.perplexity else result
    if output.timed:
        results["seconds"] = time.perf_counter() - started
    if hooks.write:
        write_results(folder, results, output.figures)
        if output.tensorboard is not None:
            _log(output.tensorboard, results)
    return results


def _log(tensorboard: Any, results: dict[str, Any]) -> None:
    """:func:`log_to_tensorboard` into a ``SummaryWriter``, or into a folder written anew."""
    if not isinstance(tensorboard, str | Path):
        log_to_tensorboard(tensorboard, results)
        return
    from torch.utils.tensorboard import SummaryWriter

    shutil.rmtree(tensorboard, ignore_errors=True)
    writer = SummaryWriter(str(tensorboard))
    try:
        log_to_tensorboard(writer, results)
    finally:
        writer.close()
