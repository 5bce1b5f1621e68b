"""Training-step time of the reference ViT with RoPE against learned APE (issue #7: within 1.2x).

The main job's model (``lmc.experiments.demo``: ``reference-vit``, width 64, 6 layers, 4 heads, 8x8 digits in
2x2 patches, batch 32), one step being forward, cross-entropy, backward and an AdamW step, on one
thread. Every variant has its own model and optimizer in this one process and the variants take
turns, a few steps each per round (the order shifted every round), so that load from other
processes on a shared machine hits them alike. Each block is timed twice: CPU time of this process
(what the step costs, little changed by other processes taking turns on the cores) and wall time.
The per-round ratios to APE, and their median, are the figures that count.

The "before" rows time the rotation this change replaced (gathers and scatters of the pair
coordinates), copied below only for this comparison.

    python benchmarks/rope_step.py                  # writes benchmarks/results/rope_step.md
    python benchmarks/rope_step.py --rounds 3 --steps 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

sys.path.insert(0, str(Path(__file__).parents[1]))

from lmc.configs import config_file  # noqa: E402

from benchmarks.align_scaling import machine  # noqa: E402
from lmc.io import atomic_write_text  # noqa: E402
from lmc.models import create_model  # noqa: E402
from lmc.models.reference import Attention, ReferenceTransformer  # noqa: E402

# The main job's model and batch (its packaged config files), positional encoding left to each variant.
_MODEL_CONFIG = yaml.safe_load(config_file("configs/model/reference_vit_ape.yaml").read_text())["model_config"]
MODEL = {k: v for k, v in _MODEL_CONFIG.items() if k != "pe"}
BATCH_SIZE = yaml.safe_load(config_file("configs/data/digits.yaml").read_text())["init_args"]["batch_size"]
DIGITS = dict(image_size=8, in_channels=1, num_classes=10)  # what the digits data module sizes the model to
APE = "APE (learned)"
VARIANTS: dict[str, tuple[dict, bool]] = {  # name: (config overrides, time the rotation from before this change)
    APE: ({"pe": "learned"}, False),
    "RoPE half": ({"pe": "rope", "rope_layout": "half"}, False),
    "RoPE interleaved": ({"pe": "rope", "rope_layout": "interleaved"}, False),
    "RoPE half, rotary_fraction 0.5": ({"pe": "rope", "rope_layout": "half", "rotary_fraction": 0.5}, False),
    "RoPE interleaved, rotary_fraction 0.5": (
        {"pe": "rope", "rope_layout": "interleaved", "rotary_fraction": 0.5},
        False,
    ),
    "RoPE half, before": ({"pe": "rope", "rope_layout": "half"}, True),
    "RoPE interleaved, before": ({"pe": "rope", "rope_layout": "interleaved"}, True),
}


def rotation_before(attention: Attention) -> Callable[[torch.Tensor], torch.Tensor]:
    """The rotation as it was before this change, with its per-pair tables computed once."""
    cos, sin, pairs = attention.rope_cos, attention.rope_sin, attention.rope_pairs  # (T_max, r/2), (r/2, 2)
    first, second = pairs[:, 0], pairs[:, 1]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x = x.transpose(1, 2)  # (B, nh, T, hs): the layout the old code rotated in
        T = x.shape[2]
        c, s = cos[:T].to(x.dtype), sin[:T].to(x.dtype)
        x1, x2 = x[..., first], x[..., second]  # (B, nh, T, r/2)
        rotated = x.clone()
        rotated[..., first] = x1 * c - x2 * s
        rotated[..., second] = x1 * s + x2 * c
        return rotated.transpose(1, 2)  # (B, T, nh, hs), as the current forward expects

    return rotate


def build(overrides: dict, before: bool) -> ReferenceTransformer:
    torch.manual_seed(0)
    model = create_model("reference-vit", **MODEL, **DIGITS, **overrides).train()
    if before:
        for block in model.blocks:
            block.attn.rotate = rotation_before(block.attn)
    return model


def largest_difference_before_after(images: torch.Tensor) -> float:
    """Largest logit difference between the old and the new rotation on equal weights (expected: 0)."""
    differences = []
    for layout in ("half", "interleaved"):
        new, old = (build({"pe": "rope", "rope_layout": layout}, before) for before in (False, True))
        with torch.no_grad():
            differences.append(float((new(images=images) - old(images=images)).abs().max()))
    return max(differences)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=5, help="steps per variant per round")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per variant first")
    args = parser.parse_args()
    torch.set_num_threads(1)

    generator = torch.Generator().manual_seed(0)
    images = torch.randn(
        BATCH_SIZE, DIGITS["in_channels"], DIGITS["image_size"], DIGITS["image_size"], generator=generator
    )
    labels = torch.randint(DIGITS["num_classes"], (BATCH_SIZE,), generator=generator)
    difference = largest_difference_before_after(images)

    runs = {}
    for name, (overrides, before) in VARIANTS.items():
        model = build(overrides, before)
        runs[name] = (model, torch.optim.AdamW(model.parameters(), lr=2e-3))

    def train_steps(name: str, steps: int) -> None:
        model, optimizer = runs[name]
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(images=images), labels).backward()
            optimizer.step()

    for name in VARIANTS:
        train_steps(name, args.warmup)
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    clocks = {"CPU": time.process_time, "wall": time.perf_counter}
    milliseconds = {clock: {name: [] for name in VARIANTS} for clock in clocks}  # clock -> variant -> per round
    names = list(VARIANTS)
    for round_ in range(args.rounds):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            start = {clock: read() for clock, read in clocks.items()}
            train_steps(name, args.steps)
            for clock, read in clocks.items():
                milliseconds[clock][name].append((read() - start[clock]) / args.steps * 1e3)
    load_after = Path("/proc/loadavg").read_text().split()[:3]

    lines = [
        "# Training step: RoPE against learned APE, reference ViT",
        "",
        f"Machine: {machine()}; load average (1, 5, 15 min) {' '.join(load_before)} before, "
        f"{' '.join(load_after)} after.",
        f"Model: `reference-vit`, {', '.join(f'{k} {v}' for k, v in MODEL.items())}, 8x8 digits in 2x2 patches "
        f"(17 tokens); batch {BATCH_SIZE}; step = forward + cross-entropy + backward + AdamW; float32.",
        f"{args.rounds} rounds of {args.steps} steps per variant (after {args.warmup} untimed), variants taking "
        "turns in one process. The machine was shared with other jobs while this ran, so the milliseconds, wall "
        "time above all, vary with their load: the ratios to APE, taken within each round and then their median, "
        "are what count. Medians over rounds; CPU time is this process's. Target (issue #7): RoPE within 1.2x.",
        "",
        "| variant | CPU ms / step | ratio to APE (CPU) | middle half of round ratios (CPU) | wall ms / step "
        "| ratio to APE (wall) |",
        "|---|---|---|---|---|---|",
    ]
    for name in VARIANTS:
        cells = [name]
        for clock in clocks:
            times, ape = milliseconds[clock][name], milliseconds[clock][APE]
            ratios = [t / a for t, a in zip(times, ape)]
            cells += [f"{statistics.median(times):.1f}", f"{statistics.median(ratios):.2f}x"]
            if clock == "CPU":
                quartiles = statistics.quantiles(ratios, n=4)
                cells.append(f"{quartiles[0]:.2f}-{quartiles[2]:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        '"before": the rotation this change replaced (advanced-index gathers and scatters), timed on the same '
        f"model. Largest logit difference between before and after on equal weights: {difference:.1e}.",
        "",
    ]
    output = Path(__file__).parent / "results" / "rope_step.md"
    atomic_write_text(output, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
