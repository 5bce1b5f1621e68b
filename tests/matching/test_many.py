"""align_many: k models into one frame, each by its own group element (docs/alignment.md, "Many models at once")."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lmc.adapters import random_symmetry
from lmc.matching import AlignmentError, AlignOptions
from lmc.matching.many import align_many, mean_model
from lmc.models import create_model, randomize_parameters_
from tests.architectures import build, relative_difference
from tests.symmetry.test_signs import outputs


def weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().double().flatten() for p in model.parameters()])


def spread(models: list[nn.Module]) -> float:
    """The mean distance of the models to their mean, over every parameter."""
    stacked = torch.stack([weights(model) for model in models])
    return float((stacked - stacked.mean(0)).norm(dim=1).mean())


@pytest.mark.parametrize("key", ["llama-gqa", "gpt2", "ref-vit-learned"])
def test_planted_twins_come_back_to_one_model(key):
    base = build(key)
    models = [random_symmetry(base, "full_model", seed=seed) for seed in (1, 2, 3)]

    aligned, result = align_many(models, "full_model")

    assert result.converged and result.rounds == 1 and result.changed == [0]
    frame = weights(models[0])
    for model in aligned:  # the first twin's frame, to float64 rounding (measured: at most 1e-15 relative)
        assert float((weights(model) - frame).norm() / frame.norm()) < 1e-12
    assert len(result.reports) == 3 and all(report.probe_relative_error < 1e-6 for report in result.reports)


def test_independent_models_keep_their_functions_and_come_closer():
    models = [build("ref-lm-rope-half-gqa-swiglu-rms-nobias", seed=seed) for seed in range(3)]

    aligned, result = align_many(models, "full_model", max_rounds=3)

    assert spread(aligned) < 0.9 * spread(models)
    for model, moved in zip(models, aligned):
        assert relative_difference(outputs(model), outputs(moved)) < 1e-12
    assert result.rounds == len(result.changed) <= 3


def test_the_mean_of_the_others_keeps_frozen_parameters_bitwise():
    models = [build("gpt2", seed=seed) for seed in range(3)]
    mean = mean_model(models, {"transformer.wte.weight"})
    first, averaged = dict(models[0].named_parameters()), dict(mean.named_parameters())
    for name, value in averaged.items():
        if name != "transformer.wte.weight":
            assert torch.equal(value, first[name]), name
    expected = sum(dict(m.named_parameters())["transformer.wte.weight"].double() for m in models) / 3
    assert torch.equal(averaged["transformer.wte.weight"], expected.to(averaged["transformer.wte.weight"].dtype))


def test_a_member_of_another_architecture_or_shape_is_refused_by_position():
    llama = build("llama-gqa")
    wider = randomize_parameters_(create_model("llama-tiny", dtype=torch.float64, intermediate_size=96), seed=0)
    with pytest.raises(AlignmentError, match=r"^model 2 of 3 cannot join model 0: different architectures"):
        align_many([llama, llama, build("gpt2")])
    with pytest.raises(AlignmentError, match=r"^model 1 of 2 cannot join model 0: .*mlp"):
        align_many([llama, wider])
    with pytest.raises(AlignmentError, match="at least two models, got 1"):
        align_many([llama])
    with pytest.raises(ValueError, match="use weight-only options"):
        align_many([llama, llama], options=AlignOptions(objective="data"))
