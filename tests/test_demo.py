"""The main job (`lmc demo`) end to end, in a tiny form: one epoch per phase."""

from __future__ import annotations

import json
import math

import pytest

from lmc import demo


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
