"""Verdicts with a symmetric burden of proof (issue 48): met, missed or unresolved from synthetic pair values."""

from __future__ import annotations

import math
import statistics

import pytest

from lmc.experiments.stats.spread import Spread
from lmc.experiments.stats.table1 import OrderStats
from lmc.experiments.stats.verdicts import (
    PAPER_FINDING,
    bounded_verdict,
    confidence_bounds,
    counts_as_evidence,
    finding_verdict,
)


def _stage1(ranks_within_noise: list[float], l_hats: list[float]) -> OrderStats:
    return OrderStats(rank_within_noise=Spread.of(ranks_within_noise), l_hat=Spread.of(l_hats))


def test_the_bounds_are_students_t_interval_of_the_mean_over_pairs():
    # Three pairs: 2 degrees of freedom, whose quantile has a closed form, t_p = (2p - 1) sqrt(2 / (4p (1 - p))).
    values = [1.0, 2.0, 6.0]
    p = 0.975
    t = (2 * p - 1) * math.sqrt(2 / (4 * p * (1 - p)))
    half = t * statistics.stdev(values) / math.sqrt(3)
    low, high = confidence_bounds(Spread.of(values))
    assert low == pytest.approx(3.0 - half, abs=1e-12) and high == pytest.approx(3.0 + half, abs=1e-12)
    assert all(math.isnan(bound) for bound in confidence_bounds(Spread.of([1.0])))  # one pair: no interval


def test_a_finding_is_met_only_when_every_upper_bound_is_under_its_threshold():
    verdict = finding_verdict(_stage1([1, 1, 2, 1, 1], [1.0, 2.0, 3.0, 2.0, 1.0]))
    assert verdict == {"rank_within_noise": "met", "l_hat": "met", "finding": "met"}
    # The same means over two pairs: the interval is too wide to claim it.
    assert finding_verdict(_stage1([1, 1.4], [1.0, 2.6]))["finding"] == "unresolved"


def test_a_finding_is_missed_only_when_a_lower_bound_is_over_its_threshold():
    verdict = finding_verdict(_stage1([1, 1, 2, 1, 1], [30.0, 35.0, 40.0, 32.0, 38.0]))
    assert verdict == {"rank_within_noise": "met", "l_hat": "missed", "finding": "missed"}
    assert bounded_verdict(Spread.of([30.0, 35.0, 40.0, 32.0, 38.0]), 40.0) != "missed"  # its mean is not over 40


def test_a_finding_whose_interval_holds_the_threshold_is_unresolved_whichever_side_its_mean_is_on():
    below = [2.0, 18.0, 5.0, 15.0, 9.0]  # mean 9.8: under 10 %, as a mean alone would have called it met
    above = [4.0, 20.0, 7.0, 17.0, 11.0]  # mean 11.8: over 10 %, as a mean alone would have called it missed
    assert statistics.fmean(below) < PAPER_FINDING["l_hat"] < statistics.fmean(above)
    for l_hats in (below, above):
        assert finding_verdict(_stage1([1, 1, 1, 1, 1], l_hats)) == {
            "rank_within_noise": "met",
            "l_hat": "unresolved",
            "finding": "unresolved",
        }
    assert bounded_verdict(None, 10.0) == bounded_verdict(Spread.of([math.nan]), 10.0) == "unresolved"


def test_a_stage1_setting_picked_on_a_family_is_evidence_only_on_the_others():
    picked_on = {"metric=midpoint-calibration_batches=all": "mnist_vit_ape"}
    assert not counts_as_evidence("metric=midpoint-calibration_batches=all", "mnist_vit_ape", picked_on)
    assert counts_as_evidence("metric=midpoint-calibration_batches=all", "gpt2_ape", picked_on)
    assert counts_as_evidence("invariant", "mnist_vit_ape", picked_on)  # fixed before the study
