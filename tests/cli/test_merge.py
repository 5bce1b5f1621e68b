"""`lmc merge` (lmc.checkpoint_merge.merge_checkpoints): k checkpoints into one frame and their weighted average,
in the inputs' format; bad inputs refused in one line before any work."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from lmc.adapters import random_symmetry
from lmc.checkpoint_merge import checked_weights
from tests.cli import exit_status, fails
from tests.formats.checkpoints import model, save_hf


def planted_triple(tmp_path) -> tuple[torch.nn.Module, list[str]]:
    """A Llama and two random elements of its whole group, saved as Hugging Face folders."""
    base = model("llama-tiny", {}, seed=0, dtype=torch.float64)
    members = [base, random_symmetry(base, "full_model", seed=1), random_symmetry(base, "full_model", seed=2)]
    return base, [str(save_hf(member, tmp_path / f"m{i}", tokenizer=False)) for i, member in enumerate(members)]


def test_a_planted_triple_merges_back_to_its_model(tmp_path, capsys):
    base, folders = planted_triple(tmp_path)
    output = tmp_path / "out"

    status = exit_status(["merge", *folders, "--output", str(output), "--weights", "[1, 1, 2]"])

    assert status == 0, capsys.readouterr()
    report = json.loads((output / "report.json").read_text())
    assert report["weights"] == [0.25, 0.25, 0.5] and report["converged"]
    expected = dict(base.named_parameters())
    for name in ("aligned_0", "aligned_1", "aligned_2", "merged"):
        loaded = AutoModelForCausalLM.from_pretrained(output / name, torch_dtype=torch.float64)
        for parameter_name, value in loaded.named_parameters():
            target = expected[parameter_name].detach()
            torch.testing.assert_close(value, target, rtol=0, atol=1e-12 * float(target.abs().max()), msg=name)


def test_a_member_of_another_shape_is_refused_in_one_line_before_any_work(tmp_path, capsys):
    _, folders = planted_triple(tmp_path)
    wider_model = model("llama-tiny", {"intermediate_size": 48}, seed=3, dtype=torch.float64)
    wider = save_hf(wider_model, tmp_path / "wider", tokenizer=False)

    error = fails(["merge", *folders, str(wider), "--output", str(tmp_path / "out")], capsys)

    assert str(wider) in error and "intermediate_size" in error
    assert not (tmp_path / "out").exists()


def test_bad_weights_and_single_checkpoints_are_refused(tmp_path, capsys):
    _, folders = planted_triple(tmp_path)
    error = fails(["merge", *folders, "--output", str(tmp_path / "out"), "--weights", "[1, 2]"], capsys)
    assert "--weights gives 2 weights for 3 checkpoints" in error
    error = fails(["merge", folders[0], "--output", str(tmp_path / "out")], capsys)
    assert "lmc merge needs at least two checkpoints, got 1" in error
    with pytest.raises(ValueError, match="finite, non-negative and not all zero"):
        checked_weights([1.0, -1.0], 2)
    assert checked_weights(None, 4) == [0.25] * 4
