"""Gram blocks of one attention layer pair: everything the two-stage matcher reads (SPEC section 3).

Both stages are computed from ``d_h x d_h`` blocks of four cross-Gram matrices (``W^T W'`` for
Q, K, V and ``W_O W_O'^T``) and the diagonal blocks of the self-Grams, so after one GEMM pass
per layer no step depends on the model width.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from lmc.symmetry import AttentionSpec, compute_dtype, head_rows


def frobenius_inner(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``<A, B> = tr(A^T B)`` over the last two axes."""
    return (a * b).sum(dim=(-1, -2))


def trace(blocks: torch.Tensor) -> torch.Tensor:
    """Traces of ``(..., d_h, d_h)`` blocks in float64, shape ``(...)``."""
    return blocks.diagonal(dim1=-2, dim2=-1).sum(-1).double()


def _cross(rows: torch.Tensor, rows_target: torch.Tensor, bias, bias_target, head_dim: int) -> torch.Tensor:
    """All blocks ``X_i^T X'_j`` (bias row included) as a ``(n, d_h, n', d_h)`` view: block ``[i, :, j, :]``.

    One GEMM of the ``(n d_h, d)`` row-stacked views.
    """
    gram = rows @ rows_target.T
    if bias is not None:
        gram = gram + bias[:, None] * bias_target[None, :]
    return gram.unflatten(1, (-1, head_dim)).unflatten(0, (-1, head_dim))


def _self(rows: torch.Tensor, bias: torch.Tensor | None, head_dim: int) -> torch.Tensor:
    """Diagonal blocks ``X_i^T X_i``, shape ``(n, d_h, d_h)`` (batched, no copy of the weights)."""
    blocks = rows.unflatten(0, (-1, head_dim))
    gram = blocks @ blocks.mT
    if bias is not None:
        per_head = bias.unflatten(0, (-1, head_dim))
        gram = gram + per_head[:, :, None] * per_head[:, None, :]
    return gram


@dataclass
class LayerGrams:
    """The Gram blocks of one (source, target) layer pair.

    Computed in :func:`~lmc.symmetry.compute_dtype` of the weights' dtype (the weights' own
    dtype in float32 and float64; half-precision weights are read into float32).
    ``*_cross[i, :, j, :] = X_i^T X'_j``; ``*_source[i] = X_i^T X_i``; ``*_target[j] = X'_j^T X'_j``
    (``X = [W; b]`` per head, ``X = W_O^T`` for the output). ``key_mean_*`` are the means over
    the ``d`` input rows of each key head (for row-centring).
    """

    query_cross: torch.Tensor
    key_cross: torch.Tensor
    value_cross: torch.Tensor
    out_cross: torch.Tensor
    query_source: torch.Tensor
    key_source: torch.Tensor
    value_source: torch.Tensor
    out_source: torch.Tensor
    query_target: torch.Tensor
    key_target: torch.Tensor
    value_target: torch.Tensor
    out_target: torch.Tensor
    key_mean_source: torch.Tensor
    key_mean_target: torch.Tensor
    width: int

    @classmethod
    def compute(
        cls, source: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor], spec: AttentionSpec
    ) -> LayerGrams:
        """From the two models' parameters (``dict(model.named_parameters())``), reading views only."""
        d_h = spec.head_dim

        def rows(parameters: Mapping[str, torch.Tensor], name: str) -> torch.Tensor | None:
            view = head_rows(parameters, spec, name)  # no copy unless the dtype is widened
            return None if view is None else view.to(compute_dtype(view.dtype))

        grams: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name in ("query", "key", "value", "out"):
                rows_s, rows_t = rows(source, name), rows(target, name)
                bias_s = rows(source, f"{name}_bias") if name != "out" else None
                bias_t = rows(target, f"{name}_bias") if name != "out" else None
                grams[f"{name}_cross"] = _cross(rows_s, rows_t, bias_s, bias_t, d_h)
                grams[f"{name}_source"] = _self(rows_s, bias_s, d_h)
                grams[f"{name}_target"] = _self(rows_t, bias_t, d_h)
            grams["key_mean_source"] = rows(source, "key").mean(dim=1).unflatten(0, (-1, d_h))
            grams["key_mean_target"] = rows(target, "key").mean(dim=1).unflatten(0, (-1, d_h))
        return cls(**grams, width=spec.width)

    def centred_key(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Key Grams with each head's weight rows centred: the part of ``W_Q W_K^T`` softmax keeps.

        ``K_c = K - 1 k_mean`` gives ``K_c^T K_c' = K^T K' - d k_mean^T k_mean'`` (the bias row
        is not centred).
        """
        d = self.width
        ms, mt = self.key_mean_source, self.key_mean_target
        cross = self.key_cross - d * ms[:, :, None, None] * mt[None, None, :, :]
        source = self.key_source - d * ms[:, :, None] * ms[:, None, :]
        target = self.key_target - d * mt[:, :, None] * mt[:, None, :]
        return cross, source, target

    def block(self, name: str, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Cross blocks ``[rows[k], :, cols[k], :]``, shape ``(len(rows), d_h, d_h)``, in float64."""
        return getattr(self, f"{name}_cross")[rows, :, cols, :].double()

    def all_finite(self) -> bool:
        """Whether no block overflowed (weights too large for the compute dtype)."""
        return all(
            bool(torch.isfinite(value).all()) for value in vars(self).values() if isinstance(value, torch.Tensor)
        )
