"""Along the Stage 2 refinement: weight distance and midpoint loss gap after k L-BFGS iterations.

For every pair (at the default Stage 1 order and at the top-1 order found by ``benchmarks/matcher_quality/pairs.py``),
run the refinement with ``steps = k`` and record the squared distance (all weights, and the part
visible to the function) and the loss gap at alpha = 0.5 (a lower bound of the barrier, equal
to it on the aligned curves measured here in most pairs).

Usage: python -m benchmarks matcher_quality.path --pe learned --seeds 5 [--pairs 0-1 ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.matcher_quality.costs import project_inputs, visible_projector
from benchmarks.matcher_quality.pairs import (
    ORDERS,
    Curve,
    Evaluator,
    aligned_weights,
    build,
    chosen_pairs,
    load_seeds,
    pair_arguments,
)
from lmc.data import Digits
from lmc.matching import AlignOptions
from lmc.matching.grams import LayerGrams
from lmc.matching.heads import assign_heads, head_cost
from lmc.matching.stage2 import attention_stages

STEPS = (0, 2, 5, 30)


def input_moment(model: torch.nn.Module) -> torch.Tensor:
    """Second moment ``E[[x, 1]^T [x, 1]]`` of the first attention layer's inputs on the training half B, float64."""
    data = Digits(part="B")
    data.setup("fit")
    images = torch.stack([data.train_set[i]["inputs"] for i in range(len(data.train_set))]).double()
    with torch.no_grad():
        x = model.blocks[0].attn_norm(model.embed(images=images)).reshape(-1, model.config.width)
    x = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)
    return x.T @ x / len(x)


def data_weighted(params: dict, root: torch.Tensor, prefix: str = "blocks.0.attn") -> dict:
    """Q/K/V weights and biases replaced by ``S [W; b]`` (``S`` the moment's square root): Grams become
    ``E[(x W + b)^T (x W' + b')]``, the function's own inner product on the layer's inputs."""
    weighted = dict(params)
    d = root.shape[0] - 1
    for p in ("q", "k", "v"):
        stacked = torch.cat([params[f"{prefix}.{p}_proj.weight"].T, params[f"{prefix}.{p}_proj.bias"][None]], dim=0)
        moved = root @ stacked  # (d + 1, out)
        weighted[f"{prefix}.{p}_proj.weight"] = moved[:d].T
        weighted[f"{prefix}.{p}_proj.bias"] = moved[d]
    return weighted


def main() -> None:
    parser = argparse.ArgumentParser()
    pair_arguments(parser)
    parser.add_argument("--results", default="benchmarks/matcher_quality/results", help="the study's per-pair JSON")
    args = parser.parse_args()
    pairs = chosen_pairs(parser, args)
    torch.set_num_threads(1)
    hyperparameters, states, models64, spec, names = load_seeds(args.runs, args.pe, args.seeds)
    layer = spec.blocks[0].attention
    output = {}
    for i, j in pairs:
        record = json.loads((Path(args.results) / f"{args.pe}_{i}_{j}.json").read_text())
        target = build(hyperparameters[i], states[i], torch.float32)
        evaluator = Evaluator(target, names)
        start = evaluator({n: p.detach() for n, p in target.named_parameters()})
        target64 = {n: p.detach() for n, p in models64[i].named_parameters()}
        source64 = {n: p.detach() for n, p in models64[j].named_parameters()}
        projector = visible_projector(target64, args.pe)
        source32 = {n: source64[n].float() for n in names}
        target32 = {n: target64[n].float() for n in names}
        end = Curve(evaluator, target32, source32, {0: start}).at(24)
        naive = record["naive"]["loss_barrier"]
        moment = input_moment(models64[i])
        values, vectors = torch.linalg.eigh(moment)
        root = vectors @ torch.diag(values.clamp(min=0).sqrt()) @ vectors.T
        data_grams = LayerGrams.compute(data_weighted(source64, root), data_weighted(target64, root), layer)
        all_grams = LayerGrams.compute(source64, target64, layer)
        visible_grams = LayerGrams.compute(
            project_inputs(source64, projector), project_inputs(target64, projector), layer
        )
        rows = {}
        orders = {"default": record["metrics"]["invariant"]["order"], "top1": record["top1_loss_barrier"]["order"]}
        for label, index in orders.items():
            match = ORDERS[index]
            for fit, grams in (("all", all_grams), ("visible", visible_grams), ("data", data_grams)):
                series = []
                for steps in STEPS:
                    options = AlignOptions(steps=steps)
                    t = attention_stages(grams, layer, match, match, "full", options)["full"]
                    weights = aligned_weights(source64, spec, 0, t, names)
                    gap = Curve(evaluator, target32, weights, {0: start, 24: end}).mid_gap()[0]
                    dist_all = sum(float((weights[n].double() - target64[n]).pow(2).sum()) for n in names)
                    seen = project_inputs({n: weights[n].double() for n in names}, projector)
                    goal = project_inputs(target64, projector)
                    dist_visible = sum(float((seen[n] - goal[n]).pow(2).sum()) for n in names)
                    cond = max(float(torch.linalg.cond(t.qk).max()), float(torch.linalg.cond(t.vo).max()))
                    series.append(
                        {
                            "steps": steps,
                            "mid_gap_pct": 100 * gap / naive,
                            "dist2": dist_all,
                            "dist2_visible": dist_visible,
                            "max_cond": cond,
                        }
                    )
                rows[f"{label}/{fit}"] = series
        # The data-weighted pipeline: its own Stage 1 order (invariant cost on weighted weights) and Stage 2.
        gaps = [o["full_mid_gap"][0] for o in record["orders"]]
        pipeline = {}
        for metric in ("invariant", "weight"):
            match, _ = assign_heads(head_cost(data_grams, layer, AlignOptions(metric=metric)), 1)
            index = next(k for k, o in enumerate(ORDERS) if torch.equal(o, match))
            pipeline[f"{metric}_order"] = index
            pipeline[f"{metric}_midgap_rank"] = 1 + sum(g < gaps[index] for g in gaps)
        match = ORDERS[pipeline["invariant_order"]]
        for stage, t in attention_stages(data_grams, layer, match, match, "full", AlignOptions()).items():
            c = Curve(evaluator, target32, aligned_weights(source64, spec, 0, t, names), {0: start, 24: end})
            pipeline[stage] = 100 * c.full()["loss_barrier"] / naive
        rows["data_pipeline"] = pipeline
        output[f"{i}-{j}"] = rows
        line = "  ".join(f"{k}: " + " ".join(f"{p['mid_gap_pct']:.1f}" for p in v) for k, v in rows.items() if "/" in k)
        line += f"  data pipeline: {rows['data_pipeline']}"
        print(f"{args.pe} {i}-{j}: {line}", flush=True)
    Path(args.results, f"path_{args.pe}.json").write_text(json.dumps(output))


if __name__ == "__main__":
    main()
