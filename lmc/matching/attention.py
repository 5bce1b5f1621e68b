"""Two-stage alignment of one attention layer (paper Section 5; SPEC section 3).

Stage 1 orders the heads by a linear assignment on an ``h x h`` cost; Stage 2 finds, per
matched key/value group, ``C`` (Q/K, in ``GL`` or ``H``) and ``B`` (V/O, in ``GL``): the best
orthogonal element, then L-BFGS on the exact objective, biases included.

Everything is computed from ``d_h x d_h`` blocks of four cross-Gram matrices (``W^T W'`` for
Q, K, V and ``W_O W_O'^T``) and the diagonal blocks of the self-Grams, so after one GEMM pass
per layer no step depends on the model width. Both Stage 2 problems have one form,

    F(C) = ||X C - X'||^2 + ||Y C^{-T} - Y'||^2
         = q(C; A_X, G_X) + q(C^{-T}; A_Y, G_Y) + const,   q(Z; A, G) = tr(Z^T A Z) - 2 tr(Z^T G),

with ``X = [W_Q; b_Q]``, ``Y = [W_K; b_K]`` for ``C`` and ``X = [W_V; b_V]``, ``Y = W_O^T``
for ``B`` (since ``B^{-1} W_O = (W_O^T B^{-T})^T``); ``A = X^T X`` and ``G = X^T X'``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from lmc.symmetry import AttentionSpec, AttentionTransform, AttentionWeights, TiedGroup, qk_group, vo_group

METRICS = ("invariant", "weight", "correlation")


@dataclass(frozen=True)
class Stage2Options:
    """Gradient refinement of Stage 2 (L-BFGS with strong-Wolfe line search, float64).

    Attributes:
        steps: Most L-BFGS iterations.
        lr: L-BFGS step size (1 is the natural quasi-Newton step).
        tolerance: Stop when the gradient's largest entry falls below this (the objective is
            scaled by the target's squared norm).
    """

    steps: int = 500
    lr: float = 1.0
    tolerance: float = 1e-12


def _stacked(per_head: torch.Tensor) -> torch.Tensor:
    """``(n, rows, d_h)`` -> ``(rows, n * d_h)``: head ``i`` owns columns ``i*d_h:(i+1)*d_h``."""
    return per_head.permute(1, 0, 2).reshape(per_head.shape[1], -1)


def _cross(a: torch.Tensor, b: torch.Tensor, a_bias: torch.Tensor | None, b_bias: torch.Tensor | None) -> torch.Tensor:
    """All blocks of ``[A; a_bias]^T [B; b_bias]``, shape ``(n_a, n_b, d_h, d_h)`` (one GEMM)."""
    gram = _stacked(a).T @ _stacked(b)
    if a_bias is not None:
        gram = gram + a_bias.reshape(-1, 1) * b_bias.reshape(1, -1)
    n_a, n_b, d_h = a.shape[0], b.shape[0], a.shape[2]
    return gram.reshape(n_a, d_h, n_b, d_h).transpose(1, 2)


def _self(a: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Diagonal blocks ``[A_i; b_i]^T [A_i; b_i]``, shape ``(n, d_h, d_h)``."""
    gram = a.mT @ a
    if bias is not None:
        gram = gram + bias[:, :, None] * bias[:, None, :]
    return gram


@dataclass
class LayerGrams:
    """The Gram blocks of one (source, target) layer pair, in float64.

    ``*_cross[i, j] = X_i^T X'_j``; ``*_source[i] = X_i^T X_i``; ``*_target[j] = X'_j^T X'_j``.
    ``key_mean_*`` are the means over the ``d`` input rows of each key head (for row-centring).
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
    def compute(cls, source: AttentionWeights, target: AttentionWeights) -> LayerGrams:
        if (source.key_bias is None) != (target.key_bias is None):
            raise ValueError("source and target differ in which biases they have")
        # The d-sized GEMMs run in the weights' dtype (the cost floor); the small blocks in float64.
        out_s, out_t = source.out.mT, target.out.mT  # (h, d, d_h): B^{-1} W_O = (W_O^T B^{-T})^T
        grams = {
            "query_cross": _cross(source.query, target.query, source.query_bias, target.query_bias),
            "key_cross": _cross(source.key, target.key, source.key_bias, target.key_bias),
            "value_cross": _cross(source.value, target.value, source.value_bias, target.value_bias),
            "out_cross": _cross(out_s, out_t, None, None),
            "query_source": _self(source.query, source.query_bias),
            "key_source": _self(source.key, source.key_bias),
            "value_source": _self(source.value, source.value_bias),
            "out_source": _self(out_s, None),
            "query_target": _self(target.query, target.query_bias),
            "key_target": _self(target.key, target.key_bias),
            "value_target": _self(target.value, target.value_bias),
            "out_target": _self(out_t, None),
            "key_mean_source": source.key.mean(dim=1),
            "key_mean_target": target.key.mean(dim=1),
        }
        return cls(**{name: value.double() for name, value in grams.items()}, width=source.key.shape[1])

    def centred_key(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Key Grams with each head's weight rows centred: the part of ``W_Q W_K^T`` softmax keeps.

        ``K_c = K - 1 k_mean`` gives ``K_c^T K_c' = K^T K' - d k_mean^T k_mean'`` (the bias row
        is not centred).
        """
        d = self.width
        ms, mt = self.key_mean_source, self.key_mean_target
        cross = self.key_cross - d * ms[:, None, :, None] * mt[None, :, None, :]
        source = self.key_source - d * ms[:, :, None] * ms[:, None, :]
        target = self.key_target - d * mt[:, :, None] * mt[:, None, :]
        return cross, source, target


