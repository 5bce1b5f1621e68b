"""Exactness checks on trained pairs (float64): Stage 2 gradient, invariance of Stage 1 costs, the visible subspace.

Reads seeds 0 and 1 and the pre-trained model of each positional encoding (``lmc run``'s
checkpoints under ``--runs``, benchmarks/matcher_quality/README.md).

Usage: python -m benchmarks matcher_quality.checks --runs runs/matcher_quality
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.matcher_quality.costs import complex_pair_cost, project_inputs, visible_projector
from benchmarks.matcher_quality.pairs import (
    PES,
    Evaluator,
    build,
    load_run,
)
from lmc.adapters import model_spec
from lmc.matching import AlignOptions
from lmc.matching.grams import LayerGrams
from lmc.matching.heads import assign_heads, head_cost
from lmc.matching.stage2 import attention_stages, orthogonal_start, refine, stage2_problems
from lmc.symmetry import ModelTransform, qk_group, sample_attention_transform, vo_group


def gradient_check(problem, group, c: torch.Tensor) -> dict[str, float]:
    """Closed-form dF/dC against autograd and central finite differences, and the coordinate gradient."""
    _, closed = problem.value_and_gradient(c)
    leaf = c.clone().requires_grad_(True)
    problem.objective(leaf).sum().backward()
    auto = leaf.grad
    # Finite differences along a random direction inside the group's subspace.
    direction = group.project(torch.randn(c.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))
    step = 1e-6
    numeric = (problem.objective(c + step * direction) - problem.objective(c - step * direction)) / (2 * step)
    analytic = (closed * direction).sum(dim=(-1, -2))
    coords = group.to_coordinates(c).clone().requires_grad_(True)
    problem.objective(group.from_coordinates(coords)).sum().backward()
    return {
        "closed_vs_autograd_rel": float((closed - auto).norm() / auto.norm()),
        "directional_vs_finite_difference_rel": float((analytic - numeric).abs().max() / numeric.abs().max()),
        "coordinate_gradient_rel": float((group.coordinate_gradient(closed) - coords.grad).norm() / coords.grad.norm()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", default="runs/matcher_quality", help="lmc run output folders: <runs>/<pe>/seed<k>")
    parser.add_argument("--out", default="benchmarks/matcher_quality/results/checks.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = {}
    for pe in PES:
        pretrained = build(*load_run(args.runs, pe, "pretrain"), torch.float64)
        models = [build(*load_run(args.runs, pe, f"seed{s}"), torch.float64) for s in (0, 1)]
        spec = model_spec(models[0])
        layer = spec.blocks[0].attention
        target, source = ({n: p.detach().clone() for n, p in m.named_parameters()} for m in models)
        result = {}

        # 1. The visible subspace: projecting Q/K/V inputs onto it leaves the function unchanged.
        projector = visible_projector(target, pe)
        evaluator = Evaluator(models[0], [f"blocks.0.attn.{p}_proj.weight" for p in "qkv"])
        with torch.inference_mode():
            evaluator.images = evaluator.images.double()
            reference = models[0](images=evaluator.images).clone()
            projected = project_inputs(target, projector)
            for p in "qkv":
                name = f"blocks.0.attn.{p}_proj.weight"
                evaluator.parameters[name].copy_(projected[name])
            changed = models[0](images=evaluator.images).clone()
            for p in "qkv":
                name = f"blocks.0.attn.{p}_proj.weight"
                evaluator.parameters[name].copy_(target[name])
        result["visible_rank"] = int(torch.linalg.matrix_rank(projector))
        result["projected_logits_max_abs_change"] = float((changed - reference).abs().max())
        result["logits_max_abs"] = float(reference.abs().max())
        fractions = {}
        for label, params in (
            ("pretrained", dict(pretrained.named_parameters())),
            ("seed0", target),
            ("seed1", source),
        ):
            for p in "qkv":
                w = params[f"blocks.0.attn.{p}_proj.weight"].detach()
                fractions[f"{label}_{p}"] = float((w @ projector).pow(2).sum() / w.pow(2).sum())
        result["visible_share_of_squared_norm"] = fractions
        norm = dict(pretrained.named_parameters())
        gamma, beta = norm["blocks.0.attn_norm.weight"].detach(), norm["blocks.0.attn_norm.bias"].detach()
        result["attn_norm_gamma"] = [float(gamma.min()), float(gamma.mean()), float(gamma.max())]
        result["attn_norm_beta_norm"] = float(beta.norm())

        # 2. Stage 2 gradients on this trained pair, at the orthogonal start and at the refined point.
        grams = LayerGrams.compute(source, target, layer)
        match, kv_match = assign_heads(head_cost(grams, layer, AlignOptions(metric="invariant")), 1)
        problems = stage2_problems(grams, layer, match, kv_match)
        groups = (qk_group(layer), vo_group(layer))
        checks = {}
        for name, problem, group in zip(("qk", "vo"), problems, groups):
            start = orthogonal_start(problem, group)
            (refined,) = refine([problem], [group], [start], AlignOptions())
            (long,) = refine([problem], [group], [start], AlignOptions(steps=1000))
            checks[name] = {
                "at_orthogonal": gradient_check(problem, group, start),
                "at_refined": gradient_check(problem, group, refined),
                "distance_orthogonal": problem.distance(start).tolist(),
                "distance_refined_30": problem.distance(refined).tolist(),
                "distance_refined_1000": problem.distance(long).tolist(),
                "grad_norm_refined_30_scaled": (
                    group.coordinate_gradient(problem.value_and_gradient(refined)[1]).norm(dim=-1) / problem.target_norm
                ).tolist(),
            }
        result["stage2_gradient"] = checks

        # The full two-stage element is a symmetry of the source: logits unchanged (float64).
        stages = attention_stages(grams, layer, match, kv_match, "full", AlignOptions())
        aligned = {n: t.clone() for n, t in source.items()}
        ModelTransform(attention={0: stages["full"]}).apply_(aligned, spec)
        with torch.no_grad():
            before = models[1](images=evaluator.images)
            parameters = dict(models[1].named_parameters())
            for name, value in aligned.items():
                parameters[name].copy_(value)
            after = models[1](images=evaluator.images)
            for name, value in source.items():
                parameters[name].copy_(value)
        result["aligned_source_logits_max_abs_change"] = float((after - before).abs().max())

        # 3. Invariance of the Stage 1 costs: move the source by a random group element (heads kept in place).
        element = sample_attention_transform(layer, torch.Generator().manual_seed(1))
        identity = torch.arange(layer.num_heads)
        element = type(element)(identity, identity, element.qk, element.vo)
        moved = {n: t.clone() for n, t in source.items()}
        ModelTransform(attention={0: element}).apply_(moved, spec)
        grams_moved = LayerGrams.compute(moved, target, layer)
        invariance = {}
        # ``weight`` refines each candidate pair (method full, the default); ``orthogonal`` stops at the start.
        for label, options in (
            ("invariant", AlignOptions(metric="invariant")),
            ("correlation", AlignOptions(metric="correlation")),
            ("weight_refined", AlignOptions(metric="weight")),
            ("weight_orthogonal_only", AlignOptions(metric="weight", method="orthogonal")),
        ):
            before, after = head_cost(grams, layer, options), head_cost(grams_moved, layer, options)
            invariance[label] = float((after - before).abs().max() / before.abs().max())
        if pe == "rope":
            before, after = complex_pair_cost(source, target, layer), complex_pair_cost(moved, target, layer)
            invariance["complex_pair_qk"] = float((after - before).abs().max() / before.abs().max())
        result["cost_invariance_rel_change"] = invariance
        out[pe] = result
        print(pe, json.dumps(result, indent=1), flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
