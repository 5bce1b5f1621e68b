"""The sensitivity tables: a study's Table 1 runs as data, laid out by fine-tuning samples and length."""

from __future__ import annotations

import math

import pytest

from lmc.experiments.report.sensitivity import sensitivity_section, table1_data
from lmc.experiments.stats.spread import spread
from lmc.experiments.study import Family
from lmc.io import atomic_write_json


def _summary(samples: int, epochs: int, ratios: list[float], ranks: list[float], l_hats: list[float]) -> dict:
    """A Table 1 run's summary.json with what the tables read: 2 pairs, given per-pair values."""
    ratio = spread(ratios)
    stage1 = {
        "rank": spread([r + 1 for r in ranks]),
        "rank_within_noise": spread(ranks),
        "l_hat": spread(l_hats),
        "ties": 1,
        "noise_pairs": 2,
    }
    curve = [{"alpha": 0.0, "accuracy": 0.8}, {"alpha": 0.5, "accuracy": 0.4}, {"alpha": 1.0, "accuracy": 0.9}]
    full = {
        "naive": {"loss_barrier": spread([1.0, 1.5])},
        "barrier_ratio": {"loss_barrier": ratio},
        "mean_curves": {"naive": curve},
    }
    orthogonal = {"barrier_ratio": {"loss_barrier": spread([r + 10 for r in ratios])}}
    return {
        "pairs": ["0_1", "0_2"],
        "protocol": {"finetune_samples": samples, "finetune_epochs": epochs},
        "alignments": {"full": full, "orthogonal": orthogonal, "permutation": full},
        "head_orders": {"orders": 24, "alignments": {"full": {"loss_barrier": stage1}}},
    }


def _runs() -> list[tuple[Family, dict]]:
    def point(name: str, samples: int, epochs: int, *values: list[float]) -> tuple[Family, dict]:
        family = Family(name, f"ViT, {samples} samples, {epochs} epochs", "configs/study/mnist_vit_ape.yaml")
        if name != "vit":
            family = Family(family.name, family.title, family.experiment, pretrained_by="vit")
        return family, _summary(samples, epochs, *values)

    return [  # listed out of order: the tables sort the points
        point("vit_epochs_80", 800, 80, [5, 7], [1, 1], [2, 4]),
        point("vit", 800, 20, [20, 30], [2, 4], [10, 20]),
        point("vit_samples_100", 100, 20, [60, 80], [6, 8], [40, 60]),
        point("vit_epochs_10", 800, 10, [40, 50], [3, 3], [30, 30]),
    ]


def test_the_points_are_laid_out_by_samples_and_by_length_with_their_measured_values(tmp_path):
    machine = {"processor": "Test CPU", "kernels": "AVX2", "torch": "2", "threads": 1}
    data = table1_data(_runs(), ["configs/study/sensitivity.yaml"], machine, {"vit/pretrain": 10.0, "vit/x": 32.5})
    path = atomic_write_json(tmp_path / "table1.json", data)
    lines = sensitivity_section(path)
    text = "\n".join(lines)
    assert "(`configs/study/sensitivity.yaml`; 2 tasks, 42 s of work on Test CPU, 1 thread per task)" in text
    assert "### ViT, 800 samples, 20 epochs (the default point) and its other points" in text
    by_size = lines.index(next(line for line in lines if line.startswith("| fine-tuning samples (at 20 epochs) |")))
    rows = lines[by_size + 2 : by_size + 4]
    assert rows == [
        "| 100 | 2 | 0.800, 0.900 | 1.250 ± 0.354 | 80.0 ± 14.1 % | 70.0 ± 14.1 % | 8.0 ± 1.4 | 7.0 ± 1.4 | 1 of 2 "
        "| 50.0 ± 14.1 |",
        "| 800 | 2 | 0.800, 0.900 | 1.250 ± 0.354 | 35.0 ± 7.1 % | 25.0 ± 7.1 % | 4.0 ± 1.4 | 3.0 ± 1.4 | 1 of 2 "
        "| 15.0 ± 7.1 |",
    ]
    by_length = lines.index(next(line for line in lines if line.startswith("| epochs (on 800 samples) |")))
    assert [line.split(" | ")[0] for line in lines[by_length + 2 : by_length + 6]] == ["| 10", "| 20", "| 80", ""]
    assert (
        "- From 100 to 800 samples (2 points): the full method leaves 70.0 % then 25.0 % (range 25.0-70.0 %) of the "
        "naive loss barrier; Stage 1's rank within noise is 7.0 then 3.0 (range 3.0-7.0), and `L_hat` 50.0 then "
        "15.0 (range 15.0-50.0)."
    ) in lines
    assert (
        "- From 10 to 80 epochs (3 points): the full method leaves 45.0 % then 6.0 % (range 6.0-45.0 %) of the "
        "naive loss barrier; Stage 1's rank within noise is 3.0 then 1.0 (range 1.0-3.0), and `L_hat` 30.0 then "
        "3.0 (range 3.0-30.0)."
    ) in lines


def test_a_point_whose_pairs_have_no_barrier_shows_na_and_the_range_skips_it(tmp_path):
    runs = _runs()
    family, summary = runs[0]  # 80 epochs
    summary["alignments"]["full"]["barrier_ratio"]["loss_barrier"] = spread([math.nan, math.nan])
    data = table1_data(runs, ["s.yaml"], None, {})
    lines = sensitivity_section(atomic_write_json(tmp_path / "table1.json", data))
    assert any(line.startswith("| 80 | 2 | ") and "| n/a (0 of 2) |" in line for line in lines)
    assert any("45.0 % then n/a (range 25.0-45.0 %)" in line for line in lines)
    assert "0 tasks, 0 s of work)." in "\n".join(lines)  # no machine recorded: none named


def test_a_run_without_the_full_method_is_left_out_of_the_data():
    runs = _runs()
    del runs[1][1]["alignments"]["full"], runs[1][1]["head_orders"]["alignments"]["full"]
    data = table1_data(runs, ["s.yaml"], None, {})
    assert [point["name"] for point in data["families"]] == ["vit_epochs_80", "vit_samples_100", "vit_epochs_10"]


def test_a_missing_data_file_is_named_with_the_command_that_writes_it(tmp_path):
    lines = sensitivity_section(tmp_path / "nowhere" / "table1.json")
    assert lines[-1].startswith(f"Not measured here: `{tmp_path / 'nowhere' / 'table1.json'}` does not exist.")
    assert "lmc repro --study configs/study/sensitivity.yaml" in lines[-1]


@pytest.mark.parametrize("text", ["not json", '{"families": []}', "[1, 2]"])
def test_a_file_that_is_no_table1_data_is_one_error_naming_it(tmp_path, text):
    path = tmp_path / "table1.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"study.sensitivity {path} is not the table1.json a study's report writes"):
        sensitivity_section(path)
