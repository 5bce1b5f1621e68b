"""Adapters for timm 1.0 vision Transformers: ``VisionTransformer`` and the (RoPE) ``Eva`` family.

timm fuses Q, K, V in one ``qkv`` Linear (rows ``[Q | K | V]``, head-major); EVA-style
attention keeps ``q_bias``/``v_bias`` apart and has no key bias. timm's RoPE ViTs use 2-D
axial RoPE (``RotaryEmbeddingCat``) on the patch tokens only, interleaved pairs unless
``rotate_half``; the class token is never rotated, which is why ``C`` must commute with every
absolute rotation, not only the relative ones (docs/spec.md, section 2). Two or more register
tokens permute among themselves, with their rows of ``pos_embed`` if they have any
(``SymmetrySpec.tokens``).
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
from lmc.symmetry.folds import Reader
from lmc.symmetry.spec import (
    AttentionSpec,
    AxisPermutation,
    BlockSpec,
    FixedAxes,
    HeadSlot,
    RotaryLayout,
    SignGroup,
    SymmetrySpec,
)


def _require_identity(module: nn.Module, attributes: tuple[str, ...], where: str) -> None:
    for attribute in attributes:
        value = getattr(module, attribute, None)
        if value is not None and not isinstance(value, nn.Identity):
            raise UnsupportedModelError(
                f"{where}.{attribute} is a {type(value).__name__}: a normalization or gate inside attention breaks "
                "the per-head GL symmetry lmc relies on; build the model with it disabled"
            )


def _attention(
    index: ParameterIndex, prefix: str, attn: nn.Module, width: int, pe: str, rotary: RotaryLayout | None
) -> tuple[AttentionSpec, list[tuple[str, int]]]:
    """The attention spec and the residual-stream axes of its projections."""
    _require_identity(attn, ("q_norm", "k_norm", "norm", "gate"), prefix)
    h, head_dim = attn.num_heads, attn.head_dim
    if getattr(attn, "qkv", None) is None:
        projections = tuple(f"{prefix}.{x}" for x in ("q_proj", "k_proj", "v_proj", "proj"))
        num_kv_heads = attn.k_proj.out_features // head_dim
        spec = linear_attention(
            index,
            prefix,
            projections,
            width=width,
            num_heads=h,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            pe=pe,
            rotary=rotary,
        )
        reads = [axis for p in projections[:3] for axis in index.linear_reads(p)]
        return spec, reads + index.linear_writes(projections[3])
    attn_dim = h * head_dim
    qkv = f"{prefix}.qkv"
    if index.optional(f"{qkv}.bias"):
        biases = [HeadSlot(f"{qkv}.bias", 0, k * attn_dim) for k in range(3)]
    else:  # EvaAttention: separate q/v biases, the key bias is a zero buffer
        biases = [index.bias_slot(f"{prefix}.q_bias"), None, index.bias_slot(f"{prefix}.v_bias")]
    spec = AttentionSpec(
        name=prefix,
        width=width,
        num_heads=h,
        num_kv_heads=h,
        head_dim=head_dim,
        pe=pe,
        rotary=rotary,
        query=HeadSlot(f"{qkv}.weight", 0, 0),
        key=HeadSlot(f"{qkv}.weight", 0, attn_dim),
        value=HeadSlot(f"{qkv}.weight", 0, 2 * attn_dim),
        out=HeadSlot(f"{prefix}.proj.weight", 1),
        query_bias=biases[0],
        key_bias=biases[1],
        value_bias=biases[2],
        out_bias=index.optional(f"{prefix}.proj.bias"),
    )
    return spec, index.linear_reads(qkv) + index.linear_writes(f"{prefix}.proj")


def _attention_readers(index: ParameterIndex, prefix: str, attn: nn.Module) -> list[Reader]:
    """The projections reading the attention's input; a fused ``qkv`` whose key has no bias (Eva's separate
    ``q_bias`` and ``v_bias``) takes no folded bias."""
    if getattr(attn, "qkv", None) is None:
        return [index.reader(f"{prefix}.{x}") for x in ("q_proj", "k_proj", "v_proj")]
    return [index.reader(f"{prefix}.qkv")]


def _axial_rotary(model: nn.Module) -> RotaryLayout | None:
    rope = getattr(model, "rope", None)
    if rope is None:
        return None
    if type(rope).__name__ != "RotaryEmbeddingCat" or getattr(model, "rope_mixed", False):
        raise UnsupportedModelError(
            f"timm rope type {type(rope).__name__} is not supported; lmc supports rope_type='cat' (RotaryEmbeddingCat)"
        )
    with torch.no_grad():
        embedding = rope.get_embed(shape=list(model.patch_embed.grid_size))  # (N, 2 * head_dim): [sin | cos]
    sin, cos = embedding.double().chunk(2, dim=-1)
    layout = "half" if getattr(model.blocks[0].attn, "rotate_half", False) else "interleaved"
    pairs = rotary_pairs(layout, sin.shape[-1])
    first, second = pairs[:, 0], pairs[:, 1]
    if not (torch.equal(sin[:, first], sin[:, second]) and torch.equal(cos[:, first], cos[:, second])):
        raise UnsupportedModelError(f"timm rope angles do not follow the {layout} pair layout")
    # Absolute angles per patch: the group commutes with each R_n, as the unrotated class token requires.
    return rotary_from_cos_sin("axial", pairs, cos[:, first], sin[:, first])


def _register_tokens(model: nn.Module, index: ParameterIndex) -> tuple[AxisPermutation | None, list[FixedAxes]]:
    """The permutation of timm's register tokens, or why they cannot permute (docs/spec.md, section 2).

    A register token enters every layer the same way wherever it sits among them: with no position
    of its own (``no_embed_class``: ``pos_embed`` covers the patches only) or with its own row of
    ``pos_embed``, after the class token's if there is one, which then moves with it. The blocks treat every token
    alike (no mask; RoPE turns the patches only), and the pooling reads the class token
    (``'token'``, which needs one) or averages or maxes over tokens, register tokens dropped or all
    included. So the ``R`` tokens permute among themselves, unless the output keeps every token in
    its place (``global_pool=''``). ``attn_pool`` is refused before this is asked.

    Returns:
        ``(tokens, fixed_axes)``: the permutation (``None`` with fewer than two register tokens or
        with every token output), and the register axis fixed by the output's token positions, if so.
    """
    count = model.reg_token.shape[1] if index.optional("reg_token") else 0
    if count < 2:
        return None, []
    if not model.global_pool:
        return None, [FixedAxes("positions", (("reg_token", 1),))]
    axes: tuple[tuple[str, int], ...] = (("reg_token", 1),)
    offsets: tuple[tuple[tuple[str, int], int], ...] = ()
    if index.optional("pos_embed") and not model.no_embed_class:
        rows = ("pos_embed", 1)  # [class token's row, if any | R register rows | patches']
        axes += (rows,)
        offsets = ((rows, int(index.optional("cls_token") is not None)),)
    return AxisPermutation("reg_token", count, axes, offsets=offsets), []


def _stream_signs(model: nn.Module, norms: tuple[str, ...]) -> SignGroup:
    """The signs of the residual stream (docs/spec.md, section 2, "Signs of the residual stream"): one per
    coordinate when every norm on the stream is an RMSNorm, one global sign when LayerNorms are among them,
    none under a max over tokens (``global_pool`` ``'max'`` or ``'avgmax'``: a max does not commute with a flip)
    or a norm of another kind."""
    from timm.layers import RmsNorm

    if "max" in model.global_pool:
        return "none"
    modules = [model.get_submodule(name) for name in norms if hasattr(model, name.split(".")[0])]
    present = [module for module in modules if not isinstance(module, nn.Identity)]
    if all(isinstance(module, RmsNorm | nn.RMSNorm) for module in present):
        return "each"
    if all(isinstance(module, RmsNorm | nn.RMSNorm | nn.LayerNorm) for module in present):
        return "global"
    return "none"


def _vision_spec(
    model: nn.Module,
    rotary: RotaryLayout | None,
    layer_scale: tuple[str, str],
    block_class: type[nn.Module],
    attention_classes: tuple[type[nn.Module], ...],
) -> SymmetrySpec:
    from timm.layers import GluMlp, Mlp, SwiGLU

    if getattr(model, "attn_pool", None) is not None:
        raise UnsupportedModelError("timm attention-pool heads (global_pool='map') are not supported")
    index = ParameterIndex(model)
    width = model.embed_dim
    has_pos_embed = index.optional("pos_embed") is not None
    pe = "rope" if rotary is not None else ("absolute" if has_pos_embed else "none")
    residual = index.axes(("cls_token", 2), ("reg_token", 2), ("pos_embed", 2))
    residual += index.axes(("patch_embed.proj.weight", 0), ("patch_embed.proj.bias", 0))
    residual += index.elementwise("patch_embed.norm") + index.elementwise("norm_pre")
    blocks, folds = [], []
    for i, block in enumerate(model.blocks):
        prefix = f"blocks.{i}"
        require_class(block, (block_class,), prefix)
        require_class(block.attn, attention_classes, f"{prefix}.attn")
        mlp = block.mlp
        require_class(mlp, (Mlp, GluMlp, SwiGLU), f"{prefix}.mlp")
        attention, attention_axes = _attention(index, f"{prefix}.attn", block.attn, width, pe, rotary)
        # SwiGLU has separate gate and value Linears; GluMlp stacks [value | gate] in fc1.
        inputs = (f"{prefix}.mlp.fc1_g", f"{prefix}.mlp.fc1_x") if type(mlp) is SwiGLU else (f"{prefix}.mlp.fc1",)
        # A norm inside the MLP (scale_mlp) is permutation-equivariant: its parameters move with the hidden units,
        # but it does not commute with a unit's scale. Otherwise a gated unit's value branch scales freely.
        hidden_norm = index.elementwise(f"{prefix}.mlp.norm")
        value = None
        if type(mlp) is SwiGLU and not hidden_norm:
            value = (f"{prefix}.mlp.fc1_x", None)  # act(fc1_g(x)) * fc1_x(x)
        elif type(mlp) is GluMlp and not hidden_norm:
            value = (f"{prefix}.mlp.fc1", 0 if mlp.gate_last else 1)  # [value | gate] by default
        feed_forward = linear_feed_forward(
            index, f"{prefix}.mlp", inputs, f"{prefix}.mlp.fc2", mlp.fc2.in_features, value
        )
        if hidden_norm:
            hidden = feed_forward.hidden
            hidden = dataclasses.replace(hidden, axes=hidden.axes + tuple(hidden_norm))
            feed_forward = type(feed_forward)(hidden, feed_forward.parameters + tuple(p for p, _ in hidden_norm))
        blocks.append(BlockSpec(attention, feed_forward))
        residual += index.elementwise(f"{prefix}.norm1") + index.elementwise(f"{prefix}.norm2") + attention_axes
        residual += [axis for p in inputs for axis in index.linear_reads(p)] + index.linear_writes(f"{prefix}.mlp.fc2")
        residual += index.axes(*((f"{prefix}.{name}", 0) for name in layer_scale))
        folds.append(index.norm_fold(f"{prefix}.norm1", _attention_readers(index, f"{prefix}.attn", block.attn)))
        folds.append(index.norm_fold(f"{prefix}.norm2", [index.reader(p) for p in inputs]))
    residual += index.elementwise("norm") + index.elementwise("fc_norm") + index.linear_reads("head")
    # Every norm on the stream reads it; ``norm`` is an Identity under fc_norm and still reads it.
    readers = tuple(f"blocks.{i}.norm{k}" for i in range(len(blocks)) for k in (1, 2)) + ("norm",)
    norms = ("patch_embed.norm", "norm_pre", *readers, "fc_norm")
    # A layer scale multiplies a writer's output: like a gain, the signs pass it by.
    unsigned = index.gains(*norms) + index.axes(
        *((f"blocks.{i}.{name}", 0) for i in range(len(blocks)) for name in layer_scale)
    )
    tokens, fixed_tokens = _register_tokens(model, index)
    fixed_axes = (
        FixedAxes("inputs", tuple(index.axes(*(("patch_embed.proj.weight", k) for k in (1, 2, 3))))),
        # Register tokens' rows, if any, move with their tokens; the class token's and the patches' stay.
        FixedAxes("positions", tuple(index.axes(("pos_embed", 1)))),
        FixedAxes("classes", tuple(index.linear_writes("head"))),
        *fixed_tokens,
    )
    residual_permutation = AxisPermutation(
        "residual", width, tuple(residual), readers, signs=_stream_signs(model, norms), unsigned=tuple(unsigned)
    )
    # The last norm (``norm``, or ``fc_norm`` after the pooling) feeds the head through an average or the class
    # token; a max over tokens does not commute with a gain that may be negative, so it does not fold there.
    final = "fc_norm" if index.optional("fc_norm.weight") else "norm"
    if "max" not in model.global_pool and index.optional(f"{final}.weight"):
        folds.append(index.norm_fold(final, [index.reader("head")]))
    return SymmetrySpec(
        tuple(blocks),
        residual_permutation,
        tokens=tokens,
        fixed_axes=fixed_axes,
        folds=tuple(folds),
    )


class _TimmVisionAdapter(ModelAdapter):
    def attention_input_module(self, model: nn.Module, layer: AttentionSpec) -> nn.Module:
        # EVA attention with separate q/v biases applies ``qkv.weight`` through F.linear without
        # calling ``qkv``; every timm attention module takes its input as the first argument.
        return model.get_submodule(layer.name)

    def model_inputs(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"x": batch["inputs"]}

    def example_inputs(self, model: nn.Module, batch_size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        height, width = model.patch_embed.img_size
        channels = model.patch_embed.proj.in_channels
        dtype = model.patch_embed.proj.weight.dtype
        return {"x": torch.randn(batch_size, channels, height, width, generator=generator, dtype=dtype)}


@register_adapter("timm:VisionTransformer")
class VisionTransformerAdapter(_TimmVisionAdapter):
    def spec(self, model: nn.Module) -> SymmetrySpec:
        from timm.layers import Attention
        from timm.models.vision_transformer import Block

        return _vision_spec(model, None, ("ls1.gamma", "ls2.gamma"), Block, (Attention,))


@register_adapter("timm:Eva")
class EvaAdapter(_TimmVisionAdapter):
    def spec(self, model: nn.Module) -> SymmetrySpec:
        from timm.layers import AttentionRope
        from timm.models.eva import EvaAttention, EvaBlock

        return _vision_spec(
            model, _axial_rotary(model), ("gamma_1", "gamma_2"), EvaBlock, (EvaAttention, AttentionRope)
        )
