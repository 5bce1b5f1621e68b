"""Time and peak memory of ``lmc.matching.align`` against heads, width and layers.

Each configuration runs in a fresh subprocess (clean peak-memory accounting): a pair of
Llama-shaped models in float32 with random weights that share every parameter outside the
attention layers (the ``all_attention`` protocol), aligned with ``method="full"`` and
``method="orthogonal"``. Beside each time stands the measured GEMM floor of Stage 1: one
``(h d_h) x d x (h d_h)`` float32 matrix product, ``d (h d_h)^2`` multiply-adds per layer.

    python -m benchmarks align_scaling                 # every row, writes benchmarks/speed/results/align_scaling.md
    python -m benchmarks align_scaling --rows 1b       # the Llama-3.2-1B-shaped pair only
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.machine import ROOT, machine_line, peak_rss, reset_peak_rss, rss

ROWS = {
    # name: (width, layers, heads, kv_heads, intermediate, vocab)
    "heads-8": (1024, 2, 8, 8, 256, 256),
    "heads-16": (1024, 2, 16, 16, 256, 256),
    "heads-32": (1024, 2, 32, 32, 256, 256),
    "width-512": (512, 2, 16, 16, 256, 256),
    "width-2048": (2048, 2, 16, 16, 256, 256),
    "layers-4": (1024, 4, 16, 16, 256, 256),
    "layers-8": (1024, 8, 16, 16, 256, 256),
    "1b": (2048, 16, 32, 8, 8192, 128256),  # Llama-3.2-1B: width 2048, 16 layers, 32/8 heads, tied embeddings
}


def measure(name: str) -> dict:
    """One row, in this process."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lmc.matching import AlignOptions, align

    width, layers, heads, kv_heads, intermediate, vocab = ROWS[name]
    config = LlamaConfig(
        hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        intermediate_size=intermediate, vocab_size=vocab, max_position_embeddings=256, bos_token_id=0, eos_token_id=0,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    source = LlamaForCausalLM(config).eval()
    target = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        sources = dict(source.named_parameters())
        for index, (key, parameter) in enumerate(target.named_parameters()):
            if "self_attn" not in key:
                parameter.copy_(sources[key])
            else:
                parameter.normal_(0, 0.02, generator=torch.Generator().manual_seed(index))
    model_bytes = sum(p.numel() * p.element_size() for p in source.parameters())

    # The Stage 1 GEMM floor: (h d_h) x d x (h d_h) in float32; and the whole Gram pass of docs/spec.md
    # section 3 (cross-Grams of Q, K, V and W_O: two such GEMMs plus two of width h_kv d_h). Best of 5.
    head_dim = width // heads

    def best_time(widths: list[int]) -> float:
        operands = [(torch.randn(width, w), torch.randn(width, w)) for w in widths]
        times = []
        for _ in range(5):
            start = time.perf_counter()
            for a, b in operands:
                a.T @ b
            times.append(time.perf_counter() - start)
        return min(times)

    floor = best_time([heads * head_dim])
    result = {"name": name, "config": ROWS[name], "params": sum(p.numel() for p in source.parameters())}
    result["floor_s"] = floor
    result["gram_pass_s"] = best_time([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim, heads * head_dim])
    result["gflops"] = 2 * width * (heads * head_dim) ** 2 / floor / 1e9
    for method in ("orthogonal", "full"):
        baseline = rss()
        reset_peak_rss()
        start = time.perf_counter()
        aligned, report = align(source, target, scope="all_attention", options=AlignOptions(method=method))
        total = time.perf_counter() - start
        peak = peak_rss()
        layers_report = [layer for layer in report.layers if layer.kind == "attention"]
        per_layer = [sum(layer.seconds.values()) for layer in layers_report]
        result[method] = {
            "total_s": total,
            "layer_s": statistics.median(per_layer),
            "grams_s": statistics.median(layer.seconds["grams"] for layer in layers_report),
            "stage1_s": statistics.median(layer.seconds["stage1"] for layer in layers_report),
            "stage2_s": statistics.median(layer.seconds["stage2"] for layer in layers_report),
            "peak_over_model": peak / model_bytes,
            "extra_over_model": (peak - baseline) / model_bytes,
            "distance_ratio": report.distance["aligned"] / report.distance["naive"],
        }
        del aligned, report
    return result


def table(results: list[dict]) -> str:
    columns = [
        "row", "width, layers, heads/kv", "params", "GEMM floor / layer", "Gram pass", "method",
        "per layer (grams + stage 1 + stage 2)", "x floor", "x Gram pass", "all layers", "peak RSS / model (extra)",
        "distance aligned / naive",
    ]  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in results:
        width, layers, heads, kv, _, _ = r["config"]
        for method in ("orthogonal", "full"):
            m = r[method]
            lines.append(
                f"| {r['name']} | {width}, {layers}, {heads}/{kv} | {r['params'] / 1e6:.0f} M | "
                f"{1000 * r['floor_s']:.1f} ms ({r['gflops']:.0f} GFLOP/s) | {1000 * r['gram_pass_s']:.1f} ms | "
                f"{method} | {1000 * m['layer_s']:.0f} ms ({1000 * m['grams_s']:.0f} + {1000 * m['stage1_s']:.0f} + "
                f"{1000 * m['stage2_s']:.0f}) | {m['layer_s'] / r['floor_s']:.1f} | "
                f"{m['layer_s'] / r['gram_pass_s']:.1f} | {m['total_s']:.1f} s | "
                f"{m['peak_over_model']:.2f} ({m['extra_over_model']:+.2f}) | {m['distance_ratio']:.4f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "align_scaling.md"))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one row, print JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one)))
        return
    results = []
    for name in args.rows:
        command = [sys.executable, "-m", "benchmarks.speed.align_scaling", "--one", name]
        run = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT)
        results.append(json.loads(run.stdout.strip().splitlines()[-1]))
        print(table(results[-1:]).splitlines()[-1], flush=True)
    from lmc.io import atomic_write_text

    text = (
        "# align(): time and peak memory (all attention layers, float32, Llama-shaped pairs)\n\n"
        f"Machine: {machine_line()}.\n\n"
        "GEMM floor: one `(h d_h) x d x (h d_h)` float32 product, `d (h d_h)^2` multiply-adds, best of 5.\n"
        "Gram pass: the four cross-Gram GEMMs every alignment needs (Q and W_O at width `h d_h`, K and V at\n"
        "`h_kv d_h`), the floor of the whole matcher (docs/spec.md, section 3); the invariant Stage 1 cost needs all\n"
        "blocks of the Q and W_O cross-Grams, so a layer cannot cost less than about two GEMM floors.\n"
        "Per layer: median over layers of the Gram pass, Stage 1 and Stage 2 (the report's timings).\n"
        "All layers: the whole `align` call (checks, copies, every layer, the probe).\n"
        "Peak RSS / model: the process's peak resident memory during `align` over one model's parameter bytes;\n"
        "in brackets the growth above the resident memory before the call (both models already loaded).\n\n"
        f"{table(results)}\n"
    )
    atomic_write_text(args.output, text)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
