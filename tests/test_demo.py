"""The main job (`lmc demo`) end to end, in a tiny form: one epoch per phase."""

from __future__ import annotations

import json

import pytest

from lmc import demo


@pytest.mark.slow
def test_main_job_runs_both_encodings_and_reports_barriers(tmp_path, capsys):
    rows = demo.run(tmp_path, epochs=1)

    assert [row["label"] for row in rows] == ["APE", "RoPE"]
    output = capsys.readouterr().out
    for row in rows:
        results = json.loads((row["results_dir"] / "lmc_results.json").read_text())
        (result,) = results["references"].values()
        assert result["curves"] == row["result"]["curves"]
        assert len(result["curves"]["aligned"]["points"]) == 25
        assert result["alignment"]["scope"] == "first_attention"
        ratio = result["barrier_ratio"]["loss_barrier"]
        assert f"{ratio:8.1f}" in output  # the printed table carries each measured ratio
    assert (tmp_path / "tensorboard").is_dir() and "TensorBoard logs" in output
