"""Every adapter proves itself: random symmetries keep the function, near-misses break it (float64)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lmc.adapters import (
    UnsupportedModelError,
    adapter_for,
    apply_transform,
    describe,
    list_adapters,
    model_spec,
    random_symmetry,
)
from lmc.models import create_model
from lmc.symmetry import (
    SCOPES,
    AttentionTransform,
    ModelTransform,
    general_linear,
    other_pair_layout,
    rotary_commutant,
    sample_attention_transform,
    sample_transform,
)
from tests.architectures import (
    APE,
    ARCHITECTURES,
    FLOAT64_RTOL,
    GQA,
    OUTPUT_RTOL,
    ROPE,
    build,
    relative_difference,
)

# A broken symmetry changes outputs by O(1e-2) or more on these models; rounding is O(1e-15).
BROKEN = 1e-4


def outputs(model: nn.Module, seed: int = 0) -> torch.Tensor:
    adapter = adapter_for(model)
    with torch.no_grad():
        return adapter.forward(model, adapter.example_inputs(model, 3, torch.Generator().manual_seed(seed)))


def transformed_parameters(model: nn.Module, scope: str) -> set[str]:
    """Names of the parameters a scope's group acts on (output biases of attention and FFN excluded)."""
    spec = model_spec(model)
    transform = sample_transform(spec, scope, torch.Generator().manual_seed(0))
    names = {slot.parameter for i in transform.attention for slot in spec.blocks[i].attention.slots}
    names |= {name for i in transform.feed_forward for name, _ in spec.blocks[i].feed_forward.hidden.axes}
    names |= {name for i in transform.task_heads for name, _ in spec.task_heads[i].axes}
    if transform.residual is not None:
        names |= {name for name, _ in spec.residual.axes}
    if transform.tokens is not None:
        names |= {name for name, _ in spec.tokens.axes}
    return names


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("key", list(ARCHITECTURES))
def test_random_symmetry_keeps_outputs_and_moves_weights(key, scope):
    model = build(key)
    before = {name: p.detach().clone() for name, p in model.state_dict().items()}

    transformed = random_symmetry(model, scope=scope, seed=1)

    # Kept to float64 rounding: at most 1.2e-15 relative (llama-gqa 1.3e-7: its float32 norm), measured.
    assert relative_difference(outputs(model), outputs(transformed)) < OUTPUT_RTOL.get(key, FLOAT64_RTOL)
    original, moved = dict(model.named_parameters()), dict(transformed.named_parameters())
    names = transformed_parameters(model, scope)
    assert names, "the scope transforms nothing"
    for name in names:
        assert relative_difference(original[name], moved[name]) > 0.1, f"{name} barely moved"
    for name in original.keys() - names:
        assert torch.equal(original[name], moved[name]), f"{name} is outside the scope but changed"
    for name, value in model.state_dict().items():  # the input model is never modified
        assert torch.equal(value, before[name]), f"random_symmetry modified the input model's {name}"


def _first_layer_transform(model: nn.Module, qk) -> nn.Module:
    spec = model_spec(model)
    element = sample_attention_transform(spec.blocks[0].attention, torch.Generator().manual_seed(2), qk)
    return apply_transform(model, ModelTransform(attention={0: element}), spec)


@pytest.mark.parametrize("key", list(ARCHITECTURES))
def test_generic_gl_on_qk_is_a_symmetry_exactly_without_rope(key):
    model = build(key)
    head_dim = model_spec(model).blocks[0].attention.head_dim

    change = relative_difference(outputs(model), outputs(_first_layer_transform(model, general_linear(head_dim))))

    if key in ROPE:
        assert change > BROKEN
    else:
        assert key in APE and change < OUTPUT_RTOL.get(key, FLOAT64_RTOL)  # at most 6.8e-16 (measured)


