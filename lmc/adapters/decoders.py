"""Llama-like decoder families as data: one :class:`DecoderLayout` per family, one generic adapter.

A family that differs from Llama only in names, biases, norms or the RoPE layout is a
:class:`DecoderLayout` (where its modules sit, which projections have biases, the pair layout
and rotary fraction) and a three-line adapter class; the symmetry spec is generic code over
the declaration (docs/spec.md, section 2; docs/extending.md shows a declaration):

- Llama rotates ``rotate_half`` pairs after any bias, before repeating KV heads (GQA);
- Mistral is Llama with a sliding-window mask, which acts on positions and leaves the group
  unchanged (docs/spec.md, section 2, "Masks");
- Qwen2 is Llama with biases on q, k and v (none on o), which move with the group.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
from torch import nn

from lmc.adapters.base import UnsupportedModelError, register_adapter
from lmc.adapters.huggingface import CausalLMAdapter, token_inputs
from lmc.adapters.layout import (
    ParameterIndex,
    linear_attention,
    linear_feed_forward,
    require_class,
    rotary_from_cos_sin,
)
from lmc.rotary import PairLayout, rotary_pairs
from lmc.symmetry.spec import AxisPermutation, BlockSpec, RotaryLayout, SymmetrySpec

#: Whether a family's Linears have a bias: always (``True``), never (``False``) or as a config field says (its name).
BiasRule = bool | str


@dataclass(frozen=True)
class DecoderLayout:
    """Where a Llama-like decoder keeps its parameters, and what its family varies.

    The adapter reads the number of layers, heads and KV heads (GQA), the head width and
    ``tie_word_embeddings`` from the model's config, and refuses a model whose modules are not
    exactly the declared classes or whose parameters do not match the declared biases.

    Attributes:
        family: Class-name prefix: the adapter requires exactly ``<family>DecoderLayer``,
            ``<family>Attention``, ``<family>MLP`` and ``<family>RMSNorm`` from ``module``.
        module: The transformers module holding those classes.
        layers: Path of the list of decoder layers.
        attention: Attribute of a layer holding its attention.
        projections: Attributes of the attention's query, key, value and output ``nn.Linear``.
        qkv_bias: Whether the query, key and value projections have biases.
        out_bias: Whether the output projection has a bias.
        mlp: Attribute of a layer holding its gated FFN.
        mlp_inputs: Attributes of the FFN's gate and up ``nn.Linear`` (they move together).
        mlp_output: Attribute of the FFN's down ``nn.Linear``.
        mlp_bias: Whether the FFN's Linears have biases.
        norms: Attributes of a layer's two pre-norms (before attention, before the FFN).
        final_norm: Path of the norm after the last layer.
        embeddings: Path of the token embedding.
        lm_head: Path of the output projection (tied to the embedding if the config says so).
        rotary: Path of the module computing the RoPE cosines and sines, ``(1, T, rotary_dim)`` per
            coordinate in the layout's order (``cat(freqs, freqs)`` for ``half``, each angle
            twice in a row for ``interleaved``).
        rope_layout: Which head coordinates rotate together (:func:`lmc.rotary.rotary_pairs`).
        rotary_fraction: Share of each head's coordinates that rotate (the first ones).
        sliding_window: Config field of a sliding-window width, if the family has one. A window
            masks positions and leaves the group unchanged; a width of 1 is refused, since then
            queries and keys do not affect the function (docs/spec.md, section 2, "Masks").
    """

    family: str
    module: str
    layers: str = "model.layers"
    attention: str = "self_attn"
    projections: tuple[str, str, str, str] = ("q_proj", "k_proj", "v_proj", "o_proj")
    qkv_bias: BiasRule = False
    out_bias: BiasRule = False
    mlp: str = "mlp"
    mlp_inputs: tuple[str, ...] = ("gate_proj", "up_proj")
    mlp_output: str = "down_proj"
    mlp_bias: BiasRule = False
    norms: tuple[str, str] = ("input_layernorm", "post_attention_layernorm")
    final_norm: str = "model.norm"
    embeddings: str = "model.embed_tokens"
    lm_head: str = "lm_head"
    rotary: str = "model.rotary_emb"
    rope_layout: PairLayout = "half"
    rotary_fraction: float = 1.0
    sliding_window: str | None = None

    def classes(self) -> dict[str, type[nn.Module]]:
        """The exact classes of a layer, its attention, its FFN and its norms (imports ``module``)."""
        module = importlib.import_module(self.module)
        names = {"layer": "DecoderLayer", "attention": "Attention", "mlp": "MLP", "norm": "RMSNorm"}
        return {role: getattr(module, f"{self.family}{suffix}") for role, suffix in names.items()}


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
        d, h, h_kv = c.hidden_size, c.num_attention_heads, c.num_key_value_heads
        head_dim = getattr(c, "head_dim", None) or d // h
        rotary = self._rotary(model, head_dim)
        residual = index.axes((f"{layout.embeddings}.weight", 1), (f"{layout.lm_head}.weight", 1))
        blocks, readers = [], []
        for i in range(c.num_hidden_layers):
            p = f"{layout.layers}.{i}"
            projections = tuple(f"{p}.{layout.attention}.{x}" for x in layout.projections)
            attention = linear_attention(
                index,
                f"{p}.{layout.attention}",
                projections,
                width=d,
                num_heads=h,
                num_kv_heads=h_kv,
                head_dim=head_dim,
                pe="rope",
                rotary=rotary,
            )
            inputs = tuple(f"{p}.{layout.mlp}.{x}" for x in layout.mlp_inputs)
            output = f"{p}.{layout.mlp}.{layout.mlp_output}"
            feed_forward = linear_feed_forward(index, f"{p}.{layout.mlp}", inputs, output, c.intermediate_size)
            blocks.append(BlockSpec(attention, feed_forward))
            norms = [f"{p}.{norm}" for norm in layout.norms]
            residual += [axis for norm in norms for axis in index.elementwise(norm)]
            residual += [axis for q in projections[:3] + inputs for axis in index.linear_reads(q)]
            residual += index.linear_writes(projections[3]) + index.linear_writes(output)
            readers += norms
        residual += index.elementwise(layout.final_norm)
        readers.append(layout.final_norm)
        return SymmetrySpec(tuple(blocks), AxisPermutation("residual", d, tuple(residual), tuple(readers)))

    def _check_storage(self, model: nn.Module, index: ParameterIndex) -> None:
        """Refuse modules of another class and parameters the declaration does not describe."""
        layout, c = self.layout, model.config
        classes = layout.classes()
        expected = {f"{layout.final_norm}.weight"}
        for i, layer in enumerate(model.get_submodule(layout.layers)):
            p = f"{layout.layers}.{i}"
            require_class(layer, (classes["layer"],), p)
            require_class(layer.get_submodule(layout.attention), (classes["attention"],), f"{p}.{layout.attention}")
            require_class(layer.get_submodule(layout.mlp), (classes["mlp"],), f"{p}.{layout.mlp}")
            for norm in layout.norms:
                require_class(layer.get_submodule(norm), (classes["norm"],), f"{p}.{norm}")
                expected.add(f"{p}.{norm}.weight")
            linears = [(f"{layout.attention}.{x}", layout.qkv_bias) for x in layout.projections[:3]]
            linears.append((f"{layout.attention}.{layout.projections[3]}", layout.out_bias))
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
        if not c.tie_word_embeddings:
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
        rotary_dim = round(head_dim * layout.rotary_fraction)
        if cos.shape[-1] != rotary_dim:
            raise UnsupportedModelError(
                f"{layout.family} rotary width {cos.shape[-1]} != {rotary_dim} (rotary_fraction "
                f"{layout.rotary_fraction} of head_dim {head_dim}) is not supported"
            )
        pairs = rotary_pairs(layout.rope_layout, rotary_dim)
        if layout.rope_layout == "half":
            cos, sin = cos[..., : rotary_dim // 2], sin[..., : rotary_dim // 2]
        else:  # interleaved: each pair's angle repeated
            cos, sin = cos[..., ::2], sin[..., ::2]
        return rotary_from_cos_sin(layout.rope_layout, pairs, cos[0], sin[0])

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
