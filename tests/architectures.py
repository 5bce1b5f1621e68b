"""The architectures every symmetry test runs on: tiny float64 models with random weights."""

from __future__ import annotations

import torch
from torch import nn

from lmc.models import create_model, randomize_parameters_

# test id -> (zoo name, config overrides)
ARCHITECTURES: dict[str, tuple[str, dict]] = {
    "ref-vit-learned": ("reference-vit-tiny", {}),
    "ref-vit-rope-interleaved": ("reference-vit-tiny", {"pe": "rope", "rope_layout": "interleaved"}),
    "ref-lm-none": ("reference-tiny", {"pe": "none"}),
    "ref-bert-sinusoidal": ("reference-bert-tiny", {"pe": "sinusoidal"}),
    "ref-lm-rope-half-gqa-swiglu-rms-nobias": (
        "reference-tiny",
        {"pe": "rope", "rope_layout": "half", "num_kv_heads": 2, "mlp": "swiglu", "norm": "rmsnorm", "bias": False},
    ),
    "ref-lm-rope-partial": ("reference-tiny", {"pe": "rope", "rope_layout": "interleaved", "rotary_fraction": 0.5}),
    "gpt2": ("gpt2-tiny", {}),
    "bert": ("bert-tiny", {}),
    "bert-mlm": ("bert-mlm-tiny", {}),  # decoder tied to the word embeddings: the transform is on the stream
    "bert-mlm-untied": ("bert-mlm-tiny", {"tie_word_embeddings": False}),  # the transform's units permute alone
    "bert-pretraining": ("bert-pretraining-tiny", {}),  # masked LM and next sentence (on the tanh pooler)
    "roformer": ("roformer-tiny", {}),
    "roformer-projected": ("roformer-tiny", {"embedding_size": 16}),  # embeddings_project: a space of its own
    "llama-gqa": ("llama-tiny", {"attention_bias": True}),
    "mistral-swa": ("mistral-tiny", {}),  # sliding window 4 < the 16-token probe
    "qwen2-gqa": ("qwen2-tiny", {}),  # biases on q, k, v
    "qwen3-gqa": ("qwen3-tiny", {"attention_bias": True}),  # per-head q_norm, k_norm; biases before them
    "olmo2-gqa": ("olmo2-tiny", {"attention_bias": True}),  # full-width q_norm, k_norm; sublayer output norms only
    "gemma-gqa": ("gemma-tiny", {}),  # (1 + w) RMSNorms, scaled embeddings, GeGLU, tied head
    "gemma2-capped": ("gemma2-tiny", {"attention_bias": True}),  # soft-capping, sublayer output norms, windows
    "phi3-partial": ("phi3-tiny", {}),  # fused [Q | K | V] with GQA, fused [gate | up], half of each head rotary
    "gpt-neox-parallel": ("gpt-neox-tiny", {}),  # fused per-head QKV, rotary_pct 0.5, parallel residual
    "gpt-neox-sequential": ("gpt-neox-tiny", {"use_parallel_residual": False, "rotary_pct": 1.0}),
    "hf-vit": ("hf-vit-tiny", {}),  # transformers' ViTForImageClassification
    "hf-vit-nobias": ("hf-vit-tiny", {"qkv_bias": False, "head_dim": 4}),  # attention narrower than the stream
    "timm-vit": ("vit-tiny", {}),
    "timm-vit-reg": ("vit-tiny", {"reg_tokens": 3}),  # register tokens with their pos_embed rows, after the class's
    "timm-rope-vit": ("rope-vit-tiny", {}),
    "timm-eva02": ("eva02-tiny", {}),
}
DECODERS = [
    "llama-gqa",
    "mistral-swa",
    "qwen2-gqa",
    "qwen3-gqa",
    "olmo2-gqa",
    "gemma-gqa",
    "gemma2-capped",
    "phi3-partial",
]  # lmc.adapters.decoders with RMSNorms
# RMSNorms on queries and keys, per head or full width: C is a sign flip (tests/symmetry/test_qwen3.py, test_olmo2.py)
QK_NORM = ["qwen3-gqa", "olmo2-gqa"]
GPT_NEOX = ["gpt-neox-parallel", "gpt-neox-sequential"]  # lmc.adapters.decoders with LayerNorms
ROPE = [
    key
    for key in ARCHITECTURES
    if "rope" in key or key in ("roformer", "roformer-projected", "timm-eva02", *DECODERS, *GPT_NEOX)
]
APE = [key for key in ARCHITECTURES if key not in ROPE]
GQA = ["ref-lm-rope-half-gqa-swiglu-rms-nobias", *DECODERS]

# HF's RMSNorms (Llama, Mistral, Qwen2, Qwen3, OLMo-2, Gemma, Gemma 2, Phi-3) normalize in float32 even in a
# float64 model, so equal functions agree only to float32 rounding after each norm (observed ~2e-7);
# every other model to ~1e-15, and so do the decoders with their norms computed in float64
# (tests/symmetry/test_decoders.py).
OUTPUT_RTOL = {key: 2e-6 for key in DECODERS}
DEFAULT_OUTPUT_RTOL = 1e-9

# The bound of every float64 exactness claim of the symmetry and matching tests (a symmetry keeps
# the function, a planted element is recovered): equal functions and recovered weights agree to
# float64 rounding, at most 1.3e-15 relative on these models (measured), so 1e-12 leaves a factor
# of about 1000 for rounding and none for a real error (one entry off by 1e-10 already fails).
FLOAT64_RTOL = 1e-12


def build(key: str, seed: int = 0) -> nn.Module:
    """The architecture ``key`` in float64 with non-trivial random weights."""
    name, overrides = ARCHITECTURES[key]
    return randomize_parameters_(create_model(name, dtype=torch.float64, **overrides), seed=seed)


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / a.detach().norm())


def float64_rms_norm(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """HF's RMSNorm without its cast to float32: the same function, computed in the input's dtype."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def float64_gemma_rms_norm(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Gemma's RMSNorm (gain ``1 + w``) without its cast to float32."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return hidden_states * torch.rsqrt(variance + self.eps) * (1.0 + self.weight)


def float64_norms(network: nn.Module, monkeypatch) -> None:
    """HF's RMSNorms in ``network`` computed in its own dtype for this test: they cast to float32 even in a
    float64 model (:data:`OUTPUT_RTOL`), so that equal functions would agree to float32 rounding only."""
    hf_norms = {type(m) for m in network.modules() if type(m).__module__.startswith("transformers.")}
    for norm in {norm for norm in hf_norms if norm.__name__.endswith("RMSNorm")}:
        forward = float64_gemma_rms_norm if norm.__name__.startswith("Gemma") else float64_rms_norm
        monkeypatch.setattr(norm, "forward", forward)
