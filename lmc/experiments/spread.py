"""The error bar of a study: statistics over pairs of fine-tuned seeds (one pair is no evidence)."""

from __future__ import annotations

import math
import statistics
from typing import Any


def spread(values: list[float]) -> dict[str, float]:
    """Mean, sample standard deviation (0 for one value), min, max and count of the finite ``values``."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return {"mean": math.nan, "std": math.nan, "min": math.nan, "max": math.nan, "count": 0}
    return {
        "mean": statistics.fmean(finite),
        "std": statistics.stdev(finite) if len(finite) > 1 else 0.0,
        "min": min(finite),
        "max": max(finite),
        "count": len(finite),
    }


def cell(stats: dict[str, float] | None, digits: int = 1, unit: str = "", of: int | None = None) -> str:
    """``mean ± std`` of :func:`spread`'s statistics for a table; ``n/a`` without a finite value.

    Args:
        of: The pairs of the table's row: a mean over fewer says how many it counts, ``(k of n)``.
    """
    if not stats or not math.isfinite(stats["mean"]):
        return "n/a" if of is None else f"n/a (0 of {of})"
    counted = "" if of is None or stats["count"] == of else f" ({stats['count']} of {of})"
    return f"{stats['mean']:.{digits}f} ± {stats['std']:.{digits}f}{unit}{counted}"


def curve_alphas_text(alignments: list[dict[str, dict[str, Any]]]) -> str:
    """Which alignments' curves have how many alphas (``protocol.alignment_alphas``), from the
    ``summary["alignments"]`` of runs; empty when all have the same."""
    labels_by_count: dict[int, list[str]] = {}
    for entries in alignments:
        for label, entry in entries.items():
            listed = labels_by_count.setdefault(len(entry["mean_curves"]["aligned"]), [])
            if f"`{label}`" not in listed:
                listed.append(f"`{label}`")
    if len(labels_by_count) < 2:
        return ""
    counts = "; ".join(f"{count} alphas: {', '.join(labels)}" for count, labels in sorted(labels_by_count.items()))
    return f"Curves on {counts} (each ratio against the naive barrier on the curve's own alphas)."
