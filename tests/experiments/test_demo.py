"""The main job (`lmc demo`) end to end, in a tiny form: one epoch per phase."""

from __future__ import annotations

import json
import math

import pytest

from lmc.experiments import demo


@pytest.mark.slow
def test_main_job_aligns_trained_pairs_below_their_naive_barrier(tmp_path, capsys):
    rows = demo.run(tmp_path, epochs=1)

    assert [row["label"] for row in rows] == ["APE", "RoPE"]
    output = capsys.readouterr().out
    for row in rows:
        summary = json.loads((row["results_dir"] / "summary.json").read_text())
        entry = summary["alignments"]["full"]
        assert entry["barrier_ratio"] == row["summary"]["alignments"]["full"]["barrier_ratio"]
        assert len(entry["mean_curves"]["aligned"]) == 25
        for pair in entry["per_pair"].values():
            naive, aligned = pair["naive"]["loss_barrier"], pair["aligned"]["loss_barrier"]
            assert math.isfinite(aligned) and 0 < aligned < naive  # trained pairs: alignment lowers the barrier
        ratio = entry["barrier_ratio"]["loss_barrier"]
        assert math.isfinite(ratio["mean"]) and ratio["count"] == len(entry["per_pair"])
        assert f"{ratio['mean']:6.1f} ± {ratio['std']:5.1f}" in output  # the printed table carries each ratio
    assert "TensorBoard logs" in output


def test_the_main_job_is_the_digits_experiments_with_the_main_job_protocol(tmp_path):
    from pathlib import Path

    from lmc.experiments.protocol import experiment_cli

    configs = Path(__file__).parents[2] / "configs"
    for label, name in (("APE", "digits_vit_ape"), ("RoPE", "digits_vit_rope")):
        config = demo.experiment_config(label, tmp_path, (demo.PRETRAIN_EPOCHS, demo.FINETUNE_EPOCHS))
        main_job = experiment_cli(["--config", json.dumps(config)], run=False).config
        from_yaml = experiment_cli(
            [
                "--config", str(configs / "experiment" / f"{name}.yaml"),
                "--config", str(configs / "protocol" / "main_job.yaml"),
                f"--protocol.output_dir={tmp_path / label}", f"--protocol.seeds={demo.SEEDS}",
            ],
            run=False,
        ).config  # fmt: skip
        for group in ("model", "data", "protocol"):
            assert _settings(main_job[group]) == _settings(from_yaml[group]), group
        assert main_job.seed_everything == from_yaml.seed_everything
        for setting in ("accelerator", "devices", "max_epochs", "precision", "deterministic"):
            assert main_job.trainer[setting] == from_yaml.trainer[setting] or setting == "max_epochs", setting


def _settings(namespace) -> dict:
    """A parsed group's values, without jsonargparse's record of the file they came from."""
    return {k: v for k, v in namespace.as_dict().items() if k != "__path__"}