@pytest.mark.parametrize("key", ROPE)
def test_h_for_the_other_pair_layout_breaks_rope(key):
    model = build(key)
    layer = model_spec(model).blocks[0].attention
    wrong = rotary_commutant(layer.head_dim, other_pair_layout(layer.rotary))
    assert relative_difference(outputs(model), outputs(_first_layer_transform(model, wrong))) > BROKEN


@pytest.mark.parametrize("key", GQA)
def test_gqa_moving_a_query_head_out_of_its_group_breaks(key):
    model = build(key)
    layer = model_spec(model).blocks[0].attention
    assert layer.num_kv_heads < layer.num_heads
    identity = AttentionTransform.identity(layer)
    query_permutation = torch.arange(layer.num_heads)
    query_permutation[[0, layer.queries_per_kv]] = query_permutation[[layer.queries_per_kv, 0]]  # swap across groups
    swapped = AttentionTransform(query_permutation, identity.kv_permutation, identity.qk, identity.vo)

    with pytest.raises(ValueError, match="out of its key/value group"):
        swapped.validate(layer)
    broken = apply_transform(model, ModelTransform(attention={0: swapped}))
    assert relative_difference(outputs(model), outputs(broken)) > BROKEN

    # Swapping two query heads *inside* one group is a symmetry.
    inside = torch.arange(layer.num_heads)
    inside[[0, 1]] = inside[[1, 0]]
    kept = AttentionTransform(inside, identity.kv_permutation, identity.qk, identity.vo)
    kept.validate(layer)
    assert relative_difference(outputs(model), outputs(apply_transform(model, ModelTransform(attention={0: kept})))) < (
        OUTPUT_RTOL.get(key, FLOAT64_RTOL)  # at most 6.9e-16 (measured)
    )


def test_unsupported_model_raises_an_error_listing_the_supported_ones():
    with pytest.raises(UnsupportedModelError) as error:
        random_symmetry(nn.Sequential(nn.Linear(4, 4)))
    message = str(error.value)
    assert "torch:Sequential" in message
    for key in list_adapters():
        assert key in message
    assert "register_adapter" in message


def test_unknown_scope_is_rejected():
    with pytest.raises(ValueError, match="unknown scope 'first_layer'.*first_attention"):
        random_symmetry(build("ref-lm-none"), scope="first_layer")


def _vit_with_parallel_blocks() -> nn.Module:
    from timm.models.vision_transformer import ParallelScalingBlock

    return create_model("vit-tiny", dtype=torch.float64, block_fn=ParallelScalingBlock)


def _llama_with_attention_subclass() -> nn.Module:
    from transformers.models.llama.modeling_llama import LlamaAttention

    class ScaledLlamaAttention(LlamaAttention):
        """Same parameters, another function: a subclass must not pass for the class it extends."""

    model = build("llama-gqa")
    model.model.layers[1].self_attn.__class__ = ScaledLlamaAttention
    return model


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: create_model("vit-tiny", dtype=torch.float64, attn_layer="diff"),
            r"blocks\.0\.attn is a timm\.layers\.diff_attention\.DiffAttention, which lmc does not support: "
            r"the adapter knows the symmetries of Attention there",
        ),
        (
            _vit_with_parallel_blocks,
            r"blocks\.0 is a timm\.models\.vision_transformer\.ParallelScalingBlock, which lmc does not support",
        ),
        (
            _llama_with_attention_subclass,
            r"model\.layers\.1\.self_attn is a .*ScaledLlamaAttention, which lmc does not support: "
            r"the adapter knows the symmetries of LlamaAttention there",
        ),
    ],
)
def test_attention_variants_the_adapter_does_not_know_are_refused_by_class(make, message):
    """timm's DiffAttention ViT stores a fused qkv like Attention, yet GL is no symmetry of it."""
    model = make()
    with pytest.raises(UnsupportedModelError, match=message):
        random_symmetry(model)
    with pytest.raises(UnsupportedModelError, match=message):
        describe(model)
