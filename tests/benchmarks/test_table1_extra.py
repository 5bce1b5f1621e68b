"""benchmarks/stage1/table1_extra: its rows are the run summary's Table 1 statistics of the full method's settings."""

from __future__ import annotations

import pytest

from benchmarks.stage1.table1_extra import main, rows


def test_rows_read_each_full_method_setting_and_its_alphas():
    stats = {"mean": 2.0, "std": 0.5, "min": 1.0, "max": 3.0, "count": 2}
    loss = {"rank": stats, "rank_within_noise": stats, "l_hat": stats, "ties": 1, "noise_pairs": 2}
    orders = {label: {"loss_barrier": loss} for label in ("full", "full-metric=balanced", "orthogonal")}

    def entry(alphas: int) -> dict:
        curve = [{"alpha": k / (alphas - 1)} for k in range(alphas)]
        return {"barrier_ratio": {"loss_barrier": stats}, "mean_curves": {"aligned": curve}}

    summary = {
        "head_orders": {"alignments": orders},
        "alignments": {"full": entry(25), "full-metric=balanced": entry(13)},
    }
    table = rows(summary)
    assert list(table) == ["full", "full-metric=balanced"]  # Variant 2 is no Stage 1 setting of the full method
    assert table["full"]["alphas"] == 25 and table["full-metric=balanced"]["alphas"] == 13
    assert table["full-metric=balanced"]["ties"] == "1 of 2" and table["full"]["ratio"] is stats


def test_a_bad_alignment_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["table1_extra", "--family", "gpt2_ape", "--alignment", '{"metric": "cka"}'])
    with pytest.raises(SystemExit, match="--alignment: .*unknown metric 'cka'"):
        main()
