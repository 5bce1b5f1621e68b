"""How much of a fine-tuned, re-initialized layer is still its random draw?

For each fine-tuned seed of an ``lmc run`` folder, the re-initialized parameters as they were
before fine-tuning are rebuilt from the run's own settings (the pre-trained checkpoint, the
strategy and ``reinit_seed``), and the share of each one's norm that training moved,
``||W_final - W_init|| / ||W_final||``, is reported. Where it is small, two fine-tunes of the
same layer differ mostly by their independent draws, which every weight-space cost compares.

    python -m benchmarks reinit_share runs/table1/mnist_vit_ape   # writes results/reinit_share.{json,md} here
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from lmc.io import atomic_write_json, atomic_write_text
from lmc.tasks import DataInfo
from lmc.training.module import LMCModule, load_trained


def moved_shares(run: Path) -> dict[str, dict[str, float]]:
    """``seed folder -> parameter -> ||W_final - W_init|| / ||W_final||`` of the parameters fine-tuning changed."""
    shares = {}
    for folder in sorted(run.glob("seed*"), key=lambda p: int(p.name[4:])):
        trained, settings = load_trained(folder / "final.ckpt")
        if settings.get("reinit") is None or settings.get("pretrained") is None:
            raise ValueError(f"{folder} is not a fine-tuning run with a re-initialized scope and a pre-trained model")
        start = LMCModule(
            settings["model"],
            settings.get("model_config"),
            DataInfo(**settings["data"]),
            reinit=settings["reinit"],
            reinit_seed=settings["reinit_seed"],
            pretrained=settings["pretrained"],
        )
        initial = dict(start.model.named_parameters())
        shares[folder.name] = {
            name: float((final - initial[name]).norm() / final.norm())
            for name, final in trained.model.named_parameters()
            if not torch.equal(final, initial[name]) and final.ndim > 1  # the weights; biases start at 0
        }
    if not shares:
        raise ValueError(f"{run} holds no fine-tuned seed folders (seed0, seed1, ...)")
    return shares


def report(run: Path, shares: dict[str, dict[str, float]]) -> str:
    names = list(next(iter(shares.values())))
    lines = [
        "# The share of each re-initialized weight that fine-tuning moved",
        "",
        f"Written by `python -m benchmarks reinit_share {run}`: `||W_final - W_init|| / ||W_final||` per fine-tuned "
        "seed; the rest of each norm is the seed's own random draw (orthogonal to the change only approximately).",
        "",
        "| seed | " + " | ".join(f"`{name}`" for name in names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for seed, row in shares.items():
        lines.append(f"| {seed} | " + " | ".join(f"{row[name]:.3f}" for name in names) + " |")
    means = [statistics.fmean(row[name] for row in shares.values()) for name in names]
    lines.append("| mean | " + " | ".join(f"{mean:.3f}" for mean in means) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="an lmc run folder (pretrain/, seed0/, seed1/, ...)")
    parser.add_argument("--results", type=Path, default=Path(__file__).parent / "results" / "reinit_share")
    args = parser.parse_args()
    torch.set_num_threads(1)
    shares = moved_shares(args.run)
    atomic_write_json(args.results.with_suffix(".json"), {"run": str(args.run), "shares": shares})
    atomic_write_text(args.results.with_suffix(".md"), report(args.run, shares))
    print(report(args.run, shares))


if __name__ == "__main__":
    main()
