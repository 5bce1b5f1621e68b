"""Input corruptions: deterministic, identity at severity 0, harsher with severity, padding and labels untouched."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmc.data.corruptions import (
    BLUR_SIGMAS,
    NOISE_STDS,
    PADDING_ID,
    TOKEN_DROPOUT_RATES,
    TOKEN_SUBSTITUTION_RATES,
    corruptions_for,
    gaussian_blur,
    gaussian_kernel,
    gaussian_noise,
    token_dropout,
    token_substitution,
)
from lmc.tasks import DataInfo

IMAGES = DataInfo("image_classification", num_classes=10, image_size=16, in_channels=3)
TEXT = DataInfo("text_classification", num_classes=4, vocab_size=257, sequence_length=128)
LM = DataInfo("causal_lm", vocab_size=257, sequence_length=128)


def generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def image_batch() -> dict[str, torch.Tensor]:
    return {"inputs": torch.randn(8, 3, 16, 16, generator=generator(1)), "labels": torch.arange(8)}


def text_batch() -> dict[str, torch.Tensor]:
    """64 samples of 128 tokens, each right-padded after a length between 1 and 128."""
    ids = torch.randint(1, 257, (64, 128), generator=generator(2))
    lengths = torch.randint(1, 129, (64,), generator=generator(3))
    ids[torch.arange(128) >= lengths[:, None]] = PADDING_ID
    return {"inputs": ids, "attention_mask": (ids != PADDING_ID).long(), "labels": torch.arange(64) % 4}


def lm_batch() -> dict[str, torch.Tensor]:
    tokens = torch.randint(1, 257, (16, 129), generator=generator(4))
    return {"inputs": tokens[:, :-1], "labels": tokens[:, 1:]}


def batch_of(info: DataInfo) -> dict[str, torch.Tensor]:
    return {"image_classification": image_batch, "text_classification": text_batch, "causal_lm": lm_batch}[info.task]()


def damage(clean: dict[str, torch.Tensor], corrupted: dict[str, torch.Tensor]) -> float:
    """Relative change of image inputs, share of changed tokens of text."""
    if clean["inputs"].is_floating_point():
        return float((corrupted["inputs"] - clean["inputs"]).norm() / clean["inputs"].norm())
    real = clean["inputs"] != PADDING_ID
    return float((corrupted["inputs"] != clean["inputs"])[real].double().mean())


CASES = [(info, name) for info in (IMAGES, TEXT, LM) for name in corruptions_for(info)]


@pytest.mark.parametrize(("info", "name"), CASES, ids=[f"{i.task}-{n}" for i, n in CASES])
def test_each_corruption_is_deterministic_pure_and_keeps_shapes_labels_and_padding(info, name):
    corruption = corruptions_for(info)[name]
    batch = batch_of(info)
    saved = {k: v.clone() for k, v in batch.items()}
    assert corruption(batch, 0, generator()) is batch  # severity 0: the clean data
    for severity in (1, 2, 3):
        first = corruption(batch, severity, generator(7))
        assert all(torch.equal(first[k], corruption(batch, severity, generator(7))[k]) for k in first)
        assert all(torch.equal(batch[k], saved[k]) for k in batch)  # the input batch is never changed
        assert first.keys() == batch.keys() and torch.equal(first["labels"], batch["labels"])
        for key in batch:
            assert first[key].shape == batch[key].shape and first[key].dtype == batch[key].dtype
        if not info.task.startswith("image"):
            padding = batch["inputs"] == PADDING_ID
            assert (first["inputs"][padding] == PADDING_ID).all()  # padding is never corrupted
            assert first["inputs"].min() >= 0 and first["inputs"].max() < info.vocab_size
    if name != "gaussian_blur":  # the only deterministic one
        other = corruption(batch, 2, generator(8))
        assert not torch.equal(other["inputs"], corruption(batch, 2, generator(7))["inputs"])
    with pytest.raises(ValueError, match="severity 4"):
        corruption(batch, 4, generator())


@pytest.mark.parametrize(("info", "name"), CASES, ids=[f"{i.task}-{n}" for i, n in CASES])
def test_severities_damage_more_and_more(info, name):
    corruption, batch = corruptions_for(info)[name], batch_of(info)
    damages = [damage(batch, corruption(batch, severity, generator(severity))) for severity in (1, 2, 3)]
    assert damages[0] > 0 and damages[0] < damages[1] < damages[2], damages


def test_noise_has_the_severity_s_standard_deviation_in_standardized_units():
    batch = {"inputs": torch.zeros(4, 3, 32, 32, dtype=torch.float64)}
    for std in NOISE_STDS:
        noise = gaussian_noise(batch, std, generator(5))["inputs"]
        assert torch.equal(noise, std * torch.randn(batch["inputs"].shape, generator=generator(5), dtype=torch.float64))
        assert noise.std().item() == pytest.approx(std, rel=0.03)  # 12,288 draws: a few standard errors


def test_blur_is_a_per_channel_gaussian_with_reflected_borders():
    images = torch.randn(2, 3, 9, 11, generator=generator(6), dtype=torch.float64)
    sigma = BLUR_SIGMAS[1]
    kernel = gaussian_kernel(sigma, 3)
    assert kernel.sum().item() == pytest.approx(1.0, abs=1e-15) and torch.equal(kernel, kernel.flip(0))
    # By hand: one 2-D convolution with the outer product of the kernel, channel by channel.
    padded = F.pad(images, (3, 3, 3, 3), mode="reflect")
    expected = torch.cat([F.conv2d(padded[:, [c]], torch.outer(kernel, kernel)[None, None]) for c in range(3)], 1)
    blurred = gaussian_blur({"inputs": images}, sigma)["inputs"]
    torch.testing.assert_close(blurred, expected, rtol=0, atol=1e-14)
    constant = torch.full((1, 2, 8, 8), 3.0, dtype=torch.float64)
    torch.testing.assert_close(gaussian_blur({"inputs": constant}, BLUR_SIGMAS[2])["inputs"], constant)


def test_dropout_deletes_tokens_from_ids_and_mask_alike_and_never_empties_a_sample():
    batch = text_batch()
    dropped = token_dropout(batch, TOKEN_DROPOUT_RATES[2], generator())
    changed = dropped["inputs"] != batch["inputs"]
    assert torch.equal(dropped["inputs"][changed], torch.zeros(int(changed.sum()), dtype=torch.long))
    assert torch.equal(dropped["attention_mask"], (dropped["inputs"] != PADDING_ID).long())
    assert "attention_mask" not in token_dropout(lm_batch(), 0.2, generator())  # a language model has none
    everything = token_dropout(batch, 1.0, generator())
    real = batch["attention_mask"].bool()
    assert torch.equal(everything["attention_mask"].sum(-1), torch.ones(64, dtype=torch.long))
    assert torch.equal(everything["inputs"][:, 0], batch["inputs"][:, 0])  # the first token stays
    assert (everything["inputs"][:, 1:][real[:, 1:]] == PADDING_ID).all()


def test_substitution_draws_real_tokens_uniformly_and_keeps_the_mask():
    batch = text_batch()
    substituted = token_substitution(batch, 1.0, generator(), vocab_size=257)
    real = batch["attention_mask"].bool()
    assert torch.equal(substituted["attention_mask"], batch["attention_mask"])
    drawn = substituted["inputs"][real]
    assert drawn.min() >= 1 and drawn.max() <= 256
    counts = torch.bincount(drawn, minlength=257)[1:].double()  # about 4,100 draws over 256 ids
    assert counts.mean() == pytest.approx(len(drawn) / 256) and counts.max() < 3 * counts.mean()
    for rate in TOKEN_SUBSTITUTION_RATES:
        changed = damage(batch, token_substitution(batch, rate, generator(9), vocab_size=257))
        assert changed == pytest.approx(rate * 255 / 256, abs=0.02)  # the draw may repeat the token


def test_the_task_decides_the_corruptions():
    assert list(corruptions_for(IMAGES)) == ["gaussian_noise", "gaussian_blur"]
    assert list(corruptions_for(TEXT)) == list(corruptions_for(LM)) == ["token_dropout", "token_substitution"]
    small = DataInfo("causal_lm", vocab_size=5)
    tokens = corruptions_for(small)["token_substitution"](
        {"inputs": torch.ones(4, 50, dtype=torch.long)}, 3, generator()
    )
    assert tokens["inputs"].max() <= 4  # drawn from the data's own vocabulary
