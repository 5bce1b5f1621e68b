"""Tiny Hugging Face model directories and timm checkpoints, written in the test (nothing is downloaded)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from lmc.adapters import scope_parameters
from lmc.models import create_model, randomize_parameters_
from lmc.symmetry import SCOPES

WORDS = "the a cat dog sat ran on under mat log red blue big small and".split()
SPECIAL = ["[PAD]", "[UNK]", "[EOS]"]
BERT_SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]

# test id -> (zoo name, config overrides); every one of lmc's HF and timm families.
HF_MODELS = {
    "gpt2": ("gpt2-tiny", {}),
    "bert": ("bert-tiny", {}),
    "bert-mlm": ("bert-mlm-tiny", {}),
    "bert-pretraining": ("bert-pretraining-tiny", {}),
    "roformer": ("roformer-tiny", {}),
    "roformer-projected": ("roformer-tiny", {"embedding_size": 16}),  # embeddings_project: a space of its own
    "llama-gqa": ("llama-tiny", {"attention_bias": True}),
    "llama-gqa-tied": ("llama-tiny", {"tie_word_embeddings": True}),
    "mistral-swa": ("mistral-tiny", {}),
    "qwen2-gqa": ("qwen2-tiny", {}),
    "qwen3-gqa": ("qwen3-tiny", {}),  # per-head q_norm, k_norm
    "olmo2-gqa": ("olmo2-tiny", {}),  # full-width q_norm, k_norm: each head's gain slices move with it
    "phi3-partial": ("phi3-tiny", {}),  # fused [Q | K | V] and [gate | up]
    "gemma-gqa": ("gemma-tiny", {}),  # (1 + w) RMSNorms, scaled embeddings, GeGLU, tied head
    "gemma2-capped": ("gemma2-tiny", {}),  # soft-capping, sublayer output norms, tied head
    "hf-vit": ("hf-vit-tiny", {}),
    "gpt-neox-parallel": ("gpt-neox-tiny", {}),  # its files store lm_head.weight as embed_out.weight
    "gpt-neox-sequential": ("gpt-neox-tiny", {"use_parallel_residual": False, "rotary_pct": 1.0}),
}
# The checkpoints researchers compare, added after lmc's first HF families (EARLIER_FAMILIES): Pythia
# (both residual forms), MultiBERTs (both heads), Mistral, Qwen2, Qwen3, OLMo-2, Phi-3, Gemma, Gemma 2, HF ViT.
EARLIER_FAMILIES = ("gpt2", "bert", "roformer", "roformer-projected", "llama-gqa", "llama-gqa-tied")
ADDED_FAMILIES = [key for key in HF_MODELS if key not in EARLIER_FAMILIES]
TIMM_MODELS = {"vit": ("vit-tiny", {}), "eva02": ("eva02-tiny", {})}
# Functionally equal float32 models agree to float32 rounding (observed ~1e-6 relative).
FLOAT32_RTOL, FLOAT32_ATOL = 1e-4, 1e-5


def model(name: str, overrides: dict, seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A tiny model with non-trivial random weights (randomized in float64, stored in ``dtype``)."""
    built = create_model(name, dtype=torch.float64, **overrides)
    return randomize_parameters_(built, seed=seed, scale=0.5).to(dtype).eval()


def at_every_scope(keys: list[str]) -> list:
    """``(key, scope)`` parameters for every key and every scope of :data:`lmc.symmetry.SCOPES`; all but
    ``full_model`` are marked ``slow`` (CI runs them, ``make test-fast`` leaves them out)."""
    return [
        pytest.param(key, scope, marks=() if scope == "full_model" else pytest.mark.slow)
        for key in keys
        for scope in SCOPES
    ]


def fine_tuned_pair(
    name: str, overrides: dict, scope: str, dtype: torch.dtype = torch.float32
) -> tuple[nn.Module, nn.Module]:
    """Two models as two fine-tunings of one pre-trained model re-initialized at ``scope`` would be:
    equal outside the scope's parameters, independently random inside them (seeds 0 and 1)."""
    source = model(name, overrides, seed=0, dtype=dtype)
    target = copy.deepcopy(source)
    fresh = dict(model(name, overrides, seed=1, dtype=dtype).named_parameters())
    inside = set(scope_parameters(source, scope))
    with torch.no_grad():
        for parameter_name, parameter in target.named_parameters():
            if parameter_name in inside:
                parameter.copy_(fresh[parameter_name])
    return source, target


def save_tokenizer(folder: Path) -> None:
    """A word-level tokenizer of :data:`WORDS` (ids below 64, the tiny models' vocabulary) saved into ``folder``."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocabulary = {word: index for index, word in enumerate(SPECIAL + WORDS)}
    backend = Tokenizer(WordLevel(vocabulary, unk_token="[UNK]"))
    backend.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]"
    )
    tokenizer.save_pretrained(str(folder))


def save_bert_tokenizer(folder: Path) -> None:
    """A BERT tokenizer of :data:`WORDS` ([CLS] ... [SEP], a [MASK] token; ids below 64) saved into ``folder``."""
    from transformers import BertTokenizer

    vocabulary = {word: index for index, word in enumerate(BERT_SPECIAL + WORDS)}
    BertTokenizer(vocab=vocabulary).save_pretrained(str(folder))


def save_hf(network: nn.Module, folder: Path, tokenizer: bool = True, max_shard_size: str | None = None) -> Path:
    network.save_pretrained(str(folder), **({} if max_shard_size is None else {"max_shard_size": max_shard_size}))
    if tokenizer:
        save_tokenizer(folder)
    return folder


def save_timm(network: nn.Module, folder: Path) -> Path:
    from timm.models import save_for_hf

    save_for_hf(network, str(folder), safe_serialization=True)
    return folder


def sentences(count: int, seed: int = 0) -> list[str]:
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(WORDS), (count, 7), generator=generator)
    return [" ".join(WORDS[i] for i in row) for row in picks.tolist()]
