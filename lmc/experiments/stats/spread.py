"""The error bar of a study: statistics over pairs of fine-tuned seeds (one pair is no evidence)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from lmc.experiments.stats.records import Record, to_json


@dataclass(frozen=True)
class Spread(Record):
    """Mean, sample standard deviation (0 for one value), min, max and count of finite values over pairs."""

    mean: float
    std: float
    min: float
    max: float
    count: int

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        """The spread of the finite ``values`` (NaN statistics and count 0 without any)."""
        finite = [v for v in values if math.isfinite(v)]
        if not finite:
            return cls(math.nan, math.nan, math.nan, math.nan, 0)
        deviation = statistics.stdev(finite) if len(finite) > 1 else 0.0
        return cls(statistics.fmean(finite), deviation, min(finite), max(finite), len(finite))

    @property
    def standard_error(self) -> float:
        """The standard error of the mean (NaN for fewer than 2 values)."""
        return self.std / math.sqrt(self.count) if self.count > 1 else math.nan


def spread(values: list[float]) -> dict[str, Any]:
    """:meth:`Spread.of` the finite ``values`` as ``summary.json`` holds it: mean, sample standard
    deviation (0 for one value), min, max and count."""
    return to_json(Spread.of(values))
