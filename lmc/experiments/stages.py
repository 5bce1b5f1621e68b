"""The training stages of ``lmc run`` (docs/experiments.md): the pre-training on half A and each seed's
fine-tuning on half B, each in its own folder with the key of its configuration.

A stage whose folder holds the same key and a checkpoint is finished and never trained again; one
that holds another key is refused unless ``protocol.overwrite`` (:class:`Stages`).
:class:`~lmc.experiments.run.Experiment` aligns and sweeps their pairs.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmc.connectivity import keyed_data_settings
from lmc.experiments.jobs import Cluster
from lmc.experiments.protocol import Protocol, RunError, Schedule, experiment_cli
from lmc.io import atomic_write, atomic_write_json
from lmc.training.cli import instantiate_data
from lmc.training.module import LMCModule, check_pretrained, load_trained

log = logging.getLogger(__name__)

#: Trainer settings that change how a run looks, not what it computes: not part of a stage's key.
COSMETIC = {"logger", "enable_progress_bar", "enable_model_summary", "log_every_n_steps", "callbacks"}
#: Callbacks that ``lmc run`` replaces by its own checkpointing and sweeps.
REPLACED_CALLBACKS = ("ModelCheckpoint", "AlignAndInterpolate")


def stage_key(*parts: object) -> str:
    """A short hash of a stage's (or a pair's) configuration: its folder's record of what it holds."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def seed_stage(seed: int) -> str:
    """The name of seed ``seed``'s fine-tuning: its stage folder, its job, its TensorBoard run."""
    return f"seed{seed}"


def stage_label(job: str) -> str:
    """How progress names a job of :meth:`~lmc.experiments.run.Experiment.jobs` (``seed1``: ``fine-tune seed 1``)."""
    if job.startswith("seed"):
        return f"fine-tune seed {job.removeprefix('seed')}"
    if job.startswith("pair"):
        return f"align and sweep pair {job.removeprefix('pair')}"
    return "pre-train" if job == "pretrain" else job


@dataclass
class Stage:
    """One training run of the protocol: its folder, configuration and upstream."""

    name: str
    config: Any  # the jsonargparse namespace of this stage
    key: str

    def folder(self, root: Path) -> Path:
        return root / self.name

    def checkpoint(self, root: Path) -> Path:
        return self.folder(root) / "final.ckpt"


