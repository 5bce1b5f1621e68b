"""Linear mode connectivity between two models, naive and aligned (docs/spec.md, section 4).

- :mod:`~lmc.connectivity.interpolation`: the interpolated points, their barriers, resumable sweeps;
- :mod:`~lmc.connectivity.measure`: align, then sweep both curves (:func:`measure_connectivity`);
- :mod:`~lmc.connectivity.results`: results files, TensorBoard scalars and figures of a sweep, and
  :func:`sweep_and_write`, the whole pipeline (record, sweep each reference, write, log);
- :mod:`~lmc.connectivity.robustness`: end points and midpoints under input corruptions.

Shared by the ``AlignAndInterpolate`` callback, ``lmc interpolate`` and ``lmc run`` (each through
:func:`sweep_and_write`).
"""

from lmc.connectivity.measure import (
    BARRIERS,
    CALIBRATION_SPLIT,
    CURVES,
    NO_BARRIER,
    Evaluation,
    SweepHooks,
    barrier_ratios,
    data_identity,
    keyed_data_settings,
    measure_connectivity,
    sweep_settings,
    training_calibration,
    with_perplexity,
)
from lmc.connectivity.results import (
    RESULT_FILES,
    STALE_FOLDER,
    OtherResultsError,
    ResultsOutput,
    curve_figure,
    log_to_tensorboard,
    results_key,
    retire_stale_results,
    run_record,
    sweep_and_write,
    write_results,
)
from lmc.tasks import CURVE_SPLITS, CurveSplit, check_curve_split

__all__ = [
    "BARRIERS",
    "CALIBRATION_SPLIT",
    "CURVES",
    "CURVE_SPLITS",
    "NO_BARRIER",
    "CurveSplit",
    "Evaluation",
    "OtherResultsError",
    "RESULT_FILES",
    "ResultsOutput",
    "STALE_FOLDER",
    "SweepHooks",
    "barrier_ratios",
    "check_curve_split",
    "curve_figure",
    "data_identity",
    "keyed_data_settings",
    "log_to_tensorboard",
    "measure_connectivity",
    "results_key",
    "retire_stale_results",
    "run_record",
    "sweep_and_write",
    "sweep_settings",
    "training_calibration",
    "with_perplexity",
    "write_results",
]