def _frobenius_inner(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b).sum(dim=(-1, -2))


def invariant_products(grams: LayerGrams, queries_per_kv: int) -> dict[str, torch.Tensor]:
    """Inner products of the invariants ``M_i = Q_i K_g^T`` (row-centred) and ``N_i = V_g O_i``.

    Uses ``<A1 B1^T, A2 B2^T> = sum((A1^T A2) * (B1^T B2))``: no ``d x d`` matrix is formed.

    Returns:
        ``qk_cross``, ``vo_cross`` of shape ``(h, h)`` and ``qk_source``, ``qk_target``,
        ``vo_source``, ``vo_target`` of shape ``(h,)``.
    """
    key_cross, key_source, key_target = grams.centred_key()

    def per_query(kv: torch.Tensor) -> torch.Tensor:  # expand KV-group blocks to query heads
        kv = kv.repeat_interleave(queries_per_kv, 0)
        return kv.repeat_interleave(queries_per_kv, 1) if kv.ndim == 4 else kv

    return {
        "qk_cross": _frobenius_inner(grams.query_cross, per_query(key_cross)),
        "vo_cross": _frobenius_inner(per_query(grams.value_cross), grams.out_cross),
        "qk_source": _frobenius_inner(grams.query_source, per_query(key_source)),
        "qk_target": _frobenius_inner(grams.query_target, per_query(key_target)),
        "vo_source": _frobenius_inner(per_query(grams.value_source), grams.out_source),
        "vo_target": _frobenius_inner(per_query(grams.value_target), grams.out_target),
    }


def head_cost(
    grams: LayerGrams, spec: AttentionSpec, metric: str, refine_candidates: bool, options: Stage2Options
) -> torch.Tensor:
    """Stage 1 cost between source query head ``i`` and target query head ``j``, shape ``(h, h)``.

    Metrics:
        ``invariant``: ``||M_i - M_j'||^2 + ||N_i - N_j'||^2`` (group-invariant products).
        ``weight``: the squared weight distance left after Stage 2 for each candidate pair
            (orthogonal start, plus the gradient refinement when ``refine_candidates``); with GQA the
            pair's own query head and its KV head stand for the group.
        ``correlation``: minus the cosine similarities of ``M`` and of ``N`` (scale-free).
    """
    if metric not in METRICS:
        raise ValueError(f"unknown head metric {metric!r}; choose one of {', '.join(METRICS)}")
    q = spec.queries_per_kv
    if metric == "weight":
        return _pairwise_stage2_distance(grams, spec, refine_candidates, options)
    p = invariant_products(grams, q)
    if metric == "invariant":
        qk = p["qk_source"][:, None] + p["qk_target"][None, :] - 2 * p["qk_cross"]
        vo = p["vo_source"][:, None] + p["vo_target"][None, :] - 2 * p["vo_cross"]
        return qk + vo
    tiny = torch.finfo(torch.float64).tiny
    qk = p["qk_cross"] / (p["qk_source"][:, None] * p["qk_target"][None, :]).clamp(min=tiny).sqrt()
    vo = p["vo_cross"] / (p["vo_source"][:, None] * p["vo_target"][None, :]).clamp(min=tiny).sqrt()
    return -(qk + vo)


