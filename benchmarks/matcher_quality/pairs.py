"""Matcher quality on trained pairs: every variant, every head order, Stage 2 diagnostics.

For each positional encoding and each pair ``i-j`` of fine-tuned seeds (target = lower seed ``i``,
source = higher seed ``j``, as ``align(source=seed j, target=seed i)``; ``lmc run`` names its
pair ``i_j`` the other way round, source ``i`` and target ``j``): barriers of naive, Stage 1 only
(per metric), orthogonal start and full Stage 2, and of all 24 head orders each followed by the
orthogonal start and by full Stage 2. Interpolations run on the validation split, 25 alphas.
The seeds are ``lmc run``'s checkpoints ``<runs>/<pe>/seed<k>/final.ckpt`` (benchmarks/matcher_quality/README.md).

Cost control (exact, not an approximation): a curve's barrier is at least its gap at the
midpoint (alpha = 0.5 is one of the 25 points), so an order whose midpoint gap already
exceeds a barrier cannot beat it. The 24 orders are evaluated at the midpoint first and full
curves are computed only for those that could be top-1 or could rank above a method's order.

Usage: python -m benchmarks matcher_quality.pairs --pe learned --seeds 5 [--pairs 0-1 ...]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.matcher_quality.costs import METRICS, project_inputs, stage1_costs, visible_projector
from lmc.adapters import model_spec, scope_parameters
from lmc.connectivity.interpolation import barriers, evenly_spaced
from lmc.data import Digits
from lmc.matching import AlignOptions, stage2  # stage2: its least-squares starts are switched off once below
from lmc.matching.grams import LayerGrams
from lmc.matching.heads import assign_heads
from lmc.matching.stage2 import attention_stages, stage_distances
from lmc.models import create_model
from lmc.symmetry import ModelTransform, read_attention, transform_attention
from lmc.tasks import DataInfo
from lmc.training.module import load_trained

ALPHAS = evenly_spaced(25)
MID = 12
ORDERS = [torch.tensor(o) for o in itertools.permutations(range(4))]
PES = ("learned", "rope")  # folder names under --runs, and the checkpoints' model_config["pe"]


# ------------------------------------------------------------------------------------------
# Models, evaluation, curves.
# ------------------------------------------------------------------------------------------


def load_run(runs: str | Path, pe: str, stage: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Hyper-parameters and backbone weights of ``lmc run``'s ``<runs>/<pe>/<stage>/final.ckpt``."""
    path = Path(runs) / pe / stage / "final.ckpt"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: train the pairs first (benchmarks/matcher_quality/README.md)")
    module, hyperparameters = load_trained(path)
    found = (hyperparameters.get("model_config") or {}).get("pe")
    if found != pe:
        raise ValueError(f"{path} is a model with pe={found!r}, not {pe!r}: pass --pe {found} or another --runs")
    return hyperparameters, module.model.state_dict()


def build(hyperparameters: dict[str, Any], state: dict, dtype: torch.dtype) -> torch.nn.Module:
    """The checkpoint's backbone in ``dtype``, in evaluation mode."""
    data = DataInfo(**hyperparameters["data"])
    model = create_model(hyperparameters["model"], dtype=dtype, data=data, **hyperparameters["model_config"])
    model.load_state_dict(state)
    return model.to(dtype).eval()


class Evaluator:
    """Validation loss/accuracy of the target model with its first attention layer replaced."""

    def __init__(self, model: torch.nn.Module, names: list[str]):
        data = Digits()
        data.setup("fit")
        val = data.val_set
        self.images = torch.stack([val[i]["inputs"] for i in range(len(val))])
        self.labels = torch.stack([val[i]["labels"] for i in range(len(val))])
        self.model, self.names = model, names
        self.parameters = dict(model.named_parameters())
        self.count = 0

    @torch.inference_mode()
    def __call__(self, weights: dict[str, torch.Tensor]) -> tuple[float, float]:
        for name in self.names:
            self.parameters[name].copy_(weights[name])
        logits = self.model(images=self.images).double()
        self.count += 1
        loss = F.cross_entropy(logits, self.labels, reduction="mean")
        return float(loss), float((logits.argmax(-1) == self.labels).double().mean())


