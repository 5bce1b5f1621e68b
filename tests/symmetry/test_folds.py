"""fold_norms: every foldable norm moved into its readers keeps the function; the norms that must not fold break it.

float64 throughout (HF's RMSNorms computed in float64 for these tests, tests/architectures.float64_norms).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lmc.adapters import adapter_for, fold_norms, model_spec
from lmc.formats import timm_files
from lmc.models import create_model, randomize_parameters_
from lmc.symmetry import NormFold, Reader, fold_parameters_
from tests.architectures import ARCHITECTURES, FLOAT64_RTOL, build, float64_norms, relative_difference

BROKEN = 1e-4
# test id -> the norms that fold: every pre-norm (read by linear maps only) and a final norm read by an untied head
# or a classifier; post-norms (BERT, RoFormer), sublayer-output norms (OLMo-2, Gemma 2) and a final norm under a
# tied head (GPT-2, Gemma) do not.
PRE_NORMS_AND_HEAD = 2 * 2 + 1  # two blocks of two pre-norms, and the final norm
EXPECTED_FOLDS = {key: PRE_NORMS_AND_HEAD for key in ARCHITECTURES} | {
    "gpt2": 4,  # ln_f's reader is the tied embedding
    "bert": 0,
    "bert-mlm": 0,
    "bert-mlm-untied": 0,
    "bert-pretraining": 0,
    "roformer": 0,
    "roformer-projected": 0,
    "olmo2-gqa": 1,  # its norms sit on the sublayers' outputs; only the final norm folds (untied head)
    "gemma-gqa": 4,  # tied head
    "gemma2-capped": 4,  # input and pre-FFN norms; output norms and the tied head's norm stay
}


def outputs(model: nn.Module) -> torch.Tensor:
    adapter = adapter_for(model)
    with torch.no_grad():
        return adapter.forward(model, adapter.example_inputs(model, 3, torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("key", list(ARCHITECTURES))
def test_folding_keeps_the_function_and_leaves_unit_gains(key, monkeypatch):
    model = build(key)
    float64_norms(model, monkeypatch)
    spec = model_spec(model)
    assert len(spec.folds) == EXPECTED_FOLDS[key]

    folded = fold_norms(model)

    assert type(folded) is type(model)
    assert relative_difference(outputs(model), outputs(folded)) < FLOAT64_RTOL  # at most 1.2e-15 (measured)
    parameters = dict(folded.named_parameters())
    for fold in spec.folds:
        if fold.gain is not None:
            assert torch.equal(parameters[fold.gain] + fold.gain_offset, torch.ones_like(parameters[fold.gain]))
        if fold.folds_bias:
            assert torch.equal(parameters[fold.bias], torch.zeros_like(parameters[fold.bias]))
    # Folding twice changes nothing more: unit gains and zero biases fold to themselves.
    again = dict(fold_norms(folded).named_parameters())
    for name, value in parameters.items():
        assert torch.equal(again[name], value), name


@pytest.mark.parametrize("key", ["gpt-neox-parallel", "hf-vit-nobias", "timm-eva02"])
def test_a_bias_no_reader_can_take_stays_divided_by_the_gain(key):
    model = build(key)
    spec = model_spec(model)
    kept = [fold for fold in spec.folds if fold.bias is not None and not fold.folds_bias]
    assert kept, "a reader without a bias"
    original, folded = dict(model.named_parameters()), dict(fold_norms(model).named_parameters())
    for fold in kept:
        torch.testing.assert_close(folded[fold.bias], original[fold.bias] / original[fold.gain], rtol=1e-15, atol=0)
    assert relative_difference(outputs(model), outputs(fold_norms(model))) < FLOAT64_RTOL


def folded_anyway(model: nn.Module, fold: NormFold) -> nn.Module:
    parameters = dict(model.named_parameters())
    fold_parameters_(parameters, (fold,))
    return model


def test_the_norms_that_must_not_fold_break_the_function_when_folded():
    # GPT-2's ln_f into the tied head: the head is the embedding, which also writes the stream.
    gpt2 = build("gpt2")
    tied = NormFold(
        "transformer.ln_f", "transformer.ln_f.weight", (Reader("transformer.wte.weight", 1),), "transformer.ln_f.bias"
    )
    before = outputs(gpt2)
    assert relative_difference(before, outputs(folded_anyway(gpt2, tied))) > BROKEN
    # BERT's post-norm into the next layer's projections: its output is the stream, which the next norm reads too.
    bert = build("bert")
    p, q = "bert.encoder.layer.0.output.LayerNorm", "bert.encoder.layer.1.attention.self"
    readers = tuple(Reader(f"{q}.{x}.weight", 1, f"{q}.{x}.bias") for x in ("query", "key", "value"))
    before = outputs(bert)
    assert (
        relative_difference(before, outputs(folded_anyway(bert, NormFold(p, f"{p}.weight", readers, f"{p}.bias"))))
        > BROKEN
    )
    # Llama's first pre-norm with one of its three readers left out.
    llama = build("llama-gqa")
    first = model_spec(llama).blocks[0].attention.name
    partial = NormFold(
        "model.layers.0.input_layernorm",
        "model.layers.0.input_layernorm.weight",
        tuple(Reader(f"{first}.{x}_proj.weight", 1) for x in "qk"),
    )
    before = outputs(llama)
    assert relative_difference(before, outputs(folded_anyway(llama, partial))) > BROKEN


@pytest.mark.parametrize("name", ["llama-tiny", "gemma-tiny", "gpt2-tiny", "gpt-neox-tiny"])
def test_a_folded_model_is_saved_and_loaded_by_its_class(tmp_path, name, monkeypatch):
    model = randomize_parameters_(create_model(name, dtype=torch.float64), seed=0)
    float64_norms(model, monkeypatch)
    model.save_pretrained(tmp_path / "model")
    fold_norms(model).save_pretrained(tmp_path / "folded")
    # Both through the loader (which builds its own float64 rotary tables): the fold is all that differs.
    loaded, folded = (
        type(model).from_pretrained(tmp_path / x, dtype=torch.float64).eval() for x in ("model", "folded")
    )
    assert relative_difference(outputs(loaded), outputs(folded)) < FLOAT64_RTOL
    for fold in model_spec(model).folds:
        assert bool((dict(folded.named_parameters())[fold.gain] + fold.gain_offset == 1).all())


def test_a_folded_timm_vit_is_saved_and_loaded_by_its_files(tmp_path):
    model = build("timm-vit")
    timm_files.save_model(fold_norms(model), tmp_path)
    loaded = timm_files.load_model(tmp_path).double().eval()
    assert relative_difference(outputs(model), outputs(loaded)) < FLOAT64_RTOL
