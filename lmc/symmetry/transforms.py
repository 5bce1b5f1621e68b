"""Group elements and their action on weights (docs/spec.md, section 2).

An attention element is ``(sigma, C_1..C_{h_kv}, B_1..B_{h_kv})``: a permutation of heads,
then per key/value head one ``C`` on Q/K and one ``B`` on V/O. It maps

    W_Q^i -> W_Q^sigma(i) C_g(i)        W_K^g -> W_K^sigma_kv(g) C_g^{-T}
    W_V^g -> W_V^sigma_kv(g) B_g        W_O^i -> B_g(i)^{-1} W_O^sigma(i)

(biases like their weights, ``b_O`` unchanged); the gain slices of a full-width QK-norm move with
their heads alone (``g_Q^i -> g_Q^sigma(i)``, ``g_K^g -> g_K^sigma_kv(g)``). Without GQA ``g(i) = i`` and both
permutations coincide. Permutations act on axes as ``new = old.index_select(axis, perm)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from lmc.symmetry.groups import QKGroup, TiedGroup, general_linear, rotary_commutant, sign_flips
from lmc.symmetry.rotations import residual_group, rotate_axes, sample_rotation
from lmc.symmetry.scales import sample_scales, scale_units
from lmc.symmetry.spec import AttentionSpec, AxisPermutation, Scope, SymmetrySpec, scope_blocks
from lmc.symmetry.weights import AttentionWeights, read_attention, write_attention


def qk_group(spec: AttentionSpec) -> QKGroup:
    """The group of ``C`` (Q/K) for this layer: ``GL(d_h)``, the commutant of its RoPE rotations, or
    with a norm on queries or keys (per head or full width) the sign flips of its rotary pairs and other coordinates."""
    if spec.normalizes_queries_and_keys:
        return sign_flips(spec.head_dim, spec.rotary)
    if spec.rotary is None:
        return general_linear(spec.head_dim)
    return rotary_commutant(spec.head_dim, spec.rotary)


def vo_group(spec: AttentionSpec) -> TiedGroup:
    """The group of ``B`` (V/O): always ``GL(d_h)``."""
    return general_linear(spec.head_dim)


@dataclass(frozen=True)
class AttentionTransform:
    """One element of the attention group of a layer.

    Attributes:
        query_permutation: ``(num_heads,)``; new query head ``i`` is old head ``perm[i]``.
        kv_permutation: ``(num_kv_heads,)``; the same for key/value heads. Query heads must
            move with their key/value head: ``perm[i] // q == kv_perm[i // q]``.
        qk: ``C`` per key/value head, ``(num_kv_heads, head_dim, head_dim)``.
        vo: ``B`` per key/value head, ``(num_kv_heads, head_dim, head_dim)``.
    """

    query_permutation: torch.Tensor
    kv_permutation: torch.Tensor
    qk: torch.Tensor
    vo: torch.Tensor

    @classmethod
    def identity(cls, spec: AttentionSpec, dtype: torch.dtype = torch.float64) -> AttentionTransform:
        eye = torch.eye(spec.head_dim, dtype=dtype).expand(spec.num_kv_heads, -1, -1).clone()
        return cls(torch.arange(spec.num_heads), torch.arange(spec.num_kv_heads), eye, eye.clone())

    @property
    def queries_per_kv(self) -> int:
        return self.query_permutation.numel() // self.kv_permutation.numel()

    def inverse(self) -> AttentionTransform:
        """The element ``g^-1`` with ``g^-1 (g theta) = theta``."""
        query_inverse = torch.argsort(self.query_permutation)
        kv_inverse = torch.argsort(self.kv_permutation)
        return AttentionTransform(
            query_inverse, kv_inverse, torch.linalg.inv(self.qk[kv_inverse]), torch.linalg.inv(self.vo[kv_inverse])
        )

    def compose(self, then: AttentionTransform) -> AttentionTransform:
        """The element ``then o self``: apply ``self`` first, then ``then`` (on ``self``'s device).

        ``then`` may come from Stage 2, computed where the weights live; ``self`` from the CPU.
        """
        return AttentionTransform(
            self.query_permutation[then.query_permutation],
            self.kv_permutation[then.kv_permutation],
            self.qk[then.kv_permutation] @ then.qk.to(self.qk.device),
            self.vo[then.kv_permutation] @ then.vo.to(self.vo.device),
        )

    def validate(self, spec: AttentionSpec, rtol: float = 1e-8) -> None:
        """Raise ``ValueError`` unless this is an element of the layer's group."""
        h, h_kv, d_h = spec.num_heads, spec.num_kv_heads, spec.head_dim
        for name, perm, n in (
            ("query_permutation", self.query_permutation, h),
            ("kv_permutation", self.kv_permutation, h_kv),
        ):
            if perm.shape != (n,) or not torch.equal(perm.sort().values, torch.arange(n)):
                raise ValueError(f"{spec.name}: {name} is not a permutation of {n} heads: {perm.tolist()}")
        q = spec.queries_per_kv
        if not torch.equal(self.query_permutation // q, self.kv_permutation.repeat_interleave(q)):
            raise ValueError(f"{spec.name}: the query permutation moves a head out of its key/value group")
        for name, matrices, group in (("qk", self.qk, qk_group(spec)), ("vo", self.vo, vo_group(spec))):
            if matrices.shape != (h_kv, d_h, d_h):
                raise ValueError(f"{spec.name}: {name} must have shape {(h_kv, d_h, d_h)}, got {tuple(matrices.shape)}")
            if not group.contains(matrices.double(), rtol=rtol):
                raise ValueError(f"{spec.name}: {name} is not in the layer's {group.name}({d_h}) group")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype lmc's linear algebra runs in for weights stored in ``dtype``.

    ``float32`` and ``float64`` stay; ``float16`` and ``bfloat16`` compute in ``float32`` (PyTorch
    has no half-precision matrix inverse, and Gram matrices of half-precision weights overflow).
    """
    return torch.promote_types(dtype, torch.float32)


def transform_attention(weights: AttentionWeights, transform: AttentionTransform) -> AttentionWeights:
    """Apply ``transform`` to per-head weights.

    Computed in :func:`compute_dtype` of the weights' dtype and returned in the weights' dtype.
    No membership check is made: tests use this to apply elements *outside* the group. The gain slices
    of a full-width QK-norm are only permuted (:data:`~lmc.symmetry.spec.HEAD_ORDER_ONLY`).
    """
    stored = weights.query.dtype
    dtype = compute_dtype(stored)
    q = transform.queries_per_kv
    # Elements are sampled (and composed) on the CPU; the weights may live on an accelerator.
    qk, vo = (m.to(device=weights.query.device, dtype=dtype) for m in (transform.qk, transform.vo))
    qk_inverse_t, vo_inverse = torch.linalg.inv(qk).mT, torch.linalg.inv(vo)
    qk_per_query, vo_inverse_per_query = qk.repeat_interleave(q, 0), vo_inverse.repeat_interleave(q, 0)
    query_perm, kv_perm = transform.query_permutation, transform.kv_permutation

    def left(matrix: torch.Tensor, perm: torch.Tensor, matrices: torch.Tensor) -> torch.Tensor:
        return (matrix[perm].to(dtype) @ matrices).to(stored)

    def rows(bias: torch.Tensor | None, perm: torch.Tensor, matrices: torch.Tensor) -> torch.Tensor | None:
        return None if bias is None else left(bias.unsqueeze(1), perm, matrices).squeeze(1)

    def heads(gain: torch.Tensor | None, perm: torch.Tensor) -> torch.Tensor | None:
        return None if gain is None else gain[perm]

    return AttentionWeights(
        query=left(weights.query, query_perm, qk_per_query),
        key=left(weights.key, kv_perm, qk_inverse_t),
        value=left(weights.value, kv_perm, vo),
        out=(vo_inverse_per_query @ weights.out[query_perm].to(dtype)).to(stored),
        query_bias=rows(weights.query_bias, query_perm, qk_per_query),
        key_bias=rows(weights.key_bias, kv_perm, qk_inverse_t),
        value_bias=rows(weights.value_bias, kv_perm, vo),
        query_gain=heads(weights.query_gain, query_perm),
        key_gain=heads(weights.key_gain, kv_perm),
    )


@torch.no_grad()
def permute_axes(
    parameters: Mapping[str, torch.Tensor],
    permutation: AxisPermutation,
    perm: torch.Tensor | None,
    partial: bool = False,
    signs: torch.Tensor | None = None,
) -> None:
    """Apply one permutation (``None``: the identity), then the units' ``signs`` ``(size,)`` of ``+-1`` if given, to
    every axis it owns, in place (with ``partial``, those of the tensors present). Negation is exact in every dtype."""
    perm = torch.arange(permutation.size) if perm is None else perm
    for what, tensor in (("permutation", perm), ("signs", signs)):
        if tensor is not None and tensor.shape != (permutation.size,):
            raise ValueError(
                f"{permutation.name}: {what} must have shape ({permutation.size},), got {tuple(tensor.shape)}"
            )
    for name, axis in permutation.axes:
        if partial and name not in parameters:
            continue
        parameter = parameters[name]
        index = permutation.index((name, axis), parameter.shape[axis], perm)
        moved = parameter.index_select(axis, index.to(parameter.device))
        if signs is not None and (name, axis) not in permutation.unsigned:
            shape = [1] * parameter.dim()
            shape[axis] = -1
            factor = permutation.sign_vector((name, axis), parameter.shape[axis], signs)
            moved.mul_(factor.to(device=parameter.device, dtype=parameter.dtype).view(shape))
        parameter.copy_(moved)


def sample_signs(permutation: AxisPermutation, generator: torch.Generator) -> torch.Tensor | None:
    """Random signs ``(size,)`` of ``+-1`` (float64) from the permutation's sign group, ``None`` if it has none."""
    if permutation.signs == "none":
        return None
    count = permutation.size if permutation.signs == "each" else 1
    signs = 1.0 - 2.0 * torch.randint(2, (count,), generator=generator).double()
    return signs.expand(permutation.size).clone()


def _chain(first: torch.Tensor | None, second: torch.Tensor | None) -> torch.Tensor | None:
    """The permutation ``first`` then ``second`` (``None``: the identity)."""
    if first is None or second is None:
        return second if first is None else first
    return first[second]


def _chain_signs(
    first: torch.Tensor | None, second_perm: torch.Tensor | None, second: torch.Tensor | None
) -> torch.Tensor | None:
    """The signs of ``(perm_1, first)`` then ``(second_perm, second)``: ``first[second_perm] * second``."""
    if first is not None and second_perm is not None:
        first = first[second_perm.to(first.device)]
    if first is None or second is None:
        return second if first is None else first
    return first * second.to(first)


@dataclass
class ModelTransform:
    """A symmetry of a whole model: attention elements per layer, FFN, task-head, residual and token permutations.

    A unit permutation with a sign group (``AxisPermutation.signs``) may carry signs: unit ``i`` of the result is
    ``signs[i]`` times unit ``perm[i]`` of the input (on every axis but the unsigned ones).

    Attributes:
        attention: Layer index -> element; absent layers are left unchanged.
        feed_forward: Block index -> permutation of the FFN's hidden units.
        task_heads: Index into ``spec.task_heads`` -> permutation of that head's hidden units.
        residual: Permutation of the residual stream, or ``None``.
        tokens: Permutation of the learned tokens (``spec.tokens``), or ``None``.
        residual_signs: Signs ``(d,)`` of ``+-1`` of the residual coordinates after ``residual``, or ``None`` (all
            ``+1``).
        task_head_signs: Index into ``spec.task_heads`` -> signs of that head's units after its permutation.
        feed_forward_scales: Block index -> the FFN units' scales ``(size,)`` after its permutation
            (:func:`scale_units`): an element of the extended group (``unit_scales``).
        residual_rotation: An orthogonal ``Q`` ``(d, d)`` (float64) applied to the residual coordinates after
            ``residual`` and ``residual_signs`` (:func:`~lmc.symmetry.rotations.rotate_axes`), or ``None``: an element
            of the extended group, a symmetry only once the norms are folded (:mod:`lmc.symmetry.rotations`).
    """

    attention: dict[int, AttentionTransform] = field(default_factory=dict)
    feed_forward: dict[int, torch.Tensor] = field(default_factory=dict)
    task_heads: dict[int, torch.Tensor] = field(default_factory=dict)
    residual: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    residual_signs: torch.Tensor | None = None
    task_head_signs: dict[int, torch.Tensor] = field(default_factory=dict)
    residual_rotation: torch.Tensor | None = None
    feed_forward_scales: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def residual_flips(self) -> int:
        """Residual coordinates whose sign the element flips."""
        return 0 if self.residual_signs is None else int((self.residual_signs < 0).sum())

    def compose(self, then: ModelTransform, spec: SymmetrySpec) -> ModelTransform:
        """The transform ``then o self``: apply ``self`` first, then ``then``."""
        attention = {}
        for i in sorted(self.attention.keys() | then.attention.keys()):
            identity = AttentionTransform.identity(spec.blocks[i].attention)
            attention[i] = self.attention.get(i, identity).compose(then.attention.get(i, identity))

        def chain_each(first: dict[int, torch.Tensor], second: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
            return {i: _chain(first.get(i), second.get(i)) for i in sorted(first.keys() | second.keys())}

        head_signs = {
            i: _chain_signs(self.task_head_signs.get(i), then.task_heads.get(i), then.task_head_signs.get(i))
            for i in sorted(self.task_head_signs.keys() | then.task_head_signs.keys())
        }
        scales = {
            i: _chain_signs(self.feed_forward_scales.get(i), then.feed_forward.get(i), then.feed_forward_scales.get(i))
            for i in sorted(self.feed_forward_scales.keys() | then.feed_forward_scales.keys())
        }
        residual = _chain(self.residual, then.residual)
        residual_signs = _chain_signs(self.residual_signs, then.residual, then.residual_signs)
        rotation = None
        if self.residual_rotation is not None or then.residual_rotation is not None:
            # A rotation does not commute with a permutation: the whole residual element as one matrix.
            rotation = then.residual_matrix(spec.residual.size) @ self.residual_matrix(spec.residual.size)
            residual = residual_signs = None
        return ModelTransform(
            attention,
            chain_each(self.feed_forward, then.feed_forward),
            chain_each(self.task_heads, then.task_heads),
            residual,
            _chain(self.tokens, then.tokens),
            residual_signs,
            head_signs,
            rotation,
            scales,
        )

    def residual_matrix(self, width: int) -> torch.Tensor:
        """The residual element as one matrix ``(d, d)`` (float64): ``x -> Q S P x``."""
        perm = torch.arange(width) if self.residual is None else self.residual.cpu()
        signs = torch.ones(width, dtype=torch.float64) if self.residual_signs is None else self.residual_signs
        matrix = torch.zeros(width, width, dtype=torch.float64)
        matrix[torch.arange(width), perm] = signs.cpu().double()
        return matrix if self.residual_rotation is None else self.residual_rotation.cpu().double() @ matrix

    def apply_(self, parameters: Mapping[str, torch.Tensor], spec: SymmetrySpec, partial: bool = False) -> None:
        """Transform the parameters in place (``dict(model.named_parameters())``).

        With ``partial``, ``parameters`` may hold some of the model's tensors only (a streamed
        alignment reads a few at a time): those are transformed, each attention layer whole or not at all.
        """
        for index, transform in self.attention.items():
            layer = spec.blocks[index].attention
            if partial:
                present = [name in parameters for name in layer.parameters]
                if not any(present):
                    continue
                if not all(present):
                    raise ValueError(f"{layer.name}: transform all of its tensors together, {layer.parameters}")
            write_attention(parameters, layer, transform_attention(read_attention(parameters, layer), transform))
        for index, perm in self.feed_forward.items():
            feed_forward = spec.blocks[index].feed_forward
            if feed_forward is None:
                raise ValueError(f"block {index} has no feed-forward network to permute")
            permute_axes(parameters, feed_forward.hidden, perm, partial)
        for index, factors in self.feed_forward_scales.items():
            scale_units(parameters, spec.blocks[index].feed_forward, factors, partial)
        for index in sorted(self.task_heads.keys() | self.task_head_signs.keys()):
            head = spec.task_heads[index]
            permute_axes(parameters, head, self.task_heads.get(index), partial, self.task_head_signs.get(index))
        if self.residual is not None or self.residual_signs is not None or self.residual_rotation is not None:
            if spec.residual is None:
                raise ValueError(f"this model has no residual-stream symmetry: {spec.residual_note}")
            if self.residual is not None or self.residual_signs is not None:
                permute_axes(parameters, spec.residual, self.residual, partial, self.residual_signs)
            if self.residual_rotation is not None:
                rotate_axes(parameters, spec.residual, self.residual_rotation, partial)
        if self.tokens is not None:
            if spec.tokens is None:
                raise ValueError("this model has no learned tokens that permute")
            permute_axes(parameters, spec.tokens, self.tokens, partial)


def sample_attention_transform(
    spec: AttentionSpec, generator: torch.Generator, qk: QKGroup | None = None
) -> AttentionTransform:
    """A random, well-conditioned element of the layer's group (float64).

    Args:
        spec: The layer.
        generator: Source of randomness.
        qk: Draw ``C`` from this group instead of the layer's own (to build a transformation
            *outside* the symmetry group, e.g. ``GL`` on a RoPE layer).
    """
    kv_perm = torch.randperm(spec.num_kv_heads, generator=generator)
    q = spec.queries_per_kv
    inside = torch.stack([torch.randperm(q, generator=generator) for _ in range(spec.num_kv_heads)])
    query_perm = (kv_perm[:, None] * q + inside).flatten()
    return AttentionTransform(
        query_perm,
        kv_perm,
        (qk or qk_group(spec)).sample(spec.num_kv_heads, generator),
        vo_group(spec).sample(spec.num_kv_heads, generator),
    )


def sample_transform(
    spec: SymmetrySpec, scope: Scope, generator: torch.Generator, rotate: bool = False, scale: bool = False
) -> ModelTransform:
    """A random element of the scope's symmetry group (float64 matrices), signs included where a unit
    permutation has them (:func:`sample_signs`); with ``rotate``, for ``full_model``, a rotation of the stream
    from the group its family allows once folded (:func:`~lmc.symmetry.rotations.residual_group`) after them; with
    ``scale``, the FFN units' scales where they have them (:func:`sample_scales`)."""
    attention, feed_forward, whole = scope_blocks(spec, scope)
    transform = ModelTransform()
    for i in attention:
        transform.attention[i] = sample_attention_transform(spec.blocks[i].attention, generator)
    for i in feed_forward:
        hidden, scales = spec.blocks[i].feed_forward.hidden, spec.blocks[i].feed_forward.scales
        transform.feed_forward[i] = torch.randperm(hidden.size, generator=generator)
        if scale and scales is not None:
            transform.feed_forward_scales[i] = sample_scales(scales, hidden.size, generator)
    if whole:
        for i, head in enumerate(spec.task_heads):
            transform.task_heads[i] = torch.randperm(head.size, generator=generator)
            if (signs := sample_signs(head, generator)) is not None:
                transform.task_head_signs[i] = signs
        if spec.residual is not None:
            transform.residual = torch.randperm(spec.residual.size, generator=generator)
            transform.residual_signs = sample_signs(spec.residual, generator)
            if rotate and (group := residual_group(spec)).rotates:
                transform.residual_rotation = sample_rotation(group, generator)
        if spec.tokens is not None:
            transform.tokens = torch.randperm(spec.tokens.size, generator=generator)
    return transform
