"""Symmetry specifications: where each group acts inside a model's parameters, as plain data.

A spec says *which* parameter axes a group acts on (git-re-basin's ``PermutationSpec``,
extended to the continuous per-head groups of docs/spec.md, section 2). Adapters produce specs;
everything else (apply, sample, invert, match) is generic code over them.

Convention (docs/spec.md, section 1): a token is a row ``x`` of width ``d`` and a layer computes
``x @ W``. A :class:`HeadSlot` locates the ``heads * head_dim`` entries of one projection
inside a stored parameter, whatever its storage (``nn.Linear`` is ``out x in``, GPT-2's
``Conv1D`` is ``in x out``, fused ``qkv`` holds three projections one after the other, or
GPT-NeoX's ``query_key_value`` interleaves them head by head).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:  # torch is imported where tensors are made: the CLI's help reads Scope and loads no torch
    import torch

    from lmc.symmetry.folds import NormFold
    from lmc.symmetry.scales import UnitScales

PositionalEncoding = Literal["none", "absolute", "rope"]
RopeLayout = Literal["half", "interleaved", "axial"]
Scope = Literal["first_attention", "all_attention", "first_block", "full_model"]
"""Which part of a model is re-initialized and aligned (docs/spec.md, section 5): the first attention
layer, every attention layer, the first block (attention and FFN) or the whole model."""
SCOPES: tuple[str, ...] = get_args(Scope)
SignGroup = Literal["none", "each", "global"]
"""The sign flips that act with a permutation of units (docs/spec.md, section 2, "Signs of the residual stream"):
none, one sign per unit (the stream of an RMSNorm model, a tanh unit's) or one sign for all units at once (the
stream of a LayerNorm model, whose mean subtraction commutes with a global sign only)."""
FixedReason = Literal["inputs", "vocabulary", "classes", "positions", "constant"]
"""Why no group acts on a parameter axis that an adapter declares fixed (:class:`FixedAxes`): it is indexed by
the input's own coordinates (image channels and pixels, token types), by token ids, by a task head's classes or by
token positions, or it is a constant of the architecture or coordinates such a constant pins."""


HEAD_ORDER_ONLY: frozenset[str] = frozenset({"query_gain", "key_gain"})
"""The :class:`AttentionSpec` slots whose entries move with the head permutation and that neither ``C`` nor ``B``
acts on (docs/spec.md, section 2, "Full-width QK-norm"); every other slot also takes its head's ``C`` or ``B``."""


@dataclass(frozen=True)
class HeadSlot:
    """Where one per-head projection (or its bias) is stored.

    Attributes:
        parameter: Fully qualified parameter name, as in ``model.named_parameters()``.
        head_axis: Axis of that parameter holding the ``heads * head_dim`` entries, head-major.
        offset: First entry of this projection along ``head_axis`` (non-zero in fused ``qkv``).
        stride: Entries from one head's first entry to the next one's; ``None`` for ``head_dim``
            (heads side by side). GPT-NeoX's ``query_key_value`` stores per head ``[q | k | v]``,
            its rows a view ``(h, 3, d_h)``: stride ``3 * d_h``, offsets ``0``, ``d_h``, ``2 * d_h``.
    """

    parameter: str
    head_axis: int
    offset: int = 0
    stride: int | None = None


@dataclass(frozen=True)
class RotaryLayout:
    """The rotations a RoPE attention layer applies to queries and keys.

    Each rotary pair ``(first, second)`` of head coordinates turns as the complex number
    ``x[first] + i x[second]`` multiplied by ``exp(i angle)``; coordinates in no pair are
    never rotated.

    Attributes:
        kind: ``"half"`` (pairs ``(j, j + r/2)``), ``"interleaved"`` (``(2j, 2j+1)``) or
            ``"axial"`` (2-D grid positions; the pairing is in ``pairs``).
        pairs: Coordinate pairs, shape ``(num_pairs, 2)``.
        angles: Angle each pair turns by at each position the model uses,
            shape ``(num_positions, num_pairs)``. Read off the model itself, so that the
            derived group follows its actual frequencies.
    """

    kind: RopeLayout
    pairs: torch.Tensor
    angles: torch.Tensor

    def __post_init__(self) -> None:
        if self.pairs.ndim != 2 or self.pairs.shape[1] != 2:
            raise ValueError(f"pairs must have shape (num_pairs, 2), got {tuple(self.pairs.shape)}")
        if self.angles.ndim != 2 or self.angles.shape[1] != self.pairs.shape[0]:
            raise ValueError(
                f"angles must have shape (num_positions, {self.pairs.shape[0]}), got {tuple(self.angles.shape)}"
            )

    @property
    def rotary_dim(self) -> int:
        """Number of head coordinates that rotate."""
        return 2 * self.pairs.shape[0]


