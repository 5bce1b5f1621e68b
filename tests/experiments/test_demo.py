"""The main job (`lmc demo`) end to end, in a tiny form: one epoch per phase."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lmc.experiments import demo


@pytest.mark.slow
def test_main_job_aligns_trained_pairs_below_their_naive_barrier(tmp_path, capsys):
    rows = demo.run(tmp_path, epochs=1, seeds=3)  # the tiny form: one epoch per phase, 3 pairs

    assert [row["label"] for row in rows] == ["APE", "RoPE"]
    captured = capsys.readouterr()
    output = captured.out
    # Each encoding's progress, followed from its run folder: pre-training, 3 seeds, 3 pairs, summary.
    for label in ("APE", "RoPE"):
        assert f"{label}: pre-train [0/8]" in captured.err and f"{label}: done [8/8]" in captured.err
    for row in rows:
        summary = json.loads((row["results_dir"] / "summary.json").read_text())
        entry = summary["alignments"]["full"]
        assert entry["barrier_ratio"] == row["summary"]["alignments"]["full"]["barrier_ratio"]
        assert len(entry["mean_curves"]["aligned"]) == 25
        for pair in entry["per_pair"].values():
            assert math.isfinite(pair["aligned"]["loss_barrier"]) and pair["naive"]["loss_barrier"] > 0
        # Models of one epoch: alignment lowers the mean barrier (a pair may not be lowered).
        assert entry["aligned"]["loss_barrier"]["mean"] < entry["naive"]["loss_barrier"]["mean"]
        assert summary["protocol"]["seeds"] == 3 and len(entry["per_pair"]) == 3
        ratio = entry["barrier_ratio"]["loss_barrier"]
        assert math.isfinite(ratio["mean"]) and ratio["count"] == len(entry["per_pair"])
        assert f"{ratio['mean']:6.1f} ± {ratio['std']:5.1f}" in output  # the printed table carries each ratio
    assert "TensorBoard logs" in output


def test_the_main_job_reads_the_packaged_configs_from_any_working_folder(tmp_path, monkeypatch):
    """The demo runs the study's configs/study/mnist_vit_*.yaml with configs/protocol/main_job.yaml, not copies."""
    from lmc.experiments.protocol import Schedule, experiment_cli

    repository = Path(__file__).parents[2] / "configs"
    monkeypatch.chdir(tmp_path)  # no configs/ here: the packaged files are read
    for label, pe in (("APE", "learned"), ("RoPE", "rope")):
        arguments = demo.experiment_arguments(label, tmp_path / "runs")
        assert [Path(a).resolve() for a in arguments[1:4:2]] == [
            (repository / "study" / f"mnist_vit_{label.lower()}.yaml").resolve(),
            (repository / "protocol" / "main_job.yaml").resolve(),
        ]
        cli = experiment_cli(arguments, run=False)
        assert cli.config.model.model_config["pe"] == pe
        assert cli.config.data.class_path == "lmc.data.MNIST5k"
        protocol = cli.config_init.protocol
        # The study's pre-training and fine-tuning rate; four seeds and half its fine-tuning epochs.
        assert (protocol.pretrain, protocol.finetune, protocol.seeds) == (Schedule(40), Schedule(20, 0.003), 4)
        assert protocol.output_dir == str(tmp_path / "runs" / label) and protocol.reinit == "first_attention"
        shortened = experiment_cli(demo.experiment_arguments(label, tmp_path, epochs=2), run=False).config_init
        assert (shortened.protocol.pretrain, shortened.protocol.finetune) == (Schedule(2), Schedule(2, 0.003))
