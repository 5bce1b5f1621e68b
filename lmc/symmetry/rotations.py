"""Rotations of the residual stream once the norms are folded (docs/spec.md, section 2, "Rotations of the stream").

With every gain on the stream folded into its readers (:mod:`lmc.symmetry.folds`), an RMSNorm commutes with every
orthogonal ``Q`` (``rms(Q x) = rms(x)``) and a LayerNorm with every ``Q`` that maps the all-ones direction to plus or
minus itself (its mean subtraction is the projection off that direction). Embedding rows, writers' output rows and
readers' input columns then all move by ``Q`` and the function is unchanged: a continuous group of dimension
``d (d - 1) / 2`` (``O(d)``) or ``(d - 1) (d - 2) / 2`` (``O(d - 1)`` times the global sign).

The group of a family follows from its spec: a gain that does not fold (a post-norm, a norm on a sublayer's output,
the final norm under a tied head, a layer scale) must commute with ``Q``, which for gains with distinct entries
leaves only the signed permutations the default group already has; a stream without signs (a max over tokens) has
no rotation either.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from lmc.symmetry.spec import AxisPermutation, SymmetrySpec

ResidualKind = Literal["signed_permutation", "orthogonal", "centered_orthogonal"]


@dataclass(frozen=True)
class ResidualGroup:
    """The residual-stream group a family allows once its foldable norms are folded.

    Attributes:
        kind: ``orthogonal`` (``O(d)``: RMSNorm streams), ``centered_orthogonal`` (the ``Q`` with ``Q 1 = +-1``:
            LayerNorm streams), or ``signed_permutation`` (no rotation: the default group's residual part).
        width: ``d``, the stream's width.
        reason: Why the group is no larger, for reports (empty for the rotations).
    """

    kind: ResidualKind
    width: int
    reason: str = ""

    @property
    def rotates(self) -> bool:
        return self.kind != "signed_permutation"

    @property
    def centered(self) -> bool:
        """Whether ``Q`` must fix the all-ones direction up to sign (a LayerNorm's mean subtraction)."""
        return self.kind == "centered_orthogonal"

    @property
    def dimension(self) -> int:
        """The dimension of the group's continuous part (0 for the signed permutations)."""
        free = {"orthogonal": self.width, "centered_orthogonal": self.width - 1}.get(self.kind, 1)
        return free * (free - 1) // 2

    @property
    def name(self) -> str:
        """``O(d)``, ``O(d-1) x Z2`` or the signed permutations, with ``d`` written out."""
        if self.kind == "orthogonal":
            return f"O({self.width})"
        if self.kind == "centered_orthogonal":
            return f"O({self.width - 1}) x Z2"
        return f"signed permutations of {self.width}"


def residual_group(spec: SymmetrySpec) -> ResidualGroup | None:
    """The residual group of ``spec``'s model after :func:`~lmc.symmetry.folds.fold_parameters_` of its folds;
    ``None`` where the stream has no symmetry at all (``spec.residual`` is ``None``)."""
    residual = spec.residual
    if residual is None:
        return None
    if residual.signs == "none":
        return ResidualGroup("signed_permutation", residual.size, "a max over tokens reads the stream")
    folded = {(fold.gain, 0) for fold in spec.folds if fold.gain is not None}
    if unfolded := [name for name, axis in residual.unsigned if (name, axis) not in folded]:
        return ResidualGroup(
            "signed_permutation",
            residual.size,
            f"{unfolded[0]} scales the stream and does not fold into linear readers, so a rotation must commute "
            "with it" + (f" ({len(unfolded)} such gains)" if len(unfolded) > 1 else ""),
        )
    return ResidualGroup("orthogonal" if residual.signs == "each" else "centered_orthogonal", residual.size)


def centered_basis(width: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """An orthonormal basis ``(d, d)`` whose first column is the all-ones direction ``1 / sqrt(d)``."""
    ones = torch.full((width, 1), width**-0.5, dtype=dtype)
    basis, _ = torch.linalg.qr(torch.cat([ones, torch.eye(width, dtype=dtype)[:, : width - 1]], dim=1))
    return basis * torch.sign(basis[0, 0] * ones[0, 0])  # the first column +1/sqrt(d), not its negative


def sample_rotation(group: ResidualGroup, generator: torch.Generator) -> torch.Tensor:
    """A random element ``(d, d)`` (float64) of ``group``'s rotations (Haar on ``O(d)`` or ``O(d - 1)``, a random
    global sign for the centered one)."""
    free = group.width - 1 if group.centered else group.width
    gaussian = torch.randn(free, free, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)
    rotation = q * torch.sign(torch.diagonal(r))
    if not group.centered:
        return rotation
    basis = centered_basis(group.width)
    sign = 1.0 - 2.0 * float(torch.randint(2, (1,), generator=generator))
    return basis @ torch.block_diag(torch.tensor([[sign]], dtype=torch.float64), rotation) @ basis.T


def in_group(rotation: torch.Tensor, group: ResidualGroup, atol: float = 1e-10) -> bool:
    """Whether ``rotation`` ``(d, d)`` is orthogonal and, for the centered group, maps ``1`` to ``+-1``."""
    eye = torch.eye(group.width, dtype=torch.float64)
    rotation = rotation.double().cpu()
    if rotation.shape != (group.width, group.width) or not torch.allclose(rotation @ rotation.T, eye, atol=atol):
        return False
    if group.centered:
        image = rotation.sum(dim=1)  # Q 1
        return bool(torch.allclose(image.abs(), torch.ones_like(image), atol=atol) and (image * image[0] > 0).all())
    return group.rotates or bool(((rotation.abs() > 0.5).sum(dim=1) == 1).all())


@torch.no_grad()
def rotate_axes(
    parameters: Mapping[str, torch.Tensor],
    permutation: AxisPermutation,
    rotation: torch.Tensor,
    partial: bool = False,
) -> None:
    """Move every axis of ``permutation`` but its unsigned ones (the folded gains, which ``Q`` leaves as they are)
    by ``rotation`` ``(d, d)``: entry ``i`` of the result is ``sum_j Q[i, j]`` entry ``j`` of the input, on each
    stacked copy; in place, computed in :func:`~lmc.symmetry.compute_dtype` of each parameter's dtype (float64 for
    float64, float32 for float32 and half precision: a rotation sums ``d`` products per entry, which float32 holds to
    about ``sqrt(d)`` of its rounding) and stored in the parameter's dtype (with ``partial``, the tensors present).

    Raises:
        ValueError: An unsigned axis is not constant: the norm it belongs to is not folded, and no rotation
            commutes with it.
    """
    size = permutation.size
    if rotation.shape != (size, size):
        raise ValueError(f"{permutation.name}: the rotation must have shape ({size}, {size}), got {rotation.shape}")
    for name, axis in permutation.axes:
        if partial and name not in parameters:
            continue
        parameter = parameters[name]
        if (name, axis) in permutation.unsigned:
            if bool((parameter != parameter.flatten()[0]).any()):
                raise ValueError(
                    f"{name} is not constant, so no rotation of the stream commutes with it: fold the norms first "
                    "(lmc.adapters.fold_norms)"
                )
            continue
        start, stop = permutation.span((name, axis), parameter.shape[axis])
        compute = torch.promote_types(parameter.dtype, torch.float32)
        moved = parameter.to(compute).movedim(axis, -1)
        units = moved[..., start:stop].unflatten(-1, (-1, size))
        moved[..., start:stop] = (units @ rotation.to(device=parameter.device, dtype=compute).T).flatten(-2)
        parameter.copy_(moved.movedim(-1, axis).to(parameter.dtype))
