"""Named model variants: tiny ones for tests, demos and ``configs/debug`` (like timm's ``test_vit``).

``create_model(name, data=info, **overrides)`` builds a variant with random weights, sized to a
data set's :class:`~lmc.tasks.DataInfo`; overrides replace config fields. No weights are
downloaded: HF and timm models are built from configs.

Each family reads a :class:`~lmc.tasks.DataInfo` in one place: a small function mapping it to
that family's config fields (``_reference_fields``, ``_gpt_fields``, ``_encoder_fields``,
``_timm_fields``, ``_vit_fields``), which also refuses data of a task the family cannot do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lmc.models.reference import ReferenceConfig, ReferenceTransformer
from lmc.tasks import DataInfo, Task

#: A model factory: ``(data, overrides) -> model`` with freshly initialized weights.
ModelFactory = Callable[[DataInfo | None, dict[str, Any]], nn.Module]

_MODELS: dict[str, ModelFactory] = {}


def register_model(name: str) -> Callable[[ModelFactory], ModelFactory]:
    """Function decorator: register a model factory under ``name``.

    A factory takes ``(data, overrides)``: the :class:`~lmc.tasks.DataInfo` of the data set to
    fit (``None``: the family's defaults) and a dict of config fields to override, and returns
    the model with freshly initialized weights.
    """

    def decorate(factory: ModelFactory) -> ModelFactory:
        if name in _MODELS:
            raise ValueError(f"a model named {name!r} is already registered")
        _MODELS[name] = factory
        return factory

    return decorate


def list_models() -> list[str]:
    """Names of every registered model variant."""
    return sorted(_MODELS)


def create_model(
    name: str, dtype: torch.dtype = torch.float32, data: DataInfo | None = None, **overrides: Any
) -> nn.Module:
    """Build a named variant in evaluation mode.

    Args:
        name: A name from :func:`list_models`.
        dtype: Parameter dtype (tests use ``torch.float64``).
        data: The data set's :class:`~lmc.tasks.DataInfo` (a DataModule's ``info``): the model
            is sized to fit it (classes or vocabulary, image size, sequence length). Explicit
            ``overrides`` win.
        **overrides: Config fields to change, e.g. ``pe="rope"`` or ``num_kv_heads=2``.
    """
    if name not in _MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(list_models())}")
    if data is not None and not isinstance(data, DataInfo):
        raise TypeError(f"data must be a DataInfo (a DataModule's .info), got {type(data).__name__}")
    return _MODELS[name](data, overrides).to(dtype).eval()


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


def _check_task(family: str, data: DataInfo, tasks: tuple[Task, ...]) -> None:
    if data.task not in tasks:
        raise ValueError(f"{family} models take {' or '.join(tasks)} data, not {data.task} data")


def _reference_fields(data: DataInfo) -> dict[str, Any]:
    """The reference Transformer does every task (text classification as ``sequence_classification``)."""
    if data.task == "image_classification":
        fields = {"image_size": data.image_size, "in_channels": data.in_channels}
        return {"task": "image_classification", "num_classes": data.num_classes, **fields}
    task = "sequence_classification" if data.task == "text_classification" else "causal_lm"
    fields = {"num_classes": data.num_classes, "vocab_size": data.vocab_size, "max_positions": data.sequence_length}
    return {"task": task, **fields}


def _gpt_fields(positions: str) -> Callable[[DataInfo], dict[str, Any]]:
    """Decoder language models (GPT-2, Llama-like, GPT-NeoX); ``positions`` names their context-length field."""

    def fields(data: DataInfo) -> dict[str, Any]:
        _check_task("decoder language", data, ("causal_lm",))
        return {"vocab_size": data.vocab_size, positions: data.sequence_length}

    return fields


def _encoder_fields(data: DataInfo) -> dict[str, Any]:
    """Encoder classifiers (BERT, RoFormer)."""
    _check_task("encoder", data, ("text_classification",))
    return {
        "vocab_size": data.vocab_size,
        "num_labels": data.num_classes,
        "max_position_embeddings": data.sequence_length,
    }


def _masked_lm_fields(data: DataInfo) -> dict[str, Any]:
    """BERT pre-training models (masked LM, next sentence): lmc has no such task to size them by."""
    raise ValueError(
        f"BERT masked-LM and pre-training models take no data set ({data.task} data given): lmc aligns and compares "
        "them but trains and evaluates no masked-LM task; build them from their config (vocab_size=...)"
    )


def _timm_fields(data: DataInfo) -> dict[str, Any]:
    """timm vision Transformers."""
    _check_task("timm vision", data, ("image_classification",))
    return {"img_size": data.image_size, "in_chans": data.in_channels, "num_classes": data.num_classes}


def _vit_fields(data: DataInfo) -> dict[str, Any]:
    """Hugging Face ViT image classifiers."""
    _check_task("ViT", data, ("image_classification",))
    return {"image_size": data.image_size, "num_channels": data.in_channels, "num_labels": data.num_classes}


def _config(
    data: DataInfo | None,
    overrides: dict[str, Any],
    defaults: dict[str, Any],
    fields: Callable[[DataInfo], dict[str, Any]],
) -> dict[str, Any]:
    """Config = family defaults, then what the data set dictates (its set fields), then user overrides."""
    dictated = {} if data is None else {k: v for k, v in fields(data).items() if v is not None}
    return {**defaults, **dictated, **overrides}


def _reference(defaults: dict[str, Any]) -> ModelFactory:
    def factory(data: DataInfo | None, overrides: dict[str, Any]) -> nn.Module:
        config = _config(data, overrides, defaults, _reference_fields)
        if config.get("task") == "image_classification":
            patches = (config.get("image_size", 8) // config.get("patch_size", 2)) ** 2
            config.setdefault("max_positions", patches + 1)
        return ReferenceTransformer(ReferenceConfig(**config))

    return factory


def _hf(
    config_class: str, model_class: str, defaults: dict[str, Any], fields: Callable[[DataInfo], dict[str, Any]]
) -> ModelFactory:
    def factory(data: DataInfo | None, overrides: dict[str, Any]) -> nn.Module:
        import transformers

        config = getattr(transformers, config_class)(**_config(data, overrides, defaults, fields))
        return getattr(transformers, model_class)(config)

    return factory


def _timm(architecture: str, defaults: dict[str, Any]) -> ModelFactory:
    def factory(data: DataInfo | None, overrides: dict[str, Any]) -> nn.Module:
        import timm

        return timm.create_model(architecture, pretrained=False, **_config(data, overrides, defaults, _timm_fields))

    return factory


_TINY = dict(width=32, depth=2, num_heads=4)
_PAPER = dict(width=256, depth=6, num_heads=4)  # the paper's 6-layer, 4-head ViT / BERT
_NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
_BERT_TINY = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    vocab_size=64,
    max_position_embeddings=32,
    **_NO_DROPOUT,
)
_GPT2 = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
_LLAMA_TINY = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    vocab_size=64,
    max_position_embeddings=32,
    bos_token_id=0,
    eos_token_id=0,
)
_VIT = dict(img_size=8, patch_size=2, in_chans=1, num_classes=10)

_FAMILIES: dict[str, ModelFactory] = {
    # Tiny variants: tests, demos and configs/debug.
    "reference-tiny": _reference(dict(task="causal_lm", vocab_size=64, max_positions=32, **_TINY)),
    "reference-vit-tiny": _reference(dict(task="image_classification", image_size=8, patch_size=2, **_TINY)),
    "reference-bert-tiny": _reference(
        dict(task="sequence_classification", vocab_size=64, max_positions=32, num_classes=4, **_TINY)
    ),
    "gpt2-tiny": _hf(
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=32, **_GPT2),
        _gpt_fields("n_positions"),
    ),
    "bert-tiny": _hf("BertConfig", "BertForSequenceClassification", dict(_BERT_TINY, num_labels=4), _encoder_fields),
    # MultiBERTs' heads: masked LM (decoder tied to the word embeddings), and with next-sentence prediction.
    "bert-mlm-tiny": _hf("BertConfig", "BertForMaskedLM", _BERT_TINY, _masked_lm_fields),
    "bert-pretraining-tiny": _hf("BertConfig", "BertForPreTraining", _BERT_TINY, _masked_lm_fields),
    "roformer-tiny": _hf(
        "RoFormerConfig",
        "RoFormerForSequenceClassification",
        dict(
            hidden_size=32,
            embedding_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            vocab_size=64,
            max_position_embeddings=32,
            num_labels=4,
            **_NO_DROPOUT,
        ),
        _encoder_fields,
    ),
    "llama-tiny": _hf("LlamaConfig", "LlamaForCausalLM", _LLAMA_TINY, _gpt_fields("max_position_embeddings")),
    # Llama-like decoders (lmc.adapters.decoders): a window shorter than the 16-token probe, so that it masks.
    "mistral-tiny": _hf(
        "MistralConfig",
        "MistralForCausalLM",
        dict(_LLAMA_TINY, sliding_window=4),
        _gpt_fields("max_position_embeddings"),
    ),
    "qwen2-tiny": _hf("Qwen2Config", "Qwen2ForCausalLM", _LLAMA_TINY, _gpt_fields("max_position_embeddings")),
    # Per-head RMSNorms on queries and keys (q_norm, k_norm); Qwen3's head_dim is a field of its own.
    "qwen3-tiny": _hf(
        "Qwen3Config", "Qwen3ForCausalLM", dict(_LLAMA_TINY, head_dim=8), _gpt_fields("max_position_embeddings")
    ),
    # RMSNorms on the sublayers' outputs only, and over the whole query and key rows (q_norm, k_norm).
    "olmo2-tiny": _hf("Olmo2Config", "Olmo2ForCausalLM", _LLAMA_TINY, _gpt_fields("max_position_embeddings")),
    # (1 + w) RMSNorms, embeddings scaled by sqrt(d), GeGLU, tied head; Gemma 2 adds sublayer output norms,
    # soft-capped attention and final logits and a window (shorter than the probe) on alternating layers.
    "gemma-tiny": _hf(
        "GemmaConfig", "GemmaForCausalLM", dict(_LLAMA_TINY, head_dim=8), _gpt_fields("max_position_embeddings")
    ),
    "gemma2-tiny": _hf(
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(_LLAMA_TINY, head_dim=8, sliding_window=4, attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
        _gpt_fields("max_position_embeddings"),
    ),
    # Fused [Q | K | V] rows with GQA and fused [gate | up]; half of each head rotary.
    "phi3-tiny": _hf(
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(_LLAMA_TINY, pad_token_id=0, partial_rotary_factor=0.5),
        _gpt_fields("max_position_embeddings"),
    ),
    # Pythia's layout: fused per-head QKV, half of each head rotary, parallel residual (the config's default).
    "gpt-neox-tiny": _hf(
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            vocab_size=64,
            max_position_embeddings=32,
            rotary_pct=0.5,
            bos_token_id=0,
            eos_token_id=0,
        ),
        _gpt_fields("max_position_embeddings"),
    ),
    # transformers' own ViT (not timm's): separate q/k/v/o_proj, a Conv2d patch projection.
    "hf-vit-tiny": _hf(
        "ViTConfig",
        "ViTForImageClassification",
        dict(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            image_size=8,
            patch_size=2,
            num_channels=1,
            num_labels=10,
            **_NO_DROPOUT,
        ),
        _vit_fields,
    ),
    "vit-tiny": _timm("vit_tiny_patch16_224", dict(embed_dim=32, depth=2, num_heads=4, **_VIT)),
    "rope-vit-tiny": _timm("vit_base_patch16_rope_224", dict(embed_dim=32, depth=2, num_heads=4, **_VIT)),
    "eva02-tiny": _timm("eva02_tiny_patch14_224", dict(embed_dim=32, depth=2, num_heads=4, **_VIT)),
    # The paper's settings (6 layers, 4 heads), sized to the data by ``data``.
    "reference-vit": _reference(dict(task="image_classification", patch_size=2, **_PAPER)),
    "reference-bert": _reference(dict(task="sequence_classification", max_positions=128, **_PAPER)),
    "reference-gpt": _reference(dict(task="causal_lm", max_positions=256, **_PAPER)),
    "vit": _timm("vit_tiny_patch16_224", dict(embed_dim=256, depth=6, num_heads=4, patch_size=4)),
    "rope-vit": _timm("vit_base_patch16_rope_224", dict(embed_dim=256, depth=6, num_heads=4, patch_size=4)),
    "gpt2": _hf(
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(n_embd=256, n_layer=6, n_head=4, n_positions=256, **_GPT2),
        _gpt_fields("n_positions"),
    ),
    "llama": _hf(
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            hidden_size=256,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=688,
            max_position_embeddings=256,
            bos_token_id=0,
            eos_token_id=0,
        ),
        _gpt_fields("max_position_embeddings"),
    ),
    "bert": _hf(
        "BertConfig",
        "BertForSequenceClassification",
        dict(
            hidden_size=256,
            num_hidden_layers=6,
            num_attention_heads=4,
            intermediate_size=1024,
            max_position_embeddings=128,
            **_NO_DROPOUT,
        ),
        _encoder_fields,
    ),
    "roformer": _hf(
        "RoFormerConfig",
        "RoFormerForSequenceClassification",
        dict(
            hidden_size=256,
            embedding_size=256,
            num_hidden_layers=6,
            num_attention_heads=4,
            intermediate_size=1024,
            max_position_embeddings=128,
            **_NO_DROPOUT,
        ),
        _encoder_fields,
    ),
}
for _name, _factory in _FAMILIES.items():
    register_model(_name)(_factory)
