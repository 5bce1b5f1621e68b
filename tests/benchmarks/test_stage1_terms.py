"""benchmarks/stage1/stage1_terms: its terms add up to the matcher's cost, and its ranks and correlations are right."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from benchmarks.stage1.stage1_terms import measure_pair, order_cost, term_costs
from lmc.adapters import model_spec, scope_parameters
from lmc.matching import AlignOptions, align
from lmc.matching.grams import LayerGrams
from lmc.matching.heads import head_cost
from lmc.models import create_model, randomize_parameters_


def test_the_terms_add_up_to_the_invariant_cost_whose_cheapest_order_the_matcher_picks():
    source, target = (randomize_parameters_(create_model("gpt2-tiny", dtype=torch.float64), seed=s) for s in (0, 1))
    free = set(scope_parameters(target, "first_attention"))  # fine-tunes of one pre-trained model differ there only
    with torch.no_grad():
        for name, parameter in source.named_parameters():
            if name not in free:
                parameter.copy_(dict(target.named_parameters())[name])
    costs = term_costs(source, target)
    layer = model_spec(target).attention[0]
    grams = LayerGrams.compute(dict(source.named_parameters()), dict(target.named_parameters()), layer)
    assert torch.equal(costs["total"], head_cost(grams, layer, AlignOptions()))
    # balanced: each term over its heads' mean squared norm, so W_O ten times larger leaves it as it is
    louder = [copy.deepcopy(model) for model in (source, target)]
    with torch.no_grad():
        for model in louder:
            dict(model.named_parameters())[layer.out.parameter].mul_(10.0)
    scaled = term_costs(*louder)
    assert torch.allclose(scaled["vo"], 100 * costs["vo"], rtol=1e-12, atol=0)
    assert torch.allclose(scaled["balanced"], costs["balanced"], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(scaled["total"], costs["total"], rtol=1e-3)
    orders = ["".join(map(str, order)) for order in itertools.permutations(range(layer.num_heads))]
    cheapest = min(orders, key=lambda order: order_cost(costs["total"], order))
    _, report = align(source, target, "first_attention", AlignOptions(method="permutation"))
    picked = next(layer for layer in report.to_dict()["layers"] if layer["kind"] == "attention")["assignment"]
    assert cheapest == "".join(map(str, picked))


def test_a_rank_through_a_screened_order_counts_its_bound():
    # two heads: orders "01" and "10"; the Q/K term prefers "10", the V/O term "01"
    costs = {"qk": torch.tensor([[3.0, 0.0], [0.0, 3.0]]), "vo": torch.tensor([[0.0, 1.0], [1.0, 0.0]])}
    costs["total"] = costs["qk"] + costs["vo"]
    costs["balanced"] = costs["qk"] / 6 + costs["vo"]  # "01": 1 + 0, "10": 0 + 2
    entry = measure_pair(costs, whole={"01": 0.2}, bounds={"10": 0.5})
    assert entry["qk"]["rank_of_cheapest"] == 2 and not entry["qk"]["cheapest_swept_whole"]
    assert entry["vo"]["rank_of_cheapest"] == 1 and entry["vo"]["cheapest_swept_whole"]
    assert entry["total"]["rank_of_cheapest"] == 2  # 6 + 0 against 0 + 2: "10"
    assert entry["balanced"]["rank_of_cheapest"] == 1 and entry["balanced"]["cheapest_swept_whole"]
    assert entry["qk"]["spread"] == pytest.approx(3.0, abs=1e-12)  # costs 6 and 0
