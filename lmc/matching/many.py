"""Many models in one frame (docs/alignment.md, "Many models at once").

``align_many`` moves each of ``k`` models by a group element of its own so that all of them sit in one frame:
first each model is aligned to the first one, then, round after round, each model (as given) is aligned to the
mean of the others as they are now, until a round changes no discrete part of any element (head orders, FFN and
task-head units, residual permutation and signs, tokens) or ``max_rounds`` have run. This is MergeMany's scheme
(Ainsworth et al. 2023) over lmc's whole group: every element is solved by :func:`~lmc.matching.align`, so each
aligned model keeps its own function (its probe check), whatever the groups. A round costs ``k`` alignments; the
mean of the others is formed in float64 from the ``k - 1`` aligned models' parameters of the scope.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from lmc.adapters import scope_parameters
from lmc.matching.alignment import align, target_frame
from lmc.matching.checks import check_pair
from lmc.matching.options import AlignOptions, checked_options
from lmc.matching.results import AlignmentError, AlignmentReport
from lmc.symmetry import ModelTransform, Scope


@dataclass
class ManyAlignment:
    """What :func:`align_many` did.

    Attributes:
        reports: One per model, in order: its alignment to the last target it had (``None`` for the first model
            until a round aligns it: in round 0 it is the frame and is not moved).
        rounds: Rounds run after the start (each aligns every model to the mean of the others).
        converged: Whether the last round changed no discrete part of any element.
        changed: Per round, how many models' discrete parts changed.
        seconds: Wall time.
    """

    reports: list[AlignmentReport | None]
    rounds: int
    converged: bool
    changed: list[int] = field(default_factory=list)
    seconds: float = 0.0


def discrete_parts(transform: ModelTransform) -> tuple:
    """The permutations and signs of ``transform``, as plain lists (what a round compares)."""

    def listed(tensor: torch.Tensor | None) -> list | None:
        return None if tensor is None else tensor.tolist()

    return (
        tuple(
            (i, listed(e.query_permutation), listed(e.kv_permutation)) for i, e in sorted(transform.attention.items())
        ),
        tuple((i, listed(perm)) for i, perm in sorted(transform.feed_forward.items())),
        tuple((i, listed(perm)) for i, perm in sorted(transform.task_heads.items())),
        tuple((i, listed(signs)) for i, signs in sorted(transform.task_head_signs.items())),
        listed(transform.residual),
        listed(transform.residual_signs),
        listed(transform.tokens),
    )


def moves_units(transform: ModelTransform) -> bool:
    """Whether any discrete part of ``transform`` is not the identity (a permutation that moves, a sign of -1)."""

    def moves(perm: torch.Tensor | None) -> bool:
        return perm is not None and not torch.equal(perm.cpu(), torch.arange(len(perm)))

    def flips(signs: torch.Tensor | None) -> bool:
        return signs is not None and bool((signs < 0).any())

    permutations = [e.query_permutation for e in transform.attention.values()]
    permutations += [e.kv_permutation for e in transform.attention.values()]
    permutations += [*transform.feed_forward.values(), *transform.task_heads.values()]
    permutations += [transform.residual, transform.tokens]
    signs = [transform.residual_signs, *transform.task_head_signs.values()]
    return any(map(moves, permutations)) or any(map(flips, signs))


def mean_model(models: Sequence[nn.Module], names: set[str]) -> nn.Module:
    """A copy of ``models[0]`` whose parameters in ``names`` are the mean of the models' (in float64); the others
    are ``models[0]``'s, bitwise (outside the scope they are equal in every model)."""
    mean = copy.deepcopy(models[0])
    parameters = [dict(model.named_parameters()) for model in models]
    with torch.no_grad():
        for name, parameter in mean.named_parameters():
            if name in names:
                total = sum(p[name].detach().double() for p in parameters)
                parameter.copy_(total / len(models))
    return mean


def align_many(
    models: Sequence[nn.Module],
    scope: Scope = "full_model",
    options: AlignOptions | None = None,
    max_rounds: int = 10,
) -> tuple[list[nn.Module], ManyAlignment]:
    """Align ``k >= 2`` models into one frame, each by a group element of its own (module docstring).

    Args:
        models: The models, same architecture, dtype and device; outside ``full_model`` their parameters outside the
            scope must be identical. Never modified.
        scope: The group acting (as :func:`~lmc.matching.align`).
        options: Alignment settings for every step (weight-only: each step's target is a mean of models, which no
            calibration data describes); ``None`` takes the defaults.
        max_rounds: Most rounds after the start (0: every model aligned to the first only).

    Returns:
        ``(aligned, result)``: ``aligned[i]`` computes ``models[i]``'s function.

    Raises:
        AlignmentError: Fewer than two models, or a model that cannot be aligned with the first (named by its
            position), before any alignment runs.
    """
    start = time.perf_counter()
    if len(models) < 2:
        raise AlignmentError(f"align_many needs at least two models, got {len(models)}")
    if max_rounds < 0:
        raise ValueError(f"max_rounds must be >= 0, got {max_rounds}")
    if options is not None and checked_options(options).data_aware:
        raise ValueError(
            f"align_many aligns each model to a mean of models, which no calibration data describes: the options "
            f"{checked_options(options).data_settings} read activations; use weight-only options"
        )
    for index, model in enumerate(models[1:], start=1):
        try:
            check_pair(model, models[0], scope)
        except AlignmentError as error:
            raise AlignmentError(f"model {index} of {len(models)} cannot join model 0: {error}") from None
    names = set(scope_parameters(models[0], scope))
    first = [align(model, models[0], scope, options) for model in models[1:]]
    # Model 0 is the frame; with the extended group, folded as the others now are.
    aligned = [target_frame(models[0], first[0][1])] + [model for model, _ in first]
    reports: list[AlignmentReport | None] = [None] + [report for _, report in first]  # model 0 is the frame
    result = ManyAlignment(reports, rounds=0, converged=max_rounds == 0)
    for _ in range(max_rounds):
        changed = 0
        for i, model in enumerate(models):
            target = mean_model([other for j, other in enumerate(aligned) if j != i], names)
            aligned[i], report = align(model, target, scope, options)
            before = reports[i]
            changed += (
                moves_units(report.transform)
                if before is None
                else (discrete_parts(report.transform) != discrete_parts(before.transform))
            )
            reports[i] = report
        result.rounds += 1
        result.changed.append(changed)
        if not changed:
            result.converged = True
            break
    result.seconds = time.perf_counter() - start
    return aligned, result