class Curve:
    """A lazily evaluated interpolation target -> source (alpha 0 = target)."""

    def __init__(self, evaluator: Evaluator, target: dict, source: dict, ends: dict[int, tuple[float, float]]):
        self.evaluator, self.target, self.source = evaluator, target, source
        # alpha 0 is the target; alpha 1 a symmetry of the source, which computes the source's function
        # (the float32 evaluation differs from the source's in the last bits only): both are shared.
        self.points: dict[int, tuple[float, float]] = dict(ends)

    def at(self, k: int) -> tuple[float, float]:
        if k not in self.points:
            alpha = ALPHAS[k]
            weights = {n: torch.lerp(self.target[n], self.source[n], alpha) for n in self.evaluator.names}
            self.points[k] = self.evaluator(weights)
        return self.points[k]

    def mid_gap(self) -> tuple[float, float]:
        """Loss and accuracy gaps at alpha = 0.5: lower bounds of the two barriers."""
        (l0, a0), (l1, a1), (lm, am) = self.at(0), self.at(len(ALPHAS) - 1), self.at(MID)
        return lm - (l0 + l1) / 2, (a0 + a1) / 2 - am

    def full(self) -> dict[str, float]:
        points = [self.at(k) for k in range(len(ALPHAS))]
        return barriers([{"alpha": a, "loss": loss, "accuracy": acc} for a, (loss, acc) in zip(ALPHAS, points)])

    @property
    def complete(self) -> bool:
        return len(self.points) == len(ALPHAS)


def aligned_weights(source64: dict, spec, layer_index: int, transform, names: list[str]) -> dict:
    """Source's first-attention weights moved by ``transform``, float32."""
    weights = {n: source64[n].clone() for n in names}
    ModelTransform(attention={layer_index: transform}).apply_(weights, spec)
    return {n: w.float() for n, w in weights.items()}


def top1(curves: list[Curve], key: str) -> tuple[int, float]:
    """Exact best barrier over curves (``key`` loss or accuracy), computing full curves only when needed."""
    which = 0 if key == "loss_barrier" else 1
    order = sorted(range(len(curves)), key=lambda i: curves[i].mid_gap()[which])
    best, best_index = float("inf"), -1
    for i in order:
        if curves[i].mid_gap()[which] >= best:
            break
        value = curves[i].full()[key]
        if value < best:
            best, best_index = value, i
    return best_index, best


def rank(curves: list[Curve], chosen: int) -> int:
    """1 + number of orders with a strictly lower loss barrier than ``chosen`` (exact)."""
    value = curves[chosen].full()["loss_barrier"]
    better = 0
    for i, curve in enumerate(curves):
        if i != chosen and curve.mid_gap()[0] < value and curve.full()["loss_barrier"] < value:
            better += 1
    return better + 1


def order_index(match: torch.Tensor) -> int:
    return next(i for i, o in enumerate(ORDERS) if torch.equal(o, match))


# ------------------------------------------------------------------------------------------
# Stage 2 diagnostics.
# ------------------------------------------------------------------------------------------


def term_breakdown(source: dict, target: dict, layer, transform) -> dict[str, float]:
    """Squared distance to the target per term (Q, K, V, O and biases) after ``transform``."""
    moved = transform_attention(read_attention(source, layer), transform)
    goal = read_attention(target, layer)
    return {
        name: float((getattr(moved, name) - getattr(goal, name)).pow(2).sum())
        for name in ("query", "key", "value", "out", "query_bias", "key_bias", "value_bias")
    }


def conditioning(matrices: torch.Tensor) -> dict[str, list[float]]:
    s = torch.linalg.svdvals(matrices.double())
    return {"cond": (s[:, 0] / s[:, -1]).tolist(), "smax": s[:, 0].tolist(), "smin": s[:, -1].tolist()}


