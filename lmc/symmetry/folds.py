"""Norm gains and biases folded into the linear maps that read them (docs/spec.md, section 2, "Folding the norms").

A norm ``y = n(x) * g + b`` read only by linear maps ``y W^T + c`` computes the same as ``n(x)`` read by
``W diag(g)`` with bias ``c + W b``. Folding moves every gain (and, where every reader has a bias, every
LayerNorm bias) into the readers and leaves the norm with a unit gain and no bias: one representative of the
orbit of the gains' scales, and the frame in which a norm commutes with rotations of the stream.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Reader:
    """A linear map reading a norm's output.

    Attributes:
        weight: Its weight's parameter name (2-D).
        axis: The weight's input axis (1 for ``nn.Linear``, 0 for GPT-2's ``Conv1D``); the other is its output.
        bias: Its bias's parameter name, ``None`` if it has none.
    """

    weight: str
    axis: int
    bias: str | None = None


@dataclass(frozen=True)
class NormFold:
    """A norm on the residual stream whose output only linear maps read.

    Attributes:
        norm: The norm's module path (for reports).
        gain: Its gain's parameter name, ``None`` without one.
        readers: Every linear map reading its output.
        bias: Its bias's parameter name (LayerNorm), ``None`` without one.
        gain_offset: The effective gain is ``gain_offset + gain`` (Gemma's ``1 + w``), 0 otherwise.
    """

    norm: str
    gain: str | None
    readers: tuple[Reader, ...]
    bias: str | None = None
    gain_offset: float = 0.0

    @property
    def folds_bias(self) -> bool:
        """Whether the bias folds: every reader has a bias to take ``W b``."""
        return self.bias is not None and all(reader.bias is not None for reader in self.readers)


@torch.no_grad()
def fold_parameters_(parameters: Mapping[str, torch.Tensor], folds: tuple[NormFold, ...]) -> list[str]:
    """Fold each norm of ``folds`` into its readers, in place: readers' input columns times the effective gain,
    their biases plus ``W b`` where the bias folds, then the gain set to one (``1 - gain_offset`` stored) and the
    folded bias to zero. A bias that does not fold stays, divided by the gain (``n g + b = (n + b / g) g``), so a
    norm with a zero gain entry and such a bias is left as it is. Computed in float64, stored in each parameter's
    dtype.

    Returns:
        The norms folded (:attr:`NormFold.norm`).
    """
    folded = []
    for fold in folds:
        gain = None if fold.gain is None else parameters[fold.gain].double() + fold.gain_offset
        bias = parameters[fold.bias].double() if fold.folds_bias else None
        if gain is not None and fold.bias is not None and bias is None:
            if bool((gain == 0).any()):
                continue
            parameters[fold.bias].copy_(parameters[fold.bias].double() / gain)
        folded.append(fold.norm)
        for reader in fold.readers:
            weight = parameters[reader.weight]
            original = weight.double()
            if bias is not None:
                parameters[reader.bias].add_(torch.tensordot(original, bias, dims=([reader.axis], [0])).to(weight))
            if gain is not None:
                shape = [1, 1]
                shape[reader.axis] = -1
                weight.copy_(original * gain.view(shape))
        if gain is not None:
            parameters[fold.gain].fill_(1.0 - fold.gain_offset)
        if bias is not None:
            parameters[fold.bias].zero_()
    return folded
