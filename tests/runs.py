"""Tiny trainers and pre-training / fine-tuning runs shared by the tests (and the DDP job script)."""

from __future__ import annotations

from pathlib import Path

import lightning as L

from lmc.data import Digits
from lmc.training import LMCModule

MODEL, CONFIG = "reference-vit-tiny", {"pe": "rope"}


def data(part: str = "B") -> Digits:
    return Digits(batch_size=32, part=part)


def trainer(root: Path, steps: int, **kwargs) -> L.Trainer:
    settings = dict(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=root,
    )
    return L.Trainer(**{**settings, **kwargs})


def finetuned(pretrained: Path, seed: int) -> LMCModule:
    L.seed_everything(seed, verbose=False)
    return LMCModule(
        MODEL,
        CONFIG,
        data().info,
        reinit="first_attention",
        reinit_seed=seed,
        pretrained=str(pretrained),
        lr=3e-3,
    )


def pretrain_and_first_seed(root: Path) -> tuple[Path, Path]:
    """A pre-trained checkpoint and a seed-0 fine-tuned checkpoint under ``root``."""
    L.seed_everything(0, verbose=False)
    module = LMCModule(MODEL, CONFIG, data().info, lr=3e-3)
    run = trainer(root / "pretrain", steps=30)
    run.fit(module, data("A"))
    pretrained = root / "pretrained.ckpt"
    run.save_checkpoint(pretrained)
    run = trainer(root / "seed0", steps=15)
    run.fit(finetuned(pretrained, 0), data())
    seed0 = root / "seed0.ckpt"
    run.save_checkpoint(seed0)
    return pretrained, seed0
