"""Stand-in for the alignment options contract (replaced at merge by the matching helper's version)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Method = Literal["naive", "permutation", "orthogonal", "full"]
Metric = Literal["invariant", "weight", "correlation"]


@dataclass(frozen=True)
class AlignOptions:
    """Every setting of :func:`lmc.matching.align` (see its docstring for their meaning)."""

    method: Method = "full"
    metric: Metric = "invariant"
    steps: int = 30
    lr: float = 1.0
    tolerance: float = 1e-12
    max_iterations: int = 20
    check_rtol: float | None = None
    probe_batch_size: int = 2
    seed: int = 0
    share_frozen: bool = True
