"""What the study's statistics say about the paper's findings (docs/results.md's verdicts)."""

from __future__ import annotations

import math

from lmc.experiments.stats.table1 import OrderStats

#: The paper's Table 1 finding (rank near 1, ``L_hat`` near 0) as this study checks it, against the
#: evaluation noise: Stage 1's mean rank within the noise and its mean ``L_hat`` (%) at most these.
PAPER_FINDING = {"rank_within_noise": 2.0, "l_hat": 10.0}
#: A difference of means over pairs is told apart from 0 beyond this many standard errors.
STANDARD_ERRORS = 2.0


def held_out_verdict(loss: OrderStats) -> str:
    """What a Stage 1 setting's loss-barrier statistics say about the paper's finding: ``met``
    (:data:`PAPER_FINDING`); else ``missed`` where its order's ``L_hat`` on halves of the evaluated
    samples exceeds the held-out pick's by more than :data:`STANDARD_ERRORS` standard errors over
    pairs; else ``unresolved`` where the held-out pick's own ``L_hat`` exceeds the finding's too, and
    ``inconclusive`` where it does not (``unmeasured``: no held-out measure of 2 pairs or more)."""
    within = loss.rank_within_noise.mean if loss.rank_within_noise else math.nan
    if within <= PAPER_FINDING["rank_within_noise"] and loss.l_hat.mean <= PAPER_FINDING["l_hat"]:
        return "met"
    if loss.halves is None or loss.halves.l_hat.difference.count < 2:
        return "unmeasured"
    halves = loss.halves.l_hat
    if halves.difference.mean > STANDARD_ERRORS * halves.difference.standard_error:
        return "missed"
    return "unresolved" if halves.held_out.mean > PAPER_FINDING["l_hat"] else "inconclusive"
