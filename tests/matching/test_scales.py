"""FFN unit scales: a gated unit's value branch times ``a``, the down column over ``a`` keeps the function, a scale
anywhere else breaks it, and ``unit_scales=True`` recovers a planted twin (docs/spec.md, section 2, "FFN unit
scales"; section 3, "Unit scales").
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lmc.adapters import apply_transform, model_spec
from lmc.matching import AlignOptions, align, equivalent
from lmc.matching.scales import best_scales
from lmc.symmetry import ModelTransform, UnitScales, sample_transform, scale_units
from lmc.symmetry.spec import FeedForwardSpec
from tests.architectures import ARCHITECTURES, DECODERS, FLOAT64_RTOL, build, float64_norms, relative_difference
from tests.matching.test_signs import RECOVERED
from tests.symmetry.test_folds import BROKEN, outputs

# The families whose FFN units scale: gated FFNs without a norm over their units (every decoder with RMSNorms).
EXPECTED_GATED = {*DECODERS, "ref-lm-rope-half-gqa-swiglu-rms-nobias", "timm-eva02"}
SCALED = AlignOptions(unit_scales=True)


@pytest.mark.parametrize("key", list(ARCHITECTURES))
def test_exactly_the_gated_families_have_unit_scales(key):
    feed_forward = model_spec(build(key)).blocks[0].feed_forward
    assert (feed_forward is not None and feed_forward.scales is not None) == (key in EXPECTED_GATED)


def scaled_twin(key: str, seed: int = 9) -> tuple[torch.nn.Module, torch.nn.Module, ModelTransform]:
    model = build(key)
    spec = model_spec(model)
    transform = sample_transform(spec, "full_model", torch.Generator().manual_seed(seed), scale=True)
    assert transform.feed_forward_scales
    return model, apply_transform(model, transform, spec), transform


@pytest.mark.parametrize("key", sorted(EXPECTED_GATED))
def test_unit_scales_keep_the_function_and_a_scale_on_the_gate_breaks_it(key, monkeypatch):
    model, twin, transform = scaled_twin(key)
    float64_norms(model, monkeypatch)
    assert relative_difference(outputs(model), outputs(twin)) < FLOAT64_RTOL
    # The nearest scale outside the group: the gate's entries scaled instead of the value branch's.
    spec = model_spec(model)
    feed_forward = spec.blocks[0].feed_forward
    scales = feed_forward.scales
    gate = [axis for axis in feed_forward.hidden.axes if axis not in scales.scaled + scales.inverse]
    copies = tuple((axis, 1 - copy) for axis, copy in scales.copies)
    wrong = dataclasses.replace(
        feed_forward, scales=UnitScales("nonzero", tuple(gate) or scales.scaled, scales.inverse, copies)
    )
    blocks = (dataclasses.replace(spec.blocks[0], feed_forward=wrong), *spec.blocks[1:])
    factors = torch.full((feed_forward.hidden.size,), 2.0, dtype=torch.float64)
    moved = apply_transform(
        model, ModelTransform(feed_forward_scales={0: factors}), dataclasses.replace(spec, blocks=blocks)
    )
    assert relative_difference(outputs(model), outputs(moved)) > BROKEN


UNGATED = [
    key
    for key in ARCHITECTURES
    if key not in EXPECTED_GATED and model_spec(build(key)).blocks[0].feed_forward is not None
]


@pytest.mark.parametrize("key", UNGATED)
def test_where_no_scale_is_declared_the_nearest_candidate_breaks_the_function(key, monkeypatch):
    """The last input projection's rows (and bias) times 2, the output projection's columns over 2: exact for a
    gated unit's value branch, not for a GELU unit or units under a norm."""
    model = build(key)
    float64_norms(model, monkeypatch)
    spec = model_spec(model)
    feed_forward = spec.blocks[0].feed_forward
    assert feed_forward.scales is None
    hidden = feed_forward.hidden
    scaled = tuple(axis for axis in hidden.axes if axis[0].startswith(f"{hidden.writers[-1]}."))
    inverse = tuple(axis for axis in hidden.axes if axis[0] == f"{hidden.readers[0]}.weight")
    assert scaled and inverse
    candidate = FeedForwardSpec(hidden, feed_forward.parameters, UnitScales("positive", scaled, inverse))
    blocks = (dataclasses.replace(spec.blocks[0], feed_forward=candidate), *spec.blocks[1:])
    factors = torch.full((hidden.size,), 2.0, dtype=torch.float64)
    transform = ModelTransform(feed_forward_scales={0: factors})
    moved = apply_transform(model, transform, dataclasses.replace(spec, blocks=blocks))
    assert relative_difference(outputs(model), outputs(moved)) > BROKEN


@pytest.mark.parametrize("key", sorted(EXPECTED_GATED))
def test_a_scaled_twin_is_recovered_with_unit_scales_only(key):
    model, twin, transform = scaled_twin(key)

    _, report = align(twin, model, "full_model", SCALED)
    _, without = align(twin, model, "full_model")

    assert report.distance["aligned"] <= RECOVERED * report.distance["naive"]
    assert without.distance["aligned"] > 0.01 * without.distance["naive"]


@pytest.mark.parametrize("key", ["llama-gqa", "phi3-partial"])
def test_a_scaled_twin_is_equivalent_with_unit_scales_only(key):
    model, twin, _ = scaled_twin(key)
    verdict = equivalent(twin, model, "full_model", SCALED)
    assert verdict.equivalent, verdict.reason
    assert not equivalent(twin, model, "full_model").equivalent


def test_the_scale_step_is_each_units_best_scale():
    """best_scales against a grid of scales per unit: none lowers a unit's distance below the one found."""
    model, twin, _ = scaled_twin("llama-gqa")
    spec = model_spec(model)
    feed_forward = spec.blocks[0].feed_forward
    source, target = dict(twin.named_parameters()), dict(model.named_parameters())
    factors, gain = best_scales(source, target, feed_forward)  # the twin's units as they are, in another order
    hidden = feed_forward.hidden

    def unit_distance(scale: torch.Tensor) -> torch.Tensor:
        moved = {name: tensor.detach().clone() for name, tensor in source.items()}
        scale_units(moved, feed_forward, scale)
        total = torch.zeros(hidden.size, dtype=torch.float64)
        for name, axis in feed_forward.scales.scaled + feed_forward.scales.inverse:
            difference = (moved[name] - target[name].detach()).double().movedim(axis, 0)
            total += difference.pow(2).reshape(hidden.size, -1).sum(dim=1)
        return total

    found = unit_distance(factors)
    for value in torch.linspace(-3, 3, 61):
        if value == 0:
            continue
        assert bool(
            (found <= unit_distance(torch.full((hidden.size,), float(value), dtype=torch.float64)) + 1e-12).all()
        )
    assert gain >= 0
