"""Weight matching for Transformers (paper Section 5; docs/spec.md, section 3).

``align(source, target, scope, AlignOptions(...))`` returns a copy of ``source`` that computes
the same function with weights close to ``target``'s, and a report of what each stage did.
``equivalent(a, b, scope)`` says whether two models compute the same function up to the group;
``align_many(models, scope)`` brings k models into one frame.
"""

from lmc.matching.alignment import align
from lmc.matching.calibration import Calibration
from lmc.matching.equivalence import EQUIVALENCE_RTOL, Equivalence, EquivalenceTolerance, equivalent
from lmc.matching.many import ManyAlignment, align_many
from lmc.matching.options import METHODS, METRICS, AlignOptions, Method, Metric
from lmc.matching.results import PROBE_RTOL, AlignmentError, AlignmentReport, LayerAlignment

__all__ = [
    "EQUIVALENCE_RTOL",
    "METHODS",
    "METRICS",
    "PROBE_RTOL",
    "AlignOptions",
    "AlignmentError",
    "AlignmentReport",
    "Calibration",
    "Equivalence",
    "EquivalenceTolerance",
    "LayerAlignment",
    "ManyAlignment",
    "Method",
    "Metric",
    "align",
    "align_many",
    "equivalent",
]
