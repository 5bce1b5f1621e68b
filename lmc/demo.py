"""The main job: a full LMC experiment on the embedded digits, offline, in minutes on a CPU.

For a ViT-style reference Transformer with learned absolute PE and with RoPE (paper Section 6,
first-attention-layer re-initialization):

1. pre-train on half A of the digits' training split;
2. fine-tune two seeds on half B, re-initializing the first attention layer, all else frozen;
3. align seed 1's attention to seed 0's (Stage 1 + Stage 2) and sweep 25 interpolation points,
   naive and aligned, on the validation split (the ``AlignAndInterpolate`` callback);
4. print naive vs aligned barriers with the paths of the TensorBoard logs and results.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger

from callbacks import AlignAndInterpolate
from lmc.data import Digits
from lmc.training import LMCModule

POSITIONAL_ENCODINGS = {"APE (learned)": {"pe": "learned"}, "RoPE": {"pe": "rope", "rope_layout": "half"}}
MODEL = dict(width=64, depth=6, num_heads=4)  # the paper's 6 layers and 4 heads, narrow for a CPU
PRETRAIN_EPOCHS, FINETUNE_EPOCHS = 40, 60
PRETRAIN_LR, FINETUNE_LR, BATCH_SIZE = 2e-3, 3e-3, 32


def _trainer(root: Path, name: str, epochs: int, callbacks: list | None = None) -> L.Trainer:
    return L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        logger=TensorBoardLogger(str(root / "tensorboard"), name=name, version=""),
        callbacks=callbacks or [],
        enable_checkpointing=False,
        log_every_n_steps=5,
        enable_model_summary=False,
    )


def run_one(root: Path, label: str, model_config: dict[str, Any], epochs: tuple[int, int]) -> dict[str, Any]:
    """Pre-train, fine-tune two seeds, align and sweep for one positional encoding."""
    data_info = Digits().info
    config = {**MODEL, **model_config}
    pretrain_epochs, finetune_epochs = epochs
    L.seed_everything(0, verbose=False)
    pretrained = LMCModule("reference-vit", config, data_info, lr=PRETRAIN_LR)
    pretrain = _trainer(root, f"{label}/pretrain", pretrain_epochs)
    pretrain.fit(pretrained, Digits(batch_size=BATCH_SIZE, part="A"))
    pretrained_path = root / label / "pretrained.ckpt"
    pretrain.save_checkpoint(pretrained_path)

    checkpoints = []
    callback = None
    for seed in (0, 1):
        L.seed_everything(100 + seed, verbose=False)
        module = LMCModule(
            "reference-vit",
            config,
            data_info,
            strategy="first_attention",
            reinit_seed=seed,
            pretrained=str(pretrained_path),
            lr=3e-3,
        )
        if seed == 1:
            callback = AlignAndInterpolate(references=[str(checkpoints[0])], output_dir=str(root / label / "results"))
        trainer = _trainer(root, f"{label}/finetune_seed{seed}", finetune_epochs, [callback] if callback else None)
        trainer.fit(module, Digits(batch_size=BATCH_SIZE, part="B"))
        path = root / label / f"finetune_seed{seed}.ckpt"
        trainer.save_checkpoint(path)
        checkpoints.append(path)
    (result,) = callback.results["references"].values()
    return {"label": label, "result": result, "results_dir": root / label / "results"}


def run(output_dir: Path = Path("runs/demo"), epochs: int | None = None) -> list[dict[str, Any]]:
    """Run the main job for APE and RoPE and print the table of barriers; returns the rows."""
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # keep the job's own output readable
    root = Path(output_dir)
    schedule = (epochs or PRETRAIN_EPOCHS, epochs or FINETUNE_EPOCHS)
    rows = [run_one(root, label.split(" ")[0], config, schedule) for label, config in POSITIONAL_ENCODINGS.items()]
    print()
    print("Linear mode connectivity after re-initializing the first attention layer (digits, validation split)")
    columns = ("loss A", "loss B", "loss barrier", "acc barrier", "ratio %")
    header = f"{'PE':6s} {'curve':8s} " + " ".join(f"{c:>{max(8, len(c))}s}" for c in columns)
    print(header)
    print("-" * len(header))
    for row in rows:
        curves, ratio = row["result"]["curves"], row["result"]["barrier_ratio"]
        for curve in ("naive", "aligned"):
            data = curves[curve]
            points = data["points"]
            share = "" if curve == "naive" else f"{ratio['loss_barrier']:8.1f}"
            print(
                f"{row['label']:6s} {curve:8s} {points[0]['loss']:8.4f} {points[-1]['loss']:8.4f} "
                f"{data['loss_barrier']:12.4f} {data['accuracy_barrier']:11.4f} {share}"
            )
    print(f"\nTensorBoard logs: {root / 'tensorboard'}   (tensorboard --logdir {root / 'tensorboard'})")
    for row in rows:
        print(f"Results ({row['label']}): {row['results_dir']}/lmc_results.json, .csv, lmc_interpolation_0.png")
    return rows
