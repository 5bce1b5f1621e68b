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

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from lmc.symmetry import AttentionSpec, AttentionTransform, TiedGroup, head_rows, qk_group, vo_group

METRICS = ("invariant", "weight", "correlation")


@dataclass(frozen=True)
class Stage2Options:
    """Gradient refinement of Stage 2 (L-BFGS with strong-Wolfe line search, float64).

    Attributes:
        steps: Most L-BFGS iterations. Independent pairs gain little after a few dozen (see
            ``benchmarks/``); planted pairs converge superlinearly well before.
        lr: L-BFGS step size (1 is the natural quasi-Newton step).
        tolerance: Stop when the largest gradient entry falls below this (each objective is
            scaled by its target's squared norm).
    """

    steps: int = 30
    lr: float = 1.0
    tolerance: float = 1e-12


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
    """The Gram blocks of one (source, target) layer pair, in the weights' dtype.

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
        grams: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name in ("query", "key", "value", "out"):
                rows_s, rows_t = head_rows(source, spec, name), head_rows(target, spec, name)
                bias_s = head_rows(source, spec, f"{name}_bias") if name != "out" else None
                bias_t = head_rows(target, spec, f"{name}_bias") if name != "out" else None
                grams[f"{name}_cross"] = _cross(rows_s, rows_t, bias_s, bias_t, d_h)
                grams[f"{name}_source"] = _self(rows_s, bias_s, d_h)
                grams[f"{name}_target"] = _self(rows_t, bias_t, d_h)
            grams["key_mean_source"] = head_rows(source, spec, "key").mean(dim=1).unflatten(0, (-1, d_h))
            grams["key_mean_target"] = head_rows(target, spec, "key").mean(dim=1).unflatten(0, (-1, d_h))
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
    q = queries_per_kv

    def per_query(kv: torch.Tensor) -> torch.Tensor:  # expand KV-group blocks to query heads
        kv = kv.repeat_interleave(q, 0)
        return kv.repeat_interleave(q, 2) if kv.ndim == 4 else kv

    def cross(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # (n, d_h, n', d_h) blocks -> (n, n')
        return torch.einsum("iajb,iajb->ij", a, b).double()

    return {
        "qk_cross": cross(grams.query_cross, per_query(key_cross)),
        "vo_cross": cross(per_query(grams.value_cross), grams.out_cross),
        "qk_source": _frobenius_inner(grams.query_source, per_query(key_source)).double(),
        "qk_target": _frobenius_inner(grams.query_target, per_query(key_target)).double(),
        "vo_source": _frobenius_inner(per_query(grams.value_source), grams.out_source).double(),
        "vo_target": _frobenius_inner(per_query(grams.value_target), grams.out_target).double(),
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


def _trace(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.diagonal(dim1=-2, dim2=-1).sum(-1).double()


def _pairwise_stage2_distance(
    grams: LayerGrams, spec: AttentionSpec, refine_candidates: bool, options: Stage2Options
) -> torch.Tensor:
    h, q = spec.num_heads, spec.queries_per_kv
    kv_of = torch.arange(h) // q
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(h), indexing="ij")
    rows, cols = rows.flatten(), cols.flatten()
    gs, gt = kv_of[rows], kv_of[cols]
    qk_problem = Stage2Problem(
        grams.query_source[rows].double(),
        grams.block("query", rows, cols),
        grams.key_source[gs].double(),
        grams.block("key", gs, gt),
        _trace(grams.query_target[cols]) + _trace(grams.key_target[gt]),
    )
    vo_problem = Stage2Problem(
        grams.value_source[gs].double(),
        grams.block("value", gs, gt),
        grams.out_source[rows].double(),
        grams.block("out", rows, cols),
        _trace(grams.value_target[gt]) + _trace(grams.out_target[cols]),
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
        """``F(C)`` per problem, shape ``(n,)``; ``inf`` where ``C`` is singular."""
        return self.value_and_gradient(c, gradient=False)[0]

    def value_and_gradient(self, c: torch.Tensor, gradient: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``F(C)`` and ``dF/dC`` in closed form (no autograd: this is the inner loop).

        With ``D = C^{-T}`` and ``M = 2 (A_Y D - G_Y)`` (the gradient of the ``D`` term in ``D``),
        ``dF/dC = 2 (A_X C - G_X) - D M^T D``.
        """
        inverse, info = torch.linalg.inv_ex(c)
        d = inverse.mT
        ax_c, ay_d = self.a_x @ c, self.a_y @ d
        value = _frobenius_inner(c, ax_c - 2 * self.g_x) + _frobenius_inner(d, ay_d - 2 * self.g_y)
        value = torch.where(info == 0, value, torch.inf)
        if not gradient:
            return value, None
        m = 2 * (ay_d - self.g_y)
        return value, 2 * (ax_c - self.g_x) - d @ m.mT @ d

    def distance(self, c: torch.Tensor) -> torch.Tensor:
        """Squared weight distance after applying ``C``, shape ``(n,)``."""
        return (self.objective(c) + self.target_norm).clamp(min=0)


def orthogonal_start(problem: Stage2Problem, group: TiedGroup) -> torch.Tensor:
    """The best orthogonal ``C`` of the group for each problem, ``(n, d_h, d_h)``.

    For orthogonal ``C``, ``C^{-T} = C`` and ``tr(C^T A C) = tr(A)``, so this maximizes
    ``<C, G_X + G_Y>``: orthogonal Procrustes (per rotary pair for ``H``).
    """
    return group.nearest_orthogonal(problem.g_x + problem.g_y)


