"""Weight matching for Transformers (paper Section 5; SPEC section 3).

``align(source, target, scope, AlignOptions(...))`` returns a copy of ``source`` that computes
the same function with weights close to ``target``'s, and a report of what each stage did.
"""

from lmc.matching.alignment import PROBE_RTOL, AlignmentError, AlignmentReport, LayerAlignment, align
from lmc.matching.calibration import Calibration
from lmc.matching.options import METHODS, METRICS, AlignOptions, Method, Metric

__all__ = [
    "METHODS",
    "METRICS",
    "PROBE_RTOL",
    "AlignOptions",
    "AlignmentError",
    "AlignmentReport",
    "Calibration",
    "LayerAlignment",
    "Method",
    "Metric",
    "align",
]