def _pairwise_stage2_distance(
    grams: LayerGrams, spec: AttentionSpec, refine_candidates: bool, options: Stage2Options
) -> torch.Tensor:
    h, q = spec.num_heads, spec.queries_per_kv
    kv_of = torch.arange(h) // q
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(h), indexing="ij")
    rows, cols = rows.flatten(), cols.flatten()
    gs, gt = kv_of[rows], kv_of[cols]
    qk_problem = Stage2Problem(
        grams.query_source[rows],
        grams.query_cross[rows, cols],
        grams.key_source[gs],
        grams.key_cross[gs, gt],
        grams.query_target[cols].diagonal(dim1=-2, dim2=-1).sum(-1)
        + grams.key_target[gt].diagonal(dim1=-2, dim2=-1).sum(-1),
    )
    vo_problem = Stage2Problem(
        grams.value_source[gs],
        grams.value_cross[gs, gt],
        grams.out_source[rows],
        grams.out_cross[rows, cols],
        grams.value_target[gt].diagonal(dim1=-2, dim2=-1).sum(-1)
        + grams.out_target[cols].diagonal(dim1=-2, dim2=-1).sum(-1),
    )
    total = torch.zeros(h * h, dtype=torch.float64)
    for problem, group in ((qk_problem, qk_group(spec)), (vo_problem, vo_group(spec))):
        total += problem.distance(solve_stage2(problem, group, refine_candidates, options))
    return total.reshape(h, h)


