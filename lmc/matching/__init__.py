"""Weight matching for Transformers (paper Section 5; SPEC section 3).

``align(source, target, scope, method)`` returns a copy of ``source`` that computes the same
function with weights close to ``target``'s, and a report of what each stage did.
"""

from lmc.matching.alignment import METHODS, AlignmentError, AlignmentReport, LayerAlignment, align
from lmc.matching.attention import METRICS
from lmc.matching.options import AlignOptions, Method, Metric

__all__ = [
    "METHODS",
    "METRICS",
    "AlignOptions",
    "AlignmentError",
    "AlignmentReport",
    "LayerAlignment",
    "Method",
    "Metric",
    "align",
]
