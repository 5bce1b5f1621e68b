"""configs/: every YAML loads, experiments compose the group files, every experiment runs a few steps."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml

from callbacks import AlignAndInterpolate
from lmc.data import LMCDataModule
from lmc.experiments.protocol import experiment_cli
from lmc.training import LMCModule

CONFIGS = Path(__file__).parents[1] / "configs"
#: One group each (``--model FILE``, or ``model: ../model/FILE`` in an experiment).
GROUP_FILES = ("model", "data", "trainer")
#: Fragments of whole configs (``--config FILE``).
FRAGMENTS = ("callbacks", "reinit", "protocol", "cluster", "experiment", "debug", "sensitivity")
#: ``lmc repro``'s studies (``study:`` files) and the experiments and overlays they run.
STUDY = "study"
ALL = sorted(CONFIGS.rglob("*.yaml"))
EXPERIMENTS = sorted((CONFIGS / "experiment").glob("*.yaml"))
STUDY_FILES = sorted(p for p in (CONFIGS / STUDY).glob("*.yaml") if "study" in yaml.safe_load(p.read_text()))
#: Experiments that compose the group files: the experiment folder's and the study's.
COMPOSED = EXPERIMENTS + sorted(p for p in (CONFIGS / STUDY).glob("*.yaml") if "model" in yaml.safe_load(p.read_text()))
FAST = str(CONFIGS / "debug" / "fast.yaml")
BASE = str(CONFIGS / "experiment" / "digits_vit_ape.yaml")
#: Data sets that ship with lmc's dependencies besides the stand-ins below: experiments run on them as they are.
EMBEDDED = ("lmc.data.MNIST5k",)
# Stand-ins with the same task for data sets that are not on this machine.
TINY_DATA = {
    "image_classification": ["--data=lmc.data.Digits"],
    "text_classification": ["--data=lmc.data.PythonTextKinds", "--data.snippets_per_class=40", "--data.batch_size=8"],
    "causal_lm": ["--data=lmc.data.PythonDocsLM", "--data.sequence_length=32", "--data.batch_size=4"],
}


def test_configs_mirror_the_groups():
    assert {p.parent.name for p in ALL} == set(GROUP_FILES + FRAGMENTS + (STUDY,))
    for group in GROUP_FILES + FRAGMENTS + (STUDY,):
        assert list((CONFIGS / group).glob("*.yaml")), f"configs/{group} is empty"


def _experiment(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _group_file(experiment: Path, group: str) -> Path:
    return (experiment.parent / _experiment(experiment)[group]).resolve()


def _flat(content: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in content.items():
        if isinstance(value, dict) and key not in ("model_config", "init_args"):
            flat.update(_flat(value, f"{prefix}{key}."))
        elif key == "init_args":
            flat.update(_flat(value, prefix))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


@pytest.mark.parametrize("path", COMPOSED, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_experiments_compose_the_group_files_and_hold_only_their_differences(path):
    content = _experiment(path)
    for group in GROUP_FILES:
        assert isinstance(content[group], str) and _group_file(path, group).is_file(), f"{group} is not a group file"
        base = _flat(yaml.safe_load(_group_file(path, group).read_text()))
        for key, value in content.items():
            if key.startswith(f"{group}."):
                inner = key[len(group) + 1 :].replace("init_args.", "")
                assert base.get(inner, object()) != value, f"{key}: {value!r} repeats {_group_file(path, group)}"


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory) -> str:
    """Weights of the base experiment's model, as a pre-trained checkpoint for reinit configs."""
    import torch

    cli = experiment_cli(["--config", BASE, "--config", FAST], run=False)
    path = tmp_path_factory.mktemp("pretrained") / "base.ckpt"
    torch.save({"state_dict": cli.model.state_dict()}, path)
    return str(path)


def _class_task(class_path: str) -> str:
    module, name = class_path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name).task


def _task(experiment: Path) -> str:
    """The task the experiment's DataModule class declares."""
    return _class_task(yaml.safe_load(_group_file(experiment, "data").read_text())["class_path"])


def _base_for(path: Path) -> str:
    """An experiment a file composes with: one that uses it, else one of the same task, else the digits one."""
    group = path.parent.name
    if group in GROUP_FILES:
        for experiment in EXPERIMENTS:
            if _group_file(experiment, group) == path.resolve():
                return str(experiment)
    if group == "data":
        task = _class_task(yaml.safe_load(path.read_text())["class_path"])
        return str(next(e for e in EXPERIMENTS if _task(e) == task))
    return BASE


@pytest.mark.parametrize("path", [p for p in ALL if p not in STUDY_FILES], ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_yaml_loads_and_composes_with_an_experiment(path, tmp_path, monkeypatch, base_checkpoint):
    content = yaml.safe_load(path.read_text())
    monkeypatch.chdir(tmp_path)
    group = path.parent.name
    if group in GROUP_FILES:
        given = [f"--{group}", str(path)]
    else:
        assert isinstance(content, dict)
        assert {key.split(".")[0] for key in content} <= {
            "model",
            "data",
            "trainer",
            "seed_everything",
            "protocol",
            "cluster",
        }
        given = ["--config", str(path)]
    extra = [f"--model.pretrained={base_checkpoint}"] if group == "reinit" else []
    cli = experiment_cli(["--config", _base_for(path), *given, "--config", FAST, *extra], run=False)
    assert isinstance(cli.model, LMCModule) and isinstance(cli.datamodule, LMCDataModule)
    if group == "data":
        assert type(cli.datamodule).__name__ == content["class_path"].rsplit(".", 1)[1]
    if group == "model":
        assert cli.model.hparams.model == content["model"]
    if group == "reinit":
        assert cli.model.hparams.reinit == content["model"]["reinit"]


@pytest.mark.slow
@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.stem)
def test_every_experiment_fits_a_few_steps_on_tiny_data(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    task = _task(path)
    embedded = yaml.safe_load(_group_file(path, "data").read_text())["class_path"] in EMBEDDED
    cli = experiment_cli(["fit", "--config", str(path), "--config", FAST, *([] if embedded else TINY_DATA[task])])
    assert cli.trainer.global_step == 2
    assert cli.datamodule.task == task
    assert cli.trainer.callback_metrics["train/loss"].isfinite()


def test_callbacks_config_instantiates_align_and_interpolate(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = CONFIGS / "callbacks" / "align_and_interpolate.yaml"
    cli = experiment_cli(["--config", BASE, "--config", str(path)], run=False)
    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, AlignAndInterpolate)]
    assert len(callback.alphas) == 25 and callback.options.method == "full"


def test_a_bad_config_value_is_reported(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        experiment_cli(["--config", BASE, "--data.init_args.part=C"], run=False)
    assert "part" in capsys.readouterr().err


@pytest.mark.parametrize("path", STUDY_FILES, ids=lambda p: p.name)
def test_every_study_loads(path, monkeypatch):
    from lmc.experiments.study import load_study

    monkeypatch.chdir(CONFIGS.parent)  # a study names its files relative to the repository
    base = [] if path.name == "repro.yaml" else [CONFIGS / STUDY / "repro.yaml"]  # overlays complete the study
    study = load_study([*base, path])
    assert study.families and all(Path(family.experiment).is_file() for family in study.families)
