"""Weight matching for Transformers (paper Section 5; docs/spec.md, section 3).

``align(source, target, scope, AlignOptions(...))`` returns a copy of ``source`` that computes
the same function with weights close to ``target``'s, and a report of what each stage did.
``equivalent(a, b, scope)`` says whether two models compute the same function up to the group;
``align_many(models, scope)`` brings k models into one frame.
Each name is imported on first use (lmc.lazy): ``AlignOptions`` loads no torch.
"""

from lmc.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "alignment": ("align",),
        "calibration": ("Calibration",),
        "equivalence": ("EQUIVALENCE_RTOL", "Equivalence", "EquivalenceTolerance", "equivalent"),
        "many": ("ManyAlignment", "align_many"),
        "options": ("METHODS", "METRICS", "AlignOptions", "Method", "Metric"),
        "results": ("PROBE_RTOL", "AlignmentError", "AlignmentReport", "LayerAlignment"),
    },
)

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
