"""The reference Transformer's RoPE attention against a straightforward formula, in float64."""

from __future__ import annotations

import math

import pytest
import torch

from lmc.models import create_model
from lmc.models.reference import Attention, ReferenceConfig

ROTARY = {
    "half": {"rope_layout": "half"},
    "interleaved": {"rope_layout": "interleaved"},
    # head_dim 12 and fraction 0.5: 3 pairs (an odd count) turn, the last 6 coordinates pass through.
    "half-partial": {"rope_layout": "half", "rotary_fraction": 0.5},
    "interleaved-partial": {"rope_layout": "interleaved", "rotary_fraction": 0.5},
}


def pairwise_rotation(x: torch.Tensor, layout: str, rotary_dim: int, base: float) -> torch.Tensor:
    """RoPE written pair by pair from its definition. ``x``: (B, nh, T, hs)."""
    rotated = x.clone()
    for j in range(rotary_dim // 2):
        first, second = (j, j + rotary_dim // 2) if layout == "half" else (2 * j, 2 * j + 1)
        angle = torch.arange(x.shape[2], dtype=torch.float64) * base ** (-2 * j / rotary_dim)  # (T,)
        cos, sin = angle.cos(), angle.sin()
        rotated[..., first] = x[..., first] * cos - x[..., second] * sin
        rotated[..., second] = x[..., first] * sin + x[..., second] * cos
    return rotated


def reference_attention(attention: Attention, x: torch.Tensor) -> torch.Tensor:
    """Causal multi-head attention with RoPE and GQA, one query head at a time. ``x``: (B, T, d)."""
    c = attention.config
    B, T, _ = x.shape

    def heads(projection: torch.nn.Linear) -> torch.Tensor:
        return projection(x).view(B, T, -1, c.head_dim).transpose(1, 2)  # (B, heads, T, hs)

    q = pairwise_rotation(heads(attention.q_proj), c.rope_layout, c.rotary_dim, c.rope_base)
    k = pairwise_rotation(heads(attention.k_proj), c.rope_layout, c.rotary_dim, c.rope_base)
    v = heads(attention.v_proj)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    outputs = []
    for i in range(c.num_heads):
        kv = i // (c.num_heads // c.num_kv_heads)
        scores = q[:, i] @ k[:, kv].transpose(-1, -2) / math.sqrt(c.head_dim)  # (B, T, T)
        outputs.append(scores.masked_fill(future, -math.inf).softmax(-1) @ v[:, kv])  # (B, T, hs)
    return attention.o_proj(torch.cat(outputs, dim=-1))


@pytest.mark.parametrize("num_kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("rotary", list(ROTARY))
def test_rope_attention_matches_pairwise_formula(rotary, num_kv_heads):
    config = ReferenceConfig(
        width=48, num_heads=4, num_kv_heads=num_kv_heads, head_dim=12, pe="rope", max_positions=16, **ROTARY[rotary]
    )
    torch.manual_seed(0)
    attention = Attention(config).double()
    x = torch.randn(3, 11, config.width, dtype=torch.float64)  # 11 of 16 positions: the tables are cut to T
    with torch.no_grad():
        expected = reference_attention(attention, x)
        actual = attention(x, causal=True)
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rotary", list(ROTARY))
def test_rope_adds_no_checkpoint_entries(rotary):
    """The rotation tables are rebuilt from the config, so a RoPE checkpoint holds what a PE-free one does."""
    overrides = {"width": 48, "num_heads": 4, "num_kv_heads": 2, "head_dim": 12}
    rope = create_model("reference-tiny", pe="rope", **ROTARY[rotary], **overrides)
    plain = create_model("reference-tiny", pe="none", **overrides)
    assert list(rope.state_dict()) == list(plain.state_dict())
