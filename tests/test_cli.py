"""The ``lmc`` command and its symmetry demo."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lmc.cli import main
from lmc.symmetry_demo import run


def test_symmetry_demo_rows_show_exact_symmetries_and_broken_near_misses(capsys):
    rows = {row["model"]: row for row in run(("vit-tiny", "llama-tiny", "roformer-tiny"))}
    assert rows["vit-tiny"]["symmetry"] < 1e-12 and rows["vit-tiny"]["gl_on_qk"] < 1e-12
    assert rows["vit-tiny"]["other_h"] is None
    assert rows["roformer-tiny"]["symmetry"] < 1e-12
    assert rows["llama-tiny"]["symmetry"] < 2e-6  # RMSNorm in float32
    for name in ("llama-tiny", "roformer-tiny"):
        assert rows[name]["gl_on_qk"] > 1e-4 and rows[name]["other_h"] > 1e-4
    assert all(row["weights"] > 0.5 for row in rows.values())
    assert "RoFormerForSequenceClassification" in capsys.readouterr().out


def test_cli_rejects_an_unknown_model(capsys):
    with pytest.raises(SystemExit):
        main(["symmetry", "--models", "resnet50"])
    assert "invalid choice: 'resnet50'" in capsys.readouterr().err


def test_python_dash_m_lmc_runs_the_symmetry_command():
    result = subprocess.run(
        [sys.executable, "-m", "lmc", "symmetry", "--models", "reference-vit-tiny"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if line.startswith("reference-vit-tiny"))
    assert "ReferenceTransformer" in row and "GL(8)" in row
