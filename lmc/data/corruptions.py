"""Input corruptions of lmc batches at three severities, for the robustness study (paper Appendix L).

Every corruption is a pure function ``(batch, strength, generator) -> batch``: it returns a new
batch and never changes the one it gets, draws its randomness from ``generator`` alone (a CPU
``torch.Generator``; the draws are moved to the inputs' device, so a batch is corrupted the same
way on any device) and returns the batch unchanged at strength 0. Only ``inputs`` and
``attention_mask`` change; ``labels`` stay clean, so a language model is scored on its
next-token accuracy on the clean text given corrupted context.

Images (every lmc image DataModule standardizes its pixels, so one unit is one pixel standard
deviation of the data):

- ``gaussian_noise``: adds noise of standard deviation :data:`NOISE_STDS` (in those units);
- ``gaussian_blur``: a separable Gaussian kernel of width :data:`BLUR_SIGMAS` (in pixels), per
  channel, with reflect padding.

Text (token id 0 pads, see :mod:`lmc.data.base`; padding is never corrupted):

- ``token_dropout``: each token is deleted with probability :data:`TOKEN_DROPOUT_RATES`: its id
  becomes the padding id and, where the batch has an ``attention_mask``, attention no longer
  sees it; every other token keeps its position. A sample never loses all its tokens (its first
  one stays), since attention over no key at all is undefined;
- ``token_substitution``: each token is replaced with probability :data:`TOKEN_SUBSTITUTION_RATES`
  by a token drawn uniformly from the non-padding vocabulary ``1 .. vocab_size - 1`` (which may
  draw the same token again).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lmc.tasks import DataInfo

#: An lmc batch (see :mod:`lmc.data.base`).
Batch = dict[str, torch.Tensor]
#: Token id of padding in every lmc text data set.
PADDING_ID = 0

#: Standard deviation of the added noise at severities 1, 2, 3, in standardized pixel units.
NOISE_STDS = (0.25, 0.5, 1.0)
#: Standard deviation of the blur kernel at severities 1, 2, 3, in pixels.
BLUR_SIGMAS = (0.5, 1.0, 1.5)
#: Probability that a token is deleted, at severities 1, 2, 3.
TOKEN_DROPOUT_RATES = (0.05, 0.1, 0.2)
#: Probability that a token is replaced by a random one, at severities 1, 2, 3.
TOKEN_SUBSTITUTION_RATES = (0.05, 0.1, 0.2)


def gaussian_noise(batch: Batch, std: float, generator: torch.Generator) -> Batch:
    """Add Gaussian noise of standard deviation ``std`` to ``inputs`` (any shape, e.g. ``(B, C, H, W)``)."""
    if std == 0:
        return batch
    inputs = batch["inputs"]
    noise = torch.randn(inputs.shape, generator=generator, dtype=inputs.dtype).to(inputs.device)
    return {**batch, "inputs": inputs + std * noise}


def gaussian_kernel(sigma: float, radius: int) -> torch.Tensor:
    """The 1-D Gaussian ``exp(-x^2 / (2 sigma^2))`` at ``x = -radius .. radius``, summing to 1: ``(2 radius + 1,)``."""
    x = torch.arange(-radius, radius + 1, dtype=torch.float64)
    kernel = torch.exp(-(x**2) / (2 * sigma**2))
    return kernel / kernel.sum()


def gaussian_blur(batch: Batch, sigma: float, generator: torch.Generator | None = None) -> Batch:
    """Blur ``inputs`` ``(B, C, H, W)`` per channel with a Gaussian of ``sigma`` pixels (deterministic).

    The kernel reaches ``ceil(3 sigma)`` pixels each way (at most the image's side minus one, as
    reflect padding needs); ``generator`` is unused, for the common signature.
    """
    if sigma == 0:
        return batch
    inputs = batch["inputs"]
    _, channels, height, width = inputs.shape
    radius = min(math.ceil(3 * sigma), height - 1, width - 1)
    kernel = gaussian_kernel(sigma, radius).to(dtype=inputs.dtype, device=inputs.device)
    # Separable: rows, then columns; groups=channels blurs each channel on its own.
    rows = kernel.view(1, 1, 1, -1).expand(channels, 1, 1, -1)
    columns = kernel.view(1, 1, -1, 1).expand(channels, 1, -1, 1)
    padded = F.pad(inputs, (radius, radius, radius, radius), mode="reflect")
    blurred = F.conv2d(F.conv2d(padded, rows, groups=channels), columns, groups=channels)
    return {**batch, "inputs": blurred}


def _chosen_tokens(inputs: torch.Tensor, rate: float, generator: torch.Generator) -> torch.Tensor:
    """Which non-padding tokens of ``inputs`` ``(B, T)`` a corruption hits, each with probability ``rate``."""
    draws = torch.rand(inputs.shape, generator=generator).to(inputs.device)
    return (inputs != PADDING_ID) & (draws < rate)


def token_dropout(batch: Batch, rate: float, generator: torch.Generator) -> Batch:
    """Delete each non-padding token of ``inputs`` ``(B, T)`` with probability ``rate`` (see the module docstring)."""
    if rate == 0:
        return batch
    inputs = batch["inputs"]
    dropped = _chosen_tokens(inputs, rate, generator)
    real = inputs != PADDING_ID
    emptied = (real & ~dropped).sum(-1) == 0  # (B,): samples that would lose every token
    first = torch.zeros_like(real).scatter_(-1, real.long().argmax(-1, keepdim=True), True)
    dropped &= ~(emptied[:, None] & first)
    corrupted = {**batch, "inputs": inputs.masked_fill(dropped, PADDING_ID)}
    if batch.get("attention_mask") is not None:
        corrupted["attention_mask"] = batch["attention_mask"].masked_fill(dropped, 0)
    return corrupted


def token_substitution(batch: Batch, rate: float, generator: torch.Generator, vocab_size: int) -> Batch:
    """Replace each non-padding token of ``inputs`` ``(B, T)`` with probability ``rate`` by a uniform
    draw from ``1 .. vocab_size - 1``; the attention mask stays as it is."""
    if rate == 0:
        return batch
    inputs = batch["inputs"]
    substituted = _chosen_tokens(inputs, rate, generator)
    drawn = torch.randint(PADDING_ID + 1, vocab_size, inputs.shape, generator=generator).to(inputs.device)
    return {**batch, "inputs": torch.where(substituted, drawn.to(inputs.dtype), inputs)}


@dataclass(frozen=True)
class Corruption:
    """A corruption and its strength at each severity.

    Attributes:
        apply: ``(batch, strength, generator) -> corrupted batch``.
        strengths: The strength at severities ``1 .. len(strengths)`` (severity 0 is the clean data).
    """

    apply: Callable[[Batch, float, torch.Generator], Batch]
    strengths: tuple[float, ...]

    def __call__(self, batch: Batch, severity: int, generator: torch.Generator) -> Batch:
        """``batch`` at ``severity`` (0: unchanged)."""
        if not 0 <= severity <= len(self.strengths):
            raise ValueError(f"severity {severity} is not one of 0 .. {len(self.strengths)}")
        return batch if severity == 0 else self.apply(batch, self.strengths[severity - 1], generator)


def corruptions_for(info: DataInfo) -> dict[str, Corruption]:
    """The corruptions of a task, by name: noise and blur for images, dropout and substitution for text."""
    if info.task == "image_classification":
        return {
            "gaussian_noise": Corruption(gaussian_noise, NOISE_STDS),
            "gaussian_blur": Corruption(gaussian_blur, BLUR_SIGMAS),
        }
    vocab_size = info.vocab_size

    def substitution(batch: Batch, rate: float, generator: torch.Generator) -> Batch:
        return token_substitution(batch, rate, generator, vocab_size)

    return {
        "token_dropout": Corruption(token_dropout, TOKEN_DROPOUT_RATES),
        "token_substitution": Corruption(substitution, TOKEN_SUBSTITUTION_RATES),
    }
