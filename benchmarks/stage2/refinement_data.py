"""Stage 2's refinement on the data: what the midpoint's first attention layer computes, orthogonal start against full.

For every pair of a finished ``first_attention`` run folder (source seed ``i`` aligned to target
seed ``j``, as ``lmc run`` does), the pair is aligned with the paper's Stage 1 and Stage 2 as the
orthogonal start alone (Variant 2) and as the full refinement (``full``); both share the head
order. At the midpoint (``alpha = 1/2``) the first attention layer's heads are compared with the
end points' on the run's curve samples (the validation split). The layer's input is the same for
the three models (everything before it is frozen and shared), so every difference is the layer's.

Per head ``i``, with ``P`` the attention probabilities and ``u = (x W_V + b_V) W_O`` what each
token's value writes into the residual stream, the head's output is ``P u``; ``A`` is the aligned
source, ``B`` the target, ``M`` the midpoint, and a bar the mean of ``A`` and ``B``. Then exactly

    P_M u_M - (P_A u_A + P_B u_B) / 2 = (P_M - P_bar) u_bar  +  P_M (u_M - u_bar)  -  (P_A - P_B)(u_A - u_B) / 4
                                        Q/K part (pattern)      V/O part (values)     fixed part

and the fixed part is the same for every group element (``P_A``, ``u_A`` are functions of the
source, which the element does not change), so a refinement can only move the first two. Each is
reported as a mean squared norm per token (per head, and of the heads' sum: the layer's output),
with the attention pattern's change itself (total variation between ``P_M`` and ``P_bar``), the
value deviation ``u_M - u_bar`` and the score deviation ``s_M - s_bar``. Hybrid elements (the full
method's ``C`` with the orthogonal ``B``, and the reverse; both exact symmetries) attribute the
barrier change to the Q/K or the V/O half of the refinement. Spearman's rank correlation over the
pairs says which quantity's change follows the barrier change ``full - orthogonal``.

A planted control (:func:`benchmarks.stage2.midpoint_heads.planted_module`) checks that the refinement does
what it should where it can: each seed against itself moved by a random element of the layer's group
plus small noise.

    python -m benchmarks refinement_data --run runs/repro/mnist_vit_ape/first_attention \\
        --data configs/data/mnist_5k.yaml --name mnist_vit_ape
    # writes benchmarks/stage2/results/refinement_data.{json,md}; --report-only writes the .md again from the .json
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import statistics
from pathlib import Path

import torch
from scipy.stats import spearmanr
from torch import nn
from torch.utils.data import DataLoader

from benchmarks.run_files import datamodule, fine_tuned, loss_barrier, pair_result
from benchmarks.stage2.midpoint_heads import (
    condition_numbers,
    head_activity,
    hybrid,
    inputs_match,
    layer_io,
    layer_weights,
    loss_gradient,
    midpoint,
    midpoint_measures,
    midpoint_parts,
    patched_loss,
    planted_module,
)
from lmc.adapters import model_spec
from lmc.io import atomic_write_json, atomic_write_text
from lmc.matching import AlignOptions, align
from lmc.symmetry import AttentionSpec

RESULTS = Path(__file__).parent / "results" / "refinement_data"
SETTINGS = {"orthogonal": AlignOptions(method="orthogonal"), "full": AlignOptions()}
#: Hybrid elements: (where Q/K comes from, where V/O comes from).
HYBRIDS = {"full Q/K, orthogonal V/O": ("full", "orthogonal"), "orthogonal Q/K, full V/O": ("orthogonal", "full")}
#: The planted control's noise, relative to each scoped parameter's norm per entry.
PLANTED_NOISE = 0.05
#: Quantities of the midpoint whose change ``full - orthogonal`` is ranked against the barrier's:
#: name -> (where in a pair's entry, key); ``midpoint`` entries are read at ``sum`` when per head.
QUANTITIES = {
    "layer output deviation": ("midpoint", "output"),
    "Q/K part": ("midpoint", "qk_part"),
    "V/O part": ("midpoint", "vo_part"),
    "attention TV to the mean pattern": ("midpoint", "attention_tv"),
    "score deviation": ("midpoint", "score"),
    "value deviation": ("midpoint", "value"),
    "first token's output deviation": ("midpoint", "first_token"),
    "<fixed part, Q/K + V/O parts>": ("midpoint", "fixed_alignment"),
    "output norm / mean output norm": ("midpoint", "output_norm_ratio"),
    "attention entropy": ("midpoint", "entropy"),
    "midpoint loss": ("midpoint_loss", None),
    "first-order loss change": ("patched", "first order"),
}


def patched_losses(module, layer: AttentionSpec, batches: list, mean_output: torch.Tensor, parts: dict) -> dict:
    """The loss with the layer's output rebuilt from its parts (:func:`midpoint_parts`, summed over heads):
    the end points' mean output, plus the fixed part (the patterns and the values averaged), plus each
    setting's Q/K and V/O parts alone and in every combination; and the first-order change
    ``<d loss / d output, Q/K part + V/O part>`` at the averaged patterns and values.

    Args:
        mean_output: ``(N, T, d)``, the mean of the end points' layer outputs, output bias included.
        parts: Setting -> :func:`midpoint_parts` summed over heads.
    """
    fixed = mean_output + parts["orthogonal"]["fixed_part"]
    result = {"mean output": patched_loss(module, layer, batches, mean_output)}
    result["averaged patterns and values"] = patched_loss(module, layer, batches, fixed)
    for label in SETTINGS:
        for part in ("qk_part", "vo_part"):
            result[f"{part} {label} alone"] = patched_loss(module, layer, batches, fixed + parts[label][part])
    for qk, vo in itertools.product(SETTINGS, SETTINGS):
        result[f"Q/K {qk}, V/O {vo}"] = patched_loss(
            module, layer, batches, fixed + parts[qk]["qk_part"] + parts[vo]["vo_part"]
        )
    gradient = loss_gradient(module, layer, batches, fixed)
    moved = {label: parts[label]["qk_part"] + parts[label]["vo_part"] for label in SETTINGS}
    for label in SETTINGS:
        result[f"first order {label}"] = float((gradient * moved[label]).sum())
    # the refinement's step in the output, against the loss's slope at the orthogonal start's midpoint
    step = moved["full"] - moved["orthogonal"]
    slope = loss_gradient(module, layer, batches, fixed + moved["orthogonal"])
    result["step first order"] = float((slope * step).sum())
    result["step cosine with the slope"] = float((slope * step).sum() / (slope.norm() * step.norm()))
    result["step squared norm"] = float(step.pow(2).sum(-1).mean())
    # the same step taken backwards: the loss's curvature along it, (L(+) + L(-)) / 2 - L(0)
    backwards = patched_loss(module, layer, batches, fixed + moved["orthogonal"] - step)
    result["step curvature"] = (result["Q/K full, V/O full"] + backwards) / 2 - result["Q/K orthogonal, V/O orthogonal"]
    return result


def measure_pair(module, source: nn.Module, batches: list) -> dict:
    """Every quantity of the module docstring for one pair: ``source`` aligned to ``module.model``."""
    target = module.model
    layer = model_spec(target).attention[0]
    if layer.rotary is not None or layer.query_norm is not None:
        raise SystemExit(f"{layer.name}: the measurement reads heads without RoPE or QK-norm")
    inputs, target_output, residual = layer_io(module, target, layer, batches)
    aligned = {label: align(source, target, "first_attention", options)[0] for label, options in SETTINGS.items()}
    for name, (qk, vo) in HYBRIDS.items():
        aligned[name] = hybrid(aligned[qk], aligned[vo], layer)
    target_heads = head_activity(layer_weights(target, layer), inputs)
    entry = {"naive": loss_barrier(module, source, batches), "barrier": {}, "condition": {}, "midpoint": {}}
    entry["midpoint_loss"], parts = {}, {}
    for label, model in aligned.items():
        entry["barrier"][label] = loss_barrier(module, model, batches)
        if label not in SETTINGS:
            continue
        inputs_match(module, model, layer, batches, inputs)
        source_heads = head_activity(layer_weights(model, layer), inputs)
        middle = midpoint(model, target)
        middle_heads = head_activity(layer_weights(middle, layer), inputs)
        entry["midpoint"][label] = midpoint_measures(source_heads, target_heads, middle_heads, residual)
        entry["condition"][label] = condition_numbers(model, source, layer)
        parts[label] = {k: v.sum(1) for k, v in midpoint_parts(source_heads, target_heads, middle_heads).items()}
        mid_module = copy.deepcopy(module)
        mid_module.model.load_state_dict(middle.state_dict())
        entry["midpoint_loss"][label] = patched_loss(mid_module, layer, batches)
        source_output = layer_io(module, model, layer, batches)[1]
    entry["patched"] = patched_losses(module, layer, batches, (source_output + target_output) / 2, parts)
    return entry


def setting_value(entry: dict, quantity: str, label: str) -> float:
    """A :data:`QUANTITIES` entry's value for one setting (``orthogonal`` or ``full``) of a pair."""
    where, key = QUANTITIES[quantity]
    if where == "midpoint":
        measure = entry["midpoint"][label][key]
        return measure["sum"] if isinstance(measure, dict) else measure
    if where == "patched":
        return entry["patched"][f"{key} {label}"]
    return entry[where][label]


