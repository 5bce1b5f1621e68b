"""Table cells of the reports: a spread over pairs as ``mean ± std``, the alphas of the curves."""

from __future__ import annotations

import math

from lmc.experiments.stats.spread import Spread
from lmc.experiments.stats.summary import AlignmentSummary


def cell(stats: Spread | dict[str, float] | None, digits: int = 1, unit: str = "", of: int | None = None) -> str:
    """``mean ± std`` of a :class:`~lmc.experiments.stats.spread.Spread` (or its ``summary.json``
    object) for a table; ``n/a`` without a finite value.

    Args:
        of: The pairs of the table's row: a mean over fewer says how many it counts, ``(k of n)``.
    """
    if isinstance(stats, dict):
        stats = Spread.from_json(stats) if stats else None
    if stats is None or not math.isfinite(stats.mean):
        return "n/a" if of is None else f"n/a (0 of {of})"
    counted = "" if of is None or stats.count == of else f" ({stats.count} of {of})"
    return f"{stats.mean:.{digits}f} ± {stats.std:.{digits}f}{unit}{counted}"


def curve_alphas_text(alignments: list[dict[str, AlignmentSummary]]) -> str:
    """Which alignments' curves have how many alphas (``protocol.alignment_alphas``), from the
    alignments of runs (:func:`~lmc.experiments.stats.summary.alignments_of`); empty when all have the same."""
    labels_by_count: dict[int, list[str]] = {}
    for entries in alignments:
        for label, entry in entries.items():
            listed = labels_by_count.setdefault(len(entry.mean_curves["aligned"]), [])
            if f"`{label}`" not in listed:
                listed.append(f"`{label}`")
    if len(labels_by_count) < 2:
        return ""
    counts = "; ".join(f"{count} alphas: {', '.join(labels)}" for count, labels in sorted(labels_by_count.items()))
    return f"Curves on {counts} (each ratio against the naive barrier on the curve's own alphas)."
