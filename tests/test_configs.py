"""configs/: every YAML loads, every group composes, every experiment runs a few steps on tiny data."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from callbacks import AlignAndInterpolate
from lmc.cli import lightning_cli
from lmc.data import LMCDataModule
from lmc.training import LMCModule

CONFIGS = Path(__file__).parents[1] / "configs"
GROUPS = ("model", "data", "trainer", "callbacks", "strategy", "experiment", "debug")
ALL = sorted(CONFIGS.rglob("*.yaml"))
EXPERIMENTS = sorted((CONFIGS / "experiment").glob("*.yaml"))
FAST = str(CONFIGS / "debug" / "fast.yaml")
BASE = str(CONFIGS / "experiment" / "digits_vit_ape.yaml")
# Stand-ins with the same task for data sets that are not on this machine.
TINY_DATA = {
    "image_classification": ["--data=lmc.data.Digits"],
    "text_classification": ["--data=lmc.data.PythonTextKinds", "--data.snippets_per_class=40", "--data.batch_size=8"],
    "causal_lm": ["--data=lmc.data.PythonDocsLM", "--data.sequence_length=32", "--data.batch_size=4"],
}
# Model families that refuse the base experiment's images compose with data of their task.
DATA_OF_MODEL = {
    "bert": TINY_DATA["text_classification"], "roformer": TINY_DATA["text_classification"],
    "gpt2": TINY_DATA["causal_lm"], "llama": TINY_DATA["causal_lm"],
}  # fmt: skip
TASK_OF = {
    "Digits": "image_classification", "MNIST": "image_classification", "CIFAR10": "image_classification",
    "CIFAR100": "image_classification", "ImageNet": "image_classification",
    "PythonTextKinds": "text_classification", "AGNews": "text_classification", "IMDB": "text_classification",
    "DBPedia": "text_classification",
    "PythonDocsLM": "causal_lm", "WikiText103": "causal_lm", "Enwik8": "causal_lm", "OneBillionWord": "causal_lm",
}  # fmt: skip


def test_configs_mirror_the_groups():
    assert {p.parent.name for p in ALL} == set(GROUPS)
    for group in GROUPS:
        assert list((CONFIGS / group).glob("*.yaml")), f"configs/{group} is empty"


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory) -> str:
    """Weights of the base experiment's model, as a pre-trained checkpoint for strategy configs."""
    import torch

    cli = lightning_cli(["--config", BASE, "--config", FAST], run=False)
    path = tmp_path_factory.mktemp("pretrained") / "base.ckpt"
    torch.save({"state_dict": cli.model.state_dict()}, path)
    return str(path)


@pytest.mark.parametrize("path", ALL, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_yaml_loads_and_composes_with_an_experiment(path, tmp_path, monkeypatch, base_checkpoint):
    content = yaml.safe_load(path.read_text())
    assert isinstance(content, dict) and set(content) <= {"model", "data", "trainer", "seed_everything"}
    monkeypatch.chdir(tmp_path)
    extra = [f"--model.pretrained={base_checkpoint}"] if path.parent.name == "strategy" else []
    if "data" not in content:
        extra += DATA_OF_MODEL.get(content.get("model", {}).get("model"), [])
    cli = lightning_cli(["--config", BASE, "--config", str(path), "--config", FAST, *extra], run=False)
    assert isinstance(cli.model, LMCModule) and isinstance(cli.datamodule, LMCDataModule)
    if "data" in content and "class_path" in content["data"]:
        assert type(cli.datamodule).__name__ == content["data"]["class_path"].rsplit(".", 1)[1]
    if "strategy" in content.get("model", {}):
        assert cli.model.hparams.strategy == content["model"]["strategy"]


def _experiment_args(path: Path) -> tuple[list[str], str]:
    content = yaml.safe_load(path.read_text())
    task = TASK_OF[content["data"]["class_path"].rsplit(".", 1)[1]]
    return ["--config", str(path), "--config", FAST, *TINY_DATA[task]], task


@pytest.mark.slow
@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.stem)
def test_every_experiment_fits_a_few_steps_on_tiny_data(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args, task = _experiment_args(path)
    cli = lightning_cli(["fit", *args])
    assert cli.trainer.global_step == 2
    assert cli.datamodule.task == task
    assert cli.trainer.callback_metrics["train/loss"].isfinite()


def test_callbacks_config_instantiates_align_and_interpolate(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = CONFIGS / "callbacks" / "align_and_interpolate.yaml"
    cli = lightning_cli(["--config", BASE, "--config", str(path)], run=False)
    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, AlignAndInterpolate)]
    assert len(callback.alphas) == 25 and callback.method == "full"


def test_a_bad_config_value_is_reported(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        lightning_cli(["--config", BASE, "--data.init_args.part=C"], run=False)
    assert "part" in capsys.readouterr().err
