"""``learned`` never ends above ``full``, checked from outside the code that claims it.

``method="learned"`` promises an element no worse than ``full``'s on a fixed objective: the mean
calibration loss, over the calibration batches, of the interpolated models
``(1 - alpha) target + alpha aligned`` at alphas 0.25, 0.5 and 0.75. The report's own numbers
cannot test that promise (they are the descent's running minimum and its starting value, taken
before the element is applied). These helpers recompute the objective with plain torch from the
aligned models the code returns, ``full``'s and ``learned``'s: a copy of the target whose
parameters are overwritten, run in eval mode on each batch. :func:`return_a_worse_element` plants
the bug the checks must catch.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

ALPHAS = (0.25, 0.5, 0.75)
"""The fixed objective's alphas (``lmc.matching.learned.EVALUATION_ALPHAS``, written out here)."""

Loss = Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]


def cross_entropy(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The calibration loss of an image classifier (``LMCModule.model_loss`` of the reference ViT), in plain torch."""
    return F.cross_entropy(model(batch["inputs"]).float(), batch["labels"])


def interpolated(target: nn.Module, aligned: nn.Module, alpha: float) -> nn.Module:
    """A copy of ``target`` in eval mode whose parameters are ``(1 - alpha) target + alpha aligned``."""
    model = copy.deepcopy(target).eval()
    ours = dict(aligned.named_parameters())
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.copy_(torch.lerp(parameter, ours[name].to(parameter), alpha))
    return model


def path_objective(
    target: nn.Module, aligned: nn.Module, batches: Sequence[dict[str, torch.Tensor]], loss: Loss
) -> float:
    """The mean of ``loss`` over :data:`ALPHAS` and ``batches`` along the path from ``target`` to ``aligned``."""
    dtype = next(target.parameters()).dtype
    values = []
    for alpha in ALPHAS:
        model = interpolated(target, aligned, alpha)
        with torch.no_grad():
            for batch in batches:
                batch = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}
                values.append(float(loss(model, batch)))
    return sum(values) / len(values)


def check_learned_not_above_full(
    target: nn.Module,
    full: nn.Module,
    learned: nn.Module,
    batches: Sequence[dict[str, torch.Tensor]],
    loss: Loss,
    reported: Mapping[str, float],
    rel: float,
) -> dict[str, float]:
    """Assert that ``learned``'s path is not above ``full``'s on the recomputed objective, and that the report says so.

    Args:
        target: The model both were aligned to.
        full: The source aligned with ``method="full"``; ``learned``: with ``method="learned"``.
        batches: The calibration batches; ``loss``: the calibration loss.
        reported: The report's ``learned["objective"]`` (``"full"`` and ``"learned"``).
        rel: Relative rounding allowed between two computations of one value (float64 ~1e-12,
            float32 ~1e-5).

    Returns:
        The recomputed objective of each.
    """
    values = {
        "full": path_objective(target, full, batches, loss),
        "learned": path_objective(target, learned, batches, loss),
    }
    assert values["learned"] <= values["full"] + rel * abs(values["full"]), f"learned ends above full: {values}"
    for name, value in values.items():
        assert reported[name] == pytest.approx(value, rel=rel), f"the report's {name} objective is not its model's"
    return values


def record_alignments(monkeypatch: pytest.MonkeyPatch, module: Any) -> list[dict[str, Any]]:
    """Record every ``module.align(...)`` call: its arguments (models copied as they were) and its result.

    Returns:
        The list the calls are appended to, each ``{"source", "target", "scope", "options",
        "calibration", "aligned", "report"}``.
    """
    original = module.align
    signature = inspect.signature(original)
    calls: list[dict[str, Any]] = []

    def recording(*args: Any, **kwargs: Any) -> tuple[nn.Module, Any]:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = {k: copy.deepcopy(v) if isinstance(v, nn.Module) else v for k, v in bound.arguments.items()}
        aligned, report = original(*args, **kwargs)
        calls.append({**arguments, "aligned": copy.deepcopy(aligned), "report": report})
        return aligned, report

    monkeypatch.setattr(module, "align", recording)
    return calls


def return_a_worse_element(monkeypatch: pytest.MonkeyPatch, seed: int = 0) -> None:
    """Make ``method="learned"`` return a random element of each layer's group instead of the one it measured.

    The function stays the source's (every element is a symmetry) and the report keeps the
    descent's values, so ``objective["learned"] <= objective["full"]`` still holds in it; only the
    path, measured independently, shows that the returned element is worse than ``full``'s.
    """
    import lmc.matching.aligner as aligner
    from lmc.symmetry import sample_attention_transform

    descend = aligner.learn_attention

    def worse(working, target, spec, layers, moving, calibration, options):
        result = descend(working, target, spec, layers, moving, calibration, options)
        generator = torch.Generator().manual_seed(seed)
        result.transforms = {i: sample_attention_transform(spec.blocks[i].attention, generator) for i in layers}
        return result

    monkeypatch.setattr(aligner, "learn_attention", worse)
