"""benchmarks/: one runner for every benchmark, each listed in the index README with a result file that exists."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.__main__ import BENCHMARKS, listing

ROOT = Path(__file__).parents[2]
README = ROOT / "benchmarks" / "README.md"


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_every_benchmark_has_a_main_and_a_row_in_the_index(name):
    assert callable(importlib.import_module(BENCHMARKS[name]).main)
    assert f"`{name}`" in README.read_text()


def test_every_file_the_index_links_exists():
    links = re.findall(r"\]\(([^)#]+)\)", README.read_text())
    assert links and [link for link in links if not (README.parent / link).exists()] == []


def test_no_python_file_of_the_suite_is_over_400_lines():
    lengths = {path: len(path.read_text().splitlines()) for path in (ROOT / "benchmarks").rglob("*.py")}
    assert {str(path): n for path, n in lengths.items() if n > 400} == {}


def test_the_runner_lists_every_benchmark_and_refuses_an_unknown_one_in_one_line():
    assert all(f"  {name} " in listing() for name in BENCHMARKS)
    run = subprocess.run([sys.executable, "-m", "benchmarks", "nope"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines() == [
        "python -m benchmarks: no benchmark 'nope'; run `python -m benchmarks` for the list"
    ]


def test_the_runner_passes_the_arguments_on_and_names_the_command_as_typed():
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks", "device", "--dry-run", "--steps", "training"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("training: ") and "configs/trainer/gpu.yaml" in run.stdout
    help_text = subprocess.run(
        [sys.executable, "-m", "benchmarks", "device", "--help"], cwd=ROOT, capture_output=True, text=True
    ).stdout
    assert help_text.startswith("usage: python -m benchmarks device")
