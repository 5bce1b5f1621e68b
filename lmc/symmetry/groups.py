"""The per-head matrix groups of docs/spec.md, section 2: ``GL(d_h)`` and RoPE's ``H(d_h)`` and kin.

Every group here is the set of invertible matrices in a linear subspace whose entries are
tied (each entry is zero or ``+-`` one shared coordinate). That one description covers:

- ``GL(d_h)``: every entry free (vanilla attention, additive APE, and ``B`` on V/O);
- ``H(d_h)``: a scaled rotation ``[[a, b], [-b, a]]`` per rotary pair (RoPE, distinct frequencies);
- the general RoPE rule: pairs that turn by identical angles at every position mix under
  ``GL(k, C)`` (a realified complex block), pairs turning by opposite angles join them with
  their orientation flipped, and coordinates that never turn mix under real ``GL``.

Such a subspace is the commutant of the rotations the model applies, hence closed under
products and inverses; the exponential of any of its elements lies in the group, which is how
we sample well-conditioned elements.

A per-head RMSNorm on queries and keys (Qwen3's ``q_norm``/``k_norm``) leaves a finite group
instead: :class:`SignFlips`, one sign per rotary pair and per unrotated coordinate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmc.rotary import rotary_pairs
from lmc.symmetry.spec import RotaryLayout

# Two angles are "the same rotation" when cos and sin agree to this (angles come from
# float32 buffers in most models).
_ANGLE_TOLERANCE = 1e-4


@dataclass(frozen=True)
class TiedGroup:
    """Invertible ``dim x dim`` matrices whose entries follow a tying pattern.

    Entry ``(r, c)`` equals ``sign[r, c] * theta[index[r, c]]`` for a coordinate vector
    ``theta`` of length ``num_coordinates``; ``index == -1`` marks a structural zero.

    Attributes:
        name: ``"GL"`` when every entry is free, else ``"H"``.
        index: Coordinate of each entry, shape ``(dim, dim)``, ``-1`` for zero.
        sign: Sign of each entry, shape ``(dim, dim)``, ``0`` where ``index == -1``.
        complex_blocks: Oriented rotary pairs of each complex block ``GL(k, C)``, each of
            shape ``(k, 2)``; ``k == 1`` blocks are the scaled rotations of ``H``.
        real_coordinates: Coordinates of the real ``GL`` block (never rotated), shape ``(n,)``.
    """

    name: str
    index: torch.Tensor
    sign: torch.Tensor
    complex_blocks: tuple[torch.Tensor, ...]
    real_coordinates: torch.Tensor

    @property
    def dim(self) -> int:
        return self.index.shape[0]

    @property
    def num_coordinates(self) -> int:
        """Dimension of the group as a manifold (``dim**2`` for GL, ``dim`` for H)."""
        return int(self.index.max()) + 1

    def project(self, matrices: torch.Tensor) -> torch.Tensor:
        """Orthogonal (Frobenius) projection onto the subspace.

        Args:
            matrices: Shape ``(..., dim, dim)``.

        Returns:
            The nearest matrices of the subspace, same shape.
        """
        return self.from_coordinates(self.to_coordinates(matrices))

    def to_coordinates(self, matrices: torch.Tensor) -> torch.Tensor:
        """Least-squares coordinates of ``matrices``, shape ``(..., num_coordinates)``."""
        index, sign = self._flat(matrices.device)
        free = index >= 0
        values = matrices.flatten(-2)[..., free] * sign[free].to(matrices.dtype)
        sums = torch.zeros(*matrices.shape[:-2], self.num_coordinates, dtype=matrices.dtype, device=matrices.device)
        sums.index_add_(-1, index[free], values)
        counts = torch.bincount(index[free], minlength=self.num_coordinates).to(matrices.dtype)
        return sums / counts

    def coordinate_gradient(self, matrix_gradient: torch.Tensor) -> torch.Tensor:
        """The gradient in coordinates of ``f(from_coordinates(theta))`` given ``df/dC``.

        The adjoint of :meth:`from_coordinates`: each coordinate collects its signed entries.
        """
        index, sign = self._flat(matrix_gradient.device)
        free = index >= 0
        values = matrix_gradient.flatten(-2)[..., free] * sign[free].to(matrix_gradient.dtype)
        gradient = torch.zeros(
            *matrix_gradient.shape[:-2],
            self.num_coordinates,
            dtype=matrix_gradient.dtype,
            device=matrix_gradient.device,
        )
        return gradient.index_add_(-1, index[free], values)

    def from_coordinates(self, coordinates: torch.Tensor) -> torch.Tensor:
        """Matrices with the given coordinates, shape ``(..., dim, dim)``."""
        index, sign = self._flat(coordinates.device)
        entries = coordinates[..., index.clamp(min=0)] * sign.to(coordinates.dtype)
        return entries.unflatten(-1, (self.dim, self.dim))

    def contains(self, matrices: torch.Tensor, rtol: float = 1e-10) -> bool:
        """Whether every matrix lies in the subspace (to ``rtol``) and is invertible."""
        residual = torch.linalg.matrix_norm(matrices - self.project(matrices))
        scale = torch.linalg.matrix_norm(matrices).clamp(min=torch.finfo(matrices.dtype).tiny)
        in_subspace = bool((residual <= rtol * scale).all())
        return in_subspace and bool((torch.linalg.matrix_rank(matrices) == self.dim).all())

    def sample(
        self, count: int, generator: torch.Generator, scale: float = 0.7, dtype: torch.dtype = torch.float64
    ) -> torch.Tensor:
        """Random well-conditioned elements ``exp(A)``, ``A`` in the subspace.

        ``A`` is a projected Gaussian scaled to spectral norm about ``scale``, so the
        condition number stays below about ``exp(2 * scale)``.

        Returns:
            Shape ``(count, dim, dim)``.
        """
        noise = torch.randn(count, self.dim, self.dim, generator=generator, dtype=torch.float64)
        tangent = self.project(noise)
        tangent = tangent * (scale / torch.linalg.matrix_norm(tangent, ord=2)[:, None, None])
        return torch.linalg.matrix_exp(tangent).to(dtype)

    def nearest_orthogonal(self, correlations: torch.Tensor) -> torch.Tensor:
        """The orthogonal elements ``C`` of the group maximizing ``<C, M>`` (orthogonal Procrustes).

        Per block: the polar factor of the block of ``M`` (real ``GL`` blocks), of its complex
        form (``GL(k, C)`` blocks, unitary), so for ``H`` the best rotation of each pair.
        ``min ||W C - W'||^2`` over orthogonal ``C`` is solved by ``M = W^T W'``.

        Args:
            correlations: ``M``, shape ``(..., dim, dim)``.

        Returns:
            Orthogonal matrices of the group, same shape.
        """
        M = self.project(correlations)
        result = torch.zeros_like(M)
        if self.real_coordinates.numel():
            coords = self.real_coordinates.to(M.device)
            block = M[..., coords[:, None], coords[None, :]]
            u, _, vh = torch.linalg.svd(block)
            result[..., coords[:, None], coords[None, :]] = u @ vh
        for size in sorted({len(block) for block in self.complex_blocks}):
            blocks = torch.stack([b for b in self.complex_blocks if len(b) == size]).to(M.device)  # (n, k, 2)
            xs, ys = blocks[..., 0], blocks[..., 1]  # (n, k)
            rows_x, cols_x = xs[:, :, None], xs[:, None, :]
            rows_y, cols_y = ys[:, :, None], ys[:, None, :]
            # The realified block is [[A, B], [-B, A]] <-> A + iB; <C, M> = 2 Re tr(U^H (A + iB)).
            z = torch.complex(M[..., rows_x, cols_x], M[..., rows_x, cols_y])  # (..., n, k, k)
            u, _, vh = torch.linalg.svd(z)
            unitary = u @ vh
            result[..., rows_x, cols_x] = unitary.real
            result[..., rows_y, cols_y] = unitary.real
            result[..., rows_x, cols_y] = unitary.imag
            result[..., rows_y, cols_x] = -unitary.imag
        return result

    def _flat(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return self.index.flatten().to(device), self.sign.flatten().to(device)


@dataclass(frozen=True)
class SignFlips:
    """The finite group of ``diag(eps)``, ``eps`` in ``{+1, -1}``, one sign per block of coordinates.

    The Q/K group of attention with a per-head RMSNorm on queries and keys whose gains are
    generic (docs/spec.md, section 2, "Per-head QK-norm"): each rotary pair flips as a whole,
    each unrotated coordinate alone. It has no continuous part (``num_coordinates == 0``) and
    every element is orthogonal, so :meth:`nearest_orthogonal` is the exact best element for
    Stage 2; there is nothing to refine.

    Attributes:
        name: ``"signs"``.
        block: The block of each coordinate, shape ``(dim,)``: coordinates of one block share a sign.
    """

    name: str
    block: torch.Tensor

    @property
    def dim(self) -> int:
        return self.block.numel()

    @property
    def num_blocks(self) -> int:
        return int(self.block.max()) + 1

    @property
    def num_coordinates(self) -> int:
        """Dimension of the group as a manifold: 0, a finite group of ``2 ** num_blocks`` elements."""
        return 0

    def elements(self, signs: torch.Tensor) -> torch.Tensor:
        """The matrices of the given block signs, ``(..., num_blocks) -> (..., dim, dim)``."""
        return torch.diag_embed(signs[..., self.block.to(signs.device)])

    def nearest_orthogonal(self, correlations: torch.Tensor) -> torch.Tensor:
        """The elements ``C`` maximizing ``<C, M>``: per block, the sign of ``M``'s diagonal sum over it.

        Every element is orthogonal, so this is also the minimizer of the Stage 2 objective over
        the whole group (docs/spec.md, section 3): the finite search, solved block by block.

        Args:
            correlations: ``M``, shape ``(..., dim, dim)``.

        Returns:
            Elements of the group, same shape.
        """
        diagonal = torch.diagonal(correlations, dim1=-2, dim2=-1)
        sums = torch.zeros(*diagonal.shape[:-1], self.num_blocks, dtype=diagonal.dtype, device=diagonal.device)
        sums.index_add_(-1, self.block.to(diagonal.device), diagonal)
        return self.elements(torch.where(sums >= 0, 1.0, -1.0).to(correlations.dtype))

    def contains(self, matrices: torch.Tensor, rtol: float = 1e-10) -> bool:
        """Whether every matrix is one of the group's sign matrices (to ``rtol``)."""
        residual = torch.linalg.matrix_norm(matrices - self.nearest_orthogonal(matrices))
        return bool((residual <= rtol * self.dim**0.5).all())

    def sample(
        self, count: int, generator: torch.Generator, scale: float = 0.7, dtype: torch.dtype = torch.float64
    ) -> torch.Tensor:
        """Uniformly random elements, shape ``(count, dim, dim)`` (``scale`` has no role in a finite group)."""
        signs = torch.randint(2, (count, self.num_blocks), generator=generator) * 2 - 1
        return self.elements(signs.to(dtype))

    def to_coordinates(self, matrices: torch.Tensor) -> torch.Tensor:
        """No coordinates: shape ``(..., 0)``."""
        return matrices.new_zeros(*matrices.shape[:-2], 0)

    def from_coordinates(self, coordinates: torch.Tensor) -> torch.Tensor:
        """The identity (the group's only element near it), ``(..., 0) -> (..., dim, dim)``; differentiable."""
        eye = torch.eye(self.dim, dtype=coordinates.dtype, device=coordinates.device)
        return eye + coordinates.sum(-1)[..., None, None]  # the empty sum keeps the coordinates in the graph


