"""`lmc equivalent` on twins made with residual signs: related when the norms allow the flips, not otherwise."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lmc.adapters import apply_transform, model_spec
from lmc.symmetry import sample_transform
from tests.cli import exit_status
from tests.formats.checkpoints import model, save_hf
from tests.symmetry.test_signs import mixed_signs


@pytest.mark.parametrize(("name", "allowed"), [("llama-tiny", True), ("llama-tiny", False), ("gpt2-tiny", False)])
def test_a_sign_twin_is_equivalent_exactly_when_its_norms_allow_the_flips(tmp_path, capsys, name, allowed):
    """Allowed: Llama's per-coordinate signs. Not: the same flips with the RMSNorm gains flipped too, or GPT-2's
    LayerNorms under per-coordinate signs."""
    source = model(name, {}, seed=0, dtype=torch.float64)
    spec = model_spec(source)
    transform = sample_transform(spec, "full_model", torch.Generator().manual_seed(2))
    transform.residual_signs = mixed_signs(spec.residual.size)
    acting = spec
    if not allowed and spec.residual.signs == "each":
        acting = dataclasses.replace(spec, residual=dataclasses.replace(spec.residual, unsigned=()))
    twin = apply_transform(source, transform, acting)
    a, b = save_hf(source, tmp_path / "a", tokenizer=False), save_hf(twin, tmp_path / "b", tokenizer=False)

    status = exit_status(["equivalent", str(a), str(b)])

    out = capsys.readouterr().out
    assert status == (0 if allowed else 1), out
    assert ("are equivalent under the full_model group" in out) == allowed
