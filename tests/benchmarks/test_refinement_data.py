"""benchmarks/stage2/refinement_data.py: its split of the midpoint's layer output is exact, its patched losses are the
model's, its hybrids are symmetries, and on a planted pair the refinement recovers what the orthogonal start misses."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.data import DataLoader

from benchmarks.stage2.midpoint_heads import (
    head_activity,
    hybrid,
    layer_io,
    layer_weights,
    loss_gradient,
    midpoint,
    midpoint_measures,
    midpoint_parts,
    patched_loss,
    planted_module,
)
from benchmarks.stage2.refinement_data import SETTINGS, measure_pair, rank_correlations
from lmc.adapters import model_spec, scope_parameters
from lmc.data import Digits
from lmc.matching import align
from lmc.training import LMCModule


@pytest.fixture(scope="module")
def tiny():
    """A tiny ViT module (float64), its validation batches, and a copy whose first attention layer was re-drawn."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = Digits(batch_size=16, part="B")
    data.setup("fit")
    module = LMCModule("reference-vit-tiny", data=data.info).eval().double()
    batches = [
        {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
        for _, batch in zip(range(2), DataLoader(data.split("val"), batch_size=16))
    ]
    other = copy.deepcopy(module.model)
    fresh = LMCModule("reference-vit-tiny", data=data.info).model.double()
    with torch.no_grad():
        for name in scope_parameters(other, "first_attention"):
            other.get_parameter(name).copy_(fresh.get_parameter(name))
    return module, batches, other


def test_the_heads_recomputed_are_the_layer_and_the_midpoint_splits_exactly(tiny):
    module, batches, other = tiny
    layer = model_spec(module.model).attention[0]
    inputs, outputs, _ = layer_io(module, module.model, layer, batches)
    bias = module.model.get_parameter(layer.out_bias).double()
    target = head_activity(layer_weights(module.model, layer), inputs)
    assert torch.allclose(target.outputs.sum(1) + bias, outputs, rtol=0, atol=1e-12)
    source = head_activity(layer_weights(other, layer), inputs)
    middle = head_activity(layer_weights(midpoint(other, module.model), layer), inputs)
    parts = midpoint_parts(source, target, middle)
    assert torch.allclose(parts["qk_part"] + parts["vo_part"] + parts["fixed_part"], parts["total"], atol=1e-12)
    assert parts["total"].abs().max() > 1e-3  # two different layers: a deviation to split
    # the same pattern at both ends leaves no fixed part; one model against itself, nothing at all
    assert midpoint_parts(target, target, target)["total"].abs().max() == 0
    same_pattern = head_activity(layer_weights(module.model, layer), inputs)
    same_pattern.values = source.values
    assert midpoint_parts(same_pattern, target, middle)["fixed_part"].abs().max() == 0
    nothing = midpoint_measures(target, target, target, inputs)
    assert nothing["output"]["sum"] == 0 and nothing["attention_tv"]["sum"] == 0 and nothing["output_norm_ratio"] == 1


def test_a_patched_loss_is_the_models_and_its_gradient_is_the_slope(tiny):
    module, batches, _ = tiny
    layer = model_spec(module.model).attention[0]
    _, outputs, _ = layer_io(module, module.model, layer, batches)
    assert patched_loss(module, layer, batches, outputs) == pytest.approx(
        patched_loss(module, layer, batches), abs=1e-12
    )
    direction = torch.randn(outputs.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    step = 1e-5
    slope = (
        patched_loss(module, layer, batches, outputs + step * direction)
        - patched_loss(module, layer, batches, outputs - step * direction)
    ) / (2 * step)
    assert float((loss_gradient(module, layer, batches, outputs) * direction).sum()) == pytest.approx(slope, rel=1e-6)


def test_a_hybrid_of_two_alignments_is_a_symmetry_of_the_source(tiny):
    module, batches, other = tiny
    layer = model_spec(module.model).attention[0]
    aligned = {label: align(other, module.model, "first_attention", options)[0] for label, options in SETTINGS.items()}
    mixed = hybrid(aligned["full"], aligned["orthogonal"], layer)
    reference = layer_io(module, other, layer, batches)[1]
    assert torch.allclose(layer_io(module, mixed, layer, batches)[1], reference, rtol=0, atol=1e-10)
    assert not torch.equal(
        mixed.get_parameter(layer.query.parameter), aligned["orthogonal"].get_parameter(layer.query.parameter)
    )
    assert torch.equal(
        mixed.get_parameter(layer.value.parameter), aligned["orthogonal"].get_parameter(layer.value.parameter)
    )


def test_on_a_planted_pair_the_refinement_recovers_the_element_the_orthogonal_start_misses(tiny):
    module, batches, _ = tiny
    exact = measure_pair(planted_module(module, seed=3, noise=0.0), module.model, batches)
    assert exact["barrier"]["full"] < 1e-9 < 1e-3 < exact["barrier"]["orthogonal"]
    assert exact["midpoint"]["full"]["output"]["sum"] < 1e-16
    # the exact split: the orthogonal start's midpoint, rebuilt from its parts, has the midpoint's loss
    patched = exact["patched"]
    for label in SETTINGS:
        assert patched[f"Q/K {label}, V/O {label}"] == pytest.approx(exact["midpoint_loss"][label], abs=1e-10)
    noisy = measure_pair(planted_module(module, seed=3, noise=0.05), module.model, batches)
    assert noisy["barrier"]["full"] < noisy["barrier"]["orthogonal"]
    correlations = rank_correlations({"a": exact, "b": noisy})
    assert correlations["midpoint loss"] == pytest.approx(1.0)