@dataclass(frozen=True)
class AttentionSpec:
    """One multi-head attention layer, in the uniform per-head view.

    Per head (docs/spec.md, section 1), ``W_Q, W_K, W_V`` are ``d x head_dim`` and ``W_O`` is
    ``head_dim x d``. With grouped-query attention ``key``/``value`` hold ``num_kv_heads``
    heads and query head ``i`` reads KV head ``i // (num_heads // num_kv_heads)``.

    Attributes:
        name: Module path of the layer (for messages and reports).
        width: Model width ``d``.
        num_heads: Query heads ``h``.
        num_kv_heads: Key/value heads ``h_kv`` (equal to ``h`` without GQA).
        head_dim: Head width ``d_h``.
        pe: ``"none"``, ``"absolute"`` (additive: sinusoidal or learned) or ``"rope"``.
        rotary: The RoPE rotations, ``None`` unless ``pe == "rope"``.
        query, key, value, out: Storage of the projections.
        query_bias, key_bias, value_bias: Storage of the per-head biases, if any.
        out_bias: Name of the output bias parameter (width ``d``), if any; the attention
            group leaves it unchanged.
        query_norm, key_norm: Names of the gains (width ``head_dim``, shared by every head) of a
            per-head RMSNorm on queries and on keys before RoPE (Qwen3's ``q_norm``/``k_norm``),
            if any. The group leaves them unchanged, and with either one ``C`` shrinks to sign
            flips (docs/spec.md, section 2, "Per-head QK-norm").
        query_gain, key_gain: Slots that only the head permutation moves (:data:`HEAD_ORDER_ONLY`):
            each query (key/value) head's ``head_dim``-wide slice of the gain of a full-width
            RMSNorm on queries (keys) before RoPE (OLMo-2's ``q_norm``/``k_norm``, of widths
            ``num_heads * head_dim`` and ``num_kv_heads * head_dim``), if any. A head moves with
            its slices; neither ``C`` nor ``B`` acts on them, and with either one ``C`` shrinks to
            sign flips, which commute with the gains (docs/spec.md, section 2, "Full-width QK-norm").
    """

    name: str
    width: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    pe: PositionalEncoding
    query: HeadSlot
    key: HeadSlot
    value: HeadSlot
    out: HeadSlot
    query_bias: HeadSlot | None = None
    key_bias: HeadSlot | None = None
    value_bias: HeadSlot | None = None
    out_bias: str | None = None
    rotary: RotaryLayout | None = None
    query_norm: str | None = None
    key_norm: str | None = None
    query_gain: HeadSlot | None = None
    key_gain: HeadSlot | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.name}: num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if (self.pe == "rope") != (self.rotary is not None):
            raise ValueError(f"{self.name}: a rotary layout is required exactly when pe == 'rope' (pe={self.pe!r})")

    @property
    def queries_per_kv(self) -> int:
        """Query heads served by each key/value head."""
        return self.num_heads // self.num_kv_heads

    @property
    def normalizes_queries_and_keys(self) -> bool:
        """Whether an RMSNorm on queries or keys (per head or full width) restricts ``C`` to sign flips."""
        return any(norm is not None for norm in (self.query_norm, self.key_norm, self.query_gain, self.key_gain))

    @property
    def slots(self) -> tuple[HeadSlot, ...]:
        """The slots present (what the group acts on), projections first, then the biases and the gains."""
        slots = (self.query, self.key, self.value, self.out, self.query_bias, self.key_bias, self.value_bias)
        slots += (self.query_gain, self.key_gain)
        return tuple(slot for slot in slots if slot is not None)

    @property
    def parameters(self) -> tuple[str, ...]:
        """Names of every parameter this layer owns, in first-seen order."""
        names = [slot.parameter for slot in self.slots]
        names += [name for name in (self.out_bias, self.query_norm, self.key_norm) if name is not None]
        return tuple(dict.fromkeys(names))


