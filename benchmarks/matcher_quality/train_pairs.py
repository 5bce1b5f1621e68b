"""Pre-train once per positional encoding and fine-tune N seeds (first attention), lmc/demo.py's recipe.

Writes ``<out>/<pe>/pretrained.pt`` and ``<out>/<pe>/seed<k>.pt`` (state dicts of the backbone).
Usage: python -m benchmarks.matcher_quality.train_pairs --out runs/matcher_quality --seeds 6
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import lightning as L
import torch

from lmc.data import Digits
from lmc.demo import BATCH_SIZE, FINETUNE_EPOCHS, MODEL, POSITIONAL_ENCODINGS, PRETRAIN_EPOCHS, PRETRAIN_LR
from lmc.training import LMCModule

FINETUNE_LR = 3e-3  # what lmc/demo.py passes (its FINETUNE_LR constant is the same value)


def trainer(epochs: int) -> L.Trainer:
    return L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,  # validation curves are not needed here: the study evaluates the end points itself
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="runs/matcher_quality")
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--pretrain-epochs", type=int, default=PRETRAIN_EPOCHS)
    parser.add_argument("--finetune-epochs", type=int, default=FINETUNE_EPOCHS)
    parser.add_argument("--pe", nargs="*", default=["learned", "rope"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    data_info = Digits().describe()
    for label, pe_config in POSITIONAL_ENCODINGS.items():
        pe = pe_config["pe"]
        if pe not in args.pe:
            continue
        folder = Path(args.out) / pe
        folder.mkdir(parents=True, exist_ok=True)
        config = {**MODEL, **pe_config}
        pretrained_ckpt = folder / "pretrained.ckpt"
        if not pretrained_ckpt.exists():
            start = time.time()
            L.seed_everything(0, verbose=False)
            module = LMCModule("reference-vit", config, data_info, lr=PRETRAIN_LR)
            fit = trainer(args.pretrain_epochs)
            fit.fit(module, Digits(batch_size=BATCH_SIZE, part="A"))
            fit.save_checkpoint(pretrained_ckpt)
            torch.save(module.model.state_dict(), folder / "pretrained.pt")
            print(f"{label}: pre-trained in {time.time() - start:.0f}s", flush=True)
        for seed in range(args.seeds):
            path = folder / f"seed{seed}.pt"
            if path.exists():
                continue
            start = time.time()
            L.seed_everything(100 + seed, verbose=False)
            module = LMCModule(
                "reference-vit",
                config,
                data_info,
                strategy="first_attention",
                reinit_seed=seed,
                pretrained=str(pretrained_ckpt),
                lr=FINETUNE_LR,
            )
            trainer(args.finetune_epochs).fit(module, Digits(batch_size=BATCH_SIZE, part="B"))
            torch.save(module.model.state_dict(), path)
            print(f"{label}: seed {seed} fine-tuned in {time.time() - start:.0f}s", flush=True)


if __name__ == "__main__":
    main()
