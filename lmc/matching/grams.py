"""Gram blocks of one attention layer pair: everything the two-stage matcher reads (docs/spec.md, section 3).

Both stages are computed from ``d_h x d_h`` blocks of four cross-Gram matrices (``W^T W'`` for
Q, K, V and ``W_O W_O'^T``) and the diagonal blocks of the self-Grams, so after one GEMM pass
per layer no step depends on the model width.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from lmc.matching.calibration import PairedMoment
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


WEIGHT_SHARE = 1e-3
"""The data objective keeps this share of the weight objective: every input moment ``S`` enters
as ``S + lambda I``, ``lambda = WEIGHT_SHARE * tr(S_source + S_target) / (2 (d + 1))`` (the mean
eigenvalue). Directions the calibration inputs never take would otherwise leave part of ``C``
undetermined (a singular ``W^T S W``); the weights settle them, and the optimum in the visible
directions moves by a relative ``O(WEIGHT_SHARE)``."""


def _augmented(rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``[W; b]`` of every head as rows ``(n d_h, d + 1)`` (a zero bias where there is none), float64."""
    rows = rows.double()
    column = torch.zeros(len(rows), 1, dtype=rows.dtype, device=rows.device) if bias is None else bias.double()[:, None]
    return torch.cat([rows, column], dim=1)


def _weighted_self(rows: torch.Tensor, moment: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Diagonal blocks ``X_i^T S X_i``, shape ``(n, d_h, d_h)``, of rows ``(n d_h, d + 1)``."""
    return (rows @ moment).unflatten(0, (-1, head_dim)) @ rows.unflatten(0, (-1, head_dim)).mT


@dataclass
class LayerGrams:
    """The Gram blocks of one (source, target) layer pair.

    Computed in :func:`~lmc.symmetry.compute_dtype` of the weights' dtype (the weights' own
    dtype in float32 and float64; half-precision weights are read into float32).
    ``*_cross[i, :, j, :] = X_i^T X'_j``; ``*_source[i] = X_i^T X_i``; ``*_target[j] = X'_j^T X'_j``
    (``X = [W; b]`` per head, ``X = W_O^T`` for the output). With the inputs' paired second
    moments (:meth:`compute`'s ``inputs``) the query, key and value blocks are instead
    ``X_i^T S X'_j = E[(x W_i + b_i)^T (x' W'_j + b'_j)]`` (``S = E[[x, 1]^T [x', 1]]``, ``x`` and
    ``x'`` the two models' inputs at the same token), the source and target blocks with their
    own ``E[[x, 1]^T [x, 1]]``; the output blocks stay on weights. ``key_offset_*`` (per key
    head, ``d_h``) is what row-centring removes: ``key_cross - offset^T offset'`` is the centred
    key Gram.
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
    key_offset_source: torch.Tensor
    key_offset_target: torch.Tensor

    @classmethod
    def compute(
        cls,
        source: Mapping[str, torch.Tensor],
        target: Mapping[str, torch.Tensor],
        spec: AttentionSpec,
        inputs: PairedMoment | None = None,
    ) -> LayerGrams:
        """From the two models' parameters (``dict(model.named_parameters())``), reading views only.

        Args:
            source, target: The parameters.
            spec: The layer.
            inputs: The paired second moments of the layer's inputs augmented with a constant 1
                (``(d + 1, d + 1)``, :func:`~lmc.matching.calibration.paired_moments`): the data
                objective (with :data:`WEIGHT_SHARE` of the weight objective). ``None``: the
                weights themselves.

        Row-centring of the keys: on weights, subtract each key head's mean over the ``d`` input
        rows (``offset = sqrt(d) * mean``); on data, subtract the mean key ``E[x W_K + b_K]``, so
        the centred Gram is the keys' covariance (the part of the scores constant over keys,
        which softmax ignores, drops out).
        """
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
                if inputs is None or name == "out":
                    grams[f"{name}_cross"] = _cross(rows_s, rows_t, bias_s, bias_t, d_h)
                    grams[f"{name}_source"] = _self(rows_s, bias_s, d_h)
                    grams[f"{name}_target"] = _self(rows_t, bias_t, d_h)
                    continue
                x_s, x_t = _augmented(rows_s, bias_s), _augmented(rows_t, bias_t)
                moment = {k: getattr(inputs, k).to(x_s) for k in ("source", "cross", "target")}
                ridge = WEIGHT_SHARE * float(moment["source"].trace() + moment["target"].trace()) / (2 * len(x_s.T))
                moment = {k: m + ridge * torch.eye(len(m), dtype=m.dtype, device=m.device) for k, m in moment.items()}
                grams[f"{name}_cross"] = _cross(x_s @ moment["cross"], x_t, None, None, d_h)
                grams[f"{name}_source"] = _weighted_self(x_s, moment["source"], d_h)
                grams[f"{name}_target"] = _weighted_self(x_t, moment["target"], d_h)
                if name == "key":  # the last row of E[[x, 1]^T [x, 1]] is the mean E[[x, 1]]
                    grams["key_offset_source"] = (x_s @ inputs.source[-1].to(x_s)).unflatten(0, (-1, d_h))
                    grams["key_offset_target"] = (x_t @ inputs.target[-1].to(x_t)).unflatten(0, (-1, d_h))
            if inputs is None:
                scale = spec.width**0.5
                grams["key_offset_source"] = scale * rows(source, "key").mean(dim=1).unflatten(0, (-1, d_h))
                grams["key_offset_target"] = scale * rows(target, "key").mean(dim=1).unflatten(0, (-1, d_h))
        return cls(**grams)

    def centred_key(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Key Grams with the part of ``W_Q W_K^T`` softmax ignores removed (see :meth:`compute`).

        ``K_c = K - 1 k_mean`` gives ``K_c^T K_c' = K^T K' - d k_mean^T k_mean'`` (the bias row
        is not centred); on data, ``Cov(k, k') = E[k^T k'] - E[k]^T E[k']``.
        """
        ms, mt = self.key_offset_source, self.key_offset_target
        cross = self.key_cross - ms[:, :, None, None] * mt[None, None, :, :]
        source = self.key_source - ms[:, :, None] * ms[:, None, :]
        target = self.key_target - mt[:, :, None] * mt[:, None, :]
        return cross, source, target

    def block(self, name: str, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Cross blocks ``[rows[k], :, cols[k], :]``, shape ``(len(rows), d_h, d_h)``, in float64."""
        return getattr(self, f"{name}_cross")[rows, :, cols, :].double()

    def all_finite(self) -> bool:
        """Whether no block overflowed (weights too large for the compute dtype)."""
        return all(
            bool(torch.isfinite(value).all()) for value in vars(self).values() if isinstance(value, torch.Tensor)
        )
