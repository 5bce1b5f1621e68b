"""`lmc equivalent A B`: exit status 0 when equivalent, 1 when not, 2 for bad input; the JSON report."""

from __future__ import annotations

import json

import pytest

from lmc.adapters import random_symmetry
from lmc.cli import main
from lmc.models import randomize_parameters_
from lmc.training import LMCModule
from lmc.training.module import save_trained
from tests.cli import fails
from tests.runs import CONFIG, MODEL, data


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Float32 checkpoints of one model: A, B = a random symmetry of A, C = another initialization."""
    root = tmp_path_factory.mktemp("equivalent")
    module = LMCModule(MODEL, CONFIG, data().info)
    hyperparameters = dict(module.hparams)
    models = {
        "a": randomize_parameters_(module.model, seed=0),
        "c": randomize_parameters_(LMCModule(MODEL, CONFIG, data().info).model, seed=1),
    }
    models["b"] = random_symmetry(models["a"], scope="full_model", seed=3)
    return {
        key: save_trained(model.state_dict(), hyperparameters, root / f"{key}.ckpt") for key, model in models.items()
    }


def _exit_status(argv: list[str]) -> int:
    try:
        main(argv)
    except SystemExit as exit_info:
        return exit_info.code
    return 0


def test_a_planted_pair_is_equivalent_exit_0_with_the_report(checkpoints, tmp_path, capsys):
    report = tmp_path / "report.json"
    assert _exit_status(["equivalent", str(checkpoints["a"]), str(checkpoints["b"]), "--output", str(report)]) == 0
    out = capsys.readouterr().out
    assert "are equivalent under the full_model group (float32)" in out
    assert "rtol 0.0001 (float32 default)" in out and "tolerance 0.001 (float32 default)" in out
    written = json.loads(report.read_text())
    assert written["equivalent"] is True and written["reason"].startswith("related by the full_model group")
    assert written["dtype"] == "float32" and written["scope"] == "full_model"
    assert written["weight_residual"]["all"] < 1e-6 and written["output_residual"] < 1e-5  # rounding of float32
    assert written["tolerance"] == {
        "weight": 1e-4,
        "output": 1e-3,
        "weight_origin": "float32 default",
        "output_origin": "float32 default",
    }
    assert written["worst_parameter"] in written["parameter_residual"]
    assert written["alignment"]["options"]["method"] == "full"


def test_independent_and_narrower_scope_pairs_exit_1(checkpoints, tmp_path, capsys):
    a, b, c = (str(checkpoints[k]) for k in "abc")
    report = tmp_path / "report.json"
    assert _exit_status(["equivalent", a, c, "--output", str(report)]) == 1
    assert "are NOT equivalent under the full_model group" in capsys.readouterr().out
    written = json.loads(report.read_text())
    assert written["equivalent"] is False and written["reason"].startswith("different functions")

    # B is A moved by the whole model's group: the first attention layer's group alone cannot reach it.
    assert _exit_status(["equivalent", a, b, "--scope", "first_attention"]) == 1
    assert "(outside scope 'first_attention', so never aligned)" in capsys.readouterr().out
    # rtol 0 asks for bit-equal weights, which float32 rounding of the planted symmetry denies.
    assert _exit_status(["equivalent", a, b, "--rtol", "0", "--output", str(report), "--overwrite", "true"]) == 1
    assert json.loads(report.read_text())["tolerance"]["weight_origin"] == "given"


def test_bad_input_exits_2_before_writing(checkpoints, tmp_path, capsys):
    a, b = str(checkpoints["a"]), str(checkpoints["b"])
    assert "rtol must be None" in fails(["equivalent", a, b, "--rtol", "-1"], capsys)
    assert "would replace an input" in fails(["equivalent", a, b, "--output", b, "--overwrite", "true"], capsys)
    existing = tmp_path / "report.json"
    existing.write_text("{}")
    assert "already exist" in fails(["equivalent", a, b, "--output", str(existing)], capsys)
    assert existing.read_text() == "{}"
    assert "is a folder" in fails(["equivalent", a, b, "--output", str(tmp_path)], capsys)
    assert "does not exist" in fails(["equivalent", a, str(tmp_path / "nope.ckpt")], capsys)
    assert _exit_status(["equivalent", a, b, "--scope", "everything"]) == 2  # refused by the parser, with the choices
    assert "first_attention" in capsys.readouterr().err
    other = LMCModule(MODEL, {"pe": "rope", "rope_layout": "interleaved"}, data().info)
    other_path = save_trained(other.model.state_dict(), dict(other.hparams), tmp_path / "other.ckpt")
    assert "different models" in fails(["equivalent", a, str(other_path)], capsys)
