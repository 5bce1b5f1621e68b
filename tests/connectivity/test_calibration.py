"""The calibration of data-aware alignment: training batches only, and part of a sweep's identity."""

from __future__ import annotations

import pytest
import torch

from lmc.connectivity import Evaluation, measure_connectivity, sweep_settings, training_calibration
from lmc.data import Digits
from lmc.matching import AlignOptions, Calibration
from tests.architectures import build


def _loss(model, batch):
    return torch.zeros(())


def _evaluation(split: str = "val") -> Evaluation:
    return Evaluation(lambda batch: {}, [], split, {"class": "x"}, {"model": "m"})


def test_training_calibration_takes_seeded_batches_of_the_training_split():
    data = Digits(batch_size=16, part="B")
    first, again = (training_calibration(data, _loss, 3) for _ in range(2))
    assert first.split == "train" and first.num_samples == 48 and len(first.batches) == 3
    assert first.data["part"] == "B" and first.data["shuffle_seed"] == 0
    torch.testing.assert_close(first.batches[0]["inputs"], again.batches[0]["inputs"], rtol=0, atol=0)
    other = training_calibration(data, _loss, 3, seed=1)
    assert not torch.equal(other.batches[0]["inputs"], first.batches[0]["inputs"])
    with pytest.raises(ValueError, match="lower calibration_batches"):
        training_calibration(data, _loss, 10_000)


def test_the_sweep_key_holds_the_calibration_of_data_aware_options_only():
    data = Digits(batch_size=16, part="B")
    calibration = training_calibration(data, _loss, 3)
    weight = sweep_settings("first_attention", AlignOptions(), [0.0, 1.0], _evaluation(), calibration)
    assert "calibration" not in weight and "objective" not in weight["options"]  # keys of earlier runs stay valid
    options = AlignOptions(objective="data", calibration_batches=2)
    settings = sweep_settings("first_attention", options, [0.0, 1.0], _evaluation(), calibration)
    assert settings["calibration"]["num_samples"] == 32 and settings["calibration"]["data"]["part"] == "B"
    wider = sweep_settings(
        "first_attention", AlignOptions(objective="data", calibration_batches=3), [0.0, 1.0], _evaluation(), calibration
    )
    assert wider != settings
    with pytest.raises(ValueError, match="need a calibration"):
        sweep_settings("first_attention", options, [0.0, 1.0], _evaluation())


def test_calibrating_on_the_curve_split_is_refused():
    model = build("ref-vit-learned")
    batch = {"inputs": torch.zeros(2, 1, 8, 8, dtype=torch.float64)}
    leaked = Calibration([batch], _loss, "val", 2)
    with pytest.raises(ValueError, match="calibrate on the training split"):
        measure_connectivity(
            model, model, "first_attention", AlignOptions(objective="data"), [0.0], _evaluation(), calibration=leaked
        )
