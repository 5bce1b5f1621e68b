"""The recipe of docs/extending.md for a new data set and a new model works end to end through ``lmc run``."""

from __future__ import annotations

import json
import math

import yaml

from lmc.cli import main


def test_a_new_data_set_and_model_run_the_whole_protocol(tmp_path):
    config = {
        "model": {"model": "stripes-vit", "lr": 3e-3},
        "data": {"class_path": "tests.extending.Stripes", "init_args": {"batch_size": 32}},
        "trainer": {"accelerator": "cpu", "max_epochs": 2, "enable_progress_bar": False},
        "protocol": {"output_dir": str(tmp_path / "run"), "seeds": 2, "num_alphas": 3},
    }
    path = tmp_path / "stripes.yaml"
    path.write_text(yaml.safe_dump(config))
    main(["run", "--config", str(path)])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    (pair,) = summary["alignments"]["full"]["per_pair"].values()
    assert all(math.isfinite(value) for value in pair["naive"].values())
    hyperparameters = yaml.safe_load((tmp_path / "run" / "tensorboard" / "seed1" / "hparams.yaml").read_text())
    assert hyperparameters["model"] == "stripes-vit" and hyperparameters["data"]["num_classes"] == 4
