"""`lmc align` and `lmc equivalent` with the extended group (`--residual orthogonal`, `--unit_scales true`) on
Hugging Face folders: streamed (both folders read folded), the outputs loadable by the
class's own loader, the merges taken against the folded target."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM

from lmc.adapters import apply_transform, fold_norms, model_spec
from lmc.matching.merge import interpolate
from lmc.symmetry import residual_group, sample_transform
from tests.cli import exit_status
from tests.formats.checkpoints import model, save_hf


def rotated_pair(tmp_path):
    source = model("llama-tiny", {}, seed=0, dtype=torch.float64)
    spec = model_spec(source)
    transform = sample_transform(spec, "full_model", torch.Generator().manual_seed(3), rotate=True, scale=True)
    twin = apply_transform(fold_norms(source), transform, spec)
    return source, save_hf(twin, tmp_path / "a", tokenizer=False), save_hf(source, tmp_path / "b", tokenizer=False)


def test_lmc_align_with_the_extended_group_recovers_a_rotated_scaled_twin(tmp_path, capsys):
    source, a, b = rotated_pair(tmp_path)
    output = tmp_path / "out"

    status = exit_status(
        [
            "align",
            str(a),
            str(b),
            "--output",
            str(output),
            "--residual",
            "orthogonal",
            "--unit_scales",
            "true",
            "--merge_alpha",
            "0.5",
        ]
    )

    assert status == 0, capsys.readouterr()
    report = json.loads((output / "report.json").read_text())
    assert report["alignment"]["residual_group"] == residual_group(model_spec(source)).name
    assert report["alignment"]["distance"]["aligned"] <= 1e-10 * report["alignment"]["distance"]["naive"]
    aligned = AutoModelForCausalLM.from_pretrained(output / "aligned", torch_dtype=torch.float64)
    merged = AutoModelForCausalLM.from_pretrained(output / "merged_0.5", torch_dtype=torch.float64)
    folded = dict(fold_norms(source).named_parameters())
    for (name, value), merge in zip(aligned.named_parameters(), merged.parameters()):
        scale = float(folded[name].detach().abs().max())
        torch.testing.assert_close(value, folded[name], rtol=0, atol=1e-10 * scale, msg=name)
        expected = interpolate(folded[name].detach(), value.detach(), 0.5)
        torch.testing.assert_close(merge, expected, rtol=0, atol=1e-10 * scale, msg=name)


def test_lmc_equivalent_relates_the_twin_under_the_extended_group_only(tmp_path, capsys):
    _, a, b = rotated_pair(tmp_path)

    extended = exit_status(["equivalent", str(a), str(b), "--residual", "orthogonal", "--unit_scales", "true"])
    extended_out = capsys.readouterr().out
    stored = exit_status(["equivalent", str(a), str(b)])
    stored_out = capsys.readouterr().out

    assert extended == 0, extended_out
    assert stored == 1, stored_out
