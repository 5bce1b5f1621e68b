"""Stage 1 costs of the matcher-quality study (benchmarks/matcher_quality/README.md): the first attention layer's
visible input subspace, each cost's ``(h, h)`` matrix."""

from __future__ import annotations

import dataclasses

import torch

from lmc.matching import AlignOptions
from lmc.matching.grams import LayerGrams
from lmc.matching.heads import head_cost, invariant_products
from lmc.symmetry import read_attention

METRICS = ("invariant", "weight", "correlation")

# ------------------------------------------------------------------------------------------
# The visible input subspace of the first attention layer (weights only).
# ------------------------------------------------------------------------------------------


def visible_projector(params: dict, pe: str) -> torch.Tensor:
    """Projector (d x d) onto the span of every input the first attention layer can receive.

    Layer 0 reads ``LN(v) = centre(v) / std(v) * gamma + beta`` with ``v`` a patch embedding
    ``W p + b + pos_t`` (any patch ``p``) or the class token ``cls + pos_0``: so its input lies in
    ``diag(gamma) centre(span{W's columns, b + pos_t, cls + pos_0}) + beta``. Rows of ``W_Q, W_K,
    W_V`` (input axis) outside this span never touch the function.
    """
    w, b, cls = params["patch_embed.weight"], params["patch_embed.bias"], params["cls_token"].reshape(-1)
    vectors = [w[:, k] for k in range(w.shape[1])]
    if pe == "learned":
        pos = params["pos_embed"]
        vectors += [b + pos[t] for t in range(1, 17)] + [cls + pos[0]]
    else:
        vectors += [b, cls]
    gamma, beta = params["blocks.0.attn_norm.weight"], params["blocks.0.attn_norm.bias"]
    basis = torch.stack([(v - v.mean()) * gamma for v in vectors] + [beta], dim=1)  # (d, k)
    u, s, _ = torch.linalg.svd(basis, full_matrices=False)
    u = u[:, s > s[0] * 1e-10]
    return u @ u.T


def project_inputs(params: dict, projector: torch.Tensor, prefix: str = "blocks.0.attn") -> dict:
    """Copy of params with the Q/K/V weights' input axis projected (``nn.Linear``: ``weight @ P``)."""
    projected = dict(params)
    for p in ("q", "k", "v"):
        name = f"{prefix}.{p}_proj.weight"
        projected[name] = params[name] @ projector
    return projected


# ------------------------------------------------------------------------------------------
# Stage 1 costs.
# ------------------------------------------------------------------------------------------


def invariant_parts(grams: LayerGrams) -> dict[str, torch.Tensor]:
    p = invariant_products(grams, 1)
    qk = p["qk_source"][:, None] + p["qk_target"][None, :] - 2 * p["qk_cross"]
    vo = p["vo_source"][:, None] + p["vo_target"][None, :] - 2 * p["vo_cross"]
    return {"invariant_qk": qk, "invariant_vo": vo}


def complex_pair_cost(source: dict, target: dict, layer) -> torch.Tensor:
    """``sum_p ||M_i^p - M_j'^p||^2`` with ``M^p = q_p k_p^H`` per rotary pair (row-centred keys, biases appended)."""
    pairs = layer.rotary.pairs

    def per_pair(params: dict) -> tuple[torch.Tensor, torch.Tensor]:
        w = read_attention(params, layer)  # query (h, d, d_h), query_bias (h, d_h)
        q = torch.cat([w.query, w.query_bias[:, None, :]], dim=1)
        key = w.key - w.key.mean(dim=1, keepdim=True)
        k = torch.cat([key, w.key_bias[:, None, :]], dim=1)
        qc = torch.complex(q[..., pairs[:, 0]], q[..., pairs[:, 1]])  # (h, d+1, P)
        kc = torch.complex(k[..., pairs[:, 0]], k[..., pairs[:, 1]])
        return qc, kc

    qs, ks = per_pair(source)
    qt, kt = per_pair(target)
    # <q k^H, q' k'^H> = (q^H q') conj(k^H k') per pair.
    cross = torch.einsum("iap,jap->ijp", qs.conj(), qt) * torch.einsum("iap,jap->ijp", ks.conj(), kt).conj()
    norm_s = (qs.abs() ** 2).sum(1) * (ks.abs() ** 2).sum(1)  # (h, P)
    norm_t = (qt.abs() ** 2).sum(1) * (kt.abs() ** 2).sum(1)
    return (norm_s[:, None, :] + norm_t[None, :, :] - 2 * cross.real).sum(-1)


def stage1_costs(source: dict, target: dict, layer, pe: str, options: AlignOptions, projector=None) -> dict:
    """Every Stage 1 cost; ``weight`` refines each candidate pair as ``options`` say, ``weight_orthogonal`` does not."""
    grams = LayerGrams.compute(source, target, layer)
    costs = {m: head_cost(grams, layer, dataclasses.replace(options, metric=m)) for m in METRICS}
    orthogonal_weight = dataclasses.replace(options, metric="weight", method="orthogonal")
    costs["weight_orthogonal"] = head_cost(grams, layer, orthogonal_weight)
    costs.update(invariant_parts(grams))
    if pe == "rope":
        costs["complex_pair_qk"] = complex_pair_cost(source, target, layer)
    if projector is not None:
        ps, pt = project_inputs(source, projector), project_inputs(target, projector)
        grams_v = LayerGrams.compute(ps, pt, layer)
        costs["visible_invariant"] = head_cost(grams_v, layer, dataclasses.replace(options, metric="invariant"))
        costs["visible_weight"] = head_cost(grams_v, layer, orthogonal_weight)
        costs.update({f"visible_{k}": v for k, v in invariant_parts(grams_v).items()})
        if pe == "rope":
            costs["visible_complex_pair_qk"] = complex_pair_cost(ps, pt, layer)
    return costs
