"""The rows of ``lmc symmetry``, one per model (docs/spec.md, section 2, "Every axis explained").

A module apart from the command (lmc.cli.symmetry): jsonargparse builds a command's parser from
its module, and ``lmc symmetry --help`` loads no torch.
"""

from __future__ import annotations

import torch
from torch import nn

from lmc.adapters import apply_transform, describe, describe_scopes, model_spec, random_symmetry
from lmc.matching.checks import probe_error
from lmc.models import create_model, randomize_parameters_
from lmc.symmetry import (
    ModelTransform,
    explain_axes,
    general_linear,
    other_pair_layout,
    rotary_commutant,
    sample_attention_transform,
    unexplained_axes,
)

#: Probe inputs per model: the relative output change is measured on this many random samples.
PROBE_BATCH = 4


def weight_change(model: nn.Module, other: nn.Module) -> float:
    """Relative distance between the two models' parameter vectors."""
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    after = torch.cat([p.detach().flatten() for p in other.parameters()])
    return float((after - before).norm() / before.norm())


def first_layer_with(model: nn.Module, qk) -> nn.Module:
    """``model`` with a random element on layer 0 whose ``C`` comes from ``qk``."""
    spec = model_spec(model)
    layer = spec.blocks[0].attention
    transform = ModelTransform(attention={0: sample_attention_transform(layer, torch.Generator().manual_seed(1), qk)})
    return apply_transform(model, transform, spec)


def run(models: tuple[str, ...], seed: int = 0) -> list[dict[str, object]]:
    """Run the checks in float64 and print one row per model; returns the rows."""
    header = (
        f"{'model':15s} {'class':34s} {'PE':16s} {'heads':>5s} {'Q/K group':18s} {'layer group':20s} "
        f"{'FFN':>5s} {'residual':>8s} {'symmetry':>9s} {'weights':>8s} {'GL on Q/K':>10s} {'other H':>9s} "
        f"{'axes fixed/left':>15s}"
    )
    print("Relative output change on random inputs (float64). 'symmetry': a random element of the full group.")
    print(header)
    print("-" * len(header))
    rows = []
    for name in models:
        model = randomize_parameters_(create_model(name, dtype=torch.float64), seed=seed)
        model_symmetry = model_spec(model)
        layer = describe(model, model_symmetry)[0]
        residual = describe_scopes(model)["full_model"]["residual_width"]
        spec = model_symmetry.blocks[0].attention
        shapes = {parameter: p.shape for parameter, p in model.named_parameters()}
        roles = explain_axes(model_symmetry, "full_model", shapes)
        transformed = random_symmetry(model, "full_model", seed=seed)
        row = {
            "model": name,
            "class": type(model).__name__,
            "pe": layer["pe"] if layer["rope_layout"] is None else f"rope/{layer['rope_layout']}",
            "heads": f"{layer['num_heads']}/{layer['num_kv_heads']}",
            "qk_group": f"{layer['qk_group']}({layer['head_dim']}) dim {layer['qk_group_dim']}",
            "layer_group": f"{layer['head_permutations']} orders, dim {layer['group_dim']}",
            "ffn": f"{layer['ffn_width']}!" if layer["ffn_width"] else "-",
            "residual": f"{residual}!" if residual else "-",
            "symmetry": probe_error(model, transformed, PROBE_BATCH, seed),
            "weights": weight_change(model, transformed),
            "gl_on_qk": probe_error(model, first_layer_with(model, general_linear(spec.head_dim)), PROBE_BATCH, seed),
            "other_h": None,
            "fixed_axes": sum(role.reason is not None for role in roles.values()),
            "unexplained_axes": unexplained_axes(model_symmetry, "full_model", shapes),
        }
        if spec.rotary is not None:
            wrong = rotary_commutant(spec.head_dim, other_pair_layout(spec.rotary))
            row["other_h"] = probe_error(model, first_layer_with(model, wrong), PROBE_BATCH, seed)
        rows.append(row)
        other = "-" if row["other_h"] is None else f"{row['other_h']:.1e}"
        axes = f"{row['fixed_axes']}/{len(row['unexplained_axes'])}"
        print(
            f"{name:15s} {row['class']:34s} {row['pe']:16s} {row['heads']:>5s} {row['qk_group']:18s} "
            f"{row['layer_group']:20s} {row['ffn']:>5s} {row['residual']:>8s} {row['symmetry']:9.1e} "
            f"{row['weights']:8.2f} {row['gl_on_qk']:10.1e} {other:>9s} {axes:>15s}"
        )
        for parameter, axis in row["unexplained_axes"]:
            print(f"  unexplained: axis {axis} of {parameter} (no group moves it and the spec gives no reason)")
    print(
        "\nA symmetry keeps outputs to rounding (~1e-16; the RMSNorms of the HF Llama-like decoders, Llama to Phi-3, "
        "compute in float32, ~1e-7) while the weights move by O(1).\n"
        "'layer group': the first attention layer's head orders and the dimension of its C (Q/K) and B (V/O) "
        "elements together, per key/value head summed.\n"
        "'FFN': the orders of the first FFN's hidden units (width!, moved by first_block and full_model); "
        "'residual': those of the residual stream (d!, moved by full_model; '-' where a fixed table added to it "
        "leaves no permutation a symmetry).\n"
        "GL on Q/K is a symmetry only without RoPE; an H for the wrong pair layout never is.\n"
        "'axes fixed/left': parameter axes that no group of the full model moves, each for a reason (vocabulary, "
        "classes, positions, inputs, ...), and axes left with neither."
    )
    return rows
