"""The main job: a full LMC experiment on the embedded digits, offline, in minutes on a CPU.

For a ViT-style reference Transformer with learned absolute PE and with RoPE (paper Section 6,
first-attention-layer re-initialization), ``lmc run``'s protocol (:mod:`lmc.experiments.run`):
pre-train on half A of the digits' training split, fine-tune seeds on half B with the first
attention layer re-initialized and everything else frozen, align every pair of seeds and sweep
25 interpolation points, naive and aligned, on the validation split. The same settings are
``configs/experiment/digits_vit_{ape,rope}.yaml`` with ``configs/protocol/main_job.yaml``
(``tests/test_demo.py`` checks that they agree).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from lmc.experiments.protocol import experiment_cli
from lmc.experiments.run import Experiment

POSITIONAL_ENCODINGS = {"APE": {"pe": "learned"}, "RoPE": {"pe": "rope", "rope_layout": "half"}}
PRETRAIN_EPOCHS, FINETUNE_EPOCHS = 40, 60
SEEDS = 3


def experiment_config(label: str, root: Path, epochs: tuple[int, int]) -> dict[str, Any]:
    """The main job's experiment for one positional encoding, as ``lmc run`` reads it."""
    pretrain_epochs, finetune_epochs = epochs
    return {
        "seed_everything": 0,
        # The paper's 6 layers and 4 heads, narrow for a CPU.
        "model": {"model": "reference-vit", "model_config": {"width": 64, **POSITIONAL_ENCODINGS[label]}, "lr": 2e-3},
        "data": {"class_path": "lmc.data.Digits", "init_args": {"batch_size": 32}},
        "trainer": {"accelerator": "cpu", "devices": 1, "log_every_n_steps": 5, "enable_model_summary": False},
        "protocol": {
            "output_dir": str(root / label),
            "reinit": "first_attention",
            "seeds": SEEDS,
            "pretrain": {"max_epochs": pretrain_epochs},
            "finetune": {"max_epochs": finetune_epochs, "lr": 3e-3},
        },
    }


def run(output_dir: Path = Path("runs/demo"), epochs: int | None = None) -> list[dict[str, Any]]:
    """Run the main job for APE and RoPE and print the table of barriers; returns one row per encoding."""
    for name in ("lightning.pytorch", "lightning.fabric"):  # keep the job's own output readable
        logging.getLogger(name).setLevel(logging.WARNING)
    root = Path(output_dir)
    schedule = (epochs or PRETRAIN_EPOCHS, epochs or FINETUNE_EPOCHS)
    rows = []
    for label in POSITIONAL_ENCODINGS:
        config = json.dumps(experiment_config(label, root, schedule))
        summary = Experiment(experiment_cli(["--config", config], run=False)).run()
        rows.append({"label": label, "summary": summary, "results_dir": root / label})
    print()
    print("Linear mode connectivity after re-initializing the first attention layer (digits, validation split)")
    print(f"{SEEDS} fine-tuned seeds per encoding: mean ± std over their pairs")
    header = f"{'PE':6s} {'curve':8s} {'loss barrier':>16s} {'acc barrier':>16s} {'loss ratio %':>14s}"
    print(header)
    print("-" * len(header))
    for row in rows:
        entry = row["summary"]["alignments"]["full"]
        ratio = entry["barrier_ratio"]["loss_barrier"]
        for curve in ("naive", "aligned"):
            loss, accuracy = entry[curve]["loss_barrier"], entry[curve]["accuracy_barrier"]
            share = "" if curve == "naive" else f"{ratio['mean']:6.1f} ± {ratio['std']:5.1f}"
            print(
                f"{row['label']:6s} {curve:8s} {loss['mean']:8.4f} ± {loss['std']:5.3f} "
                f"{accuracy['mean']:8.4f} ± {accuracy['std']:5.3f} {share:>14s}"
            )
    print(f"\nTensorBoard logs: {root}/<PE>/tensorboard   (tensorboard --logdir {root})")
    for row in rows:
        print(f"Results ({row['label']}): {row['results_dir']}/summary.md (.json, .csv, figures, pairs/)")
    return rows
