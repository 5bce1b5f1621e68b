"""``method="learned"``: move the attention group elements along the orbit to lower the path's loss (issue #8).

``full`` brings each source head close to the target in weight space; the interpolated models
``theta(alpha) = (1 - alpha) theta_target + alpha theta_aligned`` may still cross a loss
barrier. Every element of the group keeps the aligned source's function, so the end points stay
fixed while the path between them moves. This module descends the calibration loss of
interpolated models over the group coordinates of every aligned attention layer at once
(``C`` per key/value group in ``GL`` or ``H``, ``B`` in ``GL``, as
:class:`~lmc.symmetry.TiedGroup` coordinates with ``full``'s element at the origin), with Adam,
at random alphas on one calibration batch per step. The models are never modified: the
interpolated parameters enter the target model through :func:`torch.func.functional_call`.

The element kept is the best one seen on a fixed objective, the mean calibration loss at
:data:`EVALUATION_ALPHAS` over every calibration batch, measured first at ``full``'s element,
then after each pass over the calibration batches and at the end: ``learned`` never ends above
``full`` on that objective.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from lmc.matching.calibration import Calibration, CalibrationLoss, batch_to_model
from lmc.matching.options import AlignOptions
from lmc.symmetry import (
    AttentionTransform,
    SymmetrySpec,
    attention_parameters,
    qk_group,
    read_attention,
    transform_attention,
    vo_group,
)

EVALUATION_ALPHAS: tuple[float, ...] = (0.25, 0.5, 0.75)
"""Alphas of the fixed objective that picks the element ``learned`` returns."""

ALPHAS_PER_STEP = 2
"""Random alphas (uniform in ``[0, 1]``) averaged in each descent step."""


@dataclass
class LearnedAlignment:
    """What the descent found, relative to ``full``'s element.

    Attributes:
        transforms: Layer index -> the element to apply after ``full``'s (identity permutations;
            ``C`` and ``B`` float64); empty when ``full``'s element stayed the best.
        objective: The fixed objective (mean calibration loss at :data:`EVALUATION_ALPHAS`) at
            ``full``'s element (``"full"``) and at the returned one (``"learned"``).
        history: ``(step, fixed objective)`` at each evaluation, step 0 being ``full``'s element.
        best_step: The step whose element is returned (0: ``full``'s).
        steps: Adam steps taken (fewer than asked when a step left the group's invertible part).
        seconds: Wall time of the descent and its evaluations.
    """

    transforms: dict[int, AttentionTransform] = field(default_factory=dict)
    objective: dict[str, float] = field(default_factory=dict)
    history: list[tuple[int, float]] = field(default_factory=list)
    best_step: int = 0
    steps: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready summary (the matrices left out)."""
        return {
            "objective": self.objective,
            "history": [list(entry) for entry in self.history],
            "best_step": self.best_step,
            "steps": self.steps,
            "seconds": self.seconds,
        }


def learn_attention(
    working: nn.Module,
    target: nn.Module,
    spec: SymmetrySpec,
    layers: Sequence[int],
    moving: Sequence[str],
    calibration: Calibration,
    options: AlignOptions,
) -> LearnedAlignment:
    """Descend the interpolation loss over the attention layers' group coordinates (module docstring).

    Args:
        working: The source after ``full``'s alignment (read, never modified).
        target: The target (run with swapped parameters, never modified).
        spec: The models' symmetry spec.
        layers: Attention layer indices whose elements are learned.
        moving: Names of the other parameters that differ between the two models (interpolated too,
            fixed during the descent: FFN and residual permutations stay as ``full`` found them).
        calibration: The batches and the loss (``calibration.forward``).
        options: ``learned_steps``, ``learned_lr`` and ``seed`` (of the random alphas).

    Returns:
        The best element seen on the fixed objective, relative to ``full``'s.
    """
    started = time.perf_counter()
    ours, theirs = dict(working.named_parameters()), dict(target.named_parameters())
    reference = next(iter(theirs.values()))
    batches = [batch_to_model(batch, reference.device, reference.dtype) for batch in calibration.batches]
    loss_of = CalibrationLoss(target, calibration.forward)
    fixed = {name: (theirs[name].detach(), ours[name].detach()) for name in moving}

    layer_specs = [spec.blocks[index].attention for index in layers]
    weights = [read_attention(ours, layer) for layer in layer_specs]
    groups = [(qk_group(layer), vo_group(layer)) for layer in layer_specs]
    coordinates = []
    for layer, pair in zip(layer_specs, groups):
        eye = torch.eye(layer.head_dim, dtype=torch.float64).expand(layer.num_kv_heads, -1, -1)
        coordinates += [group.to_coordinates(eye).requires_grad_() for group in pair]

    def elements() -> list[AttentionTransform]:
        result = []
        for i, (layer, (qk, vo)) in enumerate(zip(layer_specs, groups)):
            identity = AttentionTransform.identity(layer)
            c, b = qk.from_coordinates(coordinates[2 * i]), vo.from_coordinates(coordinates[2 * i + 1])
            result.append(AttentionTransform(identity.query_permutation, identity.kv_permutation, c, b))
        return result

    def aligned_parameters() -> dict[str, torch.Tensor]:
        parameters = {}
        for layer, layer_weights, element in zip(layer_specs, weights, elements()):
            parameters.update(attention_parameters(ours, layer, transform_attention(layer_weights, element)))
        return parameters

    def loss(aligned: dict[str, torch.Tensor], alpha: float, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        interpolated = {name: torch.lerp(theirs[name].detach(), value, alpha) for name, value in aligned.items()}
        interpolated |= {name: torch.lerp(a, b, alpha) for name, (a, b) in fixed.items()}
        return torch.func.functional_call(loss_of, {f"model.{k}": v for k, v in interpolated.items()}, (batch,))

    def fixed_objective() -> float:
        with torch.no_grad():
            aligned = aligned_parameters()
            values = [float(loss(aligned, alpha, batch)) for alpha in EVALUATION_ALPHAS for batch in batches]
        return sum(values) / len(values)

    generator = torch.Generator().manual_seed(options.seed)
    optimizer = torch.optim.Adam(coordinates, lr=options.learned_lr)
    mode = target.training
    target.eval()  # no dropout: the objective must be a function of the coordinates
    try:
        best = fixed_objective()
        result = LearnedAlignment(objective={"full": best}, history=[(0, best)])
        best_coordinates = [c.detach().clone() for c in coordinates]
        for step in range(1, options.learned_steps + 1):
            batch = batches[(step - 1) % len(batches)]
            aligned = aligned_parameters()
            alphas = torch.rand(ALPHAS_PER_STEP, generator=generator, dtype=torch.float64).tolist()
            value = sum(loss(aligned, alpha, batch) for alpha in alphas) / len(alphas)
            gradients = torch.autograd.grad(value, coordinates)  # never into the models' .grad
            if not (torch.isfinite(value) and all(bool(torch.isfinite(g).all()) for g in gradients)):
                break  # a C or B near singular: keep the best element so far
            for coordinate, gradient in zip(coordinates, gradients):
                coordinate.grad = gradient
            optimizer.step()
            result.steps = step
            if step % len(batches) == 0 or step == options.learned_steps:
                current = fixed_objective()
                result.history.append((step, current))
                if current < best:
                    best, result.best_step = current, step
                    best_coordinates = [c.detach().clone() for c in coordinates]
    finally:
        target.train(mode)
    with torch.no_grad():
        for coordinate, kept in zip(coordinates, best_coordinates):
            coordinate.copy_(kept)
        if result.best_step:
            result.transforms = dict(zip(layers, elements()))
    result.objective["learned"] = best
    result.seconds = time.perf_counter() - started
    return result