def pair_study(pe, target64, source64, spec, layer, names, evaluator, start, projector, options) -> dict:
    record: dict = {}
    target32 = {n: target64[n].float() for n in names}
    source32 = {n: source64[n].float() for n in names}

    naive_curve = Curve(evaluator, target32, source32, {0: start})
    naive = naive_curve.full()
    record["naive"] = naive
    ends = {0: start, len(ALPHAS) - 1: naive_curve.at(len(ALPHAS) - 1)}
    cache: dict[str, Curve] = {}

    def curve(weights: dict, key: str | None = None) -> Curve:
        if key is None or key not in cache:
            made = Curve(evaluator, target32, weights, ends)
            if key is None:
                return made
            cache[key] = made
        return cache[key]

    def transform_curve(transform, key: str) -> Curve:
        """Memoized by ``key`` = stage/order; a transform equal to a cached one reuses its curve."""
        for other_key, (other, made) in transforms_seen.items():
            if torch.allclose(other.qk, transform.qk, atol=1e-12) and torch.allclose(
                other.vo, transform.vo, atol=1e-12
            ):
                if torch.equal(other.query_permutation, transform.query_permutation):
                    return made
        made = curve(aligned_weights(source64, spec, 0, transform, names), key)
        transforms_seen[key] = (transform, made)
        return made

    transforms_seen: dict = {}

    # All 24 orders: orthogonal start and full Stage 2.
    grams = LayerGrams.compute(source64, target64, layer)
    per_order = {"orthogonal": [], "full": []}
    transforms = {"orthogonal": [], "full": []}
    record["orders"] = []
    for match in ORDERS:
        stages = attention_stages(grams, layer, match, match, "full", options)
        distances = stage_distances(grams, layer, match, match, stages)
        for stage in ("orthogonal", "full"):
            transforms[stage].append(stages[stage])
            per_order[stage].append(transform_curve(stages[stage], f"{stage}/{match.tolist()}"))
        record["orders"].append({"match": match.tolist(), "distance": distances})
    for stage in ("orthogonal", "full"):
        for i, c in enumerate(per_order[stage]):
            record["orders"][i][f"{stage}_mid_gap"] = c.mid_gap()

    # Stage 1 metrics: their orders, the three variants, ranks.
    costs = stage1_costs(source64, target64, layer, pe, options, projector)
    record["costs"] = {k: v.tolist() for k, v in costs.items()}
    record["metrics"] = {}
    for metric in list(METRICS) + ["visible_invariant"]:
        match, _ = assign_heads(costs[metric], 1)
        index = order_index(match)
        stages = attention_stages(grams, layer, match, match, "permutation", options)
        v1 = transform_curve(stages["permutation"], f"permutation/{match.tolist()}").full()
        record["metrics"][metric] = {
            "order": index,
            "permutation": v1,
            "orthogonal": per_order["orthogonal"][index].full(),
            "full": per_order["full"][index].full(),
            "rank": rank(per_order["full"], index),
        }
    for key in ("loss_barrier", "accuracy_barrier"):
        best, value = top1(per_order["full"], key)
        record[f"top1_{key}"] = {"order": best, "value": value}
    # Full barriers where computed (exact), for rank correlations.
    for stage in ("orthogonal", "full"):
        for i, c in enumerate(per_order[stage]):
            record["orders"][i][f"{stage}_barrier"] = c.full()["loss_barrier"] if c.complete else None

    # Stage 2 diagnostics at the invariant metric's order (the default pipeline).
    index = record["metrics"]["invariant"]["order"]
    diag = {}
    for stage in ("orthogonal", "full"):
        t = transforms[stage][index]
        diag[stage] = {
            "terms": term_breakdown(source64, target64, layer, t),
            "C": conditioning(t.qk),
            "B": conditioning(t.vo),
        }
    # Variants of Stage 2 at that order: no least-squares candidates; fitted on visible weights only.
    match = ORDERS[index]
    original = stage2.least_squares_start
    stage2.least_squares_start = lambda problem, group, start: start  # orthogonal start only (refine reads it)
    try:
        no_ls = attention_stages(grams, layer, match, match, "full", options)["full"]
    finally:
        stage2.least_squares_start = original
    diag["full_no_least_squares"] = {
        "barrier": transform_curve(no_ls, "no_least_squares").full(),
        "terms": term_breakdown(source64, target64, layer, no_ls),
        "C": conditioning(no_ls.qk),
        "B": conditioning(no_ls.vo),
    }
    visible = LayerGrams.compute(project_inputs(source64, projector), project_inputs(target64, projector), layer)
    for stage, t in attention_stages(visible, layer, match, match, "full", options).items():
        if stage == "permutation":
            continue
        diag[f"visible_{stage}"] = {
            "barrier": transform_curve(t, f"visible_{stage}/{match.tolist()}").full(),
            "terms": term_breakdown(source64, target64, layer, t),
            "C": conditioning(t.qk),
            "B": conditioning(t.vo),
        }
    record["stage2"] = diag
    # The visible-weights pipeline end to end: its Stage 1 order (visible invariant) and its Stage 2.
    vmatch, _ = assign_heads(costs["visible_invariant"], 1)
    for stage, t in attention_stages(visible, layer, vmatch, vmatch, "full", options).items():
        c = transform_curve(t, f"visible_{stage}/{vmatch.tolist()}")
        record.setdefault("visible_pipeline", {})[stage] = c.full()
    return record


