"""Adapters for HF transformers: GPT-2, BERT and RoFormer (transformers 5.x layouts).

- GPT-2 stores ``Conv1D`` weights ``in x out`` and fuses Q, K, V in ``c_attn`` (columns
  ``[Q | K | V]``, head-major); the LM head is tied to ``wte``.
- BERT and RoFormer are post-norm encoders with separate ``query/key/value`` Linears;
  RoFormer rotates interleaved pairs with angles from its sinusoidal table. Their task heads
  have hidden units of their own (BERT's tanh pooler, RoFormer's classifier MLP).
- BERT's masked-LM head (``BertForMaskedLM``, ``BertForPreTraining``: MultiBERTs) maps the
  stream through ``dense -> act -> LayerNorm`` into a decoder tied to the word embeddings, so
  its hidden units are residual coordinates; the pre-training model's next-sentence head reads
  the tanh pooler, whose hidden units permute on their own.

- ViT (``ViTForImageClassification``, transformers' own, not timm's) is a pre-norm encoder over
  patch tokens: a ``Conv2d`` patch projection, a class token and learned positions added to the
  stream, separate ``q/k/v/o_proj`` Linears, a GELU MLP, and a classifier reading the class
  token after the final LayerNorm.

Llama-like decoders (Llama, Mistral, Qwen2) are declared as data in :mod:`lmc.adapters.decoders`.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from lmc.adapters.base import ModelAdapter, UnsupportedModelError, register_adapter
from lmc.adapters.layout import (
    ParameterIndex,
    linear_attention,
    linear_feed_forward,
    require_class,
    rotary_from_cos_sin,
)
from lmc.rotary import rotary_pairs
from lmc.symmetry.spec import (
    AttentionSpec,
    AxisPermutation,
    BlockSpec,
    FeedForwardSpec,
    FixedAxes,
    HeadSlot,
    SignGroup,
    SymmetrySpec,
)


def token_inputs(config, batch_size: int, generator: torch.Generator, max_length: int) -> torch.Tensor:
    length = min(max_length, 16)
    return torch.randint(config.vocab_size, (batch_size, length), generator=generator)


class _TokenAdapter(ModelAdapter):
    """HF models that read ``input_ids`` and an optional ``attention_mask``."""

    def model_inputs(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        inputs = {"input_ids": batch["inputs"]}
        if batch.get("attention_mask") is not None:
            inputs["attention_mask"] = batch["attention_mask"]
        return inputs


class CausalLMAdapter(_TokenAdapter):
    """HF causal LMs: lmc never generates, so no forward fills a key/value cache."""

    def model_inputs(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {**super().model_inputs(model, batch), "use_cache": False}


@register_adapter("transformers:GPT2LMHeadModel")
class GPT2Adapter(CausalLMAdapter):
    def spec(self, model: nn.Module) -> SymmetrySpec:
        from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

        c = model.config
        if c.add_cross_attention:
            raise UnsupportedModelError("GPT-2 with cross-attention is not supported (set add_cross_attention=False)")
        index = ParameterIndex(model)
        d, h = c.n_embd, c.n_head
        hidden = c.n_inner or 4 * d
        residual = index.axes(("transformer.wte.weight", 1), ("transformer.wpe.weight", 1), ("lm_head.weight", 1))
        blocks = []
        for i in range(c.n_layer):
            p = f"transformer.h.{i}"
            require_class(model.transformer.h[i].attn, (GPT2Attention,), f"{p}.attn")
            attention = AttentionSpec(
                name=f"{p}.attn",
                width=d,
                num_heads=h,
                num_kv_heads=h,
                head_dim=d // h,
                pe="absolute",
                query=HeadSlot(f"{p}.attn.c_attn.weight", 1, 0),
                key=HeadSlot(f"{p}.attn.c_attn.weight", 1, d),
                value=HeadSlot(f"{p}.attn.c_attn.weight", 1, 2 * d),
                out=HeadSlot(f"{p}.attn.c_proj.weight", 0),
                query_bias=HeadSlot(f"{p}.attn.c_attn.bias", 0, 0),
                key_bias=HeadSlot(f"{p}.attn.c_attn.bias", 0, d),
                value_bias=HeadSlot(f"{p}.attn.c_attn.bias", 0, 2 * d),
                out_bias=f"{p}.attn.c_proj.bias",
            )
            # Conv1D is ``in x out``: c_fc's hidden units are columns, c_proj's are rows.
            hidden_axes = ((f"{p}.mlp.c_fc.weight", 1), (f"{p}.mlp.c_fc.bias", 0), (f"{p}.mlp.c_proj.weight", 0))
            owned = tuple(name for name, _ in hidden_axes) + (f"{p}.mlp.c_proj.bias",)
            hidden_units = AxisPermutation(
                f"{p}.mlp", hidden, hidden_axes, readers=(f"{p}.mlp.c_proj",), writers=(f"{p}.mlp.c_fc",)
            )
            feed_forward = FeedForwardSpec(hidden_units, owned)
            blocks.append(BlockSpec(attention, feed_forward))
            residual += index.elementwise(f"{p}.ln_1") + index.elementwise(f"{p}.ln_2")
            residual += index.axes(
                (f"{p}.attn.c_attn.weight", 0), (f"{p}.attn.c_proj.weight", 1), (f"{p}.attn.c_proj.bias", 0)
            )
            residual += index.axes(
                (f"{p}.mlp.c_fc.weight", 0), (f"{p}.mlp.c_proj.weight", 1), (f"{p}.mlp.c_proj.bias", 0)
            )
        residual += index.elementwise("transformer.ln_f")
        readers = tuple(f"transformer.h.{i}.ln_{k}" for i in range(c.n_layer) for k in (1, 2)) + ("transformer.ln_f",)
        # Conv1D is ``in x out``: c_attn and c_fc read the stream on axis 0. Tied, ln_f's reader is the embedding.
        folds = [
            index.norm_fold(f"transformer.h.{i}.ln_{k}", [index.reader(f"transformer.h.{i}.{reader}", axis=0)])
            for i in range(c.n_layer)
            for k, reader in ((1, "attn.c_attn"), (2, "mlp.c_fc"))
        ]
        if not c.tie_word_embeddings:
            folds.append(index.norm_fold("transformer.ln_f", [index.reader("lm_head")]))
        fixed_axes = (
            FixedAxes("vocabulary", tuple(index.axes(("transformer.wte.weight", 0), ("lm_head.weight", 0)))),
            FixedAxes("positions", tuple(index.axes(("transformer.wpe.weight", 0)))),
        )
        residual_permutation = AxisPermutation(
            "residual", d, tuple(residual), readers, signs="global", unsigned=tuple(index.gains(*readers))
        )
        return SymmetrySpec(tuple(blocks), residual_permutation, fixed_axes=fixed_axes, folds=tuple(folds))

    def example_inputs(self, model: nn.Module, batch_size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        return {"input_ids": token_inputs(model.config, batch_size, generator, model.config.n_positions)}


class _EncoderAdapter(_TokenAdapter):
    """BERT-style post-norm encoders (BERT, RoFormer) and their task heads."""

    base: str  # attribute holding the encoder, "bert" or "roformer"
    # The task head's two Linears, if any: the first reads the residual stream after the last layer
    # and writes hidden units an elementwise nonlinearity acts on; the second reads those units.
    task_head: tuple[str, str] | None = None
    # The signs of the task head's hidden units: "each" behind an odd activation (BERT's pooler: tanh), else none.
    task_head_signs: SignGroup = "none"
    # Prefix of a masked-LM prediction head (transform.dense -> act -> transform.LayerNorm -> decoder), if any.
    prediction_head: str | None = None
    fixed_parameters: tuple[str, ...] = ()  # constants stored as frozen parameters

    def self_attention_class(self) -> type[nn.Module]:
        """The one attention class whose symmetries the spec describes."""
        raise NotImplementedError

    def rotary(self, model: nn.Module):
        return None

    def model_inputs(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        inputs = super().model_inputs(model, batch)
        if batch.get("token_type_ids") is not None:  # sentence pairs (BERT's masked-LM evaluation)
            inputs["token_type_ids"] = batch["token_type_ids"]
        return inputs

    def spec(self, model: nn.Module) -> SymmetrySpec:
        c = model.config
        if getattr(c, "is_decoder", False) or getattr(c, "add_cross_attention", False):
            raise UnsupportedModelError(f"{type(model).__name__} as a decoder is not supported (set is_decoder=False)")
        index = ParameterIndex(model)
        d, h = c.hidden_size, c.num_attention_heads
        rotary = self.rotary(model)
        e = f"{self.base}.embeddings"
        projection = f"{self.base}.embeddings_project"
        task_heads = []
        fixed_axes = [
            FixedAxes("vocabulary", tuple(index.axes((f"{e}.word_embeddings.weight", 0)))),
            FixedAxes("positions", tuple(index.axes((f"{e}.position_embeddings.weight", 0)))),
            FixedAxes("inputs", tuple(index.axes((f"{e}.token_type_embeddings.weight", 0)))),
        ]
        if index.optional(f"{projection}.weight"):
            residual = index.linear_writes(projection)
            task_heads.append(self._embedding_space(index, e, projection, c.embedding_size))
        else:
            residual = index.axes(
                (f"{e}.word_embeddings.weight", 1),
                (f"{e}.position_embeddings.weight", 1),
                (f"{e}.token_type_embeddings.weight", 1),
            )
            residual += index.elementwise(f"{e}.LayerNorm")
        # Post-norm: each LayerNorm reads the sum of the stream and a sublayer's output.
        readers = [] if task_heads else [f"{e}.LayerNorm"]
        blocks = []
        layers = getattr(model, self.base).encoder.layer
        for i in range(c.num_hidden_layers):
            p = f"{self.base}.encoder.layer.{i}"
            require_class(layers[i].attention.self, (self.self_attention_class(),), f"{p}.attention.self")
            projections = (
                f"{p}.attention.self.query",
                f"{p}.attention.self.key",
                f"{p}.attention.self.value",
                f"{p}.attention.output.dense",
            )
            attention = linear_attention(
                index,
                f"{p}.attention",
                projections,
                width=d,
                num_heads=h,
                num_kv_heads=h,
                head_dim=d // h,
                pe="rope" if rotary is not None else "absolute",
                rotary=rotary,
            )
            feed_forward = linear_feed_forward(
                index, f"{p}.intermediate", (f"{p}.intermediate.dense",), f"{p}.output.dense", c.intermediate_size
            )
            blocks.append(BlockSpec(attention, feed_forward))
            residual += [axis for q in projections[:3] for axis in index.linear_reads(q)]
            residual += index.linear_writes(projections[3]) + index.elementwise(f"{p}.attention.output.LayerNorm")
            residual += index.linear_reads(f"{p}.intermediate.dense") + index.linear_writes(f"{p}.output.dense")
            residual += index.elementwise(f"{p}.output.LayerNorm")
            readers += [f"{p}.attention.output.LayerNorm", f"{p}.output.LayerNorm"]
        # Post-norm: a LayerNorm's output is the stream, so under the global sign its bias flips and its gain does not.
        unsigned = index.gains(*readers)
        if self.task_head is not None:
            first, second = self.task_head
            residual += index.linear_reads(first)
            hidden = linear_feed_forward(index, first.rsplit(".", 1)[0], (first,), second, d).hidden
            task_heads.append(dataclasses.replace(hidden, signs=self.task_head_signs))
            fixed_axes.append(FixedAxes("classes", tuple(index.linear_writes(second))))
        if self.prediction_head is not None:
            head_residual, head = self._prediction_head(model, index, d)
            residual += head_residual
            task_heads += [head] if head is not None else []
            p = self.prediction_head
            vocabulary = index.axes((f"{p}.bias", 0)) + index.linear_writes(f"{p}.decoder")
            fixed_axes.append(FixedAxes("vocabulary", tuple(vocabulary)))
            if head is None:
                # Tied: the transform's LayerNorm writes stream coordinates from an input a sign does not reach
                # (after the activation), so its gain and bias flip with the stream and its dense does not.
                unsigned += index.linear_writes(f"{p}.transform.dense")
        fixed = tuple(name for name in self.fixed_parameters if index.optional(name))
        return SymmetrySpec(
            tuple(blocks),
            AxisPermutation("residual", d, tuple(residual), tuple(readers), signs="global", unsigned=tuple(unsigned)),
            fixed=fixed,
            task_heads=tuple(task_heads),
            fixed_axes=tuple(fixed_axes),
        )

    @staticmethod
    def _embedding_space(index: ParameterIndex, embeddings: str, projection: str, size: int) -> AxisPermutation:
        """RoFormer's embeddings when ``embedding_size != hidden_size``: a space of their own.

        ``x = LN(E_word[t] + E_type[s]) P^T + b``: the embedding columns, the LayerNorm's gain
        and bias and ``P``'s input columns permute together, apart from the residual stream
        that ``P`` writes (docs/spec.md, section 2, "Beyond attention").
        """
        axes = index.axes(
            (f"{embeddings}.word_embeddings.weight", 1), (f"{embeddings}.token_type_embeddings.weight", 1)
        )
        axes += index.elementwise(f"{embeddings}.LayerNorm") + index.linear_reads(projection)
        readers = (f"{embeddings}.LayerNorm", projection)
        # The LayerNorm allows a global sign of the space, its gain left alone (docs/spec.md, section 2).
        unsigned = tuple(index.gains(f"{embeddings}.LayerNorm"))
        return AxisPermutation(embeddings, size, tuple(axes), readers=readers, signs="global", unsigned=unsigned)

    def _prediction_head(
        self, model: nn.Module, index: ParameterIndex, width: int
    ) -> tuple[list[tuple[str, int]], AxisPermutation | None]:
        """The masked-LM head's residual axes, and its hidden units if they permute on their own.

        ``logits = LN(act(x W^T + b)) E^T + b_dec``: with the decoder tied to the word embeddings
        ``E`` (whose columns are residual coordinates), the transform's outputs must permute with
        the stream, so ``W`` permutes on both axes and the LayerNorm with them; untied, they are
        hidden units between ``W`` and the decoder, with a permutation of their own
        (docs/spec.md, section 2, "Beyond attention").
        """
        from transformers.models.bert.modeling_bert import BertLMPredictionHead, BertPredictionHeadTransform

        p = self.prediction_head
        require_class(model.get_submodule(p), (BertLMPredictionHead,), p)
        require_class(model.get_submodule(f"{p}.transform"), (BertPredictionHeadTransform,), f"{p}.transform")
        dense, norm, decoder = f"{p}.transform.dense", f"{p}.transform.LayerNorm", f"{p}.decoder"
        units = index.linear_writes(dense) + index.elementwise(norm)
        residual = index.linear_reads(dense)
        if index.optional(f"{decoder}.weight") is None:  # tied: the decoder is the word embedding
            return residual + units, None
        axes = tuple(units + index.linear_reads(decoder))
        return residual, AxisPermutation(f"{p}.transform", width, axes, readers=(decoder,), writers=(dense,))

    def example_inputs(self, model: nn.Module, batch_size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        c = model.config
        input_ids = token_inputs(c, batch_size, generator, c.max_position_embeddings)
        token_type_ids = torch.randint(c.type_vocab_size, input_ids.shape, generator=generator)
        return {"input_ids": input_ids, "token_type_ids": token_type_ids}


@register_adapter("transformers:BertForSequenceClassification")
class BertAdapter(_EncoderAdapter):
    base = "bert"
    task_head = ("bert.pooler.dense", "classifier")  # dense -> tanh -> classifier
    task_head_signs = "each"  # tanh is odd: a unit's dense row and bias, and the classifier's column, flip together

    def self_attention_class(self) -> type[nn.Module]:
        from transformers.models.bert.modeling_bert import BertSelfAttention

        return BertSelfAttention


@register_adapter("transformers:BertForMaskedLM")
class BertForMaskedLMAdapter(BertAdapter):
    task_head = None  # no pooler
    prediction_head = "cls.predictions"


@register_adapter("transformers:BertForPreTraining")
class BertForPreTrainingAdapter(BertAdapter):
    task_head = ("bert.pooler.dense", "cls.seq_relationship")  # dense -> tanh -> next-sentence logits
    prediction_head = "cls.predictions"

    def forward(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Both heads' logits in one tensor: the masked-LM ones flattened, then the next-sentence ones.

        Shape ``(B, T * vocab_size + 2)``; a symmetry must keep both.
        """
        output = model(**inputs)
        return torch.cat([output.prediction_logits.flatten(1), output.seq_relationship_logits], dim=1)


