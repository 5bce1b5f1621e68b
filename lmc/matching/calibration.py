"""Calibration data for data-aware alignment, and the activation statistics read from it.

A :class:`Calibration` holds a few training batches and a way to run a model on one. Data-aware
settings of :class:`~lmc.matching.AlignOptions` run the source and the target on the same
batches and accumulate, per watched module, the paired second moments of the module's input
(:class:`PairedMoment`): ``E[a^T a]``, ``E[a^T a']`` and ``E[a'^T a']`` over the calibration
tokens, ``a`` and ``a'`` the source's and the target's input at the same token. Which modules
to watch comes from the model's adapter (it knows the layout); padding tokens
(``attention_mask == 0``) never enter a moment. Moments are accumulated in float64.
Activation matching of FFN hidden units and the residual stream reads the correlation of
each source unit with each target unit instead (:func:`paired_correlations`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lmc.matching.options import ALL_BATCHES


@dataclass(frozen=True)
class Calibration:
    """Batches that data-aware alignment reads activations from (never the split curves are measured on).

    Attributes:
        batches: lmc batches (``inputs``, optional ``attention_mask``, ``labels``; see
            :mod:`lmc.data.base`); alignment reads the first ``AlignOptions.calibration_batches``.
        forward: Runs a model on a batch and returns its loss; the activation statistics ignore the
            value (they are read by hooks), a method that trains on the calibration may use it.
        split: The split the batches come from (recorded in results).
        num_samples: Samples in ``batches`` (recorded in results).
        data: Identity of the samples: the data set's settings and how the batches were drawn
            (recorded, and part of a sweep's key).
    """

    batches: Sequence[dict[str, torch.Tensor]]
    forward: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]
    split: str
    num_samples: int
    data: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.batches:
            raise ValueError("a Calibration needs at least one batch")
        if self.num_samples < 1:
            raise ValueError(f"num_samples must be positive, got {self.num_samples}")

    def take(self, count: int | str) -> Calibration:
        """The first ``count`` batches (``"all"``: every batch), refused if there are fewer."""
        if count == ALL_BATCHES:
            return self
        if count > len(self.batches):
            raise ValueError(
                f"calibration_batches={count} but the calibration holds {len(self.batches)} batches: "
                "lower calibration_batches or build the calibration with more batches"
            )
        batches = list(self.batches[:count])
        return Calibration(batches, self.forward, self.split, sum(len(b["inputs"]) for b in batches), self.data)

    def identity(self) -> dict[str, Any]:
        """What results record, and a sweep's key includes: split, sample count and the data's identity."""
        return {"split": self.split, "num_samples": self.num_samples, "data": dict(self.data)}


@dataclass
class PairedMoment:
    """Second moments of a module's input in two models, over the same calibration tokens, float64.

    Attributes:
        source: ``E[a^T a]``, shape ``(n, n)``.
        cross: ``E[a^T a']``, shape ``(n, n)``.
        target: ``E[a'^T a']``, shape ``(n, n)``.
        tokens: Tokens averaged over.
    """

    source: torch.Tensor
    cross: torch.Tensor
    target: torch.Tensor
    tokens: int

    def moved(self, index: torch.Tensor, matrix: torch.Tensor | None = None) -> PairedMoment:
        """The moments after the source's activations became ``a[:, index] @ matrix`` (a symmetry applied to it).

        Args:
            index: Source coordinate of each new coordinate, ``(n,)``.
            matrix: ``(n, n)`` map applied after the re-indexing; ``None``: none.
        """
        source, cross = self.source[index][:, index], self.cross[index]
        if matrix is not None:
            matrix = matrix.to(source)
            source, cross = matrix.T @ source @ matrix, matrix.T @ cross
        return PairedMoment(source, cross, self.target, self.tokens)


class CalibrationLoss(nn.Module):
    """``calibration.forward(model, batch)`` as a module, so ``torch.func.functional_call`` can swap the
    model's parameters (``model.<name>``) without touching the model."""

    def __init__(self, model: nn.Module, forward: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]):
        super().__init__()
        self.model = model
        self.loss = forward

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.loss(self.model, batch)


def batch_to_model(batch: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``batch`` on the model's device, its floating tensors in the model's dtype (labels and tokens keep theirs)."""
    return {
        k: v.to(device, dtype if v.is_floating_point() else None) if isinstance(v, torch.Tensor) else v
        for k, v in batch.items()
    }


def _token_rows(value: torch.Tensor, mask: torch.Tensor | None, where: str) -> torch.Tensor:
    """``(tokens, n)`` rows of an activation ``(B, T, n)`` with padding tokens dropped, or of a
    pooled ``(B, n)`` (a task head's: one row per sequence, which padding does not enter)."""
    rows = value.reshape(-1, value.shape[-1])
    if mask is None or (value.dim() == 2 and len(value) == len(mask)):
        return rows
    if tuple(value.shape[:-1]) != tuple(mask.shape):
        raise ValueError(
            f"{where} received an input of shape {tuple(value.shape)} that the batch's attention_mask "
            f"{tuple(mask.shape)} does not index: padding cannot be left out of the statistics"
        )
    return rows[mask.reshape(-1) != 0]


def _std(second_moment: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """Per-unit standard deviation; 0 where the variance is rounding error of ``E[a^2] - E[a]^2``."""
    variance = second_moment - mean.pow(2)
    return torch.where(variance > 1e-12 * second_moment, variance, 0).sqrt()


def _with_ones(rows: torch.Tensor) -> torch.Tensor:
    return torch.cat([rows, torch.ones(len(rows), 1, dtype=rows.dtype, device=rows.device)], dim=1)


def _read_paired(
    source: nn.Module,
    target: nn.Module,
    modules: Mapping[str, tuple[nn.Module, nn.Module]],
    calibration: Calibration,
    accumulate: Callable[[str, torch.Tensor, torch.Tensor], None],
    outputs: frozenset[str] = frozenset(),
) -> None:
    """Run both models on every calibration batch and hand each watched input to ``accumulate``.

    ``accumulate(key, a, b)`` receives the source's and the target's rows of one batch, float64
    ``(tokens, n)`` with padding tokens dropped. The keys in ``outputs`` watch their modules'
    output instead of their first positional input. Both models run in eval mode (no dropout)
    without gradients, on the batch moved to their device with floating tensors in their dtype.
    """
    parameter = next(source.parameters())
    device, dtype = parameter.device, parameter.dtype
    captured: dict[tuple[str, int], torch.Tensor] = {}

    def keep(key: str, side: int, value: object, what: str) -> None:
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{key}: the watched module's {what} is not a tensor")
        if (key, side) in captured:
            raise ValueError(f"{key}: the watched module ran twice in one forward pass")
        captured[key, side] = value.detach()

    def register(key: str, side: int):
        module = modules[key][side]
        if key in outputs:
            return module.register_forward_hook(lambda _, args, output: keep(key, side, output, "output"))
        return module.register_forward_pre_hook(
            lambda _, args: keep(key, side, args[0] if args else None, "first positional input")
        )

    handles = [register(key, side) for key in modules for side in (0, 1)]
    modes = source.training, target.training
    source.eval(), target.eval()
    try:
        with torch.no_grad():
            for batch in calibration.batches:
                batch = batch_to_model(batch, device, dtype)
                captured.clear()
                calibration.forward(source, batch)
                calibration.forward(target, batch)
                mask = batch.get("attention_mask")
                for key in modules:
                    missing = [role for side, role in enumerate(("source", "target")) if (key, side) not in captured]
                    if missing:
                        raise ValueError(
                            f"{key}: the watched module of the {' and '.join(missing)} never ran in the calibration "
                            "forward; the model's adapter names a module the model does not call"
                        )
                    a, b = (_token_rows(captured[key, side], mask, key).double() for side in (0, 1))
                    accumulate(key, a, b)
    finally:
        for handle in handles:
            handle.remove()
        source.train(modes[0]), target.train(modes[1])


def paired_moments(
    source: nn.Module,
    target: nn.Module,
    modules: Mapping[str, tuple[nn.Module, nn.Module]],
    calibration: Calibration,
    augment: frozenset[str] = frozenset(),
) -> dict[str, PairedMoment]:
    """Paired second moments of the first positional input of each watched module pair.

    Args:
        source, target: The two models (same architecture; neither is changed).
        modules: Key -> ``(module of source, module of target)`` whose input is read.
        calibration: The batches and the forward.
        augment: Keys whose rows get a constant 1 appended (``[a, 1]``: the moment then covers
            the bias of a layer that reads ``a``, and its last row is the mean ``E[[a, 1]]``).

    Returns:
        Key -> its :class:`PairedMoment` (on the CPU).

    Raises:
        ValueError: A watched module was not called exactly once per forward, or its input is not
            a tensor of tokens the batch's attention mask indexes.
    """
    sums: dict[str, list[torch.Tensor]] = {}
    tokens = dict.fromkeys(modules, 0)

    def accumulate(key: str, a: torch.Tensor, b: torch.Tensor) -> None:
        if key in augment:
            a, b = _with_ones(a), _with_ones(b)
        products = (a.T @ a, a.T @ b, b.T @ b)
        sums[key] = list(products) if key not in sums else [s + p for s, p in zip(sums[key], products)]
        tokens[key] += len(a)

    _read_paired(source, target, modules, calibration, accumulate)
    moments = {}
    for key, (s, c, t) in sums.items():
        count = max(tokens[key], 1)
        moments[key] = PairedMoment((s / count).cpu(), (c / count).cpu(), (t / count).cpu(), tokens[key])
    return moments


def paired_correlations(
    source: nn.Module,
    target: nn.Module,
    modules: Mapping[str, tuple[nn.Module, nn.Module]],
    calibration: Calibration,
    outputs: frozenset[str] = frozenset(),
) -> dict[str, torch.Tensor]:
    """Pearson correlation of every source unit with every target unit of each watched input
    (or output, for the keys in ``outputs``).

    The statistic of Git Re-Basin's activation matching: ``corr[i, j]`` over the calibration
    tokens between unit ``i`` of the source's input and unit ``j`` of the target's, at the same
    token. A unit constant over the calibration (a dead ReLU) correlates 0 with everything. Only
    the cross moment is ``(n, n)``; the rest is per unit, so an FFN's hidden width costs one
    ``n x n`` float64 matrix.

    Args:
        source, target, modules, calibration: As :func:`paired_moments`.
        outputs: Keys whose modules' output is read instead of their first positional input.

    Returns:
        Key -> ``(n, n)`` float64 correlations on the CPU.

    Raises:
        ValueError: As :func:`paired_moments`.
    """
    sums: dict[str, dict[str, torch.Tensor]] = {}
    tokens = dict.fromkeys(modules, 0)

    def accumulate(key: str, a: torch.Tensor, b: torch.Tensor) -> None:
        batch = {"a": a.sum(0), "b": b.sum(0), "aa": a.pow(2).sum(0), "bb": b.pow(2).sum(0), "ab": a.T @ b}
        sums[key] = batch if key not in sums else {k: sums[key][k] + v for k, v in batch.items()}
        tokens[key] += len(a)

    _read_paired(source, target, modules, calibration, accumulate, outputs)
    correlations = {}
    for key, sum_of in sums.items():
        count = max(tokens[key], 1)
        mean_a, mean_b = sum_of["a"] / count, sum_of["b"] / count
        covariance = sum_of["ab"] / count - torch.outer(mean_a, mean_b)
        std_a, std_b = (_std(sum_of[k] / count, m) for k, m in (("aa", mean_a), ("bb", mean_b)))
        scale = torch.outer(std_a, std_b)
        correlations[key] = torch.where(scale > 0, covariance / scale.where(scale > 0, 1), 0).cpu()
    return correlations