def rank_correlation(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation of two lists (average ranks for ties)."""
    return float(spearmanr(x, y).statistic)


def rank_correlations(pairs: dict[str, dict]) -> dict[str, float]:
    """Spearman over pairs between the barrier change ``full - orthogonal`` and each quantity's change
    (:data:`QUANTITIES`), and each hybrid's barrier change and the patched losses' Q/K and V/O halves."""
    rise = [e["barrier"]["full"] - e["barrier"]["orthogonal"] for e in pairs.values()]
    result = {}
    for name in QUANTITIES:
        change = [setting_value(e, name, "full") - setting_value(e, name, "orthogonal") for e in pairs.values()]
        result[name] = rank_correlation(rise, change)
    for name in HYBRIDS:
        result[f"barrier of {name}"] = rank_correlation(
            rise, [e["barrier"][name] - e["barrier"]["orthogonal"] for e in pairs.values()]
        )
    for key in ("step first order", "step cosine with the slope", "step squared norm", "step curvature"):
        result[f"{key} (full - orthogonal at the orthogonal midpoint)"] = rank_correlation(
            rise, [e["patched"][key] for e in pairs.values()]
        )
    base = "Q/K orthogonal, V/O orthogonal"
    for half, key in (("Q/K", "Q/K full, V/O orthogonal"), ("V/O", "Q/K orthogonal, V/O full")):
        change = [e["patched"][key] - e["patched"][base] for e in pairs.values()]
        result[f"patched loss, {half} part of full"] = rank_correlation(rise, change)
    return result


def stored_barrier(run: Path, pair: str, method: str) -> float | None:
    """The run's own aligned loss barrier of ``method`` for ``pair`` (``None`` if the run has no such sweep)."""
    folder = run / "pairs" / pair / method
    if not (folder / "lmc_results.json").is_file():
        return None
    return pair_result(folder)["curves"]["aligned"]["loss_barrier"]


def mean_std(values: list[float]) -> str:
    """``mean ± std`` of a list (std over at least two values)."""
    spread = statistics.stdev(values) if len(values) > 1 else float("nan")
    return f"{statistics.mean(values):.4g} ± {spread:.2g}"


def pair_rows(pairs: dict[str, dict]) -> list[str]:
    """The report's per-pair tables: barriers, then the midpoint's layer quantities."""
    labels = [*SETTINGS, *HYBRIDS]
    lines = [
        "| pair | naive | " + " | ".join(labels) + " | full - orthogonal |",
        "|---|---|" + "---|" * (len(labels) + 1),
    ]
    for pair, e in pairs.items():
        rise = e["barrier"]["full"] - e["barrier"]["orthogonal"]
        cells = " | ".join(f"{e['barrier'][label]:.3f}" for label in labels)
        lines.append(f"| {pair} | {e['naive']:.3f} | {cells} | {rise:+.3f} |")
    lines += [
        "",
        "Midpoint quantities (orthogonal → full; squared norms are means per token, summed over heads' outputs):",
        "",
        "| pair | layer output dev. | Q/K part | V/O part | fixed part | attention TV | score dev. | value dev. "
        "| out norm / mean | entropy | dev. / residual | cond C (max) | cond B (max) |",
        "|---|" + "---|" * 12,
    ]
    for pair, e in pairs.items():
        o, f = e["midpoint"]["orthogonal"], e["midpoint"]["full"]

        def cell(key: str, digits: int = 4) -> str:
            a, b = (m[key]["sum"] if isinstance(m[key], dict) else m[key] for m in (o, f))
            return f"{a:.{digits}g} → {b:.{digits}g}"

        conditions = [
            f"{max(e['condition']['orthogonal'][k]):.2f} → {max(e['condition']['full'][k]):.2f}" for k in "CB"
        ]
        keys = ("output", "qk_part", "vo_part", "fixed_part", "attention_tv", "score", "value")
        lines.append(
            f"| {pair} | "
            + " | ".join(cell(k) for k in keys)
            + f" | {cell('output_norm_ratio')} | {cell('entropy')} | {cell('relative_to_residual')} | "
            + " | ".join(conditions)
            + " |"
        )
    return lines


def patched_rows(pairs: dict[str, dict]) -> list[str]:
    """The loss (nats) with the first layer's output rebuilt from the midpoint's parts (:func:`patched_losses`)."""
    combos = [f"Q/K {qk}, V/O {vo}" for qk, vo in itertools.product(SETTINGS, SETTINGS)]
    header = ["mean output", "averaged P and u", *combos, "first order orth.", "first order full"]
    header += ["step: first order", "step: cosine with slope", "step: squared norm", "step: curvature"]
    lines = ["| pair | " + " | ".join(header) + " |", "|---|" + "---|" * len(header)]
    for pair, e in pairs.items():
        p = e["patched"]
        cells = [p["mean output"], p["averaged patterns and values"], *(p[c] for c in combos)]
        cells += [p["first order orthogonal"], p["first order full"], p["step first order"]]
        cells += [p["step cosine with the slope"], p["step squared norm"], p["step curvature"]]
        lines.append(f"| {pair} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    return lines


def head_rows(pairs: dict[str, dict]) -> list[str]:
    """Per head: the change ``full - orthogonal`` of the Q/K and V/O parts and of the attention TV."""
    lines = ["| pair | head | Q/K part | V/O part | attention TV | value dev. |", "|---|---|---|---|---|---|"]
    for pair, e in pairs.items():
        o, f = e["midpoint"]["orthogonal"], e["midpoint"]["full"]
        for head in range(len(o["qk_part"]["heads"])):
            cells = []
            for key in ("qk_part", "vo_part", "attention_tv", "value"):
                a, b = o[key]["heads"][head], f[key]["heads"][head]
                cells.append(f"{a:.4g} → {b:.4g} ({100 * (b - a) / a:+.1f} %)")
            lines.append(f"| {pair} | {head} | " + " | ".join(cells) + " |")
    return lines


def write_report(results: dict) -> None:
    """``benchmarks/stage2/results/refinement_data.md`` from the results of every family."""
    lines = [
        "# Stage 2's refinement on the data: the first attention layer at the midpoint",
        "",
        "Written by `python -m benchmarks refinement_data` (one thread). Loss barriers (nats) on the run's curve",
        "samples (validation split, 25 alphas) for the orthogonal start (Variant 2), the full refinement, and the two",
        "hybrid elements (one half of the refinement each). Then the midpoint's first attention layer against",
        "the end points' mean output, split exactly into a Q/K part (the attention pattern's change, carrying",
        "the mean values), a V/O part (the values' change, through the midpoint's pattern) and a part fixed by",
        "the two models (the same for every element). `cond C`, `cond B`: the largest condition number of the",
        "element's per-head matrices.",
        "",
    ]
    for name, family in results.items():
        pairs, planted = family["pairs"], family["planted"]
        lines += [f"## {name} (`{family['run']}`, {len(pairs)} pairs)", "", *pair_rows(pairs), ""]
        stored = {p: e["stored_full"] for p, e in pairs.items() if e.get("stored_full") is not None}
        if stored:
            worst = max(abs(pairs[p]["barrier"]["full"] - v) for p, v in stored.items())
            lines += [f"The full barriers equal the run's own to {worst:.1e} nats ({len(stored)} pairs).", ""]
        rises = [e["barrier"]["full"] - e["barrier"]["orthogonal"] for e in pairs.values()]
        patched = [e["patched"] for e in pairs.values()]
        midpoint_change = [p["Q/K full, V/O full"] - p["Q/K orthogonal, V/O orthogonal"] for p in patched]
        remainder = [c - p["step first order"] for c, p in zip(midpoint_change, patched)]
        curvature = [p["step curvature"] for p in patched]
        deviation = [e["midpoint"]["orthogonal"]["output"]["sum"] for e in pairs.values()]
        share = [p["step squared norm"] / d for p, d in zip(patched, deviation)]
        fixed = [e["midpoint"]["orthogonal"]["fixed_part"]["sum"] / d for e, d in zip(pairs.values(), deviation)]
        lines += [
            f"Barrier change full - orthogonal: {mean_std(rises)} nats, a rise in "
            f"{sum(r > 0 for r in rises)} of {len(rises)} pairs. The midpoint's loss changes by "
            f"{mean_std(midpoint_change)} nats; the refinement's step in the layer's output has "
            f"{mean_std([100 * s for s in share])} % of the squared norm of the orthogonal midpoint's deviation "
            f"(of which the fixed part is {mean_std([100 * f for f in fixed])} %), a cosine with the loss's slope of "
            f"{mean_std([p['step cosine with the slope'] for p in patched])}, a first-order effect of "
            f"{mean_std([p['step first order'] for p in patched])} nats and a rest beyond first order of "
            f"{mean_std(remainder)} nats (positive in {sum(r > 0 for r in remainder)} of {len(remainder)}); "
            f"the curvature along the step, (L(+step) + L(-step)) / 2 - L(0), is {mean_std(curvature)} nats "
            f"(positive in {sum(c > 0 for c in curvature)} of {len(curvature)}).",
            "",
            "Spearman's rank correlation over the pairs between the barrier change `full - orthogonal` and the",
            "change of each quantity (summed over heads):",
            "",
            "| quantity | Spearman |",
            "|---|---|",
            *(f"| {k} | {v:+.2f} |" for k, v in family["correlation"].items()),
            "",
            "The loss with the first layer's output rebuilt from its parts: the end points' mean output, plus the",
            "fixed part (patterns and values averaged), plus the Q/K and V/O parts of each setting (`Q/K orthogonal,",
            "V/O orthogonal` is the orthogonal start's midpoint, `Q/K full, V/O full` the full method's); `first",
            "order`: the loss change the Q/K and V/O parts make to first order from the averaged patterns and values.",
            "",
            *patched_rows(pairs),
            "",
            "Per head (orthogonal → full):",
            "",
            *head_rows(pairs),
            "",
            f"### Planted control: each seed against itself moved by a random group element plus "
            f"{PLANTED_NOISE:g} relative noise",
            "",
            *pair_rows(planted),
            "",
        ]
    atomic_write_text(RESULTS.with_suffix(".md"), "\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, help="a finished first_attention lmc run folder")
    parser.add_argument("--data", type=Path, help="the run's DataModule config (configs/data/...)")
    parser.add_argument("--name", help="the family's name in the results")
    parser.add_argument(
        "--report-only", action="store_true", help="write the .md again from the .json, measure nothing"
    )
    args = parser.parse_args()
    path = RESULTS.with_suffix(".json")
    if args.report_only:
        write_report(json.loads(path.read_text()))
        return
    if args.run is None or args.data is None or args.name is None:
        parser.error("--run, --data and --name are required (or --report-only)")
    torch.set_num_threads(1)
    modules = fine_tuned(args.run)
    data = datamodule(args.data)
    batches = list(DataLoader(data.split("val"), batch_size=data.batch_size))
    family = {"run": str(args.run), "pairs": {}, "planted": {}}
    for i, j in itertools.combinations(range(len(modules)), 2):
        pair = f"{i}_{j}"
        entry = measure_pair(modules[j], modules[i].model, batches)
        entry["stored_full"] = stored_barrier(args.run, pair, "full")
        family["pairs"][pair] = entry
        print(f"{args.name} {pair}: " + ", ".join(f"{k} {v:.3f}" for k, v in entry["barrier"].items()), flush=True)
    for k, module in enumerate(modules):
        family["planted"][f"seed{k}"] = measure_pair(planted_module(module, k, PLANTED_NOISE), module.model, batches)
    family["correlation"] = rank_correlations(family["pairs"])
    results = json.loads(path.read_text()) if path.is_file() else {}
    results[args.name] = family
    atomic_write_json(path, results)
    write_report(results)


if __name__ == "__main__":
    main()
