"""benchmarks/matcher_quality reads ``lmc run``'s checkpoints through lmc's current API."""

import dataclasses
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.matcher_quality.pairs import build, load_run
from lmc.data import Digits
from lmc.models import create_model
from lmc.training.module import save_trained

MODULES = ("pairs", "checks", "path", "report")
ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize("name", MODULES)
def test_scripts_import(name):
    """Each script imports: the pairs script broke silently once when the lmc API it uses moved."""
    importlib.import_module(f"benchmarks.matcher_quality.{name}")


def _write_seed(root, pe: str, stage: str) -> torch.nn.Module:
    """A main-job-shaped backbone as an lmc checkpoint with its settings, where ``lmc run`` puts a stage's."""
    model_config = {"pe": pe, "width": 64, **({"rope_layout": "half"} if pe == "rope" else {})}
    data = Digits().info
    torch.manual_seed(0)
    model = create_model("reference-vit", data=data, **model_config)
    hyperparameters = {"model": "reference-vit", "model_config": model_config, "data": dataclasses.asdict(data)}
    save_trained(dict(model.named_parameters()), hyperparameters, root / pe / stage / "final.ckpt")
    return model


@pytest.mark.parametrize("pe", ["learned", "rope"])
def test_load_run_rebuilds_the_checkpointed_model(tmp_path, pe):
    model = _write_seed(tmp_path, pe, "seed0")
    hyperparameters, state = load_run(tmp_path, pe, "seed0")
    images = torch.randn(3, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        rebuilt = build(hyperparameters, state, torch.float32)(images=images)
        torch.testing.assert_close(rebuilt, model(images=images), rtol=0, atol=0)
    widened = dict(build(hyperparameters, state, torch.float64).named_parameters())
    for name, parameter in model.named_parameters():
        assert widened[name].dtype == torch.float64
        assert torch.equal(widened[name], parameter.double()), name


def test_load_run_refuses_a_checkpoint_of_the_other_encoding(tmp_path):
    _write_seed(tmp_path, "learned", "seed0")
    (tmp_path / "learned").rename(tmp_path / "rope")  # an APE run under the RoPE folder
    with pytest.raises(ValueError, match="pe='learned', not 'rope'"):
        load_run(tmp_path, "rope", "seed0")


def test_load_run_names_a_missing_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="train the pairs first"):
        load_run(tmp_path, "learned", "seed0")


def test_the_readme_command_prints_the_readme_tables_from_the_committed_results():
    """The README's command, on the committed records: the folder also holds other scripts' records
    (``learned_alignment.json`` of ``data_aware.py``), which are not pairs and once crashed it."""
    command = [sys.executable, "-m", "benchmarks", "matcher_quality.report", "benchmarks/matcher_quality/results"]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    readme = (ROOT / "benchmarks" / "matcher_quality" / "README.md").read_text()
    heading = "used only for the rank correlations and the refinement path).\n"
    start = readme.index(heading) + len(heading)
    end = readme.index("## An independent replicate")
    assert run.stdout.strip() == readme[start:end].strip()  # the README's tables are this output
