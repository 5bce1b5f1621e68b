"""lmc.matching.checks: the finiteness check the streamed passes run on every tensor."""

from __future__ import annotations

import pytest
import torch

from lmc.matching.checks import all_finite


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_one_non_finite_entry_anywhere_is_found(dtype, bad):
    # Sizes around the vectorized reduction's widths, the entry at the start, middle and tail.
    for size in (1, 7, 33, 4099):
        for position in sorted({0, size // 2, size - 1}):
            values = torch.randn(size).to(dtype)
            assert all_finite(values)
            values[position] = bad
            assert not all_finite(values), (size, position)
            assert not all_finite(values.reshape(1, -1).expand(2, -1).t()), (size, position)  # strided


def test_empty_and_integer_tensors_are_finite():
    assert all_finite(torch.empty(0)) and all_finite(torch.arange(5))
    assert all_finite(torch.tensor(torch.finfo(torch.bfloat16).max, dtype=torch.bfloat16))
