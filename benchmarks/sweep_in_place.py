"""The interpolation sweep writing weights in place against a copy of the model per alpha.

Both evaluate the same 25 points of a GPT-2-sized reference decoder (85 M parameters, float32)
on the same batches; the only difference is how each interpolated model is materialized.

    python benchmarks/sweep_in_place.py        # writes benchmarks/results/sweep_in_place.md
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from pathlib import Path


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def measure(mode: str) -> dict:
    import torch

    from lmc.connectivity.interpolation import SweepStore, evaluate, evenly_spaced, point_metrics, sweep
    from lmc.models import create_model

    torch.manual_seed(0)
    config = dict(width=768, depth=12, num_heads=12, vocab_size=257, max_positions=128)
    model_a = create_model("reference-gpt", **config)
    model_b = create_model("reference-gpt", **config)
    batches = [{"inputs": torch.randint(257, (4, 128)), "labels": torch.randint(257, (4, 128))}]
    model_bytes = sum(p.numel() * p.element_size() for p in model_a.parameters())
    endpoint_a = [p.detach().clone() for p in model_a.parameters()]
    endpoint_b = [p.detach().clone() for p in model_b.parameters()]
    alphas = evenly_spaced(25)

    def sums_for(model):
        def batch_sums(batch):
            logits = model(input_ids=batch["inputs"]).flatten(0, 1)
            labels = batch["labels"].flatten()
            loss = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
            correct = (logits.argmax(-1) == labels).sum().double()
            return {"count": torch.tensor(float(labels.numel())), "loss": loss.double(), "accuracy": correct}

        return batch_sums

    Path("/proc/self/clear_refs").write_text("5")
    baseline = _peak_rss()
    start = time.perf_counter()
    with torch.no_grad():
        if mode == "in_place":
            store = SweepStore.open(None, "benchmark")
            points = sweep(
                model_a,
                endpoint_a,
                endpoint_b,
                lambda per_cluster: evaluate(sums_for(model_a), batches, "cpu", per_cluster),
                alphas,
                store,
                "naive",
            )
        else:
            points = []
            for alpha in alphas:
                interpolated = copy.deepcopy(model_a)
                for p, a, b in zip(interpolated.parameters(), endpoint_a, endpoint_b):
                    p.copy_(torch.lerp(a, b, alpha))
                sums = evaluate(sums_for(interpolated), batches, "cpu")
                points.append({"alpha": alpha, **point_metrics({k: float(v) for k, v in sums.items()})})
                del interpolated
    seconds = time.perf_counter() - start
    return {
        "mode": mode,
        "seconds": seconds,
        "extra_peak_over_model": (_peak_rss() - baseline) / model_bytes,
        "losses": [p["loss"] for p in points],
        "params": sum(p.numel() for p in model_a.parameters()),
    }


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        print(json.dumps(measure(sys.argv[2])))
        return
    rows = {}
    for mode in ("in_place", "copy_per_alpha"):
        run = subprocess.run([sys.executable, __file__, "--one", mode], capture_output=True, text=True, check=True)
        rows[mode] = json.loads(run.stdout.strip().splitlines()[-1])
    same = max(abs(a - b) for a, b in zip(rows["in_place"]["losses"], rows["copy_per_alpha"]["losses"]))
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from benchmarks.align_scaling import machine
    from lmc.io import atomic_write_text

    lines = [
        "# Interpolation sweep: in place vs one model copy per alpha",
        "",
        f"Machine: {machine()}.",
        f"Model: reference decoder, {rows['in_place']['params'] / 1e6:.0f} M parameters, float32; 25 alphas, "
        "one batch of 4 x 128 tokens per point.",
        "",
        "| sweep | time | peak RSS growth / model |",
        "|---|---|---|",
    ]
    for mode, row in rows.items():
        lines.append(f"| {mode.replace('_', ' ')} | {row['seconds']:.2f} s | {row['extra_peak_over_model']:+.2f} |")
    lines += ["", f"Largest difference between the two curves' losses: {same:.2e}.", ""]
    output = Path(__file__).parent / "results" / "sweep_in_place.md"
    atomic_write_text(output, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
