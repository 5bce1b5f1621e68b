"""Adapter for lmc's own :class:`~lmc.models.reference.ReferenceTransformer`."""

from __future__ import annotations

import torch

from lmc.adapters.base import ModelAdapter, register_adapter
from lmc.adapters.layout import (
    ParameterIndex,
    linear_attention,
    linear_feed_forward,
    require_class,
    rotary_from_cos_sin,
)
from lmc.models.reference import Attention, Block, FeedForward, ReferenceTransformer
from lmc.symmetry.spec import AxisPermutation, BlockSpec, FixedAxes, SymmetrySpec


@register_adapter("lmc:ReferenceTransformer")
class ReferenceAdapter(ModelAdapter):
    def spec(self, model: ReferenceTransformer) -> SymmetrySpec:
        c = model.config
        index = ParameterIndex(model)
        pe = {"none": "none", "sinusoidal": "absolute", "learned": "absolute", "rope": "rope"}[c.pe]
        blocks, residual, folds = [], [], []
        residual += index.axes(("patch_embed.weight", 0), ("patch_embed.bias", 0), ("cls_token", 2))
        residual += index.axes(("token_embed.weight", 1), ("pos_embed", 1))
        for i, block in enumerate(model.blocks):
            prefix = f"blocks.{i}"
            require_class(block, (Block,), prefix)
            require_class(block.attn, (Attention,), f"{prefix}.attn")
            require_class(block.mlp, (FeedForward,), f"{prefix}.mlp")
            rotary = None
            if c.pe == "rope":
                attn = block.attn
                rotary = rotary_from_cos_sin(c.rope_layout, attn.rope_pairs, attn.rope_cos, attn.rope_sin)
            projections = tuple(f"{prefix}.attn.{p}_proj" for p in ("q", "k", "v", "o"))
            attention = linear_attention(
                index,
                f"{prefix}.attn",
                projections,
                width=c.width,
                num_heads=c.num_heads,
                num_kv_heads=c.num_kv_heads,
                head_dim=c.head_dim,
                pe=pe,
                rotary=rotary,
            )
            inputs = (f"{prefix}.mlp.up_proj",) + ((f"{prefix}.mlp.gate_proj",) if c.mlp == "swiglu" else ())
            value = (f"{prefix}.mlp.up_proj", None) if c.mlp == "swiglu" else None  # silu(gate(x)) * up(x)
            feed_forward = linear_feed_forward(
                index, f"{prefix}.mlp", inputs, f"{prefix}.mlp.down_proj", c.mlp_hidden, value
            )
            blocks.append(BlockSpec(attention, feed_forward))
            residual += index.elementwise(f"{prefix}.attn_norm") + index.elementwise(f"{prefix}.mlp_norm")
            residual += [axis for p in projections[:3] for axis in index.linear_reads(p)]
            residual += index.linear_writes(projections[3]) + index.linear_writes(f"{prefix}.mlp.down_proj")
            residual += [axis for p in inputs for axis in index.linear_reads(p)]
            folds.append(index.norm_fold(f"{prefix}.attn_norm", [index.reader(p) for p in projections[:3]]))
            folds.append(index.norm_fold(f"{prefix}.mlp_norm", [index.reader(p) for p in inputs]))
        residual += index.elementwise("norm") + index.linear_reads("head")
        folds.append(index.norm_fold("norm", [index.reader("head")]))  # pre-norm blocks: linear readers only
        fixed_axes = [
            FixedAxes("inputs", tuple(index.linear_reads("patch_embed"))),
            FixedAxes("vocabulary", tuple(index.axes(("token_embed.weight", 0)))),
            FixedAxes("positions", tuple(index.axes(("pos_embed", 0)))),
            FixedAxes("vocabulary" if c.task == "causal_lm" else "classes", tuple(index.linear_writes("head"))),
        ]
        if c.pe == "sinusoidal":
            fixed_axes.append(FixedAxes("constant", tuple(residual)))  # the stream's coordinates are the table's
            note = "the sinusoidal position table is a fixed buffer added to the residual stream"
            return SymmetrySpec(tuple(blocks), None, note, fixed_axes=tuple(fixed_axes), folds=tuple(folds))
        readers = tuple(f"blocks.{i}.{norm}" for i in range(len(blocks)) for norm in ("attn_norm", "mlp_norm"))
        readers += ("norm",)
        residual_permutation = AxisPermutation(
            "residual",
            c.width,
            tuple(residual),
            readers,
            signs="each" if c.norm == "rmsnorm" else "global",  # docs/spec.md, "Signs of the residual stream"
            unsigned=tuple(index.gains(*readers)),
        )
        return SymmetrySpec(tuple(blocks), residual_permutation, fixed_axes=tuple(fixed_axes), folds=tuple(folds))

    def model_inputs(self, model: ReferenceTransformer, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if model.config.task == "image_classification":
            return {"images": batch["inputs"]}
        return {"input_ids": batch["inputs"], "attention_mask": batch.get("attention_mask")}

    def example_inputs(
        self, model: ReferenceTransformer, batch_size: int, generator: torch.Generator
    ) -> dict[str, torch.Tensor]:
        c = model.config
        dtype = next(model.parameters()).dtype
        if c.task == "image_classification":
            images = torch.randn(
                batch_size, c.in_channels, c.image_size, c.image_size, generator=generator, dtype=dtype
            )
            return {"images": images}
        length = min(c.max_positions, 16)
        return {"input_ids": torch.randint(c.vocab_size, (batch_size, length), generator=generator)}
