"""A safetensors checkpoint read as if its norms were folded: the extended group, streamed.

:class:`FoldedCheckpoint` serves every tensor as :func:`~lmc.symmetry.fold_parameters_` would leave it, computed when
it is read (whole or a block of rows) from the stored tensors, with the same arithmetic, so a streamed alignment of
two folders with ``residual="orthogonal"`` reads the folded models without ever holding them: a reader's rows times
the norm's gain, a reader's bias plus ``W b`` (its weight read once more for that), the gain itself one, the bias
zero or divided by the gain (docs/spec.md, section 2, "Folding the norms").
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from lmc.formats.safetensors import SafetensorsCheckpoint
from lmc.symmetry import NormFold, Reader


class FoldedCheckpoint:
    """``checkpoint`` with ``folds`` folded, tensor by tensor as read; everything else as ``checkpoint`` has it.

    Args:
        checkpoint: The stored tensors (by parameter name).
        folds: The norms to fold (``SymmetrySpec.folds``); one whose gain has a zero entry while its bias stays
            is left as it is, as :func:`~lmc.symmetry.fold_parameters_` leaves it.
    """

    def __init__(self, checkpoint: SafetensorsCheckpoint, folds: tuple[NormFold, ...]):
        self.checkpoint = checkpoint
        self.folds: list[NormFold] = []
        self.readers: dict[str, tuple[NormFold, Reader]] = {}
        self.reader_biases: dict[str, tuple[NormFold, Reader]] = {}
        for fold in folds:
            if fold.gain is not None and fold.bias is not None and not fold.folds_bias:
                if bool((self._gain(fold) == 0).any()):
                    continue
            self.folds.append(fold)
            for reader in fold.readers:
                self.readers[reader.weight] = fold, reader
                if fold.folds_bias:
                    self.reader_biases[reader.bias] = fold, reader
        self.gains = {fold.gain: fold for fold in self.folds if fold.gain is not None}
        self.biases = {fold.bias: fold for fold in self.folds if fold.bias is not None}

    @property
    def folded(self) -> list[str]:
        """The norms folded (:attr:`NormFold.norm`)."""
        return [fold.norm for fold in self.folds]

    def _gain(self, fold: NormFold) -> torch.Tensor | None:
        """The fold's effective gain (float64), ``None`` without one."""
        return None if fold.gain is None else self.checkpoint[fold.gain].double() + fold.gain_offset

    def _folded(self, name: str, stored: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Tensor ``name``'s rows from ``start`` on (``stored``, as stored) as the fold leaves them."""
        if name in self.readers:
            fold, reader = self.readers[name]
            gain = self._gain(fold)
            if gain is None:
                return stored
            if reader.axis == 0:  # GPT-2's Conv1D reads along its rows
                return (stored.double() * gain[start : start + len(stored), None]).to(stored.dtype)
            return (stored.double() * gain[None, :]).to(stored.dtype)
        if name in self.reader_biases:
            fold, reader = self.reader_biases[name]
            weight = self.checkpoint[reader.weight].double()
            bias = self.checkpoint[fold.bias].double()
            whole = self.checkpoint[name].add(torch.tensordot(weight, bias, dims=([reader.axis], [0])).to(stored))
            return whole[start : start + len(stored)]
        if name in self.gains:
            return torch.full_like(stored, 1.0 - self.gains[name].gain_offset)
        if name in self.biases:
            fold = self.biases[name]
            if fold.folds_bias:
                return torch.zeros_like(stored)
            gain = self._gain(fold)
            return stored if gain is None else (stored.double() / gain[start : start + len(stored)]).to(stored.dtype)
        return stored

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._folded(name, self.checkpoint[name])

    def rows(self, name: str, start: int | None, stop: int | None) -> torch.Tensor:
        """Rows ``start:stop`` of tensor ``name``, folded (as :meth:`SafetensorsCheckpoint.rows`)."""
        return self._folded(name, self.checkpoint.rows(name, start, stop), start or 0)

    def same_values(self, name: str, other: str) -> bool:
        return self.checkpoint.same_values(name, other) and name not in self.readers and other not in self.readers

    def __iter__(self) -> Iterator[str]:
        return iter(self.checkpoint)

    def __len__(self) -> int:
        return len(self.checkpoint)

    def __getattr__(self, name: str):  # folder, shards, headers, entries, names, chunks, layout: as stored
        return getattr(self.checkpoint, name)
