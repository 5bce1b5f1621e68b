"""The main job: a full LMC experiment on the embedded digits, offline, in minutes on a CPU.

For a ViT-style reference Transformer with learned absolute PE and with RoPE (paper Section 6,
first-attention-layer re-initialization), ``lmc run``'s protocol (:mod:`lmc.experiments.run`):
pre-train on half A of the digits' training split, fine-tune seeds on half B with the first
attention layer re-initialized and everything else frozen, align every pair of seeds and sweep
25 interpolation points, naive and aligned, on the validation split. The settings are the
packaged ``configs/experiment/digits_vit_{ape,rope}.yaml`` with ``configs/protocol/main_job.yaml``,
read from any working folder (:func:`lmc.configs.config_file`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from lmc.configs import config_file
from lmc.experiments.protocol import experiment_cli
from lmc.experiments.run import Experiment

#: The experiment config of each positional encoding.
EXPERIMENTS = {"APE": "configs/experiment/digits_vit_ape.yaml", "RoPE": "configs/experiment/digits_vit_rope.yaml"}
PROTOCOL = "configs/protocol/main_job.yaml"


def experiment_arguments(label: str, root: Path, epochs: int | None = None) -> list[str]:
    """The ``lmc run`` arguments of the main job for one positional encoding.

    Args:
        label: ``"APE"`` or ``"RoPE"``.
        root: The demo's output folder; this encoding's run goes into ``root / label``.
        epochs: Pre-training and fine-tuning epochs instead of the protocol's.
    """
    args = ["--config", str(config_file(EXPERIMENTS[label])), "--config", str(config_file(PROTOCOL))]
    args += [f"--protocol.output_dir={root / label}", "--trainer.enable_model_summary=false"]
    if epochs is not None:
        args += [f"--protocol.pretrain.max_epochs={epochs}", f"--protocol.finetune.max_epochs={epochs}"]
    return args


def run(output_dir: Path = Path("runs/demo"), epochs: int | None = None) -> list[dict[str, Any]]:
    """Run the main job for APE and RoPE and print the table of barriers; returns one row per encoding."""
    for name in ("lightning.pytorch", "lightning.fabric"):  # keep the job's own output readable
        logging.getLogger(name).setLevel(logging.WARNING)
    root = Path(output_dir)
    rows = []
    for label in EXPERIMENTS:
        experiment = Experiment(experiment_cli(experiment_arguments(label, root, epochs), run=False))
        summary = experiment.run()
        rows.append(
            {"label": label, "summary": summary, "results_dir": root / label, "seeds": experiment.protocol.seeds}
        )
    print()
    print("Linear mode connectivity after re-initializing the first attention layer (digits, validation split)")
    print(f"{rows[0]['seeds']} fine-tuned seeds per encoding: mean ± std over their pairs")
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
