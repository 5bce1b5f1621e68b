"""Linear mode connectivity between two models, naive and aligned (docs/spec.md, section 4).

- :mod:`~lmc.connectivity.interpolation`: the interpolated points, their barriers, resumable sweeps;
- :mod:`~lmc.connectivity.measure`: align, then sweep both curves (:func:`measure_connectivity`);
- :mod:`~lmc.connectivity.results`: results files, TensorBoard scalars and figures of a sweep;
- :mod:`~lmc.connectivity.robustness`: end points and midpoints under input corruptions.

Shared by the ``AlignAndInterpolate`` callback, ``lmc interpolate`` and ``lmc run``.
"""

from lmc.connectivity.measure import (
    BARRIERS,
    CALIBRATION_SPLIT,
    CURVE_SPLITS,
    CURVES,
    CurveSplit,
    Evaluation,
    SweepHooks,
    barrier_ratios,
    check_curve_split,
    data_identity,
    measure_connectivity,
    sweep_settings,
    training_calibration,
    with_perplexity,
)
from lmc.connectivity.results import (
    RESULT_FILES,
    STALE_FOLDER,
    curve_figure,
    log_to_tensorboard,
    results_key,
    retire_stale_results,
    run_record,
    write_results,
)

__all__ = [
    "BARRIERS",
    "CALIBRATION_SPLIT",
    "CURVES",
    "CURVE_SPLITS",
    "CurveSplit",
    "Evaluation",
    "RESULT_FILES",
    "STALE_FOLDER",
    "SweepHooks",
    "barrier_ratios",
    "check_curve_split",
    "curve_figure",
    "data_identity",
    "log_to_tensorboard",
    "measure_connectivity",
    "results_key",
    "retire_stale_results",
    "run_record",
    "sweep_settings",
    "training_calibration",
    "with_perplexity",
    "write_results",
]
