"""The seeded masked-LM evaluation of BERT masked-LM and pre-training models (MultiBERTs).

BERT's recipe (Devlin et al., 2019, section 3.1; ``create_pretraining_data.py``): in each
sequence, ``max(1, round(0.15 n))`` of its ``n`` scored candidates (tokens that are neither
special nor padding) are chosen uniformly; of the chosen ones 80 % are replaced by the mask
token, 10 % by a random token of the vocabulary (not a special token) and 10 % are kept. The
loss is the mean cross-entropy of the original tokens over the chosen positions. The masks
are drawn once, from one seed, when the data is read (:func:`mask_tokens`), so every alpha of
a curve and both end points see the very same inputs and targets.

A pre-training model (``BertForPreTraining``) given sentence pairs with next-sentence labels
also reports its next-sentence loss and accuracy, under ``next_sentence/`` names counted by
the pairs (:func:`lmc.training.module.masked_lm_sums`,
:func:`lmc.connectivity.interpolation.point_metrics`); the curves' loss stays the masked-LM loss.
"""

from __future__ import annotations

import torch

from lmc.data.base import NOT_SCORED

#: The fraction of each sequence's candidates that is chosen (and scored).
CHOSEN_FRACTION = 0.15
#: The fractions of the chosen tokens replaced by the mask token and by a random token (the rest are kept).
MASK_FRACTION, RANDOM_FRACTION = 0.8, 0.1


def mask_tokens(
    ids: torch.Tensor,
    candidates: torch.Tensor,
    mask_id: int,
    replacement_ids: torch.Tensor,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masked inputs and targets of a batch of sequences, drawn from ``seed``.

    Args:
        ids: ``(N, T)`` token ids.
        candidates: ``(N, T)`` bool, the positions that may be chosen (not special, not padding).
        mask_id: The tokenizer's mask token.
        replacement_ids: ``(V',)`` the ids a random replacement is drawn from.
        seed: Seed of every draw; the same seed gives the same masks.

    Returns:
        ``inputs`` ``(N, T)``: ``ids`` with the chosen tokens masked, replaced or kept, and
        ``labels`` ``(N, T)``: the original token at chosen positions, :data:`NOT_SCORED` elsewhere.
    """
    generator = torch.Generator().manual_seed(seed)
    counts = candidates.sum(1)
    chosen_counts = torch.tensor([max(1, round(CHOSEN_FRACTION * int(n))) if n else 0 for n in counts])
    # A uniform choice of chosen_counts[i] candidates of row i: the candidates with the smallest random scores.
    scores = torch.rand(ids.shape, generator=generator, dtype=torch.float64).masked_fill(~candidates, torch.inf)
    ranks = scores.argsort(1).argsort(1)
    chosen = ranks < chosen_counts[:, None]
    action = torch.rand(ids.shape, generator=generator, dtype=torch.float64)
    random_ids = replacement_ids[torch.randint(len(replacement_ids), ids.shape, generator=generator)]
    masked = chosen & (action < MASK_FRACTION)
    randomized = chosen & (action >= MASK_FRACTION) & (action < MASK_FRACTION + RANDOM_FRACTION)
    inputs = ids.masked_fill(masked, mask_id)
    inputs[randomized] = random_ids[randomized]
    labels = ids.masked_fill(~chosen, NOT_SCORED)
    return inputs, labels
