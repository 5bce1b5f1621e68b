"""The LightningModule of every lmc experiment (paper Section 6; docs/spec.md, section 5).

One module covers image classification, text classification and causal language modelling
with any supported backbone. ``reinit`` (the paper's re-initialization strategy; named so as
not to clash with Lightning's ``trainer.strategy``) picks the run's role:

- ``None``: pre-training, every parameter trains;
- ``"first_attention"``, ``"all_attention"``, ``"first_block"``, ``"full_model"``: start from
  ``pretrained``, re-initialize exactly the parameters of that scope (seeded by
  ``reinit_seed``, with the backbone's own initializer) and freeze everything else. Only the
  re-initialized parameters have ``requires_grad`` and sit in the optimizer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric

from lmc.adapters import adapter_for, scope_parameters
from lmc.checkpoints import CheckpointError, load_weights, read_checkpoint
from lmc.data.base import NOT_SCORED
from lmc.io import atomic_write
from lmc.models import create_model
from lmc.symmetry import Scope, check_scope
from lmc.tasks import DataInfo

NO_END = (
    "the learning-rate schedule decays over the whole run, which has no end with trainer.max_epochs -1 "
    "and trainer.max_steps -1: set trainer.max_epochs or trainer.max_steps"
)


def require_an_end(max_epochs: int | None, max_steps: int) -> None:
    """Raise ``ValueError`` (:data:`NO_END`) for trainer settings under which the learning-rate schedule never ends,
    before a trainer is built from them."""
    if max_epochs == -1 and max_steps == -1:
        raise ValueError(NO_END)


class LMCModule(L.LightningModule):
    """Train or fine-tune one backbone under a re-initialization scope.

    Logs ``{train,val,test}/{loss,accuracy}`` (and ``bits_per_token`` for language models) as
    torchmetrics means weighted by samples or tokens.

    Args:
        model: A registered model name (``lmc.models.list_models()``), e.g. ``"reference-vit"``.
        model_config: Config fields overriding the family defaults (e.g. ``{"pe": "rope"}``).
        data: The DataModule's ``info`` (task, classes, sizes); the CLI links it.
        reinit: ``None`` (pre-training) or the scope to re-initialize and fine-tune.
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
        reinit: Scope | None = None,
        reinit_seed: int = 0,
        pretrained: str | None = None,
        lr: float = 1e-3,
        weight_decay: float = 0.01,
        warmup_steps: int = 0,
    ):
        super().__init__()
        if reinit is not None:
            check_scope(reinit)
        if reinit is not None and reinit != "full_model" and pretrained is None:
            raise ValueError(f"reinit={reinit!r} fine-tunes a pre-trained model: set pretrained to its checkpoint")
        self.save_hyperparameters()
        if isinstance(data, DataInfo):  # checkpoints hold plain types: they must load with weights_only=True
            self.save_hyperparameters({**self.hparams, "data": dataclasses.asdict(data)})
        self.model = self.build_model()
        if pretrained is not None:
            check_pretrained(pretrained, model, model_config)
            load_weights(self.model, pretrained)
        # Sample- (or token-) weighted means, one per stage and metric, created on first use: their
        # states are sums, so epoch values are exact across batches and DDP ranks.
        self.metrics = nn.ModuleDict()
        if reinit is not None:
            self.reinitialize(reinit, reinit_seed)
        self.adapter = adapter_for(self.model)

    def require_data(self, datamodule) -> None:
        """Refuse a DataModule that does not fit the data this model was sized for."""
        if dataclasses.asdict(datamodule.info) != self.hparams.data:
            raise ValueError(
                f"the data ({type(datamodule).__name__}: {datamodule.info}) does not fit the model, which was "
                f"built for {self.hparams.data}: evaluate on the data set the checkpoints were trained on"
            )

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

    def model_loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean cross-entropy of ``model`` on ``batch``: this module's backbone or a copy of it (an
        aligned one); the forward of a calibration (:func:`lmc.connectivity.training_calibration`)."""
        logits = self.adapter.forward(model, self.adapter.model_inputs(model, batch))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch["labels"].reshape(-1))

    def sample_sums(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Named float64 sums of each sample of a batch, ``(B,)`` each: over its one prediction
        (classification) or its tokens (language modelling).

        ``count`` is the number of predictions, ``loss`` the summed cross-entropy and ``accuracy``
        the number of correct predictions; every reported metric is ``sum / count``. Sums, not
        means, so that samples, batches and shards combine exactly, and per sample, so that the
        interpolation's bootstrap resamples clusters of samples whatever the batch size
        (:func:`lmc.connectivity.interpolation.evaluate`). A metric added here is logged in
        training and swept by the interpolation without any other change.
        """
        return classification_sums(self(batch), batch["labels"], per_sample=True)

    def metric_sums(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """:meth:`sample_sums` added over the batch: float64 scalars."""
        return {name: value.sum() for name, value in self.sample_sums(batch).items()}

    def _mean(self, stage: str, name: str) -> MeanMetric:
        key = f"{stage}_{name}"
        if key not in self.metrics:
            self.metrics[key] = MeanMetric().to(self.device)
        return self.metrics[key]

    def _step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        sums = self.metric_sums(batch)
        count = sums.pop("count")
        means = {name: value / count for name, value in sums.items()}
        if batch["labels"].ndim == 2:  # language modelling: one label per token
            means["bits_per_token"] = means["loss"] / math.log(2)
        for name, mean in means.items():
            metric = self._mean(stage, name)
            metric(mean, count)  # forward: accumulates and keeps the batch's value for step logs
            show = name == "loss" or (stage != "train" and name == "accuracy")
            self.log(
                f"{stage}/{name}",
                metric,
                on_step=stage == "train",
                on_epoch=True,
                prog_bar=show,
                metric_attribute=f"metrics.{stage}_{name}",  # created lazily: Lightning's lookup misses it
            )
        return means["loss"].float()

    def training_step(self, batch: dict[str, torch.Tensor], batch_index: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: dict[str, torch.Tensor], batch_index: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch: dict[str, torch.Tensor], batch_index: int) -> None:
        self._step(batch, "test")

    def configure_optimizers(self):
        parameters = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(parameters, lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        steps = self.trainer.estimated_stepping_batches
        if not math.isfinite(steps):  # max_epochs -1 with max_steps -1: the cosine schedule has no end
            raise ValueError(NO_END)
        total = max(1, int(steps))
        warmup = min(self.hparams.warmup_steps, total - 1)

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / (warmup + 1)
            return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _scored(logits: torch.Tensor) -> torch.Tensor:
    """Logits in the precision their loss is taken in: float64 kept, anything else in float32."""
    return logits if logits.dtype == torch.float64 else logits.float()


def classification_sums(
    logits: torch.Tensor, labels: torch.Tensor, per_sample: bool = False
) -> dict[str, torch.Tensor]:
    """``count``, summed cross-entropy ``loss`` and ``accuracy`` (correct predictions) in float64.

    Args:
        logits: ``(B, classes)`` or ``(B, T, vocab)``, any float dtype (the loss is taken in float32,
            or in float64 for float64 logits).
        labels: ``(B,)`` or ``(B, T)`` class indices.
        per_sample: Return each sample's sums, ``(B,)`` (over its ``T`` tokens), instead of scalars.
    """
    samples = labels.shape[0]
    losses = F.cross_entropy(_scored(logits).reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    correct = logits.argmax(-1).reshape(-1) == labels.reshape(-1)
    sums = {
        "count": torch.full((samples,), math.prod(labels.shape[1:]), dtype=torch.float64, device=labels.device),
        "loss": losses.double().reshape(samples, -1).sum(1),
        "accuracy": correct.double().reshape(samples, -1).sum(1),
    }
    return sums if per_sample else {name: value.sum() for name, value in sums.items()}


def masked_lm_sums(
    output: Mapping[str, torch.Tensor], batch: dict[str, torch.Tensor], per_sample: bool = False
) -> dict[str, torch.Tensor]:
    """Float64 sums of a masked-LM batch (:mod:`lmc.formats.masked_lm`): ``count`` chosen positions,
    their summed cross-entropy ``loss`` and correct predictions ``accuracy``; with next-sentence
    labels also ``next_sentence/count``, ``next_sentence/loss`` and ``next_sentence/accuracy``
    over the pairs (each metric is divided by its own count,
    :func:`lmc.connectivity.interpolation.point_metrics`).

    Args:
        output: The model's output: ``BertForMaskedLM``'s ``logits`` ``(B, T, V)`` or
            ``BertForPreTraining``'s ``prediction_logits`` ``(B, T, V)`` and
            ``seq_relationship_logits`` ``(B, 2)``.
        batch: ``labels`` ``(B, T)``: the original token at chosen positions, ``NOT_SCORED``
            elsewhere; ``next_sentence_label`` ``(B,)`` (0: the second sentence follows the
            first, 1: it is a random one, HF's convention) when the data gives sentence pairs.
        per_sample: Return each sequence's sums, ``(B,)``, instead of scalars.
    """
    logits = output["prediction_logits"] if "prediction_logits" in output else output["logits"]
    labels = batch["labels"]
    chosen = labels != NOT_SCORED
    losses = F.cross_entropy(  # 0 at the positions not scored
        _scored(logits).flatten(0, 1),
        labels.reshape(-1),
        ignore_index=NOT_SCORED,
        reduction="none",
    )
    sums = {
        "count": chosen.double().sum(1),
        "loss": losses.double().reshape(labels.shape).sum(1),
        "accuracy": ((logits.argmax(-1) == labels) & chosen).double().sum(1),
    }
    if "next_sentence_label" in batch:
        pairs = classification_sums(output["seq_relationship_logits"], batch["next_sentence_label"], per_sample=True)
        sums.update({f"next_sentence/{name}": value for name, value in pairs.items()})
    return sums if per_sample else {name: value.sum() for name, value in sums.items()}


#: Hyper-parameters that fix the backbone's architecture (the rest are training settings).
MODEL_FIELDS = ("model", "model_config", "data")


def load_trained(path: str | Path) -> tuple[LMCModule, dict[str, Any]]:
    """An :class:`LMCModule` holding a checkpoint's weights, built from the checkpoint's own settings.

    Nothing else is read: no pre-trained checkpoint, no re-initialization. Returns the module
    and the checkpoint's hyper-parameters.

    Raises:
        CheckpointError: ``path`` is not an lmc checkpoint with its hyper-parameters.
    """
    checkpoint = read_checkpoint(path)
    hyperparameters = checkpoint.get("hyper_parameters")
    if not isinstance(hyperparameters, dict) or "model" not in hyperparameters:
        raise CheckpointError(
            f"{path} holds weights without their model's configuration: pass a checkpoint written by lmc fit, "
            "lmc run or lmc align, or for a timm state dict add --timm_model NAME (and --timm_args)"
        )
    data = hyperparameters.get("data")
    module = LMCModule(hyperparameters["model"], hyperparameters.get("model_config"), data and DataInfo(**data))
    load_weights(module.model, path)
    return module, hyperparameters


def check_pretrained(
    path: str | Path, model: str, model_config: Mapping[str, Any] | None, setting: str = "model.pretrained"
) -> None:
    """Refuse a pre-trained checkpoint of another model than ``model`` built with ``model_config``.

    The same shapes can hold another function (a rotary layout, a positional encoding), which a
    fine-tuning would silently start from; every way of loading pre-trained weights checks this
    first (``lmc fit --model.pretrained``, ``lmc run --protocol.pretrained``, each fine-tuning).
    A checkpoint without lmc's settings (a safetensors file, a bare state dict) has none to compare.

    Args:
        path: The pre-trained checkpoint.
        model: The registered model name the weights are loaded into.
        model_config: Its config overrides (``None`` as ``{}``).
        setting: The setting that named ``path``, for the message.

    Raises:
        CheckpointError: The checkpoint's model or config differs (naming both), or it cannot be read.
    """
    if Path(path).suffix == ".safetensors":
        return
    hyperparameters = read_checkpoint(path).get("hyper_parameters")
    if not isinstance(hyperparameters, dict) or "model" not in hyperparameters:
        return
    expected = {"model": model, "model_config": dict(model_config or {})}
    found = {"model": hyperparameters["model"], "model_config": dict(hyperparameters.get("model_config") or {})}
    differing = [name for name in expected if found[name] != expected[name]]
    if differing:
        details = "; ".join(f"{name} {found[name]!r} there, {expected[name]!r} here" for name in differing)
        raise CheckpointError(
            f"{setting} {path} is another model than this one ({details}): start from a checkpoint of this "
            "model, or build this model with the checkpoint's config"
        )


def trained_scope(hyperparameters: dict[str, Any]) -> Scope:
    """The scope a checkpoint's model was re-initialized at for fine-tuning (its hyper-parameters' ``reinit``), the
    default scope of the commands that align lmc checkpoints; ``full_model`` for a model trained from scratch."""
    return hyperparameters.get("reinit") or "full_model"


def require_same_model(hyperparameters: dict[str | Path, dict[str, Any]]) -> None:
    """Refuse checkpoints (path -> hyper-parameters) whose architectures differ, naming the difference."""
    (first, reference), *others = hyperparameters.items()
    for path, other in others:
        differing = [k for k in MODEL_FIELDS if other.get(k) != reference.get(k)]
        if differing:
            details = "; ".join(f"{k}: {reference.get(k)!r} in {first}, {other.get(k)!r} in {path}" for k in differing)
            raise CheckpointError(f"the checkpoints are of different models ({details}): use runs of one experiment")


def save_trained(weights: dict[str, torch.Tensor], hyperparameters: dict[str, Any], path: str | Path) -> Path:
    """Write backbone ``weights`` as an lmc checkpoint (readable by :func:`load_trained`), atomically."""
    checkpoint = {
        "state_dict": {f"model.{name}": value for name, value in weights.items()},
        "hyper_parameters": {k: hyperparameters.get(k) for k in MODEL_FIELDS},
    }
    return atomic_write(path, lambda p: torch.save(checkpoint, p))
