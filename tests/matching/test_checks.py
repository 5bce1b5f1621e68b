"""lmc.matching.checks: the finiteness check the streamed passes run on every tensor, and the attention probe."""

from __future__ import annotations

import pytest
import torch

from lmc.adapters import model_spec
from lmc.matching.checks import AttentionProbe, all_finite
from lmc.models import create_model, randomize_parameters_
from lmc.symmetry import AttentionSpec, AttentionTransform, ModelTransform, sample_attention_transform
from lmc.symmetry.groups import general_linear


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_one_non_finite_entry_anywhere_is_found(dtype, bad):
    # Sizes around the vectorized reduction's widths, the entry at the start, middle and tail.
    for size in (1, 7, 33, 4099):
        for position in sorted({0, size // 2, size - 1}):
            values = torch.randn(size).to(dtype)
            assert all_finite(values)
            values[position] = bad
            assert not all_finite(values), (size, position)
            assert not all_finite(values.reshape(1, -1).expand(2, -1).t()), (size, position)  # strided


def test_empty_and_integer_tensors_are_finite():
    assert all_finite(torch.empty(0)) and all_finite(torch.arange(5))
    assert all_finite(torch.tensor(torch.finfo(torch.bfloat16).max, dtype=torch.bfloat16))


def _first_attention(name: str, **config) -> tuple[torch.nn.Module, dict[str, torch.Tensor], AttentionSpec]:
    model = randomize_parameters_(create_model(name, dtype=torch.float64, **config), seed=0)
    return model, {n: p.detach() for n, p in model.named_parameters()}, model_spec(model).blocks[0].attention


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_the_attention_probe_computes_the_hugging_face_layer_in_float64(name):
    # The layer's own forward pass (SDPA without a mask: Llama's eager path takes the softmax in float32), given
    # the probe's input and, for RoPE, cos and sin of the spec's angles laid out as Llama's (pairs
    # (j, j + d_h / 2)): equal up to float64 summation order.
    model, parameters, layer = _first_attention(name)
    model.config._attn_implementation = "sdpa"
    probe = AttentionProbe(layer, seed=3)
    x = probe.x[None]
    if name == "gpt2-tiny":
        module = model.transformer.h[0].attn
        module.is_causal = False
        expected = module(x, attention_mask=None)[0][0] - module.c_proj.bias  # the output bias is no head's
    else:
        module = model.model.layers[0].self_attn
        module.is_causal = False
        half = layer.head_dim // 2
        assert torch.equal(layer.rotary.pairs, torch.stack([torch.arange(half), torch.arange(half) + half], 1))
        angles = layer.rotary.angles[: x.shape[1]].double().repeat(1, 2)[None]
        expected = module(x, position_embeddings=(angles.cos(), angles.sin()), attention_mask=None)[0][0]
    found = probe.output(parameters)
    assert float((found - expected).abs().max()) <= 1e-13 * float(expected.abs().max())


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "gpt-neox-tiny"])
def test_the_attention_probe_keeps_the_layers_group_and_sees_what_leaves_it(name):

    model, parameters, layer = _first_attention(name)
    spec, generator = model_spec(model), torch.Generator().manual_seed(1)
    probe = AttentionProbe(layer, seed=3)
    reference = probe.output(parameters)

    def moved(transform: ModelTransform) -> dict[str, torch.Tensor]:
        tensors = {n: parameters[n].clone() for n in layer.parameters}
        transform.apply_(tensors, spec, partial=True)
        return tensors

    element = sample_attention_transform(layer, generator)
    assert probe.error(reference, moved(ModelTransform(attention={0: element}))) <= 1e-13
    residual = torch.randperm(layer.width, generator=generator)  # full_model: the input and output move too
    both = moved(ModelTransform(attention={0: element}, residual=residual))
    assert probe.error(reference, both, residual) <= 1e-13
    assert probe.error(reference, both) > 1e-2  # the permuted input must be given
    identity = AttentionTransform.identity(layer)
    heads_alone = torch.roll(torch.arange(layer.num_heads), layer.queries_per_kv)  # queries without their keys
    outside = AttentionTransform(heads_alone, identity.kv_permutation, identity.qk, identity.vo)
    assert probe.error(reference, moved(ModelTransform(attention={0: outside}))) > 1e-2
    if layer.rotary is not None:  # GL on Q/K leaves H(d_h): RoPE must be applied for the probe to see it
        general = sample_attention_transform(layer, generator, qk=general_linear(layer.head_dim))
        assert probe.error(reference, moved(ModelTransform(attention={0: general}))) > 1e-2
