"""``train_samples``: a seeded subset of a part's training split, nested across sizes, on every DataModule."""

from __future__ import annotations

import inspect
import re

import pytest
import torch

import lmc.data
from lmc.data import Digits, LMCDataModule, MNIST5k, PythonDocsLM

#: Every DataModule lmc exports.
MODULES = [
    cls
    for name in lmc.data.__all__
    if isinstance(cls := getattr(lmc.data, name), type) and issubclass(cls, LMCDataModule)
]


def _indices(module: LMCDataModule) -> list[int]:
    """Indices of the module's training samples in its data set's whole training split."""
    module.setup()
    return list(module.train_set.indices)


@pytest.mark.parametrize("make", [Digits, MNIST5k, PythonDocsLM], ids=["digits", "mnist_5k", "python_docs_lm"])
def test_train_samples_are_nested_subsets_of_the_part_and_leave_the_other_splits_alone(make):
    whole, half_a, half_b = make(), make(part="A"), make(part="B")
    whole.setup()
    b = set(_indices(half_b))
    sizes = [len(b) // 8, len(b) // 4, len(b) // 2, len(b)]
    drawn = [make(part="B", train_samples=n) for n in sizes]
    chosen = [_indices(module) for module in drawn]
    assert [len(indices) for indices in chosen] == [len(module.split("train")) for module in drawn] == sizes
    for smaller, larger in zip(chosen, chosen[1:]):
        assert set(smaller) < set(larger)  # a sweep over sizes changes only the amount of data
    assert set(chosen[-1]) == b and not set(chosen[0]) & set(_indices(half_a))
    # The samples are the whole split's own, and validation and test are untouched.
    module = drawn[0]
    for position in (0, len(chosen[0]) - 1):
        sample, expected = module.split("train")[position], whole.split("train")[chosen[0][position]]
        assert all(torch.equal(sample[key], expected[key]) for key in expected)
    for split in ("val", "test"):
        assert len(module.split(split)) == len(whole.split(split))
        assert all(torch.equal(module.split(split)[0][k], whole.split(split)[0][k]) for k in whole.split(split)[0])
    assert set(_indices(make(part="A", train_samples=3))) <= set(_indices(half_a))


def test_the_subset_is_drawn_from_the_seed_and_spread_over_the_half():
    def drawn(seed: int) -> list[int]:
        return _indices(Digits(part="B", seed=seed, train_samples=100))

    assert drawn(0) == drawn(0) != drawn(1)
    half = _indices(Digits(part="B"))
    positions = [half.index(index) for index in drawn(0)]
    # A shuffle, not the first samples of the half: the subset reaches into every quarter of it.
    quarters = torch.bincount(torch.tensor(positions) * 4 // len(half), minlength=4)
    assert quarters.min() >= 10, quarters.tolist()


def test_the_whole_split_can_be_subsampled_too():
    whole = Digits()
    whole.setup()
    module = Digits(train_samples=10)
    assert len(_indices(module)) == 10 and set(_indices(module)) <= set(range(len(whole.train_set)))


def test_too_many_or_too_few_samples_are_refused_with_the_fix():
    available = len(Digits(part="B").split("train"))
    message = (
        f"train_samples={available + 1} is more than the {available} training samples of part 'B' of Digits: "
        f"give at most {available}, or None for all of them"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        Digits(part="B", train_samples=available + 1).setup()
    for count in (0, -3):
        with pytest.raises(
            ValueError,
            match=re.escape(f"train_samples must be at least 1 (None: the whole training split), got {count}"),
        ):
            Digits(train_samples=count)


@pytest.mark.parametrize("cls", MODULES, ids=[cls.__name__ for cls in MODULES])
def test_every_data_module_takes_train_samples_and_hands_it_to_the_base(cls):
    parameter = inspect.signature(cls).parameters["train_samples"]
    assert parameter.default is None and parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert "train_samples:" in cls.__doc__  # documented in the class's Args, which its --help reads
    assert cls(train_samples=7).train_samples == 7  # constructs without touching the disk
    with pytest.raises(ValueError, match="train_samples must be at least 1"):
        cls(train_samples=0)
