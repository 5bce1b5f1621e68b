"""``metric="midpoint"``: Stage 1 priced by the calibration loss of the target with one head at its midpoint.

The cost is checked against a loss computed here from the models' own modules (not lmc's head
slots), and on planted pairs, where a matched head's midpoint is the target's own head.
"""

from __future__ import annotations

import copy

import pytest
import torch

from lmc.adapters import model_spec, random_symmetry
from lmc.matching import AlignOptions, Calibration, align
from lmc.matching.heads import head_cost
from lmc.matching.midpoint import pairing_orders
from tests.architectures import ARCHITECTURES, FLOAT64_RTOL, OUTPUT_RTOL, build
from tests.matching.test_align import reinitialized
from tests.matching.test_data_aware import calibration
from tests.matching.test_learned import _loss

SCOPE = "first_attention"
OPTIONS = AlignOptions(metric="midpoint", calibration_batches=2)


def _calibration(model) -> Calibration:
    """Random batches (:func:`tests.matching.test_data_aware.calibration`) with a scalar loss."""
    data = calibration(model)
    return Calibration(data.batches, _loss, "train", data.num_samples)


def _mean_loss(model, data) -> float:
    losses = [float(data.forward(model, batch)) for batch in data.batches]
    sizes = [len(batch["inputs"]) for batch in data.batches]
    return sum(loss * size for loss, size in zip(losses, sizes)) / sum(sizes)


@pytest.mark.parametrize("key", list(ARCHITECTURES))
def test_pairing_orders_pair_every_source_head_with_every_target_head_once(key):
    layer = model_spec(build(key)).attention[0]
    orders = pairing_orders(layer)
    h, q = layer.num_heads, layer.queries_per_kv
    assert len(orders) == h
    pairs = {(source, int(target)) for order in orders for source, target in enumerate(order)}
    assert pairs == {(i, j) for i in range(h) for j in range(h)}
    for order in orders:
        assert sorted(order.tolist()) == list(range(h))
        groups = order.view(-1, q) // q  # the query heads of one key/value head stay together
        assert bool((groups == groups[:, :1]).all())


@pytest.mark.parametrize("key", ["ref-vit-learned", "ref-lm-rope-half-gqa-swiglu-rms-nobias"])
def test_the_cost_is_the_loss_of_the_target_with_one_head_at_its_midpoint(key):
    target = build(key)
    source = reinitialized(target, SCOPE, seed=1)
    data = _calibration(target)
    _, report = align(source, target, SCOPE, OPTIONS, data)
    cost = torch.tensor(report.layers[0].stage1_cost, dtype=torch.float64)
    config = target.config
    head_dim, q = config.head_dim, config.num_heads // config.num_kv_heads
    for order in pairing_orders(model_spec(target).attention[0]):
        # Stage 2 of this order, through the public API; then the midpoint written into the modules by hand.
        aligned, _ = align(source, target, SCOPE, AlignOptions(head_orders={0: order.tolist()}))
        ours, theirs = aligned.blocks[0].attn, target.blocks[0].attn
        for source_head, head in enumerate(order.tolist()):
            rows = slice(head * head_dim, (head + 1) * head_dim)
            kv_rows = slice(head // q * head_dim, (head // q + 1) * head_dim)
            probe = copy.deepcopy(target)
            attention = probe.blocks[0].attn
            with torch.no_grad():
                for name, index in (("q_proj", rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
                    for kind in ("weight", "bias"):
                        mine = getattr(getattr(attention, name), kind)
                        if mine is not None:
                            mine[index] = (
                                getattr(getattr(theirs, name), kind)[index] + getattr(getattr(ours, name), kind)[index]
                            ) / 2
                attention.o_proj.weight[:, rows] = (theirs.o_proj.weight[:, rows] + ours.o_proj.weight[:, rows]) / 2
            expected = _mean_loss(probe, data)
            assert cost[source_head, head] == pytest.approx(expected, rel=FLOAT64_RTOL), (source_head, head)
    # The picked order is the cost's assignment, and the aligned model keeps the source's function.
    assert report.probe_relative_error < OUTPUT_RTOL.get(key, 1e-12)
    assert report.calibration["batches"] == 2


@pytest.mark.parametrize("key", list(ARCHITECTURES))
def test_a_planted_pair_prices_its_own_heads_at_the_target_loss(key):
    target = build(key)
    source = random_symmetry(target, SCOPE, seed=3)
    data = _calibration(target)
    _, planted = align(source, target, SCOPE)  # the invariant cost recovers planted elements exactly
    before = {name: p.detach().clone() for name, p in target.named_parameters()}
    aligned, report = align(source, target, SCOPE, OPTIONS, data)
    cost = torch.tensor(report.layers[0].stage1_cost, dtype=torch.float64)
    loss = _mean_loss(target, data)
    matched = torch.zeros_like(cost, dtype=torch.bool)
    matched[torch.arange(len(cost)), torch.tensor(planted.layers[0].assignment)] = True
    rtol = OUTPUT_RTOL.get(key, FLOAT64_RTOL)
    assert torch.allclose(cost[matched], torch.full_like(cost[matched], loss), rtol=rtol, atol=0)
    # A head paired with another's is a different model: its loss is not the target's.
    assert bool(((cost[~matched] - loss).abs() > 10 * rtol * abs(loss)).all())
    # (Which order wins is not checked: on an untrained model a mismatched midpoint can lower the loss.)
    assert report.probe_relative_error < OUTPUT_RTOL.get(key, 1e-12)
    for name, parameter in target.named_parameters():  # run with swapped parameters only
        assert torch.equal(parameter, before[name]), name


def test_midpoint_needs_a_calibration_and_the_models_in_memory():
    assert OPTIONS.data_aware and "metric=midpoint" in OPTIONS.data_settings
    target = build("ref-vit-learned")
    with pytest.raises(ValueError, match="metric=midpoint"):
        align(reinitialized(target, SCOPE, seed=1), target, SCOPE, OPTIONS)
    with pytest.raises(ValueError, match="runs the models on calibration batches"):
        head_cost(None, model_spec(target).attention[0], OPTIONS)
    with pytest.raises(ValueError, match="return the batch's mean loss"):  # a forward that is not a loss
        align(reinitialized(target, SCOPE, seed=1), target, SCOPE, OPTIONS, calibration(target))
