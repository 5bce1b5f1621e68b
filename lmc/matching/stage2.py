"""Stage 2 of attention alignment: the per-head group elements (paper Section 5; docs/spec.md, section 3).

Per matched key/value group, ``C`` (Q/K, in ``GL`` or ``H``) and ``B`` (V/O, in ``GL``): the best
orthogonal element, then L-BFGS on the exact objective, biases included. Where ``C`` lies in a
finite group of orthogonal elements (sign flips, under a per-head QK-norm), the best orthogonal
element is already the best one: no refinement, and never an element outside the group. Both problems have
one form,

    F(C) = ||X C - X'||^2 + ||Y C^{-T} - Y'||^2
         = q(C; A_X, G_X) + q(C^{-T}; A_Y, G_Y) + const,   q(Z; A, G) = tr(Z^T A Z) - 2 tr(Z^T G),

with ``X = [W_Q; b_Q]``, ``Y = [W_K; b_K]`` for ``C`` and ``X = [W_V; b_V]``, ``Y = W_O^T``
for ``B`` (since ``B^{-1} W_O = (W_O^T B^{-T})^T``); ``A = X^T X`` and ``G = X^T X'`` are
blocks of :class:`~lmc.matching.grams.LayerGrams`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmc.matching.grams import LayerGrams, frobenius_inner, trace
from lmc.matching.options import AlignOptions, Method
from lmc.symmetry import AttentionSpec, AttentionTransform, QKGroup, TiedGroup, qk_group, vo_group


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
        value = frobenius_inner(c, ax_c - 2 * self.g_x) + frobenius_inner(d, ay_d - 2 * self.g_y)
        value = torch.where(info == 0, value, torch.inf)
        if not gradient:
            return value, None
        m = 2 * (ay_d - self.g_y)
        return value, 2 * (ax_c - self.g_x) - d @ m.mT @ d

    def distance(self, c: torch.Tensor) -> torch.Tensor:
        """Squared weight distance after applying ``C``, shape ``(n,)``."""
        return (self.objective(c) + self.target_norm).clamp(min=0)


def orthogonal_start(problem: Stage2Problem, group: QKGroup) -> torch.Tensor:
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
    problems: list[Stage2Problem], groups: list[QKGroup], starts: list[torch.Tensor], options: AlignOptions
) -> list[torch.Tensor]:
    """Minimize every ``F`` by one L-BFGS run over all problems' group coordinates.

    A finite group (``num_coordinates == 0``: sign flips) keeps its start: every element is
    orthogonal, so :func:`orthogonal_start` already minimizes ``F`` over it.

    Each problem starts from the best of its given start and the least-squares candidates
    (:func:`least_squares_start`). The problems are independent, so one run over the
    concatenated coordinates (the sum of the objectives, each scaled by its target's squared
    norm) solves them all at the cost of one optimizer loop. Every iterate lies in its group by
    construction, and ``F`` grows without bound as ``C`` nears a singular matrix, which keeps
    the iterates invertible.

    Args:
        problems, groups, starts: One problem, its group and its start ``(n, d_h, d_h)`` each.
        options: ``steps``, ``lr`` and ``tolerance`` of L-BFGS.

    Returns:
        The refined ``C`` of each problem, float64; never worse than its start.
    """
    continuous = [i for i, group in enumerate(groups) if group.num_coordinates]
    if options.steps == 0 or not continuous:
        return starts
    refined = list(starts)
    descended = _descend(*([items[i] for i in continuous] for items in (problems, groups, starts)), options)
    for i, c in zip(continuous, descended):
        refined[i] = c
    return refined


def _descend(
    problems: list[Stage2Problem], groups: list[TiedGroup], starts: list[torch.Tensor], options: AlignOptions
) -> list[torch.Tensor]:
    """:func:`refine` over groups with coordinates."""
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


def solve_stage2(problem: Stage2Problem, group: QKGroup, options: AlignOptions) -> torch.Tensor:
    """Orthogonal start, then the gradient refinement if the method runs ``full``; ``(n, d_h, d_h)`` float64."""
    start = orthogonal_start(problem, group)
    return refine([problem], [group], [start], options)[0] if options.last_stage == "full" else start


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
        target_norm=per_group(trace(grams.query_target)) + trace(grams.key_target),
    )
    vo = Stage2Problem(
        a_x=grams.value_source[kv_source_of].double(),
        g_x=grams.block("value", kv_source_of, kv_targets),
        a_y=per_group(grams.out_source[source_of].double()),
        g_y=per_group(grams.block("out", source_of, targets)),
        target_norm=trace(grams.value_target) + per_group(trace(grams.out_target)),
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
    last_stage: Method,
    options: AlignOptions,
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
