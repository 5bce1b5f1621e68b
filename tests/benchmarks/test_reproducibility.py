"""benchmarks/reproduction/reproducibility: two reports' strategies tables side by side, shifts in spreads."""

import json

import pytest

from benchmarks.reproduction.reproducibility import compare, compare_runs, differences, main, parse_cell, shift

HEADER = (
    "| family | strategy | pairs | end points | naive loss barrier | aligned loss barrier | loss ratio "
    "| naive acc barrier | aligned acc barrier | acc ratio | aligned < naive | paper |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
)


def _report(rows: list[str]) -> str:
    return (
        "# Results\n\n## The four re-initialization strategies\n\nText.\n\n"
        + HEADER
        + "\n".join(rows)
        + "\n\n## Next\n"
    )


def _row(family: str, strategy: str, ends: str, naive: str, loss: str, accuracy: str) -> str:
    return f"| {family} | {strategy} | 3 | {ends} | {naive} | x | {loss} | x | x | {accuracy} | 3/3 | p |"


def test_cells_parse_and_shifts_are_in_units_of_the_larger_spread():
    assert parse_cell("58.8 ± 15.5 %") == (58.8, 15.5) and parse_cell("n/a") is None
    assert shift("58.8 ± 15.5 %", "75.1 ± 39.9 %") == pytest.approx(16.3 / 39.9)
    assert shift("0.002 ± 0.004", "0.015 ± 0.001") == pytest.approx(0.013 / 0.004)
    assert shift("1.0 ± 0.0 %", "1.0 ± 0.0 %") == 0.0 and shift("1.0 ± 0.0", "2.0 ± 0.0") == float("inf")
    assert shift("n/a", "1.0 ± 0.1") is None


def test_the_comparison_pairs_rows_by_family_and_strategy_and_counts_cells_within_one_spread():
    first = _report(
        [
            _row("ViT", "first_attention", "0.826, 0.847", "2.065 ± 0.578", "58.8 ± 15.5 %", "58.5 ± 15.2 %"),
            _row("BERT", "full_model", "0.480, 0.653", "0.208 ± 0.046", "181.6 ± 68.7 %", "n/a"),
        ]
    )
    second = _report(
        [
            _row("BERT", "full_model", "0.477, 0.752", "0.408 ± 0.198", "190.1 ± 83.1 %", "9.0 ± 1.0 %"),
            _row("ViT", "first_attention", "0.848, 0.857", "2.005 ± 0.405", "58.9 ± 14.7 %", "63.7 ± 17.1 %"),
        ]
    )
    lines = compare(first, second, ("A", "B"))
    assert lines[0].startswith("| family | strategy | end points | naive loss barrier: A | naive loss barrier: B |")
    vit, bert = lines[2], lines[3]
    assert vit.startswith("| ViT | first_attention | 0.826, 0.847 / 0.848, 0.857 | 2.065 ± 0.578 | 2.005 ± 0.405 |")
    assert vit.endswith("| 0.10 | 0.01 | 0.30 |")  # 0.06 / 0.578, 0.1 / 15.5, 5.2 / 17.1
    assert bert.endswith("| 1.01 | 0.10 | n/a |")  # 0.2 / 0.198
    assert lines[-1] == "4 of 5 cells moved by at most one spread over pairs."


def test_a_file_that_is_not_a_study_report_is_refused_by_name():
    with pytest.raises(ValueError, match="no section '## The four re-initialization strategies'"):
        compare("# Something else\n", _report([]), ("A", "B"))


def _run_folder(root, summary: dict) -> None:
    (root / "vit" / "first_attention").mkdir(parents=True)
    (root / "vit" / "first_attention" / "summary.json").write_text(json.dumps(summary))
    (root / "vit" / "first_layer_inputs.json").write_text(json.dumps({"rank": 22}))


def test_run_folders_compare_every_number_exactly_but_wall_times_and_calibration(tmp_path):
    summary = {"alignments": {"full": {"ratio": [58.8, float("nan")], "calibration": {"num_samples": [256]}}}}
    summary["alignment_seconds"] = {"full": 0.1}
    _run_folder(tmp_path / "a", summary)
    moved = json.loads(json.dumps(summary))
    moved["alignment_seconds"]["full"] = 0.2  # wall time: not a result
    del moved["alignments"]["full"]["calibration"]  # recorded by one version of the summary only
    _run_folder(tmp_path / "b", moved)
    assert compare_runs(tmp_path / "a", tmp_path / "b") == ["2 files compared, 0 differ"]
    moved["alignments"]["full"]["ratio"][0] = 58.800000000000004  # one ulp
    (tmp_path / "b" / "vit" / "first_attention" / "summary.json").write_text(json.dumps(moved))
    (tmp_path / "b" / "vit" / "first_layer_inputs.json").unlink()
    assert compare_runs(tmp_path / "a", tmp_path / "b") == [
        "vit/first_attention/summary.json: 1 differences, first /alignments/full/ratio[0]: 58.8 != 58.800000000000004",
        f"vit/first_layer_inputs.json: missing in {tmp_path / 'b'}",
        "2 files compared, 2 differ",
    ]
    assert differences({"a": 1}, {"a": 1.0}) == ["/a: 1 != 1.0"]  # an int is not a float of the same value


def test_a_folder_without_results_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="holds no summary.json or first_layer_inputs.json"):
        compare_runs(tmp_path, tmp_path)


def test_a_result_file_only_the_second_folder_holds_is_named(tmp_path):
    _run_folder(tmp_path / "a", {"alignments": {}})
    _run_folder(tmp_path / "b", {"alignments": {}})
    (tmp_path / "b" / "vit" / "full_model").mkdir()
    (tmp_path / "b" / "vit" / "full_model" / "summary.json").write_text("{}")
    assert compare_runs(tmp_path / "a", tmp_path / "b") == [
        f"vit/full_model/summary.json: missing in {tmp_path / 'a'}",
        "3 files compared, 1 differ",
    ]


@pytest.mark.parametrize("args", [["missing.md", "other.md"], ["--runs", "nowhere", "nowhere"]])
def test_the_command_names_a_bad_input_in_one_line(monkeypatch, capsys, tmp_path, args):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["reproducibility.py", *args])
    with pytest.raises(SystemExit) as exit_info:
        main()
    error = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(error.splitlines()) == 1 and args[-2] in error, error


def test_folders_written_to_other_paths_compare_equal(tmp_path):
    _run_folder(tmp_path / "a", {"protocol": {"output_dir": "runs/a/vit", "seeds": 5}})
    _run_folder(tmp_path / "b", {"protocol": {"output_dir": "runs/b/vit", "seeds": 5}})
    assert compare_runs(tmp_path / "a", tmp_path / "b") == ["2 files compared, 0 differ"]
