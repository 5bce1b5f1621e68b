"""benchmarks/stage1/stage1_orders.py: its barrier and its additivity measure what its docstring says."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from benchmarks.stage1.stage1_orders import additivity, barriers


def test_a_barrier_is_the_largest_rise_above_the_chord():
    curves = torch.tensor([[1.0, 3.0, 2.0], [0.0, 0.5, 2.0], [2.0, 1.0, 0.0]], dtype=torch.float64)
    # chords at the middle alpha: 1.5, 1.0, 1.0
    assert barriers(curves).tolist() == pytest.approx([1.5, 0.0, 0.0], abs=1e-15)


def test_additivity_is_one_for_a_sum_of_pair_terms_and_less_otherwise():
    heads = 4
    labels = ["".join(map(str, order)) for order in itertools.permutations(range(heads))]
    pair_cost = np.random.default_rng(0).normal(size=(heads, heads))
    additive = np.array([sum(pair_cost[i, int(label[i])] for i in range(heads)) for label in labels])
    assert additivity(labels, additive, heads) == pytest.approx(1.0, abs=1e-12)
    # A term on two heads at once (source heads 0 and 1 both moved up by one) is no sum of pair terms.
    joint = additive + 3.0 * np.array([float(label[0] == "1" and label[1] == "2") for label in labels])
    assert additivity(labels, joint, heads) < 0.9
