"""The ``midpoint`` Stage 1 cost: what pairing two heads does to the loss, one head at a time (docs/alignment.md).

Between two aligned models the barrier is the loss the interpolated model adds over the two
endpoints. At the midpoint of a layer, the sum over its heads of ``(head_i + head'_j) / 2`` is the
same whatever the order, so the order changes the loss only through what each matched pair's
interpolated head adds to that average, and on trained pairs the barrier over all ``h!`` orders
is close to a sum of per-pair terms (``benchmarks/stage1_orders.py`` measures both). The cost of
pairing source head ``i`` with target head ``j`` is therefore the calibration loss of the target
with its head ``j`` replaced by the midpoint of its own weights and those of source head ``i``
after Stage 2: ``h`` Stage 2 solves (orders that pair every source head with every target head
once) and ``h^2`` evaluations of the calibration per layer, never all ``h!`` orders.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from lmc.matching.calibration import Calibration, CalibrationLoss, batch_to_model
from lmc.matching.grams import LayerGrams
from lmc.matching.options import AlignOptions
from lmc.matching.stage2 import attention_stages
from lmc.symmetry import (
    AttentionSpec,
    AttentionWeights,
    attention_parameters,
    per_query_head,
    read_attention,
    transform_attention,
)


def pairing_orders(layer: AttentionSpec) -> list[torch.Tensor]:
    """``h`` head orders that together pair every source query head with every target query head once.

    Each keeps the query heads of a key/value head together (GQA): source head ``g q + r`` goes
    to target head ``((g + a) mod h_kv) q + (r + b) mod q`` for each shift ``(a, b)``.

    Returns:
        ``h`` tensors ``match`` of shape ``(h,)``: the target head of each source query head.
    """
    q, h_kv = layer.queries_per_kv, layer.num_kv_heads
    group, rank = torch.arange(layer.num_heads) // q, torch.arange(layer.num_heads) % q
    return [((group + a) % h_kv) * q + (rank + b) % q for a in range(h_kv) for b in range(q)]


def _with_midpoint_head(target: AttentionWeights, moved: AttentionWeights, head: int, kv_head: int) -> AttentionWeights:
    """``target`` with query head ``head`` and its key/value head at the midpoint of ``target`` and ``moved``."""
    fields = {}
    for field in dataclasses.fields(AttentionWeights):
        ours, theirs = getattr(target, field.name), getattr(moved, field.name)
        if ours is None:
            fields[field.name] = None
            continue
        index = head if per_query_head(field.name) else kv_head
        value = ours.clone()
        value[index] = (ours[index] + theirs[index]) / 2
        fields[field.name] = value
    return AttentionWeights(**fields)


@torch.no_grad()
def midpoint_cost(
    working: nn.Module,
    target: nn.Module,
    layer: AttentionSpec,
    grams: LayerGrams,
    options: AlignOptions,
    calibration: Calibration,
) -> torch.Tensor:
    """The ``midpoint`` metric's Stage 1 cost of one layer pair (module docstring), shape ``(h, h)``.

    Args:
        working: The source as aligned so far (read, never modified).
        target: The target (run with swapped parameters, never modified).
        layer: The layer.
        grams: The Grams Stage 2 fits (the data Grams under ``objective="data"``).
        options: Stage 2's settings; each pair is aligned up to ``options.last_stage``.
        calibration: The batches and the loss (``calibration.forward``).

    Returns:
        ``cost[i, j]``: the mean calibration loss of the target whose query head ``j`` (and its
        key/value head) is the midpoint of its weights and source head ``i``'s after Stage 2, float64.
    """
    ours, theirs = dict(working.named_parameters()), dict(target.named_parameters())
    reference = next(iter(theirs.values()))
    batches = [batch_to_model(batch, reference.device, reference.dtype) for batch in calibration.batches]
    sizes = torch.tensor([len(batch["inputs"]) for batch in batches], dtype=torch.float64)
    loss_of = CalibrationLoss(target, calibration.forward)
    source_weights, target_weights = read_attention(ours, layer), read_attention(theirs, layer)
    q = layer.queries_per_kv

    def mean_loss(weights: AttentionWeights) -> float:
        swapped = {f"model.{name}": value for name, value in attention_parameters(theirs, layer, weights).items()}
        losses = [torch.func.functional_call(loss_of, swapped, (batch,)) for batch in batches]
        if any(loss.numel() != 1 for loss in losses):
            raise ValueError(
                "metric='midpoint' ranks head pairs by the calibration's loss, but calibration.forward returned "
                f"a tensor of shape {tuple(losses[0].shape)}: make it return the batch's mean loss (a scalar)"
            )
        return float((torch.stack(losses).double().cpu().flatten() * sizes).sum() / sizes.sum())

    cost = torch.full((layer.num_heads, layer.num_heads), torch.nan, dtype=torch.float64)
    mode = target.training
    target.eval()  # no dropout: the cost must be a function of the weights
    try:
        for match in pairing_orders(layer):
            kv_match = match[::q] // q
            element = attention_stages(grams, layer, match, kv_match, options.last_stage, options)[options.last_stage]
            moved = transform_attention(source_weights, element)  # source head i now sits at match[i]
            for source_head, head in enumerate(match.tolist()):
                cost[source_head, head] = mean_loss(_with_midpoint_head(target_weights, moved, head, head // q))
    finally:
        target.train(mode)
    return cost
