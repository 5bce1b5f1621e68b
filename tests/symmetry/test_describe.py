"""describe(), scopes and the per-head view against each model's documented storage layout."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch

from lmc.adapters import describe, describe_scopes, model_spec, scope_parameters
from lmc.models.reference import ReferenceTransformer
from lmc.symmetry import read_attention, write_attention
from tests.architectures import ARCHITECTURES, build
from tests.symmetry.test_signs import RMS_NORM

# test id -> (pe, rope_layout, num_heads, num_kv_heads, head_dim, qk_group, qk_group_dim)
EXPECTED = {
    "ref-vit-learned": ("absolute", None, 4, 4, 8, "GL", 64),
    "ref-vit-rope-interleaved": ("rope", "interleaved", 4, 4, 8, "H", 8),
    "ref-lm-none": ("none", None, 4, 4, 8, "GL", 64),
    "ref-bert-sinusoidal": ("absolute", None, 4, 4, 8, "GL", 64),
    "ref-lm-rope-half-gqa-swiglu-rms-nobias": ("rope", "half", 4, 2, 8, "H", 8),
    "ref-lm-rope-partial": ("rope", "interleaved", 4, 4, 8, "H", 4 + 16),  # 2 pairs of H, GL(4) on the rest
    "gpt2": ("absolute", None, 4, 4, 8, "GL", 64),
    "bert": ("absolute", None, 4, 4, 8, "GL", 64),
    "bert-mlm": ("absolute", None, 4, 4, 8, "GL", 64),
    "bert-mlm-untied": ("absolute", None, 4, 4, 8, "GL", 64),
    "bert-pretraining": ("absolute", None, 4, 4, 8, "GL", 64),
    "roformer": ("rope", "interleaved", 4, 4, 8, "H", 8),
    "roformer-projected": ("rope", "interleaved", 4, 4, 8, "H", 8),
    "llama-gqa": ("rope", "half", 4, 2, 8, "H", 8),
    "mistral-swa": ("rope", "half", 4, 2, 8, "H", 8),  # the window masks positions, not head coordinates
    "qwen2-gqa": ("rope", "half", 4, 2, 8, "H", 8),
    "gemma-gqa": ("rope", "half", 4, 2, 8, "H", 8),
    "gemma2-capped": ("rope", "half", 4, 2, 8, "H", 8),  # capping and windows act on scores and positions
    "phi3-partial": ("rope", "half", 4, 2, 8, "H", 4 + 16),  # 2 pairs of H, GL(4) on the rest
    "qwen3-gqa": ("rope", "half", 4, 2, 8, "signs", 0),  # 2^4 sign flips of the rotary pairs: a finite group
    "olmo2-gqa": ("rope", "half", 4, 2, 8, "signs", 0),  # the same with full-width norms (gains move with heads)
    "gpt-neox-parallel": ("rope", "half", 4, 4, 8, "H", 4 + 16),  # 2 pairs of H, GL(4) on the rest
    "gpt-neox-sequential": ("rope", "half", 4, 4, 8, "H", 8),  # every coordinate rotates
    "hf-vit": ("absolute", None, 4, 4, 8, "GL", 64),
    "hf-vit-nobias": ("absolute", None, 4, 4, 4, "GL", 16),
    "timm-vit": ("absolute", None, 4, 4, 8, "GL", 64),
    "timm-vit-reg": ("absolute", None, 4, 4, 8, "GL", 64),
    "timm-rope-vit": ("rope", "axial", 4, 4, 8, "H", 8),
    "timm-eva02": ("rope", "axial", 4, 4, 8, "H", 8),
}
KEYS = ("pe", "rope_layout", "num_heads", "num_kv_heads", "head_dim", "qk_group", "qk_group_dim")
# test id -> the sizes of the permutation groups beyond the blocks that full_model moves, from each config
OTHER_UNITS = {
    "bert": [32],  # the tanh pooler's hidden_size units
    "bert-mlm-untied": [32],  # the masked-LM transform's hidden_size units, untied from the word embeddings
    "bert-pretraining": [32],  # the pooler under the next-sentence head
    "roformer": [32],  # the classifier MLP's hidden_size units
    "roformer-projected": [16, 32],  # the embedding_size space before embeddings_project, and the classifier's
    "timm-vit-reg": [3],  # the 3 register tokens
}
# test id -> the order of the task heads' sign groups: the tanh pooler's units flip one by one, RoFormer's
# embedding space (read by a LayerNorm) has one global sign
OTHER_SIGN_FLIPS = {"bert": 2**32, "bert-pretraining": 2**32, "roformer-projected": 2}
# A fixed sinusoidal table is added to the stream: no non-trivial permutation of it is a symmetry (docs/spec.md).
NO_RESIDUAL = {"ref-bert-sinusoidal"}


def _head_orders(num_heads: int, num_kv_heads: int) -> int:
    """Head orders counted by enumeration: those that keep every query head with its KV head's group."""
    per_kv = num_heads // num_kv_heads
    return sum(
        all(len({head // per_kv for head in order[g : g + per_kv]}) == 1 for g in range(0, num_heads, per_kv))
        for order in itertools.permutations(range(num_heads))
    )


def _widths(model) -> tuple[int, int]:
    """The FFN's hidden width and the residual width, read from the model's own config or modules (not the spec)."""
    if isinstance(model, ReferenceTransformer):
        return model.config.mlp_hidden, model.config.width
    if type(model).__module__.startswith("timm."):
        return model.blocks[0].mlp.fc2.in_features, model.embed_dim  # fc2 reads the hidden units (SwiGLU's too)
    config = model.config
    if config.model_type == "gpt2":
        return config.n_inner or 4 * config.n_embd, config.n_embd
    return config.intermediate_size, config.hidden_size


@pytest.mark.parametrize("key", list(ARCHITECTURES))
def test_describe_reports_each_layer_group(key):
    layers = describe(build(key))
    assert len(layers) == 2
    for layer in layers:
        assert tuple(layer[k] for k in KEYS) == EXPECTED[key]
        assert layer["vo_group"] == "GL" and layer["vo_group_dim"] == layer["head_dim"] ** 2
        assert layer["head_permutations"] == _head_orders(layer["num_heads"], layer["num_kv_heads"])
        assert layer["group_dim"] == layer["num_kv_heads"] * (layer["qk_group_dim"] + layer["head_dim"] ** 2)


@pytest.mark.parametrize("key", list(ARCHITECTURES))
def test_describe_reports_each_blocks_ffn_and_each_scope_every_permutation_group(key):
    model = build(key)
    ffn, d = _widths(model)
    ffn_groups = [(layer["ffn_width"], layer["ffn_permutations"]) for layer in describe(model)]
    assert ffn_groups == [(ffn, math.factorial(ffn))] * 2
    _, _, num_heads, num_kv_heads, head_dim, _, qk_dim = EXPECTED[key]
    heads, continuous = _head_orders(num_heads, num_kv_heads), num_kv_heads * (qk_dim + head_dim**2)
    residual = 0 if key in NO_RESIDUAL else d
    others = math.prod(math.factorial(n) for n in OTHER_UNITS.get(key, []))
    # Residual signs: one per coordinate under RMSNorms, one global sign under LayerNorms (docs/spec.md).
    signs = "none" if key in NO_RESIDUAL else ("each" if key in RMS_NORM else "global")
    flips = {"each": 2**residual, "global": 2, "none": 1}[signs]
    other_flips = OTHER_SIGN_FLIPS.get(key, 1)
    whole = heads**2 * math.factorial(ffn) ** 2 * math.factorial(residual) * flips * others * other_flips
    # scope -> (attention layers, FFNs, residual width, order of the discrete group) of the two-block model
    expected = {
        "first_attention": ([0], [], 0, heads),
        "all_attention": ([0, 1], [], 0, heads**2),
        "first_block": ([0], [0], 0, heads * math.factorial(ffn)),
        "full_model": ([0, 1], [0, 1], residual, whole),
    }
    scopes = describe_scopes(model)
    assert list(scopes) == list(expected)
    for scope, (attention, feed_forwards, residual_width, order) in expected.items():
        found = scopes[scope]
        assert found["attention_layers"] == attention and found["feed_forwards"] == feed_forwards, scope
        assert found["residual_width"] == residual_width, scope
        assert found["group_dim"] == len(attention) * continuous, scope
        assert found["residual_permutations"] == math.factorial(residual_width), scope
        assert found["other_permutations"] == (others if scope == "full_model" else 1), scope
        assert found["residual_signs"] == (signs if scope == "full_model" else "none"), scope
        assert found["residual_sign_flips"] == (flips if scope == "full_model" else 1), scope
        assert found["other_sign_flips"] == (other_flips if scope == "full_model" else 1), scope
        assert found["permutations"] == order, scope


def test_each_scope_accounts_for_every_axis_of_its_parameters():
    # GPT-2, two blocks, Conv1D weights (in, out). An attention layer: c_attn's output axis and bias
    # hold the head slots, c_proj's input axis too; their residual axes (c_attn's input, c_proj's
    # output and bias) move only under full_model's residual permutation: 3 moved, 3 "scope". The
    # FFN the same: c_fc's output and bias, c_proj's input moved; the residual axes "scope".
    # full_model: 38 axes (wte 2, wpe 2, 16 a block, ln_f 2), all moved but the vocabulary and positions.
    scopes = describe_scopes(build("gpt2"))
    expected = {
        "first_attention": (3, {"scope": 3}),
        "all_attention": (6, {"scope": 6}),
        "first_block": (6, {"scope": 6}),
        "full_model": (36, {"vocabulary": 1, "positions": 1}),
    }
    for scope, (moved, fixed) in expected.items():
        assert (scopes[scope]["moved_axes"], scopes[scope]["fixed_axes"]) == (moved, fixed), scope
        assert scopes[scope]["unexplained_axes"] == [], scope


def test_scope_parameters_name_the_reinitialized_parts():
    model = build("gpt2")
    first_attention = ["transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_attn.bias"]
    first_attention += ["transformer.h.0.attn.c_proj.weight", "transformer.h.0.attn.c_proj.bias"]
    assert scope_parameters(model, "first_attention") == first_attention
    assert set(scope_parameters(model, "all_attention")) == set(first_attention) | {
        name.replace(".h.0.", ".h.1.") for name in first_attention
    }
    mlp = {f"transformer.h.0.mlp.{p}.{k}" for p in ("c_fc", "c_proj") for k in ("weight", "bias")}
    assert set(scope_parameters(model, "first_block")) == set(first_attention) | mlp
    assert scope_parameters(model, "full_model") == [name for name, _ in model.named_parameters()]


def test_gpt2_view_reads_fused_conv1d_columns():
    model = build("gpt2")
    d, head_dim = 32, 8
    weights = read_attention(dict(model.named_parameters()), model_spec(model).blocks[0].attention)
    c_attn = model.transformer.h[0].attn.c_attn
    c_proj = model.transformer.h[0].attn.c_proj
    for i in range(4):
        columns = slice(i * head_dim, (i + 1) * head_dim)
        assert torch.equal(weights.query[i], c_attn.weight[:, columns])
        assert torch.equal(weights.key[i], c_attn.weight[:, d:][:, columns])
        assert torch.equal(weights.value[i], c_attn.weight[:, 2 * d :][:, columns])
        assert torch.equal(weights.key_bias[i], c_attn.bias[d:][columns])
        assert torch.equal(weights.out[i], c_proj.weight[columns])


def test_timm_view_reads_fused_qkv_rows_transposed():
    model = build("timm-vit")
    d, head_dim = 32, 8
    weights = read_attention(dict(model.named_parameters()), model_spec(model).blocks[1].attention)
    qkv, proj = model.blocks[1].attn.qkv, model.blocks[1].attn.proj
    for i in range(4):
        rows = slice(i * head_dim, (i + 1) * head_dim)
        assert torch.equal(weights.query[i], qkv.weight[rows].T)
        assert torch.equal(weights.value[i], qkv.weight[2 * d :][rows].T)
        assert torch.equal(weights.value_bias[i], qkv.bias[2 * d :][rows])
        assert torch.equal(weights.out[i], proj.weight[:, rows].T)


def test_eva_view_has_no_key_bias_and_separate_query_value_biases():
    model = build("timm-eva02")
    weights = read_attention(dict(model.named_parameters()), model_spec(model).blocks[0].attention)
    assert weights.key_bias is None
    assert torch.equal(weights.query_bias.flatten(), model.blocks[0].attn.q_bias)
    assert torch.equal(weights.value_bias.flatten(), model.blocks[0].attn.v_bias)


@pytest.mark.parametrize(
    "key", ["gpt2", "llama-gqa", "timm-rope-vit", "timm-eva02", "ref-lm-rope-half-gqa-swiglu-rms-nobias"]
)
def test_write_of_read_restores_every_slot_into_a_zeroed_copy(key):
    """Writing what was read into zeroed parameters gives back exactly the layers' stored entries, nothing else."""
    model = build(key)
    spec = model_spec(model)
    read = [read_attention(dict(model.named_parameters()), layer) for layer in spec.attention]
    blank = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in blank.parameters():
            parameter.zero_()
    written = dict(blank.named_parameters())
    for layer, weights in zip(spec.attention, read):
        write_attention(written, layer, weights)

    slots = {slot.parameter for layer in spec.attention for slot in layer.slots}
    for name, value in model.named_parameters():
        if name in slots:
            assert torch.equal(written[name], value), f"{name} was not written back exactly"
        else:
            assert not written[name].any(), f"{name} is no slot but was written"