QKGroup = TiedGroup | SignFlips
"""A group ``C`` of Q/K lies in: tied (``GL``, ``H`` and kin) or finite (sign flips)."""


def sign_flips(head_dim: int, rotary: RotaryLayout | None) -> SignFlips:
    """One sign per rotary pair and per unrotated coordinate of a head of width ``head_dim``."""
    block = torch.full((head_dim,), -1, dtype=torch.long)
    pairs = rotary.pairs.tolist() if rotary is not None else []
    for j, (first, second) in enumerate(pairs):
        block[first] = block[second] = j
    unrotated = (block < 0).nonzero().flatten()
    block[unrotated] = torch.arange(len(pairs), len(pairs) + len(unrotated))
    return SignFlips(name="signs", block=block)


def general_linear(dim: int) -> TiedGroup:
    """``GL(dim)``: every entry is its own coordinate."""
    return TiedGroup(
        name="GL",
        index=torch.arange(dim * dim).reshape(dim, dim),
        sign=torch.ones(dim, dim, dtype=torch.int8),
        complex_blocks=(),
        real_coordinates=torch.arange(dim),
    )


def rotary_commutant(head_dim: int, rotary: RotaryLayout) -> TiedGroup:
    """The group of matrices commuting with every rotation of ``rotary`` (docs/spec.md, section 2).

    Pairs are grouped by their angle sequences: identical sequences form one complex block
    ``GL(k, C)``; a pair with the opposite sequence joins with its two coordinates swapped
    (``x2 + i x1 = i * conj(x1 + i x2)`` turns the other way); pairs that never turn join
    the unrotated coordinates in one real ``GL`` block.

    Args:
        head_dim: Head width ``d_h``.
        rotary: Pairs and the angles each turns by at each position.

    Returns:
        The group; ``H(d_h)`` when all pairs turn distinctly and every coordinate rotates.
    """
    pairs = rotary.pairs.tolist()
    cos, sin = rotary.angles.double().cos(), rotary.angles.double().sin()
    if len({c for pair in pairs for c in pair}) != 2 * len(pairs) or max(max(p) for p in pairs) >= head_dim:
        raise ValueError(f"rotary pairs must be distinct coordinates below head_dim={head_dim}, got {pairs}")

    classes: list[tuple[int, list[tuple[int, int]]]] = []  # (representative pair, oriented pairs)
    still: list[int] = sorted(set(range(head_dim)) - {c for pair in pairs for c in pair})
    for j, (first, second) in enumerate(pairs):
        if torch.allclose(cos[:, j], torch.ones_like(cos[:, j]), atol=_ANGLE_TOLERANCE) and torch.allclose(
            sin[:, j], torch.zeros_like(sin[:, j]), atol=_ANGLE_TOLERANCE
        ):
            still += [first, second]
            continue
        for representative, members in classes:
            if not torch.allclose(cos[:, j], cos[:, representative], atol=_ANGLE_TOLERANCE):
                continue
            if torch.allclose(sin[:, j], sin[:, representative], atol=_ANGLE_TOLERANCE):
                members.append((first, second))
                break
            if torch.allclose(sin[:, j], -sin[:, representative], atol=_ANGLE_TOLERANCE):
                members.append((second, first))
                break
        else:
            classes.append((j, [(first, second)]))

    index = torch.full((head_dim, head_dim), -1, dtype=torch.long)
    sign = torch.zeros(head_dim, head_dim, dtype=torch.int8)
    next_coordinate = 0
    for _, members in classes:
        # Realified complex matrix M = A + iB acting on rows: [x, y] -> [x, y] @ [[A, B], [-B, A]].
        k = len(members)
        real_part = torch.arange(k * k).reshape(k, k) + next_coordinate
        imaginary_part = real_part + k * k
        next_coordinate += 2 * k * k
        xs = torch.tensor([m[0] for m in members])
        ys = torch.tensor([m[1] for m in members])
        for rows, cols, part, s in (
            (xs, xs, real_part, 1),
            (ys, ys, real_part, 1),
            (xs, ys, imaginary_part, 1),
            (ys, xs, imaginary_part, -1),
        ):
            index[rows[:, None], cols[None, :]] = part
            sign[rows[:, None], cols[None, :]] = s
    if still:
        coords = torch.tensor(still)
        index[coords[:, None], coords[None, :]] = (
            torch.arange(len(still) ** 2).reshape(len(still), -1) + next_coordinate
        )
        sign[coords[:, None], coords[None, :]] = 1

    return TiedGroup(
        name="H" if classes else "GL",
        index=index,
        sign=sign,
        complex_blocks=tuple(torch.tensor(members, dtype=torch.long) for _, members in classes),
        real_coordinates=torch.tensor(still, dtype=torch.long),
    )


def other_pair_layout(rotary: RotaryLayout) -> RotaryLayout:
    """The same angles on the other 1-D pairing (``half`` <-> ``interleaved``).

    An ``H`` built from it is *not* a symmetry of the model: a diagnostic that the layout an
    adapter declares is the one the model uses.
    """
    pairs = rotary.pairs
    interleaved = rotary_pairs("interleaved", rotary.rotary_dim)
    other = "half" if torch.equal(pairs, interleaved) else "interleaved"
    return RotaryLayout(kind=rotary.kind, pairs=rotary_pairs(other, rotary.rotary_dim), angles=rotary.angles)