def pair_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that say which checkpoints and pairs a script reads (``study.py`` and ``path.py``)."""
    parser.add_argument("--runs", default="runs/matcher_quality", help="lmc run output folders: <runs>/<pe>/seed<k>")
    parser.add_argument("--pe", default="learned", choices=PES)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--pairs", nargs="+", metavar="I-J", help="only these pairs (default: every pair of --seeds)")


def chosen_pairs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[tuple[int, int]]:
    """Pairs ``(i, j)``, ``i < j < args.seeds``: all of them, or those ``--pairs`` names."""
    every = list(itertools.combinations(range(args.seeds), 2))
    if args.pairs is None:
        return every
    chosen = []
    for text in args.pairs:
        try:
            pair = tuple(int(k) for k in text.split("-"))
        except ValueError:
            pair = None
        if pair not in every:
            parser.error(f"--pairs {text}: name a pair as I-J with I < J < --seeds ({args.seeds}), e.g. 0-1")
        chosen.append(pair)
    return chosen


def load_seeds(runs: str, pe: str, seeds: int):
    """Each seed's hyper-parameters, weights and float64 model, the spec, and the first layer's parameter names."""
    hyperparameters, states = zip(*(load_run(runs, pe, f"seed{s}") for s in range(seeds)))
    models64 = [build(h, s, torch.float64) for h, s in zip(hyperparameters, states)]
    spec = model_spec(models64[0])
    return hyperparameters, states, models64, spec, scope_parameters(models64[0], "first_attention", spec)


def main() -> None:
    parser = argparse.ArgumentParser()
    pair_arguments(parser)
    parser.add_argument("--out", default="benchmarks/matcher_quality/results")
    args = parser.parse_args()
    pairs = chosen_pairs(parser, args)
    torch.set_num_threads(1)
    hyperparameters, states, models64, spec, names = load_seeds(args.runs, args.pe, args.seeds)
    layer = spec.blocks[0].attention
    options = AlignOptions()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for i, j in pairs:
        path = out / f"{args.pe}_{i}_{j}.json"
        if path.exists():  # finished earlier: the study resumes pair by pair
            continue
        started = time.time()
        target = build(hyperparameters[i], states[i], torch.float32)
        evaluator = Evaluator(target, names)
        start = evaluator({n: p.detach() for n, p in target.named_parameters()})
        target64 = {n: p.detach() for n, p in models64[i].named_parameters()}
        source64 = {n: p.detach() for n, p in models64[j].named_parameters()}
        projector = visible_projector(target64, args.pe)
        record = pair_study(args.pe, target64, source64, spec, layer, names, evaluator, start, projector, options)
        record.update(pair=[i, j], pe=args.pe, evaluations=evaluator.count, seconds=time.time() - started)
        record["visible_rank"] = int(torch.linalg.matrix_rank(projector))
        path.write_text(json.dumps(record))
        m = record["metrics"]["invariant"]
        n = record["naive"]["loss_barrier"]
        print(
            f"{args.pe} {i}-{j}: naive {n:.4f} perm {100 * m['permutation']['loss_barrier'] / n:.1f}% "
            f"orth {100 * m['orthogonal']['loss_barrier'] / n:.1f}% full {100 * m['full']['loss_barrier'] / n:.1f}% "
            f"top1 {100 * record['top1_loss_barrier']['value'] / n:.1f}% rank {m['rank']} "
            f"visible {100 * record['visible_pipeline']['full']['loss_barrier'] / n:.1f}% "
            f"({record['evaluations']} evals, {record['seconds']:.0f}s)",
            flush=True,
        )


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
