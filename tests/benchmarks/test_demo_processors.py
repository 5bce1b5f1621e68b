"""benchmarks/reproduction/demo_processors: shifts in units of the larger spread; a setting without a time says so."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks.reproduction import demo_processors


def _run(folder: str, ape: tuple[float, float], rope: tuple[float, float], seconds: float | None) -> dict:
    ratio = {"APE": {"mean": ape[0], "std": ape[1]}, "RoPE": {"mean": rope[0], "std": rope[1]}}
    return {"folder": folder, "environment": {}, "seconds": seconds, "ratio": ratio, "pairs": {"APE": 6, "RoPE": 6}}


def test_the_shift_is_the_gap_of_the_means_over_the_larger_spread(tmp_path):
    runs = {
        "free, this processor": _run(str(tmp_path / "a"), (26.0, 10.0), (51.0, 22.0), 364.0),
        "free, as an AVX2 processor": _run(str(tmp_path / "b"), (36.0, 20.0), (40.0, 16.0), None),
    }
    result = demo_processors.summarize(runs, epochs=None)
    (comparison,) = result["comparisons"]  # the pinned pair has not run
    assert comparison["APE"]["shift"] == 10.0 and comparison["APE"]["shift_in_spreads"] == 10.0 / 20.0
    assert comparison["RoPE"]["shift"] == 11.0 and comparison["RoPE"]["shift_in_spreads"] == 11.0 / 22.0
    assert comparison["identical_weights"] is False  # no checkpoints in either folder
    text = demo_processors.report(json.loads(json.dumps(result)))
    assert f"({result['machine']['cores']} cores, torch" in text
    assert "| free, this processor | 26.0 ± 10.0 % (6 pairs) | 51.0 ± 22.0 % (6 pairs) | 364 s |" in text
    assert (
        "| free, as an AVX2 processor | 36.0 ± 20.0 % (6 pairs) | 40.0 ± 16.0 % (6 pairs) | resumed, not timed |"
        in text
    )
    assert "10.0 points (0.50 spreads)" in text and "11.0 points (0.50 spreads)" in text


def test_another_machines_results_are_compared_with_this_processors_free_run(tmp_path, monkeypatch):
    monkeypatch.setattr(demo_processors, "processor_name", lambda: "AMD EPYC")
    there = {
        "machine": {"processor": "Intel(R) Xeon(R) Processor"},
        "epochs": None,
        "runs": {"free, this processor": _run("elsewhere", (26.0, 10.0), (51.0, 22.0), 364.0)},
    }
    here = {"free, this processor": _run(str(tmp_path / "a"), (30.0, 8.0), (40.0, 11.0), 400.0)}
    result = demo_processors.summarize(here, epochs=None, against=there)
    (comparison,) = result["comparisons"]
    assert comparison["settings"] == ["free, AMD EPYC", "free, Intel(R) Xeon(R) Processor"]
    assert comparison["APE"] == {"shift": 4.0, "shift_in_spreads": 4.0 / 10.0}
    assert comparison["RoPE"] == {"shift": 11.0, "shift_in_spreads": 11.0 / 22.0}
    text = demo_processors.report(json.loads(json.dumps(result)))
    assert "| free, AMD EPYC vs free, Intel(R) Xeon(R) Processor | 4.0 points (0.40 spreads) " in text
    assert text.rstrip().endswith("| n/a (two machines) |")
    with pytest.raises(ValueError, match="no 'free, this processor' run with epochs=3"):
        demo_processors.summarize(here, epochs=3, against=there)


def test_the_readmes_demo_figures_are_the_committed_results():
    """The README's demo paragraph had barriers, accuracies and losses typed by hand that no file held:
    each of its figures (a decimal, a percentage, a wall time in seconds) is in
    benchmarks/reproduction/results/demo_*.md."""
    root = Path(__file__).parents[2]
    readme = (root / "README.md").read_text()
    section = readme[readme.index("## What the demo prints") :].split("\n## ")[0]
    results = " ".join(
        path.read_text() for path in sorted((root / "benchmarks" / "reproduction" / "results").glob("demo_*.md"))
    )
    figures = re.findall(r"\d+\.\d+|\d+(?= s\b| %)", section)
    assert figures and [f for f in figures if not re.search(rf"(?<![\d.]){re.escape(f)}(?![\d])", results)] == []
