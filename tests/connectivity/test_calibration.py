"""The calibration of data-aware alignment: training batches only, and part of a sweep's identity."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import DataLoader

from lmc.connectivity import Evaluation, data_identity, measure_connectivity, sweep_settings, training_calibration
from lmc.connectivity.measure import calibration_overlap, refuse_calibration_leak, sample_keys
from lmc.data import Digits
from lmc.matching import AlignOptions, Calibration
from tests.architectures import build

CPU = torch.device("cpu")


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
    # "all": every batch of the training split, the last one partial; the alignment reads them all
    whole = training_calibration(data, _loss, "all")
    train = len(data.split("train"))
    assert whole.num_samples == train and len(whole.batches) == -(-train // 16) and train % 16
    assert whole.take("all") is whole and whole.take(2).num_samples == 32
    torch.testing.assert_close(whole.batches[0]["inputs"], first.batches[0]["inputs"], rtol=0, atol=0)


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
    every = AlignOptions(objective="data", calibration_batches="all")
    assert sweep_settings("first_attention", every, [0.0, 1.0], _evaluation(), calibration)["calibration"] == {
        **settings["calibration"],
        "num_samples": 48,  # all 3 batches
    }
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


def _shuffled(data: Digits, split: str, batches: int) -> list[dict[str, torch.Tensor]]:
    """Seeded batches of 16 of a split, drawn the way training_calibration draws the training split's."""
    loader = DataLoader(data.split(split), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0))
    return list(itertools.islice(loader, batches))


def _curves_on(data: Digits, split: str, **kwargs) -> Evaluation:
    loader = DataLoader(data.split(split), batch_size=64)
    return Evaluation(lambda batch: {}, loader, split, data_identity(data), {"model": "m"}, **kwargs)


def test_batches_of_the_curve_split_labelled_train_are_refused():
    """The refusal compares the samples, not the splits' names: validation batches called "train" leak."""
    data = Digits(batch_size=16, part="B")
    honest = training_calibration(data, _loss, 2)
    mislabelled = Calibration(_shuffled(data, "val", 2), _loss, "train", 32, honest.data)  # the same identity
    model = build("ref-vit-learned")
    for split in ("val", "test"):
        leaked = Calibration(_shuffled(data, split, 2), _loss, "train", 32, honest.data)
        message = (
            rf"32 of the 32 calibration samples \(labelled 'train'\) are among the '{split}' samples the curves "
            "are measured on: calibrate on the training split"
        )
        with pytest.raises(ValueError, match=message):
            options, curves = AlignOptions(objective="data"), _curves_on(data, split)
            measure_connectivity(model, model, "first_attention", options, [0.0], curves, calibration=leaked)
    # Validation batches do not leak into test curves; the training split's leak into neither.
    assert calibration_overlap(mislabelled, _curves_on(data, "test"), CPU) == 0
    for split in ("val", "test"):
        assert calibration_overlap(honest, _curves_on(data, split), CPU) == 0
        refuse_calibration_leak(honest, _curves_on(data, split), CPU)


def test_a_few_shared_samples_warn_and_every_process_counts_its_shard():
    data = Digits(batch_size=16, part="B")
    training, validation = _shuffled(data, "train", 1)[0], _shuffled(data, "val", 1)[0]
    one = {name: torch.cat([training[name][:-1], validation[name][:1]]) for name in training}  # 1 of 16
    calibration = Calibration([one], _loss, "train", 16)
    with pytest.warns(UserWarning, match="1 of the 16 calibration samples"):
        refuse_calibration_leak(calibration, _curves_on(data, "val"), CPU)
    # Two processes, each finding the sample once in its shard: the verdict sums them.
    seen = []
    two = _curves_on(data, "val", all_reduce=lambda count: seen.append(count) or 2 * count)
    assert calibration_overlap(calibration, two, CPU) == 2 and seen[0].dtype == torch.float64


def test_a_sample_has_one_key_whatever_its_padding_dtype_and_batch():
    tokens = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 1, 2, 3]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    padded = {"inputs": tokens, "attention_mask": mask}
    alone = {"inputs": torch.tensor([[5, 6, 7]], dtype=torch.int32), "attention_mask": torch.ones(1, 3)}
    left = {"inputs": torch.tensor([[0, 5, 6, 7]]), "attention_mask": torch.tensor([[0, 1, 1, 1]])}
    assert sample_keys(alone)[0] == sample_keys(left)[0] == sample_keys(padded)[0] != sample_keys(padded)[1]
    images = torch.randn(3, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    assert sample_keys({"inputs": images.double()}) == sample_keys({"inputs": images})
    assert sample_keys({"inputs": images[1:]}) == sample_keys({"inputs": images})[1:]