@register_adapter("transformers:RoFormerForSequenceClassification")
class RoFormerAdapter(_EncoderAdapter):
    base = "roformer"
    task_head = ("classifier.dense", "classifier.out_proj")  # dense -> hidden_act -> out_proj
    fixed_parameters = ("roformer.encoder.embed_positions.weight",)

    def self_attention_class(self) -> type[nn.Module]:
        from transformers.models.roformer.modeling_roformer import RoFormerSelfAttention

        return RoFormerSelfAttention

    def rotary(self, model: nn.Module):
        c = model.config
        if c.rotary_value:
            raise UnsupportedModelError("RoFormer with rotary_value=True is not supported (set rotary_value=False)")
        head_dim = c.hidden_size // c.num_attention_heads
        table = model.roformer.encoder.embed_positions.weight.detach()  # (positions, head_dim): [sin | cos]
        sin, cos = table.chunk(2, dim=-1)
        return rotary_from_cos_sin("interleaved", rotary_pairs("interleaved", head_dim), cos, sin)


@register_adapter("transformers:ViTForImageClassification")
class ViTAdapter(ModelAdapter):
    """transformers' ViT: the group of timm's ``VisionTransformer`` (docs/spec.md, section 2) in HF storage."""

    def spec(self, model: nn.Module) -> SymmetrySpec:
        from transformers.models.vit.modeling_vit import ViTAttention, ViTEmbeddings, ViTLayer, ViTMLP

        c = model.config
        index = ParameterIndex(model)
        d = c.hidden_size
        require_class(model.vit.embeddings, (ViTEmbeddings,), "vit.embeddings")
        e = "vit.embeddings"
        residual = index.axes((f"{e}.cls_token", 2), (f"{e}.position_embeddings", 2), (f"{e}.mask_token", 2))
        residual += index.linear_writes(f"{e}.patch_embeddings.projection")  # Conv2d: out channels first
        blocks, readers, folds = [], [], []
        for i, layer in enumerate(model.vit.layers):
            p = f"vit.layers.{i}"
            require_class(layer, (ViTLayer,), p)
            require_class(layer.attention, (ViTAttention,), f"{p}.attention")
            require_class(layer.mlp, (ViTMLP,), f"{p}.mlp")
            projections = tuple(f"{p}.attention.{x}_proj" for x in "qkvo")
            attention = linear_attention(
                index,
                f"{p}.attention",
                projections,
                width=d,
                num_heads=c.num_attention_heads,
                num_kv_heads=c.num_attention_heads,
                head_dim=layer.attention.head_dim,
                pe="absolute",
            )
            feed_forward = linear_feed_forward(
                index, f"{p}.mlp", (f"{p}.mlp.fc1",), f"{p}.mlp.fc2", c.intermediate_size
            )
            blocks.append(BlockSpec(attention, feed_forward))
            residual += [axis for q in projections[:3] for axis in index.linear_reads(q)]
            residual += index.linear_writes(projections[3]) + index.linear_reads(f"{p}.mlp.fc1")
            residual += index.linear_writes(f"{p}.mlp.fc2")
            residual += index.elementwise(f"{p}.layernorm_before") + index.elementwise(f"{p}.layernorm_after")
            readers += [f"{p}.layernorm_before", f"{p}.layernorm_after"]
            folds.append(index.norm_fold(f"{p}.layernorm_before", [index.reader(q) for q in projections[:3]]))
            folds.append(index.norm_fold(f"{p}.layernorm_after", [index.reader(f"{p}.mlp.fc1")]))
        residual += index.elementwise("vit.layernorm") + index.linear_reads("classifier")
        readers.append("vit.layernorm")
        folds.append(index.norm_fold("vit.layernorm", [index.reader("classifier")]))
        fixed_axes = (
            FixedAxes(
                "inputs", tuple(index.axes(*((f"{e}.patch_embeddings.projection.weight", k) for k in (1, 2, 3))))
            ),
            FixedAxes("positions", tuple(index.axes((f"{e}.position_embeddings", 1)))),
            FixedAxes("classes", tuple(index.linear_writes("classifier"))),
        )
        residual_permutation = AxisPermutation(
            "residual", d, tuple(residual), tuple(readers), signs="global", unsigned=tuple(index.gains(*readers))
        )
        return SymmetrySpec(tuple(blocks), residual_permutation, fixed_axes=fixed_axes, folds=tuple(folds))

    # save_pretrained writes each layer in the layout of older transformers (its conversion mapping, reversed).
    SAVED_MODULES = {
        "attention.q_proj": "attention.attention.query",
        "attention.k_proj": "attention.attention.key",
        "attention.v_proj": "attention.attention.value",
        "attention.o_proj": "attention.output.dense",
        "mlp.fc1": "intermediate.dense",
        "mlp.fc2": "output.dense",
        "layernorm_before": "layernorm_before",
        "layernorm_after": "layernorm_after",
    }

    def saved_names(self, model: nn.Module) -> dict[str, str]:
        names = {}
        for name, _ in model.named_parameters():
            head, _, rest = name.partition("vit.layers.")
            if head or not rest:
                continue
            layer, _, inner = rest.partition(".")
            module, _, leaf = inner.rpartition(".")
            if module in self.SAVED_MODULES:
                names[name] = f"vit.encoder.layer.{layer}.{self.SAVED_MODULES[module]}.{leaf}"
        return names

    def model_inputs(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"pixel_values": batch["inputs"]}

    def example_inputs(self, model: nn.Module, batch_size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        c = model.config
        dtype = model.vit.embeddings.patch_embeddings.projection.weight.dtype
        shape = (batch_size, c.num_channels, c.image_size, c.image_size)
        return {"pixel_values": torch.randn(shape, generator=generator, dtype=dtype)}
