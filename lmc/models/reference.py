"""The in-house reference Transformer: every positional encoding, GQA and both FFNs, one file.

A pre-norm Transformer (docs/spec.md, section 1) that is a ViT-style image classifier, a BERT-style
sequence classifier or a GPT-style causal language model, switched by config fields:

- ``pe``: ``"none"``, ``"sinusoidal"`` (fixed buffer added to the embeddings), ``"learned"``
  (a parameter added to the embeddings) or ``"rope"`` (``rope_layout`` ``"half"`` as in
  Llama or ``"interleaved"`` as in RoFormer; ``rotary_fraction < 1`` rotates only the first
  coordinates of each head);
- ``num_kv_heads < num_heads``: grouped-query attention (query head ``i`` reads KV head
  ``i // (num_heads // num_kv_heads)``);
- ``norm``: ``"layernorm"`` or ``"rmsnorm"``; ``mlp``: ``"gelu"`` or ``"swiglu"``; ``bias``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from lmc.rotary import rotary_pairs


@dataclass
class ReferenceConfig:
    """Configuration of :class:`ReferenceTransformer`.

    Attributes:
        task: ``"image_classification"`` (patches of ``image_size`` images plus a class token),
            ``"sequence_classification"`` (tokens, classify the first) or ``"causal_lm"``.
        width: Residual width ``d``.
        depth: Number of blocks.
        num_heads: Query heads ``h``.
        num_kv_heads: Key/value heads (``None``: ``num_heads``, no GQA).
        head_dim: Head width (``None``: ``width // num_heads``).
        mlp_hidden: FFN hidden units (``None``: ``4 * width``).
        mlp: ``"gelu"`` or ``"swiglu"`` (gate and up projections).
        norm: ``"layernorm"`` or ``"rmsnorm"``.
        bias: Whether linear layers (and LayerNorm) have biases.
        pe: ``"none"``, ``"sinusoidal"``, ``"learned"`` or ``"rope"``.
        rope_layout: ``"half"`` or ``"interleaved"`` rotary pairs.
        rotary_fraction: Share of each head's coordinates that rotate (partial rotary).
        rope_base: RoPE frequency base.
        max_positions: Longest sequence (tokens, class token included).
        vocab_size: Token vocabulary (text tasks).
        num_classes: Classes (classification tasks).
        image_size: Side of the square input images.
        patch_size: Side of the square patches.
        in_channels: Image channels.
    """

    task: Literal["image_classification", "sequence_classification", "causal_lm"] = "causal_lm"
    width: int = 64
    depth: int = 2
    num_heads: int = 4
    num_kv_heads: int | None = None
    head_dim: int | None = None
    mlp_hidden: int | None = None
    mlp: Literal["gelu", "swiglu"] = "gelu"
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    bias: bool = True
    pe: Literal["none", "sinusoidal", "learned", "rope"] = "learned"
    rope_layout: Literal["half", "interleaved"] = "half"
    rotary_fraction: float = 1.0
    rope_base: float = 10000.0
    max_positions: int = 128
    vocab_size: int = 256
    num_classes: int = 10
    image_size: int = 8
    patch_size: int = 2
    in_channels: int = 1

    def __post_init__(self) -> None:
        self.num_kv_heads = self.num_kv_heads or self.num_heads
        self.head_dim = self.head_dim or self.width // self.num_heads
        self.mlp_hidden = self.mlp_hidden or 4 * self.width
        choices = {
            "task": ("image_classification", "sequence_classification", "causal_lm"),
            "mlp": ("gelu", "swiglu"),
            "norm": ("layernorm", "rmsnorm"),
            "pe": ("none", "sinusoidal", "learned", "rope"),
            "rope_layout": ("half", "interleaved"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"ReferenceConfig.{name}={getattr(self, name)!r}; choose one of {allowed}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if not 0 < self.rotary_fraction <= 1 or self.rotary_dim == 0:
            raise ValueError(f"rotary_fraction={self.rotary_fraction} must leave at least one rotary pair in (0, 1]")
        if self.task == "image_classification" and self.image_size % self.patch_size:
            raise ValueError(f"image_size={self.image_size} is not a multiple of patch_size={self.patch_size}")
        if self.num_positions > self.max_positions:
            raise ValueError(f"{self.num_positions} image tokens exceed max_positions={self.max_positions}")

    @property
    def rotary_dim(self) -> int:
        """Rotated coordinates per head (even)."""
        return 2 * int(self.head_dim * self.rotary_fraction / 2)

    @property
    def num_positions(self) -> int:
        """Tokens of an image (patches plus the class token); ``max_positions`` for text."""
        if self.task != "image_classification":
            return self.max_positions
        return (self.image_size // self.patch_size) ** 2 + 1


def rotary_angles(num_positions: int, rotary_dim: int, base: float) -> torch.Tensor:
    """Angle of each rotary pair at each position, shape ``(num_positions, rotary_dim // 2)``."""
    inverse_frequency = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    return torch.arange(num_positions, dtype=torch.float64)[:, None] * inverse_frequency[None, :]


def sinusoidal_table(num_positions: int, width: int) -> torch.Tensor:
    """The fixed sinusoidal encoding of Vaswani et al. (2017), shape ``(num_positions, width)``."""
    angles = rotary_angles(num_positions, width, 10000.0)  # (T, width / 2)
    return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1)


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain, computed in the input dtype."""

    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _norm(config: ReferenceConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(config.width)
    return nn.LayerNorm(config.width, bias=config.bias)


class Attention(nn.Module):
    """Multi-head attention with optional RoPE and grouped-query heads."""

    def __init__(self, config: ReferenceConfig):
        super().__init__()
        self.config = config
        c = config
        self.q_proj = nn.Linear(c.width, c.num_heads * c.head_dim, bias=c.bias)
        self.k_proj = nn.Linear(c.width, c.num_kv_heads * c.head_dim, bias=c.bias)
        self.v_proj = nn.Linear(c.width, c.num_kv_heads * c.head_dim, bias=c.bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.width, bias=c.bias)
        if c.pe == "rope":
            # Each pair's cosine and sine written at both of its coordinates, the sine negated at the
            # first, so that the rotation is elementwise (no gathers or scatters): see ``rotate``.
            angles = rotary_angles(c.max_positions, c.rotary_dim, c.rope_base)  # (T_max, r/2)
            first, second = rotary_pairs(c.rope_layout, c.rotary_dim).unbind(1)
            cos = torch.empty(c.max_positions, c.rotary_dim, dtype=torch.float64)
            sin = torch.empty_like(cos)
            cos[:, first], cos[:, second] = angles.cos(), angles.cos()
            sin[:, first], sin[:, second] = -angles.sin(), angles.sin()
            # (T_max, 1, r), spread over a call's heads in ``rotate``. Not persistent: checkpoints hold
            # the same entries with or without RoPE.
            self.register_buffer("rope_cos_table", cos[:, None], persistent=False)
            self.register_buffer("rope_sin_table", sin[:, None], persistent=False)

    @property
    def rope_pairs(self) -> torch.Tensor:
        """Coordinate pairs ``(first, second)`` of each head that rotate together, shape (r/2, 2).

        With ``rope_cos`` and ``rope_sin``, the per-pair view the symmetry adapter reads.
        """
        return rotary_pairs(self.config.rope_layout, self.config.rotary_dim)

    @property
    def rope_cos(self) -> torch.Tensor:
        """Cosine of each pair's angle at each position, shape (T_max, r/2)."""
        return self.rope_cos_table[:, 0, self.rope_pairs[:, 0]]

    @property
    def rope_sin(self) -> torch.Tensor:
        """Sine of each pair's angle at each position, shape (T_max, r/2)."""
        return self.rope_sin_table[:, 0, self.rope_pairs[:, 1]]

    def swap_pairs(self, x: torch.Tensor) -> torch.Tensor:
        """Exchange the two coordinates of every rotary pair. ``x``: (..., r).

        A roll rather than ``flip`` or ``stack``: on CPU it is a copy of two slices, the cheapest
        of the three forward and backward.
        """
        if self.config.rope_layout == "half":  # pairs (j, j + r/2): swap the halves
            return x.roll(x.shape[-1] // 2, dims=-1)
        return x.unflatten(-1, (-1, 2)).roll(1, dims=-1).flatten(-2)  # pairs (2j, 2j + 1): swap neighbours

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """Turn each rotary pair ``x[first] + i x[second]`` by its angle. ``x``: (B, T, n, hs), n heads.

        ``first' = first cos - second sin`` and ``second' = second cos + first sin`` are, over
        all coordinates at once, ``x * cos_table + swap_pairs(x) * sin_table``: the same products
        and sums as the pairwise formula, so the same result bit for bit.
        """
        T, n, r = *x.shape[1:3], self.config.rotary_dim
        # Spread over the heads first: on CPU a product with a table broadcast over the heads runs on
        # rows of r elements, several times slower than on contiguous memory.
        cos, sin = (t[:T].to(x.dtype).expand(T, n, r).contiguous() for t in (self.rope_cos_table, self.rope_sin_table))
        if r == x.shape[-1]:
            return x * cos + self.swap_pairs(x) * sin
        # Partial rotary: only the first r coordinates turn. One split rather than two slices: one
        # backward op instead of two zero-filled gradients summed.
        rotary, passed = x.split([r, x.shape[-1] - r], dim=-1)
        return torch.cat([rotary * cos + self.swap_pairs(rotary) * sin, passed], dim=-1)

    def forward(self, x: torch.Tensor, causal: bool, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        c = self.config
        q = self.q_proj(x).view(B, T, c.num_heads, c.head_dim)  # (B, T, nh, hs)
        k = self.k_proj(x).view(B, T, c.num_kv_heads, c.head_dim)  # (B, T, nkv, hs)
        v = self.v_proj(x).view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        if c.pe == "rope":  # before the transpose, on contiguous memory
            q, k = self.rotate(q), self.rotate(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, nh, T, hs), (B, nkv, T, hs)
        group = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, is_causal=causal)  # (B, nh, T, hs)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, c.num_heads * c.head_dim))


class FeedForward(nn.Module):
    """GELU MLP or SwiGLU (``down(silu(gate(x)) * up(x))``)."""

    def __init__(self, config: ReferenceConfig):
        super().__init__()
        c = config
        self.swiglu = c.mlp == "swiglu"
        self.up_proj = nn.Linear(c.width, c.mlp_hidden, bias=c.bias)
        self.gate_proj = nn.Linear(c.width, c.mlp_hidden, bias=c.bias) if self.swiglu else None
        self.down_proj = nn.Linear(c.mlp_hidden, c.width, bias=c.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.silu(self.gate_proj(x)) * self.up_proj(x) if self.swiglu else F.gelu(self.up_proj(x))
        return self.down_proj(hidden)


class Block(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + ffn(norm(x))``."""

    def __init__(self, config: ReferenceConfig):
        super().__init__()
        self.attn_norm = _norm(config)
        self.attn = Attention(config)
        self.mlp_norm = _norm(config)
        self.mlp = FeedForward(config)

    def forward(self, x: torch.Tensor, causal: bool, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), causal, key_mask)
        return x + self.mlp(self.mlp_norm(x))


class ReferenceTransformer(nn.Module):
    """The reference Transformer. ``forward`` takes ``images`` (B, C, H, W) or ``input_ids`` (B, T)
    (and optionally an ``attention_mask``) and returns logits: (B, num_classes) for
    classification, (B, T, vocab_size) for LM."""

    def __init__(self, config: ReferenceConfig):
        super().__init__()
        self.config = c = config
        if c.task == "image_classification":
            self.patch_embed = nn.Linear(c.in_channels * c.patch_size**2, c.width)
            self.cls_token = nn.Parameter(torch.zeros(1, 1, c.width))
        else:
            self.token_embed = nn.Embedding(c.vocab_size, c.width)
        if c.pe == "learned":
            self.pos_embed = nn.Parameter(torch.randn(c.max_positions, c.width) * 0.02)
        elif c.pe == "sinusoidal":
            self.register_buffer("pos_table", sinusoidal_table(c.max_positions, c.width), persistent=False)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.depth))
        self.norm = _norm(c)
        self.head = nn.Linear(c.width, c.vocab_size if c.task == "causal_lm" else c.num_classes, bias=c.bias)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=1 / math.sqrt(module.in_features))
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=1.0)

    def embed(self, images: torch.Tensor | None = None, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings plus any additive position encoding, shape (B, T, d)."""
        c = self.config
        if c.task == "image_classification":
            if images is None:
                raise ValueError("an image classifier needs images of shape (B, C, H, W)")
            patches = F.unfold(images, kernel_size=c.patch_size, stride=c.patch_size).transpose(1, 2)  # (B, N, C*p*p)
            x = self.patch_embed(patches)
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)  # (B, N+1, d)
        else:
            if input_ids is None:
                raise ValueError("a text model needs input_ids of shape (B, T)")
            x = self.token_embed(input_ids)  # (B, T, d)
        T = x.shape[1]
        if T > c.max_positions:
            raise ValueError(f"sequence of {T} tokens exceeds max_positions={c.max_positions}")
        if c.pe == "learned":
            x = x + self.pos_embed[:T]
        elif c.pe == "sinusoidal":
            x = x + self.pos_table[:T].to(x.dtype)
        return x

    def forward(
        self,
        images: torch.Tensor | None = None,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits. ``attention_mask`` (B, T), 1 for real tokens, hides padding from a classifier."""
        x = self.embed(images, input_ids)
        causal = self.config.task == "causal_lm"
        key_mask = None
        if attention_mask is not None and not causal:
            key_mask = attention_mask[:, None, None, :].bool()  # (B, 1, 1, T): which keys to attend
        for block in self.blocks:
            x = block(x, causal, key_mask)
        x = self.norm(x)
        return self.head(x if causal else x[:, 0])
