"""What the study's statistics say about the paper's findings (docs/results.md's verdicts), with the
same burden of proof both ways: a mean over pairs is under a threshold only where its confidence
interval lies under it, over it only where the interval lies over it, and unresolved otherwise."""

from __future__ import annotations

import math

from lmc.experiments.stats.spread import Spread
from lmc.experiments.stats.table1 import OrderStats

#: The paper's Table 1 finding (rank near 1, ``L_hat`` near 0) as this study checks it, against the
#: evaluation noise: Stage 1's mean rank within the noise and its mean ``L_hat`` (%) under these
#: (:func:`finding_verdict`).
PAPER_FINDING = {"rank_within_noise": 2.0, "l_hat": 10.0}
#: The confidence of the interval over pairs behind a :func:`bounded_verdict` (two-sided: each bound
#: is crossed by chance in half the rest).
CONFIDENCE = 0.95


def confidence_bounds(stats: Spread, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Student's t interval of a mean over pairs: ``mean ± t · std / sqrt(count)`` with ``t`` the
    ``(1 + confidence) / 2`` quantile at ``count - 1`` degrees of freedom; ``(nan, nan)`` for fewer
    than 2 pairs (one pair is no evidence either way)."""
    if stats.count < 2 or not math.isfinite(stats.mean):
        return math.nan, math.nan
    from scipy.stats import t

    half = float(t.ppf((1.0 + confidence) / 2.0, stats.count - 1)) * stats.standard_error
    return stats.mean - half, stats.mean + half


def bounded_verdict(stats: Spread | None, threshold: float) -> str:
    """Whether a mean over pairs is under ``threshold`` with the same burden of proof both ways:
    ``met`` where the interval's upper bound (:func:`confidence_bounds`) is under it, ``missed``
    where its lower bound is over it, ``unresolved`` otherwise (the interval holds the threshold,
    fewer than 2 pairs, or nothing measured)."""
    low, high = confidence_bounds(stats) if stats is not None else (math.nan, math.nan)
    if high < threshold:
        return "met"
    return "missed" if low > threshold else "unresolved"


def finding_verdict(loss: OrderStats) -> dict[str, str]:
    """The paper's Table 1 finding (:data:`PAPER_FINDING`) for a Stage 1 setting's loss-barrier
    statistics, each measure's :func:`bounded_verdict` and the finding's own under ``"finding"``:
    ``met`` where every measure is met, ``missed`` where one is missed, ``unresolved`` otherwise."""
    measures = {name: bounded_verdict(getattr(loss, name), limit) for name, limit in PAPER_FINDING.items()}
    verdicts = set(measures.values())
    finding = "met" if verdicts == {"met"} else "missed" if "missed" in verdicts else "unresolved"
    return {**measures, "finding": finding}


def counts_as_evidence(setting: str, family: str, picked_on: dict[str, str]) -> bool:
    """Whether a Stage 1 setting's verdict on ``family`` is evidence: not where the setting was
    picked (``picked_on``: setting -> the family it was chosen on; a setting fixed before the
    study, like the paper's ``invariant``, is evidence on every family)."""
    return picked_on.get(setting) != family


def held_out_comparison(loss: OrderStats) -> str:
    """How a Stage 1 setting's order compares with the held-out pick on halves of the evaluated
    samples, with the same burden of proof both ways (:func:`bounded_verdict` of their paired ``L_hat``
    differences against 0): ``held_out_better`` where the interval lies above 0, ``stage1_better``
    where it lies below, ``not_told_apart`` otherwise, ``unmeasured`` without halves."""
    if loss.halves is None:
        return "unmeasured"
    verdict = bounded_verdict(loss.halves.l_hat.difference, 0.0)
    return {"met": "stage1_better", "missed": "held_out_better", "unresolved": "not_told_apart"}[verdict]
