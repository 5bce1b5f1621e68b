"""BERT's pre-training heads (MultiBERTs): the masked-LM transform and the next-sentence head.

The generic tests run on the ``bert-mlm``, ``bert-mlm-untied`` and ``bert-pretraining`` entries of
tests/architectures.py; these check what the heads add: with the decoder tied to the word
embeddings the transform's units are residual coordinates (no permutation of their own), untied
they permute alone, and the next-sentence head's units are the pooler's.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lmc.adapters import adapter_for, apply_transform, model_spec
from lmc.models import create_model, randomize_parameters_
from lmc.symmetry import AxisPermutation, ModelTransform
from lmc.symmetry.transforms import permute_axes
from tests.architectures import FLOAT64_RTOL, build, relative_difference

BROKEN = 1e-4
TRANSFORM = "cls.predictions.transform"


def outputs(model: nn.Module) -> torch.Tensor:
    adapter = adapter_for(model)
    with torch.no_grad():
        return adapter.forward(model, adapter.example_inputs(model, 3, torch.Generator().manual_seed(0)))


def _transform_units(model: nn.Module) -> AxisPermutation:
    """The transform's output units, as the untied model's spec would permute them (decoder columns if untied)."""
    axes = [(f"{TRANSFORM}.dense.weight", 0), (f"{TRANSFORM}.dense.bias", 0)]
    axes += [(f"{TRANSFORM}.LayerNorm.weight", 0), (f"{TRANSFORM}.LayerNorm.bias", 0)]
    if not model.config.tie_word_embeddings:
        axes.append(("cls.predictions.decoder.weight", 1))
    return AxisPermutation(TRANSFORM, model.config.hidden_size, tuple(axes))


@pytest.mark.parametrize("key", ["bert-mlm", "bert-mlm-untied"])
def test_the_transform_units_permute_alone_only_when_the_decoder_is_untied(key):
    model = build(key)
    spec = model_spec(model)
    tied = model.config.tie_word_embeddings
    assert [head.name for head in spec.task_heads] == ([] if tied else [TRANSFORM])
    assert ((f"{TRANSFORM}.dense.weight", 1) in spec.residual.axes) and (
        ((f"{TRANSFORM}.dense.weight", 0) in spec.residual.axes) == tied
    )
    moved = apply_transform(model, ModelTransform())
    perm = torch.randperm(model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    permute_axes(dict(moved.named_parameters()), _transform_units(model), perm)
    change = relative_difference(outputs(model), outputs(moved))
    if tied:  # E^T reads the transform's units in the stream's order: permuting them alone breaks the logits
        assert change > BROKEN
    else:  # measured 0 (a permutation moves entries exactly)
        assert change < FLOAT64_RTOL


def test_pretraining_keeps_both_heads_and_a_pooler_permutation_alone_breaks_the_next_sentence_logits():
    model = build("bert-pretraining")
    spec = model_spec(model)
    assert [head.name for head in spec.task_heads] == ["bert.pooler"]
    inputs = adapter_for(model).example_inputs(model, 3, torch.Generator().manual_seed(0))
    with torch.no_grad():
        output = model(**inputs)
    both = outputs(model)
    assert torch.equal(both[:, -2:], output.seq_relationship_logits)
    assert torch.equal(both[:, :-2], output.prediction_logits.flatten(1))

    pooler = AxisPermutation("pooler", 32, (("bert.pooler.dense.weight", 0), ("bert.pooler.dense.bias", 0)))
    broken = apply_transform(model, ModelTransform())
    permute_axes(dict(broken.named_parameters()), pooler, torch.roll(torch.arange(32), 1))  # not the classifier
    with torch.no_grad():
        broken_output = broken(**inputs)
    assert torch.equal(broken_output.prediction_logits, output.prediction_logits)  # the MLM head never reads it
    nsp = relative_difference(output.seq_relationship_logits, broken_output.seq_relationship_logits)
    assert nsp > BROKEN


def test_a_masked_lm_model_built_for_another_head_class_is_refused():
    from transformers.models.bert.modeling_bert import BertLMPredictionHead

    from lmc.adapters import UnsupportedModelError

    class OtherHead(BertLMPredictionHead):
        """Same parameters, perhaps another function."""

    model = randomize_parameters_(create_model("bert-mlm-tiny", dtype=torch.float64))
    model.cls.predictions.__class__ = OtherHead
    with pytest.raises(UnsupportedModelError, match=r"cls\.predictions is a .*OtherHead"):
        model_spec(model)
