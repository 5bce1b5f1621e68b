"""The LightningModule of every lmc experiment (paper Section 6; SPEC section 5).

One module covers image classification, text classification and causal language modelling
with any supported backbone. ``strategy`` picks the run's role:

- ``None``: pre-training, every parameter trains;
- ``"first_attention"``, ``"all_attention"``, ``"first_block"``, ``"full_model"``: start from
  ``pretrained``, re-initialize exactly the parameters of that scope (seeded by
  ``reinit_seed``, with the backbone's own initializer) and freeze everything else. Only the
  re-initialized parameters have ``requires_grad`` and sit in the optimizer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric

from lmc.adapters import adapter_for
from lmc.checkpoints import load_weights
from lmc.models import create_model
from lmc.symmetry import SCOPES, scope_parameters
from lmc.tasks import DataInfo


class LMCModule(L.LightningModule):
    """Train or fine-tune one backbone under a re-initialization strategy.

    Logs ``{train,val,test}/{loss,accuracy}`` (and ``bits_per_token`` for language models) as
    torchmetrics means weighted by samples or tokens.

    Args:
        model: A registered model name (``lmc.models.list_models()``), e.g. ``"reference-vit"``.
        model_config: Config fields overriding the family defaults (e.g. ``{"pe": "rope"}``).
        data: The DataModule's ``info`` (task, classes, sizes); the CLI links it.
        strategy: ``None`` (pre-training) or a re-initialization scope.
        reinit_seed: Seed of the re-initialized parameters (one fine-tuning run per seed).
        pretrained: Checkpoint to start from (required with a strategy).
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        warmup_steps: Linear warm-up steps before cosine decay (over ``trainer.max_steps`` or
            the estimated total steps).
    """

    def __init__(
        self,
        model: str = "reference-vit-tiny",
        model_config: dict[str, Any] | None = None,
        data: DataInfo | None = None,
        strategy: str | None = None,
        reinit_seed: int = 0,
        pretrained: str | None = None,
        lr: float = 1e-3,
        weight_decay: float = 0.01,
        warmup_steps: int = 0,
    ):
        super().__init__()
        if strategy is not None and strategy not in SCOPES:
            raise ValueError(f"strategy={strategy!r}; choose None (pre-training) or one of {', '.join(SCOPES)}")
        if strategy is not None and strategy != "full_model" and pretrained is None:
            raise ValueError(f"strategy {strategy!r} fine-tunes a pre-trained model: set pretrained to its checkpoint")
        self.save_hyperparameters()
        if isinstance(data, DataInfo):  # checkpoints hold plain types: they must load with weights_only=True
            self.save_hyperparameters({**self.hparams, "data": dataclasses.asdict(data)})
        self.model = self.build_model()
        if pretrained is not None:
            load_weights(self.model, pretrained)
        # Sample- (or token-) weighted means whose states are sums: exact across batches and DDP ranks.
        self.metrics = nn.ModuleDict(
            {
                f"{stage}_{name}": MeanMetric()
                for stage in ("train", "val", "test")
                for name in ("loss", "accuracy", "bits_per_token")
            }
        )
        if strategy is not None:
            self.reinitialize(strategy, reinit_seed)
        self.adapter = adapter_for(self.model)

    def build_model(self) -> nn.Module:
        """A freshly initialized backbone of this module's configuration."""
        hp = self.hparams
        data = None if hp.data is None else DataInfo(**hp.data)
        return create_model(hp.model, data=data, **(hp.model_config or {})).train()

    def reinitialize(self, scope: str, seed: int) -> list[str]:
        """Re-initialize the scope's parameters from a fresh seeded backbone and freeze the rest."""
        names = scope_parameters(self.model, scope)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            fresh = dict(self.build_model().named_parameters())
        chosen = set(names)
        with torch.no_grad():
            for name, parameter in self.model.named_parameters():
                if name in chosen:
                    parameter.copy_(fresh[name])
                parameter.requires_grad_(name in chosen)
        return names

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Logits: ``(B, classes)`` or ``(B, T, vocab)``."""
        return self.adapter.forward(self.model, self.adapter.model_inputs(self.model, batch))

    def loss_sums(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(summed loss, correct predictions, count)`` of a batch, in float64.

        Counts are samples (classification) or tokens (language modelling). Sums, not means,
        so that shards and batches combine exactly.
        """
        logits = self(batch)
        labels = batch["labels"]
        logits = logits.reshape(-1, logits.shape[-1]).float()
        labels = labels.reshape(-1)
        loss = F.cross_entropy(logits, labels, reduction="sum")
        correct = (logits.argmax(-1) == labels).sum()
        return loss.double(), correct.double(), torch.tensor(labels.numel(), dtype=torch.float64, device=labels.device)

    def _step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        loss_sum, correct, count = self.loss_sums(batch)
        loss = loss_sum / count
        batch_size = int(count)
        self.log(f"{stage}/loss", loss, prog_bar=True, sync_dist=stage != "train", batch_size=batch_size)
        self.log(
            f"{stage}/accuracy",
            correct / count,
            prog_bar=stage != "train",
            sync_dist=stage != "train",
            batch_size=batch_size,
        )
        if batch["labels"].ndim == 2:  # language modelling: one label per token
            self.log(f"{stage}/bits_per_token", loss / math.log(2), sync_dist=stage != "train", batch_size=batch_size)
        return loss.float()

    def training_step(self, batch: dict[str, torch.Tensor], batch_index: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: dict[str, torch.Tensor], batch_index: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch: dict[str, torch.Tensor], batch_index: int) -> None:
        self._step(batch, "test")

    def configure_optimizers(self):
        parameters = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(parameters, lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup = min(self.hparams.warmup_steps, total - 1)

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / (warmup + 1)
            return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
