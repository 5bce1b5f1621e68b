"""transformers' ViTForImageClassification: timm's ViT group in Hugging Face storage (docs/spec.md, section 2).

The generic tests (test_invariance.py, test_groups.py, test_describe.py, tests/matching) run on the
``hf-vit`` entries of tests/architectures.py; these check what is specific to its storage: the
residual stream through the class token, the learned positions and the ``Conv2d`` patch projection,
and the names its files use.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lmc.adapters import adapter_for, apply_transform, model_spec
from lmc.symmetry import AxisPermutation, ModelTransform
from lmc.symmetry.transforms import permute_axes
from tests.architectures import FLOAT64_RTOL, build, relative_difference

BROKEN = 1e-4
EMBEDDINGS = ("vit.embeddings.cls_token", "vit.embeddings.position_embeddings", "vit.embeddings.patch_embeddings")


def outputs(model: nn.Module) -> torch.Tensor:
    adapter = adapter_for(model)
    with torch.no_grad():
        return adapter.forward(model, adapter.example_inputs(model, 3, torch.Generator().manual_seed(0)))


def test_the_residual_permutation_keeps_the_function_and_breaks_it_without_an_embedding():
    model = build("hf-vit")
    residual = model_spec(model).residual
    perm = torch.randperm(residual.size, generator=torch.Generator().manual_seed(1))
    moved = apply_transform(model, ModelTransform(residual=perm))
    assert relative_difference(outputs(model), outputs(moved)) < FLOAT64_RTOL  # 0 measured: entries only move
    for left_out in EMBEDDINGS:
        axes = tuple((name, axis) for name, axis in residual.axes if not name.startswith(left_out))
        assert len(axes) < len(residual.axes), left_out
        broken = apply_transform(model, ModelTransform())
        permute_axes(dict(broken.named_parameters()), AxisPermutation("residual", residual.size, axes), perm)
        assert relative_difference(outputs(model), outputs(broken)) > BROKEN, left_out


@pytest.mark.parametrize("key", ["hf-vit", "hf-vit-nobias"])
def test_saved_names_are_the_names_in_its_files(key, tmp_path):
    from safetensors import safe_open

    model = build(key)
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        stored = set(handle.keys())
    saved = adapter_for(model).saved_names(model)
    assert {saved.get(name, name) for name, _ in model.named_parameters()} == stored
    assert all(name.startswith("vit.layers.") for name in saved)
