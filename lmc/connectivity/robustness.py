"""Robustness of the end points and midpoints of a pair under input corruptions (paper Appendix L).

The paper finds that models showing linear mode connectivity also generalize better. For a
pair (target = end point ``alpha = 0``, source = ``alpha = 1``) this measures, on clean data
and under each corruption of :mod:`lmc.data.corruptions` at each severity, the metrics of

- ``target`` and ``source``, the two fine-tuned models;
- ``naive_midpoint``, the average of their weights;
- ``aligned_midpoint:<alignment>``, the average of the target's and the aligned source's weights,
  one per alignment setting.

Every model sees the very same corrupted batches: batch ``k`` under corruption ``c`` at
severity ``s`` is corrupted with a generator seeded from ``(seed, c, s, k)`` only, on the CPU.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmc.connectivity import Evaluation
from lmc.connectivity.interpolation import fingerprint, point_metrics
from lmc.data.corruptions import Batch, Corruption, corruptions_for
from lmc.io import atomic_write_json, nan_for_null
from lmc.tasks import DataInfo

#: Where the midpoints lie on the interpolation.
MIDPOINT = 0.5
#: Seed of the corruptions of ``lmc run``.
CORRUPTION_SEED = 0
#: The clean data's entry in a model's row (beside one entry per corruption).
CLEAN = "clean"


def aligned_midpoint(label: str) -> str:
    """The name of the aligned midpoint of an alignment setting (its label in ``lmc run``)."""
    return f"aligned_midpoint:{label}"


def corruption_generator(seed: int, corruption: str, severity: int, batch_index: int) -> torch.Generator:
    """The CPU generator that corrupts one batch: a function of its arguments only."""
    digest = hashlib.sha256(json.dumps([seed, corruption, severity, batch_index]).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def corrupted_batches(batches: Any, corruption: Corruption, name: str, severity: int, seed: int) -> Iterator[Batch]:
    """``batches`` (an iterable, iterated once) under ``corruption`` ``name`` at ``severity``."""
    for index, batch in enumerate(batches):
        yield corruption(batch, severity, corruption_generator(seed, name, severity, index))


@torch.no_grad()
def corruption_table(
    model: nn.Module,
    weights: dict[str, list[torch.Tensor]],
    evaluation: Evaluation,
    corruptions: dict[str, Corruption],
    seed: int = CORRUPTION_SEED,
) -> dict[str, dict[str, Any]]:
    """Every model's metrics on clean data and under each corruption at each severity.

    Args:
        model: Receives each model's weights in turn, in place (its parameters, in
            ``parameters()`` order, match each list); left holding its own weights afterwards.
        weights: The models to evaluate, by name: one tensor per parameter of ``model``.
        evaluation: The metric sums and the clean batches (its ``split`` and identity are not used here).
        corruptions: The corruptions by name (:func:`lmc.data.corruptions.corruptions_for`).
        seed: Seed of the corruptions.

    Returns:
        ``{model name: {"clean": metrics, <corruption>: [metrics at severity 1, 2, ...]}}``, where
        ``metrics`` is ``{<metric>: sum / count}`` (``loss``, ``accuracy``, ...) from float64 sums.
    """
    parameters = list(model.parameters())
    own = [p.detach().clone() for p in parameters]
    device = own[0].device

    def metrics(batches) -> dict[str, float]:
        sums = dataclasses.replace(evaluation, batches=batches).sums(device)
        return point_metrics({name: float(value) for name, value in sums.items()})

    table = {}
    try:
        for name, tensors in weights.items():
            if len(tensors) != len(parameters):
                raise ValueError(f"model {name!r} lists {len(tensors)} tensors for {len(parameters)} parameters")
            for target, value in zip(parameters, tensors):
                target.copy_(value)
            row: dict[str, Any] = {CLEAN: metrics(evaluation.batches)}
            for corruption_name, corruption in corruptions.items():
                row[corruption_name] = [
                    metrics(corrupted_batches(evaluation.batches, corruption, corruption_name, severity, seed))
                    for severity in range(1, len(corruption.strengths) + 1)
                ]
            table[name] = row
    finally:
        for target, value in zip(parameters, own):
            target.copy_(value)
    return table


def midpoint_robustness(
    model: nn.Module,
    source: nn.Module,
    aligned: dict[str, nn.Module],
    evaluation: Evaluation,
    info: DataInfo,
    path: Path | None = None,
    seed: int = CORRUPTION_SEED,
) -> dict[str, Any]:
    """The corruption table of a pair's end points and midpoints, reused from ``path`` when it holds the same.

    Args:
        model: The target (``alpha = 0``); evaluated in place and left with its own weights.
        source: The source (``alpha = 1``) before alignment (never modified).
        aligned: The source aligned to the target, by alignment label.
        evaluation: How every model is evaluated.
        info: The data's task (which corruptions apply) and vocabulary size.
        path: Where the result is kept (``robustness.json``); ``None``: not kept.
        seed: Seed of the corruptions.

    Returns:
        ``{"key", "settings": {"midpoint", "seed", "severities": {corruption: [strength at
        severity 1, 2, 3]}, "evaluation"}, "models": {name: row}}`` with rows as in
        :func:`corruption_table`; ``key`` covers every evaluated weight and every setting.
    """
    target = [p.detach().clone() for p in model.parameters()]
    source_weights = [p.detach() for p in source.parameters()]
    weights = {"target": target, "source": source_weights}
    weights["naive_midpoint"] = [torch.lerp(a, b, MIDPOINT) for a, b in zip(target, source_weights)]
    for label, aligned_model in aligned.items():
        weights[aligned_midpoint(label)] = [
            torch.lerp(a, b.detach(), MIDPOINT) for a, b in zip(target, aligned_model.parameters())
        ]
    corruptions = corruptions_for(info)
    settings = {
        "midpoint": MIDPOINT,
        "seed": seed,
        "severities": {name: list(corruption.strengths) for name, corruption in corruptions.items()},
        "evaluation": json.loads(json.dumps(evaluation.identity(), default=str)),
    }
    key = fingerprint(*weights.values(), extra={"models": list(weights), **settings})
    if path is not None and path.is_file():
        try:
            saved = json.loads(path.read_text())
        except ValueError:  # a garbled file is only a cache: measured again below
            saved = None
        if isinstance(saved, dict) and saved.get("key") == key:
            return {**saved, "models": nan_for_null(saved.get("models"))}
    result = {
        "key": key,
        "settings": settings,
        "models": corruption_table(model, weights, evaluation, corruptions, seed),
    }
    if path is not None:
        atomic_write_json(path, result)
    return result