@dataclass(frozen=True)
class AxisPermutation:
    """One permutation acting on the same-sized axis of several parameters.

    ``new.index_select(axis, perm)`` is applied to every ``(parameter, axis)`` pair: a
    hidden unit (or residual coordinate) moves together everywhere it appears. An axis
    ``k * size`` long holds ``k`` stacked copies (a fused ``[up | gate]`` projection) and
    each copy is permuted alike. An axis listed in ``offsets`` holds one copy at entries
    ``offset .. offset + size - 1`` and keeps its other entries in place (the register tokens'
    rows of a ViT's ``pos_embed``, after the class token's row and before the patches').

    Attributes:
        name: What is permuted (for messages and reports).
        size: Number of units permuted.
        axes: ``(parameter name, axis)`` pairs.
        readers: Modules whose first positional input holds the permuted units as its last
            axis, ``(B, T, size)`` or ``(B, size)``: an FFN's output projection reads its hidden
            units, the norms on the residual stream read the stream. Activation matching
            correlates these inputs; empty where the adapter names none.
        writers: Modules whose output holds the permuted units as its last axis (``k * size``
            long: ``k`` stacked copies): an FFN's input projections (up, and gate if gated).
            Activation matching also correlates these outputs, since a gated unit's activation
            (gate times up) does not tell its gate and up weights apart.
        offsets: ``((parameter name, axis), offset)`` for the axes of ``axes`` whose units are a
            sub-range starting at ``offset`` (``0`` included); every other axis is whole copies.
        signs: The sign flips that act with the permutation (:data:`SignGroup`): a unit's entries are
            multiplied by its sign on every axis but those of ``unsigned``.
        unsigned: The axes of ``axes`` the signs leave alone, which the permutation only moves: a norm's gain
            (``g * D x / rms(D x) = D (g * x / rms(x))``), a layer scale multiplying a writer's output.
    """

    name: str
    size: int
    axes: tuple[tuple[str, int], ...]
    readers: tuple[str, ...] = ()
    writers: tuple[str, ...] = ()
    offsets: tuple[tuple[tuple[str, int], int], ...] = ()
    signs: SignGroup = "none"
    unsigned: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if stray := [axis for axis in self.unsigned if axis not in self.axes]:
            raise ValueError(f"{self.name}: unsigned axes {stray} are not among the permutation's axes")

    def restricted(self, axes: Iterable[tuple[str, int]]) -> AxisPermutation:
        """The same units over ``axes`` only (a part of :attr:`axes`), the unsigned ones among them kept so."""
        axes = tuple(axes)
        return replace(self, axes=axes, unsigned=tuple(axis for axis in self.unsigned if axis in axes))

    def span(self, axis: tuple[str, int], length: int) -> tuple[int, int]:
        """The entries ``[start, stop)`` the units occupy on ``axis``, ``length`` entries long.

        Raises:
            ValueError: The units do not fit: a sub-range running past the axis's end, or a whole
                axis that is not a multiple of ``size`` long.
        """
        offsets = dict(self.offsets)
        if axis in offsets:
            start = offsets[axis]
            if start < 0 or start + self.size > length:
                raise ValueError(
                    f"{self.name}: {axis[0]} has {length} entries on axis {axis[1]}, "
                    f"too few for {self.size} units from entry {start}"
                )
            return start, start + self.size
        if length == 0 or length % self.size:
            raise ValueError(
                f"{self.name}: {axis[0]} has {length} entries on axis {axis[1]}, not a multiple of {self.size}"
            )
        return 0, length

    def index(self, axis: tuple[str, int], length: int, perm: torch.Tensor) -> torch.Tensor:
        """The index ``(length,)`` that moves ``axis`` by ``perm`` ``(size,)``: ``new = old.index_select(axis, index)``.

        Each stacked copy of the units is permuted alike; entries outside the units keep their place.
        """
        import torch

        start, stop = self.span(axis, length)
        index = torch.arange(length)
        index[start:stop] = torch.cat([perm.cpu() + first for first in range(start, stop, self.size)])
        return index

    def sign_vector(self, axis: tuple[str, int], length: int, signs: torch.Tensor) -> torch.Tensor:
        """The factor ``(length,)`` of each entry of ``axis`` after the permutation: the units' ``signs``
        ``(size,)`` on each stacked copy, ``1`` on the entries outside the units and on an unsigned axis."""
        import torch

        factor = torch.ones(length, dtype=signs.dtype)
        if axis not in self.unsigned:
            start, stop = self.span(axis, length)
            factor[start:stop] = signs.cpu().repeat((stop - start) // self.size)
        return factor


@dataclass(frozen=True)
class FixedAxes:
    """Parameter axes that no group acts on, for one reason (docs/spec.md, section 2, "Every axis explained").

    Attributes:
        reason: What indexes them (:data:`FixedReason`).
        axes: ``(parameter name, axis)`` pairs.
    """

    reason: FixedReason
    axes: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class FeedForwardSpec:
    """A feed-forward network whose hidden units permute.

    Attributes:
        hidden: The permutation of hidden units (``W_in`` columns and bias, gate and up
            projections together, ``W_out`` rows).
        parameters: Every parameter the network owns (its output bias included).
        scales: The units' scales, ``None`` where none keeps the function (a GELU unit, a norm over the units).
    """

    hidden: AxisPermutation
    parameters: tuple[str, ...]
    scales: UnitScales | None = None


@dataclass(frozen=True)
class BlockSpec:
    """One Transformer block: an attention layer and (optionally) its feed-forward network."""

    attention: AttentionSpec
    feed_forward: FeedForwardSpec | None = None


@dataclass(frozen=True)
class SymmetrySpec:
    """Every symmetry lmc knows for one model.

    Attributes:
        blocks: The Transformer blocks, input to output.
        residual: The residual-stream permutation, or ``None`` where a fixed tensor (a
            sinusoidal position table held as a buffer) is added to the stream and so no
            non-trivial permutation of it is a symmetry.
        residual_note: Why ``residual`` is ``None``, for error messages.
        fixed: Parameters that are constants of the architecture, never trained nor
            re-initialized (RoFormer's sinusoidal table is stored as a frozen parameter).
        task_heads: Units outside the blocks that permute on their own, like FFN hidden units:
            task heads' hidden units between two linear maps with an elementwise nonlinearity
            of their own (BERT's tanh pooler, RoFormer's classifier MLP), and an embedding
            space read by a projection into the stream (RoFormer with ``embedding_size !=
            hidden_size``). Only ``full_model`` moves them.
        tokens: The permutation of learned tokens the model puts in every sequence, each reaching
            the layers the same way whatever its place (timm's register tokens: no position of their
            own, or their own rows of the position table, which move with them), or ``None``. Its
            units are parameters, the same for every input, so it is matched by weight whatever the
            unit matching. Only ``full_model`` moves it.
        folds: The norms on the residual stream whose gains (and biases) their readers can absorb
            (:func:`~lmc.symmetry.folds.fold_parameters_`; docs/spec.md, section 2, "Folding the norms"); a norm
            whose output the stream itself or a tied head also reads is not among them.
        fixed_axes: The axes of the model's parameters that no group acts on, each with its reason
            (vocabulary rows, class logits, position tables, pixels). With the groups above they
            explain every axis of every parameter (:func:`lmc.symmetry.axes.unexplained_axes`); an
            axis a group moves in part (``AxisPermutation.offsets``) is declared by what fixes its other entries.
    """

    blocks: tuple[BlockSpec, ...]
    residual: AxisPermutation | None = None
    residual_note: str = field(default="", compare=False)
    fixed: tuple[str, ...] = ()
    task_heads: tuple[AxisPermutation, ...] = ()
    tokens: AxisPermutation | None = None
    fixed_axes: tuple[FixedAxes, ...] = ()
    folds: tuple[NormFold, ...] = ()

    @property
    def attention(self) -> tuple[AttentionSpec, ...]:
        """The attention layers, input to output."""
        return tuple(block.attention for block in self.blocks)


def check_scope(scope: str) -> None:
    """Raise ``ValueError`` unless ``scope`` is one of :data:`SCOPES`."""
    if scope not in SCOPES:
        raise ValueError(f"unknown scope {scope!r}; choose one of {', '.join(SCOPES)}")


def scope_blocks(spec: SymmetrySpec, scope: Scope) -> tuple[list[int], list[int], bool]:
    """What a scope covers: its attention layers, its FFNs and whether it is the whole model.

    The whole model adds the residual-stream permutation, the task heads' hidden units and the token permutation.
    """
    check_scope(scope)
    every = list(range(len(spec.blocks)))
    attention = [0] if scope in ("first_attention", "first_block") else every
    feed_forward = {"first_attention": [], "all_attention": [], "first_block": [0], "full_model": every}[scope]
    return attention, [i for i in feed_forward if spec.blocks[i].feed_forward is not None], scope == "full_model"


def scope_parameter_names(spec: SymmetrySpec, scope: Scope, names: Iterable[str]) -> list[str]:
    """The parameters among ``names`` that a scope re-initializes (docs/spec.md, section 5), in their order.

    ``full_model`` is every parameter but the architecture's constants (``spec.fixed``); the
    others are the attention layers' projections, biases and norms, plus for ``first_block`` the
    first feed-forward network.
    """
    attention, feed_forward, whole = scope_blocks(spec, scope)
    owned = {p for i in attention for p in spec.blocks[i].attention.parameters}
    owned |= {p for i in feed_forward for p in spec.blocks[i].feed_forward.parameters}
    fixed = set(spec.fixed)
    return [name for name in names if (whole and name not in fixed) or name in owned]