class Stages:
    """The training stages of :class:`~lmc.experiments.protocol.Protocol` for one parsed experiment configuration.

    Args:
        cli: A LightningCLI (``run=False``) holding the parsed experiment config and its parser.
        protocol: The protocol to run instead of the config's own (``lmc repro`` builds each
            run's); the stages' configs record it, as if it had been given in the config.
    """

    def __init__(self, cli, protocol: Protocol | None = None):
        self.parser, self.config = cli.parser, cli.config
        if protocol is not None:
            self.config = self.parser.parse_object({"protocol": dataclasses.asdict(protocol)}, self.config)
        self.protocol: Protocol = protocol or cli.config_init.protocol
        self.cluster: Cluster = cli.config_init.get("cluster") or Cluster()
        self.root = Path(self.protocol.output_dir)

    def _stage_config(self, name: str, overrides: dict[str, Any], schedule: Schedule):
        config = copy.deepcopy(self.config)
        for dotted, value in overrides.items():
            config[dotted] = value
        if schedule.max_epochs is not None:
            config["trainer.max_epochs"] = schedule.max_epochs
        if schedule.lr is not None:
            config["model.lr"] = schedule.lr
        if schedule.samples is not None:
            if "train_samples" not in config.data.init_args:
                phase = "pretrain" if name == "pretrain" else "finetune"
                raise RunError(
                    f"protocol.{phase}.samples needs a DataModule that takes train_samples, which "
                    f"{config.data.class_path} does not: add train_samples to its __init__ and pass it to LMCDataModule"
                )
            config["data.init_args.train_samples"] = schedule.samples
        config["trainer.logger"] = {
            "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
            "init_args": {"save_dir": str(self.root / "tensorboard"), "name": name, "version": ""},
        }
        callbacks = config.get("trainer.callbacks") or []
        config["trainer.callbacks"] = [
            c for c in callbacks if str(c.class_path).rsplit(".", 1)[-1] not in REPLACED_CALLBACKS
        ]
        config["trainer.enable_checkpointing"] = False
        return config

    def _key_of(self, config, upstream: str) -> str:
        trainer = {k: v for k, v in config.trainer.as_dict().items() if k not in COSMETIC}
        data = config.data.as_dict()
        if "init_args" in data:
            data["init_args"] = keyed_data_settings(data["init_args"])
        return stage_key(config.model.as_dict(), data, trainer, config.seed_everything, upstream)

    def pretrain_stage(self) -> Stage:
        config = self._stage_config(
            "pretrain", {"model.reinit": None, "data.init_args.part": "A"}, self.protocol.pretrain
        )
        return Stage("pretrain", config, self._key_of(config, ""))

    def finetune_stage(self, seed: int, pretrained: Path, upstream: str) -> Stage:
        base_seed = self.config.seed_everything if isinstance(self.config.seed_everything, int) else 0
        overrides = {
            "model.reinit": self.protocol.reinit,
            "model.reinit_seed": seed,
            "model.pretrained": str(pretrained),
            "data.init_args.part": "B",
            # Data order and dropout differ per seed; 100 apart from pre-training's seed.
            "seed_everything": base_seed + 100 + seed,
        }
        name = seed_stage(seed)
        config = self._stage_config(name, overrides, self.protocol.finetune)
        config_for_key = copy.deepcopy(config)
        config_for_key["model.pretrained"] = None  # the upstream key stands for the checkpoint
        return Stage(name, config, self._key_of(config_for_key, upstream))

    def instantiate(self, stage: Stage):
        """``(trainer, module, datamodule)`` of a stage, seeded as its config says.

        Parsed anew from the stage's whole config, so the module's saved hyper-parameters are
        the stage's own (LightningCLI records the config it parsed, not the arguments it got).
        """
        cli = experiment_cli(["--config", self.parser.dump(stage.config)], run=False)
        return cli.trainer, cli.model, cli.datamodule

    def trained(self, stage: Stage, checkpoint: Path) -> tuple[LMCModule, Any]:
        """``(module, datamodule)`` of a trained stage: the module built once from ``checkpoint`` (its
        own architecture and weights, in evaluation mode; no pre-trained weights, no
        re-initialization), the DataModule from the stage's config alone."""
        module, _ = load_trained(checkpoint)
        return module.eval(), instantiate_data(stage.config)

    def _finished(self, stage: Stage) -> bool:
        record = stage.folder(self.root) / "stage.json"
        if not record.is_file():
            return False
        saved = json.loads(record.read_text()).get("key")
        if saved == stage.key and stage.checkpoint(self.root).is_file():
            return True
        if saved != stage.key and not self.protocol.overwrite:
            raise RunError(
                f"{stage.folder(self.root)} holds a {stage.name} run of another configuration: rerun with "
                f"--protocol.overwrite true to recompute it (and what depends on it), or choose another "
                f"--protocol.output_dir"
            )
        return False

    def fit(self, stage: Stage) -> Path:
        """Train a stage unless its checkpoint of the same configuration exists; returns the checkpoint."""
        checkpoint = stage.checkpoint(self.root)
        if self._finished(stage):
            log.info("%s: finished earlier (%s)", stage.name, checkpoint)
            return checkpoint
        trainer, module, datamodule = self.instantiate(stage)
        if trainer.is_global_zero:
            (stage.folder(self.root) / "stage.json").unlink(missing_ok=True)
        trainer.fit(module, datamodule)
        if not trainer.is_global_zero:  # a DDP rank: takes part in the collective save, rank 0 writes
            trainer.save_checkpoint(checkpoint, weights_only=True)
            return checkpoint
        atomic_write(checkpoint, lambda path: trainer.save_checkpoint(path, weights_only=True))
        # The ranks it trained on: a DDP fit trains another model than one process (docs/experiments.md).
        record = {"key": stage.key, "name": stage.name, "world_size": trainer.world_size}
        atomic_write_json(stage.folder(self.root) / "stage.json", record)
        return checkpoint

    def _check_pretrained(self, path: Path) -> None:
        """Refuse a missing pre-trained checkpoint, or one of another model (:func:`check_pretrained`),
        before any training."""
        if not path.is_file():
            raise RunError(f"protocol.pretrained {path} does not exist: train it or drop the setting")
        model = self.config.model
        check_pretrained(path, model.model, model.model_config, "protocol.pretrained")

    def data_info(self):
        """What the experiment's data tells its model (``DataInfo``)."""
        return instantiate_data(self.config).info

    def upstream(self) -> tuple[Path, str]:
        """``(checkpoint, key)`` the fine-tunings start from: ``protocol.pretrained`` or the pre-training's."""
        if self.protocol.pretrained is None:
            stage = self.pretrain_stage()
            return stage.checkpoint(self.root), stage.key
        pretrained = Path(self.protocol.pretrained)
        self._check_pretrained(pretrained)
        return pretrained, stage_key(
            str(pretrained.resolve()), pretrained.stat().st_size, pretrained.stat().st_mtime_ns
        )

    def finetune_stages(self) -> list[Stage]:
        """The fine-tuning stage of every seed."""
        pretrained, upstream = self.upstream()
        return [self.finetune_stage(seed, pretrained, upstream) for seed in range(self.protocol.seeds)]
