"""`lmc align` and `lmc interpolate` on two existing checkpoints and a config."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from lmc.adapters import adapter_for
from lmc.checkpoints import CheckpointError, load_weights, read_state_dict
from lmc.cli import main
from tests.runs import CONFIG, MODEL, data, finetuned, pretrain_and_first_seed, trainer


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    pretrained, seed0 = pretrain_and_first_seed(root)
    run = trainer(root / "seed1", steps=15)
    run.fit(finetuned(pretrained, 1), data())
    seed1 = root / "seed1.ckpt"
    run.save_checkpoint(seed1)
    config = root / "experiment.yaml"
    experiment = {"model": {"model": MODEL, "model_config": CONFIG}, "data": {"class_path": "lmc.data.Digits"}}
    config.write_text(yaml.safe_dump(experiment))
    return {"root": root, "pretrained": pretrained, "seed0": seed0, "seed1": seed1, "config": str(config)}


def _model(checkpoints: dict, path) -> torch.nn.Module:
    return load_weights(finetuned(checkpoints["pretrained"], 0).build_model().eval(), path)


def test_align_writes_aligned_and_merged_weights(checkpoints, tmp_path, capsys):
    output = tmp_path / "aligned.safetensors"
    main([
        "align", "--config", checkpoints["config"], "--scope", "first_attention",
        "--source", str(checkpoints["seed0"]), "--target", str(checkpoints["seed1"]),
        "--output", str(output), "--merge-alpha", "0.5",
    ])  # fmt: skip
    assert "distance to target" in capsys.readouterr().out
    source, target = _model(checkpoints, checkpoints["seed0"]), _model(checkpoints, checkpoints["seed1"])
    aligned = _model(checkpoints, output)
    adapter = adapter_for(source)
    inputs = adapter.example_inputs(source, 4, torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            adapter.forward(aligned, inputs), adapter.forward(source, inputs), rtol=1e-4, atol=1e-5
        )
    report = json.loads(output.with_suffix(".json").read_text())
    assert report["distance"]["aligned"] < report["distance"]["naive"]
    merged = read_state_dict(tmp_path / "merged_0.5.safetensors")
    for name, value in aligned.state_dict().items():
        expected = 0.5 * target.state_dict()[name] + 0.5 * value
        torch.testing.assert_close(merged[name], expected, rtol=1e-6, atol=1e-7)


def test_interpolate_writes_curves(checkpoints, tmp_path, capsys):
    main([
        "interpolate", "--config", checkpoints["config"], "--scope", "first_attention", "--num-alphas", "5",
        "--a", str(checkpoints["seed1"]), "--b", str(checkpoints["seed0"]), "--output-dir", str(tmp_path),
    ])  # fmt: skip
    results = json.loads((tmp_path / "lmc_results.json").read_text())
    (result,) = results["references"].values()
    naive, aligned = result["curves"]["naive"]["points"], result["curves"]["aligned"]["points"]
    assert [p["alpha"] for p in naive] == [0, 0.25, 0.5, 0.75, 1.0]
    assert naive[0] == aligned[0] and aligned[-1]["loss"] == pytest.approx(naive[-1]["loss"], rel=1e-5)
    assert "barrier ratio" in capsys.readouterr().out


def test_a_checkpoint_of_another_model_is_refused(checkpoints, tmp_path):
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump({"model": {"model": "vit-tiny"}, "data": {"class_path": "lmc.data.Digits"}}))
    with pytest.raises(CheckpointError, match="does not fit VisionTransformer"):
        main([
            "align", "--config", str(other), "--source", str(checkpoints["seed0"]),
            "--target", str(checkpoints["seed1"]), "--output", str(tmp_path / "x.safetensors"),
        ])  # fmt: skip
    assert not (tmp_path / "x.safetensors").exists()


def test_a_missing_config_is_reported(tmp_path):
    with pytest.raises(SystemExit, match="does not exist"):
        main(
            [
                "interpolate",
                "--config",
                str(tmp_path / "nope.yaml"),
                "--a",
                "a",
                "--b",
                "b",
                "--output-dir",
                str(tmp_path),
            ]
        )