def least_squares_start(problem: Stage2Problem, group: TiedGroup, start: torch.Tensor) -> torch.Tensor:
    """The best of ``start`` and the two one-sided least-squares solutions, per problem.

    ``A_X^{-1} G_X`` minimizes the first term alone, and ``(A_Y^{-1} G_Y)^{-T}`` the second (as a
    function of ``D = C^{-T}``); both are exact when the target is the source moved by a group
    element, and good starts otherwise. Each is projected onto the group's subspace; a
    candidate that is singular or worse is dropped.
    """
    candidates = [start]
    for a, g, flip in ((problem.a_x, problem.g_x, False), (problem.a_y, problem.g_y, True)):
        solution, info = torch.linalg.solve_ex(a, g)
        if flip:
            solution, info_inverse = torch.linalg.inv_ex(solution)
            solution, info = solution.mT, info | info_inverse
        candidate = group.project(torch.where((info == 0)[:, None, None], solution, start))
        candidates.append(candidate)
    values = torch.stack([problem.objective(c) for c in candidates])  # (candidates, n), inf if singular
    best = values.nan_to_num(nan=torch.inf).argmin(dim=0)
    return torch.stack(candidates)[best, torch.arange(len(best))]


def refine(
    problems: list[Stage2Problem], groups: list[TiedGroup], starts: list[torch.Tensor], options: Stage2Options
) -> list[torch.Tensor]:
    """Minimize every ``F`` by one L-BFGS run over all problems' group coordinates.

    Each problem starts from the best of its given start and the least-squares candidates
    (:func:`least_squares_start`). The problems are independent, so one run over the
    concatenated coordinates (the sum of the objectives, each scaled by its target's squared
    norm) solves them all at the cost of one optimizer loop. Every iterate lies in its group by
    construction, and ``F`` grows without bound as ``C`` nears a singular matrix, which keeps
    the iterates invertible.

    Returns:
        The refined ``C`` of each problem, float64; never worse than its start.
    """
    if options.steps == 0:
        return starts
    starts = [least_squares_start(p, g, start) for p, g, start in zip(problems, groups, starts)]
    scales = [p.target_norm.clamp(min=torch.finfo(torch.float64).tiny)[:, None, None] for p in problems]
    pieces = [g.to_coordinates(c) for g, c in zip(groups, starts)]
    sizes = [piece.numel() for piece in pieces]
    coordinates = torch.cat([piece.flatten() for piece in pieces])
    optimizer = torch.optim.LBFGS(
        [coordinates],
        lr=options.lr,
        max_iter=options.steps,
        tolerance_grad=options.tolerance,
        tolerance_change=1e-15,  # near float64 resolution: planted pairs must converge fully
        history_size=20,
        line_search_fn="strong_wolfe",
    )

    def unpack() -> list[torch.Tensor]:
        chunks = coordinates.split(sizes)
        return [g.from_coordinates(chunk.view_as(piece)) for g, chunk, piece in zip(groups, chunks, pieces)]

    def closure() -> torch.Tensor:
        loss = torch.zeros((), dtype=torch.float64)
        gradients = []
        for problem, group, scale, c in zip(problems, groups, scales, unpack()):
            value, gradient = problem.value_and_gradient(c)
            loss = loss + (value / scale[:, 0, 0]).sum()  # inf at a singular trial step: the line search backs off
            gradients.append(group.coordinate_gradient(gradient / scale).flatten())
        coordinates.grad = torch.cat(gradients)
        return loss

    optimizer.step(closure)
    # The line search only accepts decreases; still, never return a worse element than the start.
    refined = []
    for problem, start, c in zip(problems, starts, unpack()):
        better = problem.objective(c) <= problem.objective(start)
        refined.append(torch.where(better[:, None, None], c, start))
    return refined


def solve_stage2(problem: Stage2Problem, group: TiedGroup, refine_steps: bool, options: Stage2Options) -> torch.Tensor:
    """Orthogonal start, then (``refine_steps``) the gradient refinement; ``(n, d_h, d_h)`` float64."""
    start = orthogonal_start(problem, group)
    return refine([problem], [group], [start], options)[0] if refine_steps else start


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

    kv_targets = torch.arange(h_kv)
    qk = Stage2Problem(
        a_x=per_group(grams.query_source[source_of].double()),
        g_x=per_group(grams.block("query", source_of, targets)),
        a_y=grams.key_source[kv_source_of].double(),
        g_y=grams.block("key", kv_source_of, kv_targets),
        target_norm=per_group(_trace(grams.query_target)) + _trace(grams.key_target),
    )
    vo = Stage2Problem(
        a_x=grams.value_source[kv_source_of].double(),
        g_x=grams.block("value", kv_source_of, kv_targets),
        a_y=per_group(grams.out_source[source_of].double()),
        g_y=per_group(grams.block("out", source_of, targets)),
        target_norm=_trace(grams.value_target) + per_group(_trace(grams.out_target)),
    )
    return qk, vo


def stage_distances(
    grams: LayerGrams, spec: AttentionSpec, match: torch.Tensor, kv_match: torch.Tensor, stages: dict
) -> dict[str, float]:
    """Distance to the target over the layer's per-head weights and biases after each stage, from the Grams."""
    problems = stage2_problems(grams, spec, match, kv_match)
    distances = {}
    for stage, element in stages.items():
        squared = sum(float(p.distance(c).sum()) for p, c in zip(problems, (element.qk.double(), element.vo.double())))
        distances[stage] = squared**0.5
    return distances


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
        refined = refine(list(problems), list(groups), starts, options)
        stages["full"] = AttentionTransform(query_permutation, kv_permutation, *refined)
    return stages
