"""Named model variants: tiny ones for tests, demos and ``configs/debug`` (like timm's ``test_vit``).

``create_model(name, **overrides)`` builds a variant with random weights; overrides replace
config fields. No weights are downloaded: HF and timm models are built from configs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lmc.models.reference import ReferenceConfig, ReferenceTransformer

_MODELS: dict[str, Callable[..., nn.Module]] = {}


def register_model(name: str) -> Callable[[Callable[..., nn.Module]], Callable[..., nn.Module]]:
    """Function decorator: register a model factory under ``name``."""

    def decorate(factory: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        if name in _MODELS:
            raise ValueError(f"a model named {name!r} is already registered")
        _MODELS[name] = factory
        return factory

    return decorate


def list_models() -> list[str]:
    """Names of every registered model variant."""
    return sorted(_MODELS)


def create_model(name: str, dtype: torch.dtype = torch.float32, **overrides: Any) -> nn.Module:
    """Build a named variant in evaluation mode.

    Args:
        name: A name from :func:`list_models`.
        dtype: Parameter dtype (tests use ``torch.float64``).
        **overrides: Config fields to change, e.g. ``pe="rope"`` or ``num_kv_heads=2``.
    """
    if name not in _MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(list_models())}")
    return _MODELS[name](**overrides).to(dtype).eval()


@torch.no_grad()
def randomize_parameters_(model: nn.Module, seed: int = 0, scale: float = 1.0) -> nn.Module:
    """Give every trainable parameter non-trivial random values, in place.

    Default inits leave biases at 0, norm gains at 1 and attention near uniform, which makes
    symmetry checks nearly vacuous. Matrices get ``N(0, scale / fan_in)``; vectors (biases,
    norms, layer scales) get ``N(0, 1)`` around 1 for gains and 0 otherwise, times ``scale``.
    Frozen tables (``requires_grad=False``, e.g. RoFormer's sinusoids) are left alone.
    """
    generator = torch.Generator().manual_seed(seed)
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float64)
        if parameter.ndim >= 2 and not name.endswith(("cls_token", "reg_token", "pos_embed")):
            fan_in = parameter[0].numel() if parameter.ndim > 2 else parameter.shape[-1]
            value = noise * (scale / fan_in) ** 0.5
        else:
            is_gain = name.endswith(("norm.weight", "LayerNorm.weight", "ln_1.weight", "ln_2.weight", "ln_f.weight"))
            is_gain |= name.endswith(("layernorm.weight", "gamma", "gamma_1", "gamma_2"))
            value = noise * 0.5 * scale + (1.0 if is_gain else 0.0)
        parameter.copy_(value)
    return model


def _reference(defaults: dict[str, Any], overrides: dict[str, Any]) -> ReferenceTransformer:
    return ReferenceTransformer(ReferenceConfig(**{**defaults, **overrides}))


@register_model("reference-tiny")
def reference_tiny(**overrides: Any) -> nn.Module:
    """Causal LM, width 32, 2 blocks, 4 heads of 8."""
    return _reference(
        dict(task="causal_lm", width=32, depth=2, num_heads=4, vocab_size=64, max_positions=32), overrides
    )


@register_model("reference-vit-tiny")
def reference_vit_tiny(**overrides: Any) -> nn.Module:
    """ViT-style classifier of 8x8 grey images (the embedded digits), 2x2 patches."""
    defaults = dict(
        task="image_classification", width=32, depth=2, num_heads=4, image_size=8, patch_size=2, max_positions=17
    )
    return _reference(defaults, overrides)


@register_model("reference-bert-tiny")
def reference_bert_tiny(**overrides: Any) -> nn.Module:
    """BERT-style sequence classifier (classifies the first token)."""
    defaults = dict(
        task="sequence_classification", width=32, depth=2, num_heads=4, vocab_size=64, max_positions=32, num_classes=4
    )
    return _reference(defaults, overrides)


@register_model("gpt2-tiny")
def gpt2_tiny(**overrides: Any) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = dict(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(GPT2Config(**{**config, **overrides}))


@register_model("bert-tiny")
def bert_tiny(**overrides: Any) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=64)
    config.update(max_position_embeddings=32, num_labels=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(BertConfig(**{**config, **overrides}))


@register_model("roformer-tiny")
def roformer_tiny(**overrides: Any) -> nn.Module:
    from transformers import RoFormerConfig, RoFormerForSequenceClassification

    config = dict(hidden_size=32, embedding_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    config.update(
        vocab_size=64,
        max_position_embeddings=32,
        num_labels=4,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return RoFormerForSequenceClassification(RoFormerConfig(**{**config, **overrides}))


@register_model("llama-tiny")
def llama_tiny(**overrides: Any) -> nn.Module:
    """Llama with grouped-query attention: 4 query heads share 2 KV heads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64
    )
    config.update(vocab_size=64, max_position_embeddings=32, bos_token_id=0, eos_token_id=0)
    return LlamaForCausalLM(LlamaConfig(**{**config, **overrides}))


@register_model("vit-tiny")
def vit_tiny(**overrides: Any) -> nn.Module:
    """timm ``VisionTransformer`` (fused qkv, learned APE) on 8x8 grey images."""
    import timm

    config = dict(img_size=8, patch_size=2, in_chans=1, embed_dim=32, depth=2, num_heads=4, num_classes=10)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, **{**config, **overrides})


@register_model("rope-vit-tiny")
def rope_vit_tiny(**overrides: Any) -> nn.Module:
    """timm RoPE ViT (``Eva``, 2-D axial RoPE, class token unrotated) on 8x8 grey images."""
    import timm

    config = dict(img_size=8, patch_size=2, in_chans=1, embed_dim=32, depth=2, num_heads=4, num_classes=10)
    return timm.create_model("vit_base_patch16_rope_224", pretrained=False, **{**config, **overrides})


@register_model("eva02-tiny")
def eva02_tiny(**overrides: Any) -> nn.Module:
    """timm EVA-02 (``EvaAttention`` with separate q/v biases, gated MLP, APE plus 2-D RoPE)."""
    import timm

    config = dict(img_size=8, patch_size=2, in_chans=1, embed_dim=32, depth=2, num_heads=4, num_classes=10)
    return timm.create_model("eva02_tiny_patch14_224", pretrained=False, **{**config, **overrides})
