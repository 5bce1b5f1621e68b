"""Rotary position embedding pair layouts (Su et al. 2021, "RoFormer"; docs/spec.md, section 2).

The lowest layer of lmc: the models that apply RoPE and the symmetry groups that must commute
with it read the same definition of which head coordinates rotate together.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

PairLayout = Literal["half", "interleaved"]
PAIR_LAYOUTS: tuple[str, ...] = get_args(PairLayout)


def rotary_pairs(layout: PairLayout, rotary_dim: int) -> torch.Tensor:
    """The coordinate pairs of a 1-D rotary layout, shape ``(rotary_dim // 2, 2)``.

    Each pair ``(first, second)`` turns as the complex number ``x[first] + i x[second]``.

    Args:
        layout: ``"half"`` (``rotate_half``, as in Llama: pairs ``(j, j + r/2)``) or
            ``"interleaved"`` (as in RoFormer: pairs ``(2j, 2j + 1)``).
        rotary_dim: Rotated coordinates per head (even).
    """
    j = torch.arange(rotary_dim // 2)
    if layout == "half":
        return torch.stack([j, j + rotary_dim // 2], dim=1)
    if layout == "interleaved":
        return torch.stack([2 * j, 2 * j + 1], dim=1)
    raise ValueError(f"unknown rotary layout {layout!r}; choose one of {', '.join(PAIR_LAYOUTS)}")
