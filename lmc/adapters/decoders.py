"""Llama-like decoder families as data: one :class:`DecoderLayout` per family, one generic adapter.

A family that differs from Llama only in names, biases, norms, the FFN, the QKV storage or the
RoPE layout is a :class:`DecoderLayout` (where its modules sit, which projections have biases,
the norm kind, the pair layout and rotary fraction) and a short adapter class; the symmetry spec
is generic code over the declaration (docs/spec.md, section 2; docs/extending.md shows one):

- Llama rotates ``rotate_half`` pairs after any bias, before repeating KV heads (GQA);
- Mistral is Llama with a sliding-window mask, which acts on positions and leaves the group
  unchanged (docs/spec.md, section 2, "Masks");
- Qwen2 is Llama with biases on q, k and v (none on o), which move with the group;
- Qwen3 is Llama with a per-head RMSNorm on queries and on keys before RoPE (``q_norm``/``k_norm``,
  one gain of width ``head_dim`` shared by every head), which leaves ``C`` only sign flips of its
  rotary pairs (docs/spec.md, section 2, "Per-head QK-norm"); V/O keeps ``GL(d_h)``;
- Gemma is Llama with a ``(1 + w)`` RMSNorm gain, embeddings scaled by ``sqrt(d)`` and GeGLU: the
  same group (a gain ``1 + w`` permutes as ``w`` does, a constant scale commutes); Gemma 2 adds
  norms on each sublayer's output (on residual coordinates, so they permute with the stream),
  soft-capped attention logits and final logits (injective maps of each score and logit: the group
  is unchanged) and windows on alternating layers (docs/spec.md, section 2, "Other variants");
- OLMo-2 is Llama with its norms moved onto the sublayers' outputs (``post_attention_layernorm``,
  ``post_feedforward_layernorm``; the sublayers read the stream itself) and an RMSNorm over the whole
  query row and the whole key row before RoPE (``q_norm``/``k_norm``, gains of widths ``h d_h`` and
  ``h_kv d_h``): ``C`` is again a sign flip of each rotary pair, and each head's gain slices move with
  the head permutation and with nothing else (``AttentionSpec.query_gain``/``key_gain``; docs/spec.md,
  section 2, "Full-width QK-norm"); V/O keeps ``GL(d_h)`` and the residual group is Llama's;
- Phi-3 is Llama with q, k and v fused in one Linear as ``[Q | K | V]`` blocks (GQA: ``h``, ``h_kv``,
  ``h_kv`` heads) and gate and up fused as ``[gate | up]`` (two stacked copies of the hidden units),
  with optional partial rotary (``partial_rotary_factor``): the same group as Llama's, or GPT-NeoX's
  block-diagonal one under partial rotary;
- GPT-NeoX (Pythia) fuses q, k, v in one Linear, per head ``[q | k | v]``, rotates only the first
  ``rotary_pct`` of each head's coordinates (``rotate_half`` within them), has LayerNorms with
  biases, a GELU FFN and, by default, a parallel residual ``x + attn(ln1 x) + mlp(ln2 x)``. Both
  residual forms have the same group: the sublayers read the stream only through norms, which
  move with its permutation (docs/spec.md, section 2, "Partial rotary and GPT-NeoX").
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from lmc.adapters.base import UnsupportedModelError, register_adapter
from lmc.adapters.huggingface import CausalLMAdapter, token_inputs
from lmc.adapters.layout import (
    ParameterIndex,
    block_fused_attention,
    linear_attention,
    linear_feed_forward,
    per_head_fused_attention,
    require_class,
    rotary_from_cos_sin,
)
from lmc.rotary import PairLayout, rotary_pairs
from lmc.symmetry.spec import AxisPermutation, BlockSpec, FixedAxes, HeadSlot, RotaryLayout, SymmetrySpec

#: Whether a family's Linears have a bias: always (``True``), never (``False``) or as a config field says (its name).
BiasRule = bool | str


@dataclass(frozen=True)
class DecoderLayout:
    """Where a Llama-like decoder keeps its parameters, and what its family varies.

    The adapter reads the number of layers, heads and KV heads (GQA) and the head width from the
    model's config, whether the LM head is tied from its parameters, and refuses a model whose modules are not
    exactly the declared classes or whose parameters do not match the declared biases.

    Attributes:
        family: Class-name prefix: the adapter requires exactly ``<family><layer_suffix>``,
            ``<family>Attention`` and ``<family>MLP`` from ``module``, and norms of ``norm``'s class.
        module: The transformers module holding those classes.
        layer_suffix: Class-name suffix of a decoder layer.
        layers: Path of the list of decoder layers.
        attention: Attribute of a layer holding its attention.
        projections: Attributes of the attention's query, key, value and output ``nn.Linear``; with
            ``fused_qkv``, of the one query-key-value Linear and the output.
        fused_qkv: Whether one ``nn.Linear`` holds the queries, keys and values.
        fused_layout: How a fused Linear orders its rows: ``"per_head"``, per head ``[q | k | v]``
            (a view ``(h, 3, d_h)``, GPT-NeoX's ``query_key_value``), or ``"blocks"``, ``[Q | K | V]``
            with ``h``, ``h_kv`` and ``h_kv`` heads (Phi-3's ``qkv_proj``, GQA allowed).
        qkv_bias: Whether the query, key and value projections have biases.
        out_bias: Whether the output projection has a bias.
        mlp: Attribute of a layer holding its FFN.
        mlp_inputs: Attributes of the FFN's input ``nn.Linear``: gate and up (they move together),
            or the one up projection of a non-gated FFN.
        mlp_output: Attribute of the FFN's down ``nn.Linear``.
        mlp_value: A gated FFN's value branch, the input the gate's activation multiplies: ``(attribute, copy)``
            (``copy`` of a fused ``[gate | up]``, ``None`` for a Linear of its own); its units scale freely
            (docs/spec.md, section 2, "FFN unit scales"). ``None`` for a non-gated FFN.
        mlp_bias: Whether the FFN's Linears have biases.
        norm: ``"rms"``: ``<family>RMSNorm`` (a gain); ``"layer"``: ``torch.nn.LayerNorm`` (gain and bias).
        norms: Attributes of a layer's norms on residual coordinates: its two pre-norms (before
            attention, before the FFN; in a parallel residual both read the layer's input), where the
            family has them, and norms of the sublayers' outputs where it has those (Gemma 2 both,
            OLMo-2 only these: its sublayers read the stream itself).
        pre_norms: Of ``norms``, the one the attention's projections read and the one the FFN's inputs read
            (``None`` where the sublayer reads the stream itself, OLMo-2): only linear maps read these, so their
            gains fold (docs/spec.md, section 2, "Folding the norms").
        gain_offset: The norms' gain is ``gain_offset + weight`` (Gemma's ``1 + w``), 0 otherwise.
        final_norm: Path of the norm after the last layer.
        embeddings: Path of the token embedding.
        lm_head: Path of the output projection (tied to the embedding where the model ties them).
        saved_names: ``(parameter, name)`` pairs of parameters ``save_pretrained`` stores under
            another name (GPT-NeoX's ``lm_head.weight`` is ``embed_out.weight`` in its files).
        rotary: Path of the module computing the RoPE cosines and sines, ``(1, T, rotary_dim)`` per
            coordinate in the layout's order (``cat(freqs, freqs)`` for ``half``, each angle
            twice in a row for ``interleaved``).
        rope_layout: Which head coordinates rotate together (:func:`lmc.rotary.rotary_pairs`).
        rotary_fraction: Share of each head's coordinates that rotate (the first ones), or the key
            of the config's ``rope_parameters`` holding it (GPT-NeoX's ``partial_rotary_factor``,
            from ``rotary_pct``); the rotary width is ``int(head_dim * fraction)``, as HF computes it.
        sliding_window: Config field of a sliding-window width, if the family has one. A window
            masks positions and leaves the group unchanged; a width of 1 is refused, since then
            queries and keys do not affect the function (docs/spec.md, section 2, "Masks").
        qk_norms: Attributes of the attention's norms on queries and on keys (norms of ``norm``'s
            class, applied before RoPE), if the family has them.
        qk_norm_width: ``"head"``: each norm acts on one head at a time, with one gain of width
            ``head_dim`` shared by every head (Qwen3); ``"full"``: on the whole query (key) row, with
            one gain slice per head that moves with the head (OLMo-2, ``AttentionSpec.query_gain``).
    """

    family: str
    module: str
    layer_suffix: str = "DecoderLayer"
    layers: str = "model.layers"
    attention: str = "self_attn"
    projections: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    fused_qkv: bool = False
    fused_layout: Literal["per_head", "blocks"] = "per_head"
    qkv_bias: BiasRule = False
    out_bias: BiasRule = False
    mlp: str = "mlp"
    mlp_inputs: tuple[str, ...] = ("gate_proj", "up_proj")
    mlp_output: str = "down_proj"
    mlp_value: tuple[str, int | None] | None = ("up_proj", None)
    mlp_bias: BiasRule = False
    norm: Literal["rms", "layer"] = "rms"
    norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    pre_norms: tuple[str | None, str | None] = ("input_layernorm", "post_attention_layernorm")
    gain_offset: float = 0.0
    final_norm: str = "model.norm"
    embeddings: str = "model.embed_tokens"
    lm_head: str = "lm_head"
    saved_names: tuple[tuple[str, str], ...] = ()
    rotary: str = "model.rotary_emb"
    rope_layout: PairLayout = "half"
    rotary_fraction: float | str = 1.0
    sliding_window: str | None = None
    qk_norms: tuple[str, str] | None = None
    qk_norm_width: Literal["head", "full"] = "head"

    def __post_init__(self) -> None:
        if len(self.projections) != (2 if self.fused_qkv else 4):
            expected = "(qkv, output)" if self.fused_qkv else "(query, key, value, output)"
            raise ValueError(f"{self.family}: projections must be {expected}, got {self.projections}")

    @property
    def qkv_projections(self) -> tuple[str, ...]:
        """Attributes of the Linears computing queries, keys and values (one where fused)."""
        return self.projections[:-1]

    def classes(self) -> dict[str, type[nn.Module]]:
        """The exact classes of a layer, its attention, its FFN and its norms (imports ``module``)."""
        module = importlib.import_module(self.module)
        names = {"layer": self.layer_suffix, "attention": "Attention", "mlp": "MLP"}
        classes = {role: getattr(module, f"{self.family}{suffix}") for role, suffix in names.items()}
        classes["norm"] = nn.LayerNorm if self.norm == "layer" else getattr(module, f"{self.family}RMSNorm")
        return classes


def _has_bias(rule: BiasRule, config: object) -> bool:
    """Whether a Linear under ``rule`` has a bias in a model of ``config``."""
    return rule if isinstance(rule, bool) else bool(getattr(config, rule))


class DecoderAdapter(CausalLMAdapter):
    """The adapter of every Llama-like decoder: a subclass sets :attr:`layout`."""

    layout: DecoderLayout

    def spec(self, model: nn.Module) -> SymmetrySpec:
        layout, c = self.layout, model.config
        index = ParameterIndex(model)
        self._check_storage(model, index)
        d, h = c.hidden_size, c.num_attention_heads
        h_kv = getattr(c, "num_key_value_heads", None) or h  # GPT-NeoX's fused per-head QKV has no GQA
        head_dim = getattr(c, "head_dim", None) or d // h
        rotary = self._rotary(model, head_dim)
        residual = index.axes((f"{layout.embeddings}.weight", 1), (f"{layout.lm_head}.weight", 1))
        blocks, readers, folds = [], [], []
        for i in range(c.num_hidden_layers):
            p = f"{layout.layers}.{i}"
            projections = tuple(f"{p}.{layout.attention}.{x}" for x in layout.projections)
            shape = dict(width=d, num_heads=h, head_dim=head_dim, pe="rope", rotary=rotary)
            if layout.fused_qkv and layout.fused_layout == "blocks":
                attention = block_fused_attention(
                    index, f"{p}.{layout.attention}", *projections, num_kv_heads=h_kv, **shape
                )
            elif layout.fused_qkv:
                attention = per_head_fused_attention(index, f"{p}.{layout.attention}", *projections, **shape)
            else:
                attention = linear_attention(index, f"{p}.{layout.attention}", projections, num_kv_heads=h_kv, **shape)
            if layout.qk_norms is not None:
                query_norm, key_norm = (f"{p}.{layout.attention}.{norm}.weight" for norm in layout.qk_norms)
                if layout.qk_norm_width == "full":
                    gains = dict(query_gain=HeadSlot(query_norm, 0), key_gain=HeadSlot(key_norm, 0))
                else:
                    gains = dict(query_norm=query_norm, key_norm=key_norm)
                attention = dataclasses.replace(attention, **gains)
            inputs = tuple(f"{p}.{layout.mlp}.{x}" for x in layout.mlp_inputs)
            output = f"{p}.{layout.mlp}.{layout.mlp_output}"
            value = (
                None if layout.mlp_value is None else (f"{p}.{layout.mlp}.{layout.mlp_value[0]}", layout.mlp_value[1])
            )
            feed_forward = linear_feed_forward(index, f"{p}.{layout.mlp}", inputs, output, c.intermediate_size, value)
            blocks.append(BlockSpec(attention, feed_forward))
            norms = [f"{p}.{norm}" for norm in layout.norms]
            residual += [axis for norm in norms for axis in index.elementwise(norm)]
            residual += [axis for q in projections[:-1] + inputs for axis in index.linear_reads(q)]
            residual += index.linear_writes(projections[-1]) + index.linear_writes(output)
            readers += norms
            attention_norm, ffn_norm = layout.pre_norms
            for norm, linears in ((attention_norm, projections[:-1]), (ffn_norm, inputs)):
                if norm is not None:
                    fold = index.norm_fold(f"{p}.{norm}", [index.reader(q) for q in linears], layout.gain_offset)
                    folds.append(fold)
        residual += index.elementwise(layout.final_norm)
        readers.append(layout.final_norm)
        if not c.tie_word_embeddings:  # tied, the head is the embedding, which also writes the stream
            folds.append(index.norm_fold(layout.final_norm, [index.reader(layout.lm_head)], layout.gain_offset))
        vocabulary = index.axes((f"{layout.embeddings}.weight", 0), (f"{layout.lm_head}.weight", 0))
        residual_permutation = AxisPermutation(
            "residual",
            d,
            tuple(residual),
            tuple(readers),
            signs="each" if layout.norm == "rms" else "global",  # docs/spec.md, "Signs of the residual stream"
            unsigned=tuple(index.gains(*readers)),
        )
        fixed_axes = (FixedAxes("vocabulary", tuple(vocabulary)),)
        return SymmetrySpec(tuple(blocks), residual_permutation, fixed_axes=fixed_axes, folds=tuple(folds))

    def _check_storage(self, model: nn.Module, index: ParameterIndex) -> None:
        """Refuse modules of another class and parameters the declaration does not describe."""
        layout, c = self.layout, model.config
        classes = layout.classes()
        norm_parameters = ("weight", "bias") if layout.norm == "layer" else ("weight",)
        expected = {f"{layout.final_norm}.{x}" for x in norm_parameters}
        for i, layer in enumerate(model.get_submodule(layout.layers)):
            p = f"{layout.layers}.{i}"
            require_class(layer, (classes["layer"],), p)
            require_class(layer.get_submodule(layout.attention), (classes["attention"],), f"{p}.{layout.attention}")
            require_class(layer.get_submodule(layout.mlp), (classes["mlp"],), f"{p}.{layout.mlp}")
            for norm in layout.norms + tuple(f"{layout.attention}.{n}" for n in layout.qk_norms or ()):
                require_class(layer.get_submodule(norm), (classes["norm"],), f"{p}.{norm}")
                expected.update(f"{p}.{norm}.{x}" for x in norm_parameters)
            linears = [(f"{layout.attention}.{x}", layout.qkv_bias) for x in layout.qkv_projections]
            linears.append((f"{layout.attention}.{layout.projections[-1]}", layout.out_bias))
            linears += [(f"{layout.mlp}.{x}", layout.mlp_bias) for x in (*layout.mlp_inputs, layout.mlp_output)]
            for name, bias in linears:
                expected.add(f"{p}.{name}.weight")
                if _has_bias(bias, c):
                    expected.add(f"{p}.{name}.bias")
        require_class(model.get_submodule(layout.final_norm), (classes["norm"],), layout.final_norm)
        window = getattr(c, layout.sliding_window) if layout.sliding_window else None
        if window is not None and window < 2:
            raise UnsupportedModelError(
                f"{layout.family} with {layout.sliding_window}={window} is not supported: each token attends to "
                "itself alone, so queries and keys do not affect the function and no Q/K group describes it"
            )
        expected.add(f"{layout.embeddings}.weight")
        # Tied as loaded, not as the config says: from_pretrained unties a head the files store apart.
        if model.get_submodule(layout.lm_head).weight is not model.get_submodule(layout.embeddings).weight:
            expected.add(f"{layout.lm_head}.weight")
        if expected != set(index.shapes):
            missing, extra = sorted(expected - set(index.shapes)), sorted(set(index.shapes) - expected)
            raise UnsupportedModelError(
                f"{type(model).__name__}'s parameters differ from the {layout.family} layout lmc knows "
                f"(missing: {missing or 'none'}; unexpected: {extra or 'none'}); build it from its config unchanged"
            )

    def _rotary(self, model: nn.Module, head_dim: int) -> RotaryLayout:
        """The rotations the model's own rotary module applies, checked against the declared fraction."""
        layout = self.layout
        # Distinct frequencies show within a few thousand positions; long contexts need no more.
        positions = torch.arange(min(model.config.max_position_embeddings, 4096))[None]
        probe = torch.zeros(1, 1, dtype=torch.float64)
        rotary_emb = model.get_submodule(layout.rotary)
        if rotary_emb.inv_freq.is_meta:  # a skeleton on the meta device: the frequencies follow from the config
            rotary_emb = type(rotary_emb)(model.config)
        with torch.no_grad():
            cos, sin = rotary_emb(probe, positions)  # (1, T, rotary_dim) each
        fraction = layout.rotary_fraction
        if isinstance(fraction, str):
            fraction = (model.config.rope_parameters or {}).get(fraction, 1.0)
        rotary_dim = int(head_dim * fraction)
        if cos.shape[-1] != rotary_dim or rotary_dim % 2:
            raise UnsupportedModelError(
                f"{layout.family} rotary width {cos.shape[-1]} != {rotary_dim} (rotary_fraction "
                f"{fraction} of head_dim {head_dim}) is not supported: lmc needs the rotary module to turn "
                "exactly int(head_dim * fraction) coordinates, an even number"
            )
        pairs = rotary_pairs(layout.rope_layout, rotary_dim)
        if layout.rope_layout == "half":
            cos, sin = cos[..., : rotary_dim // 2], sin[..., : rotary_dim // 2]
        else:  # interleaved: each pair's angle repeated
            cos, sin = cos[..., ::2], sin[..., ::2]
        return rotary_from_cos_sin(layout.rope_layout, pairs, cos[0], sin[0])

    def saved_names(self, model: nn.Module) -> dict[str, str]:
        parameters = dict(model.named_parameters())
        return {parameter: name for parameter, name in self.layout.saved_names if parameter in parameters}

    def example_inputs(self, model: nn.Module, batch_size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        return {"input_ids": token_inputs(model.config, batch_size, generator, model.config.max_position_embeddings)}


@register_adapter("transformers:LlamaForCausalLM")
class LlamaAdapter(DecoderAdapter):
    layout = DecoderLayout(
        "Llama",
        "transformers.models.llama.modeling_llama",
        qkv_bias="attention_bias",
        out_bias="attention_bias",
        mlp_bias="mlp_bias",
    )


@register_adapter("transformers:MistralForCausalLM")
class MistralAdapter(DecoderAdapter):
    layout = DecoderLayout("Mistral", "transformers.models.mistral.modeling_mistral", sliding_window="sliding_window")


@register_adapter("transformers:Qwen2ForCausalLM")
class Qwen2Adapter(DecoderAdapter):
    layout = DecoderLayout(
        "Qwen2", "transformers.models.qwen2.modeling_qwen2", qkv_bias=True, sliding_window="sliding_window"
    )


@register_adapter("transformers:Qwen3ForCausalLM")
class Qwen3Adapter(DecoderAdapter):
    layout = DecoderLayout(
        "Qwen3",
        "transformers.models.qwen3.modeling_qwen3",
        qkv_bias="attention_bias",
        out_bias="attention_bias",
        sliding_window="sliding_window",
        qk_norms=("q_norm", "k_norm"),
    )


@register_adapter("transformers:Olmo2ForCausalLM")
class Olmo2Adapter(DecoderAdapter):
    layout = DecoderLayout(
        "Olmo2",
        "transformers.models.olmo2.modeling_olmo2",
        qkv_bias="attention_bias",
        out_bias="attention_bias",
        norms=("post_attention_layernorm", "post_feedforward_layernorm"),
        pre_norms=(None, None),
        qk_norms=("q_norm", "k_norm"),
        qk_norm_width="full",
    )


@register_adapter("transformers:GemmaForCausalLM")
class GemmaAdapter(DecoderAdapter):
    layout = DecoderLayout(
        "Gemma",
        "transformers.models.gemma.modeling_gemma",
        qkv_bias="attention_bias",
        out_bias="attention_bias",
        gain_offset=1.0,
    )


@register_adapter("transformers:Gemma2ForCausalLM")
class Gemma2Adapter(DecoderAdapter):
    layout = DecoderLayout(
        "Gemma2",
        "transformers.models.gemma2.modeling_gemma2",
        qkv_bias="attention_bias",
        out_bias="attention_bias",
        norms=(
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ),
        pre_norms=("input_layernorm", "pre_feedforward_layernorm"),
        gain_offset=1.0,
        sliding_window="sliding_window",
    )


@register_adapter("transformers:Phi3ForCausalLM")
class Phi3Adapter(DecoderAdapter):
    layout = DecoderLayout(
        "Phi3",
        "transformers.models.phi3.modeling_phi3",
        projections=("qkv_proj", "o_proj"),
        fused_qkv=True,
        fused_layout="blocks",
        mlp_inputs=("gate_up_proj",),
        mlp_value=("gate_up_proj", 1),  # gate, up = gate_up_proj(x).chunk(2)
        rotary_fraction="partial_rotary_factor",
        sliding_window="sliding_window",
    )


@register_adapter("transformers:GPTNeoXForCausalLM")
class GPTNeoXAdapter(DecoderAdapter):
    layout = DecoderLayout(
        "GPTNeoX",
        "transformers.models.gpt_neox.modeling_gpt_neox",
        layer_suffix="Layer",
        layers="gpt_neox.layers",
        attention="attention",
        projections=("query_key_value", "dense"),
        fused_qkv=True,
        qkv_bias="attention_bias",
        out_bias="attention_bias",
        mlp_inputs=("dense_h_to_4h",),
        mlp_output="dense_4h_to_h",
        mlp_value=None,  # GELU: no unit scale
        mlp_bias=True,
        norm="layer",
        final_norm="gpt_neox.final_layer_norm",
        embeddings="gpt_neox.embed_in",
        saved_names=(("lm_head.weight", "embed_out.weight"),),
        rotary="gpt_neox.rotary_emb",
        rotary_fraction="partial_rotary_factor",
    )