def assign_heads(cost: torch.Tensor, queries_per_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Solve Stage 1: KV groups by a linear assignment on group costs, then query heads inside.

    The cost of pairing source group ``g`` with target group ``g'`` is the optimal inner
    assignment of their query heads, so the result minimizes the total cost over every
    permutation that keeps query heads with their KV head.

    Args:
        cost: ``(h, h)`` cost of source query head ``i`` -> target query head ``j``.
        queries_per_kv: Query heads per KV head (1 without GQA).

    Returns:
        ``(match, kv_match)``: target head of each source query head ``(h,)`` and target KV
        head of each source KV head ``(h_kv,)``.
    """
    q = queries_per_kv
    h_kv = cost.shape[0] // q
    blocks = cost.double().cpu().numpy().reshape(h_kv, q, h_kv, q).transpose(0, 2, 1, 3)  # (g, g', i, j)
    inner = {}
    group_cost = np.zeros((h_kv, h_kv))
    for g in range(h_kv):
        for g2 in range(h_kv):
            rows, cols = linear_sum_assignment(blocks[g, g2])
            inner[g, g2] = cols
            group_cost[g, g2] = blocks[g, g2][rows, cols].sum()
    _, kv_match = linear_sum_assignment(group_cost)
    match = np.concatenate([kv_match[g] * q + inner[g, kv_match[g]] for g in range(h_kv)])
    return torch.as_tensor(match), torch.as_tensor(kv_match)


@dataclass
class Stage2Problem:
    """A batch of problems ``min F(C)`` (module docstring), each ``d_h x d_h``.

    Attributes:
        a_x, g_x, a_y, g_y: ``A_X, G_X, A_Y, G_Y``, shape ``(n, d_h, d_h)``, float64.
        target_norm: ``||X'||^2 + ||Y'||^2``, shape ``(n,)``: ``F + target_norm`` is the squared distance.
    """

    a_x: torch.Tensor
    g_x: torch.Tensor
    a_y: torch.Tensor
    g_y: torch.Tensor
    target_norm: torch.Tensor

    def objective(self, c: torch.Tensor) -> torch.Tensor:
        """``F(C)`` per problem, shape ``(n,)``."""
        d = torch.linalg.inv(c).mT
        return _quadratic(c, self.a_x, self.g_x) + _quadratic(d, self.a_y, self.g_y)

    def distance(self, c: torch.Tensor) -> torch.Tensor:
        """Squared weight distance after applying ``C``, shape ``(n,)``."""
        return (self.objective(c) + self.target_norm).clamp(min=0)


def _quadratic(z: torch.Tensor, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return _frobenius_inner(z, a @ z) - 2 * _frobenius_inner(z, g)


def orthogonal_start(problem: Stage2Problem, group: TiedGroup) -> torch.Tensor:
    """The best orthogonal ``C`` of the group for each problem, ``(n, d_h, d_h)``.

    For orthogonal ``C``, ``C^{-T} = C`` and ``tr(C^T A C) = tr(A)``, so this maximizes
    ``<C, G_X + G_Y>``: orthogonal Procrustes (per rotary pair for ``H``).
    """
    return group.nearest_orthogonal(problem.g_x + problem.g_y)


def refine(problem: Stage2Problem, group: TiedGroup, start: torch.Tensor, options: Stage2Options) -> torch.Tensor:
    """Minimize ``F`` from ``start`` by L-BFGS on the group's coordinates (float64, batched).

    Every iterate lies in the group by construction, and ``F`` grows without bound as ``C``
    nears a singular matrix, which keeps the iterates invertible.
    """
    if options.steps == 0:
        return start
    scale = problem.target_norm.clamp(min=torch.finfo(torch.float64).tiny)
    coordinates = group.to_coordinates(start).clone().requires_grad_(True)
    optimizer = torch.optim.LBFGS(
        [coordinates],
        lr=options.lr,
        max_iter=options.steps,
        tolerance_grad=options.tolerance,
        tolerance_change=1e-15,
        history_size=20,
        line_search_fn="strong_wolfe",
    )

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = (problem.objective(group.from_coordinates(coordinates)) / scale).sum()
        if not torch.isfinite(loss):  # a trial step reached a singular C: reject it
            return torch.tensor(float("inf"), dtype=torch.float64)
        loss.backward()
        return loss

    optimizer.step(closure)
    refined = group.from_coordinates(coordinates.detach())
    # The line search only accepts decreases; still, never return a worse element than the start.
    better = problem.objective(refined) <= problem.objective(start)
    return torch.where(better[:, None, None], refined, start)


def solve_stage2(problem: Stage2Problem, group: TiedGroup, refine_steps: bool, options: Stage2Options) -> torch.Tensor:
    """Orthogonal start, then (``refine_steps``) the gradient refinement; ``(n, d_h, d_h)`` float64."""
    start = orthogonal_start(problem, group)
    return refine(problem, group, start, options) if refine_steps else start


def stage2_problems(
    grams: LayerGrams, spec: AttentionSpec, match: torch.Tensor, kv_match: torch.Tensor
) -> tuple[Stage2Problem, Stage2Problem]:
    """The Q/K and V/O problems of each target KV group, given the Stage 1 matching.

    For target group ``g`` (source group ``s``): ``C_g`` sums over key head ``s`` and every
    query head it serves; ``B_g`` over value head ``s`` and every served output block.
    """
    h, q = spec.num_heads, spec.queries_per_kv
    h_kv = spec.num_kv_heads
    source_of = torch.argsort(match)  # target query head -> source query head
    kv_source_of = torch.argsort(kv_match)
    targets = torch.arange(h)

    def per_group(blocks: torch.Tensor) -> torch.Tensor:  # (h, ...) -> (h_kv, ...) summed over served heads
        return blocks.reshape(h_kv, q, *blocks.shape[1:]).sum(dim=1)

    def trace(blocks: torch.Tensor) -> torch.Tensor:
        return blocks.diagonal(dim1=-2, dim2=-1).sum(-1)

    kv_targets = torch.arange(h_kv)
    qk = Stage2Problem(
        a_x=per_group(grams.query_source[source_of]),
        g_x=per_group(grams.query_cross[source_of, targets]),
        a_y=grams.key_source[kv_source_of],
        g_y=grams.key_cross[kv_source_of, kv_targets],
        target_norm=per_group(trace(grams.query_target)) + trace(grams.key_target),
    )
    vo = Stage2Problem(
        a_x=grams.value_source[kv_source_of],
        g_x=grams.value_cross[kv_source_of, kv_targets],
        a_y=per_group(grams.out_source[source_of]),
        g_y=per_group(grams.out_cross[source_of, targets]),
        target_norm=trace(grams.value_target) + per_group(trace(grams.out_target)),
    )
    return qk, vo


def attention_stages(
    grams: LayerGrams,
    spec: AttentionSpec,
    match: torch.Tensor,
    kv_match: torch.Tensor,
    last_stage: str,
    options: Stage2Options,
) -> dict[str, AttentionTransform]:
    """The group elements aligning the source layer to the target, after each stage up to ``last_stage``.

    Stages: ``"permutation"`` (Stage 1 only, ``C = B = I``), ``"orthogonal"`` (plus the best
    orthogonal elements) and ``"full"`` (plus the gradient refinement).
    """
    identity = AttentionTransform.identity(spec)
    query_permutation, kv_permutation = torch.argsort(match), torch.argsort(kv_match)
    stages = {"permutation": AttentionTransform(query_permutation, kv_permutation, identity.qk, identity.vo)}
    if last_stage == "permutation":
        return stages
    problems = stage2_problems(grams, spec, match, kv_match)
    groups = (qk_group(spec), vo_group(spec))
    starts = [orthogonal_start(problem, group) for problem, group in zip(problems, groups)]
    stages["orthogonal"] = AttentionTransform(query_permutation, kv_permutation, *starts)
    if last_stage == "full":
        refined = [refine(p, g, start, options) for p, g, start in zip(problems, groups, starts)]
        stages["full"] = AttentionTransform(query_permutation, kv_permutation, *refined)
    return stages
