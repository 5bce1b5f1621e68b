"""Interpolation sweeps: in place equals copies, barriers follow their definitions, sweeps resume."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from lmc.interpolation import SweepStore, barriers, evaluate, evenly_spaced, fingerprint, sweep


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _batches():
    generator = torch.Generator().manual_seed(0)
    return [
        {"inputs": torch.randn(10, 6, generator=generator), "labels": torch.randint(3, (10,), generator=generator)}
        for _ in range(3)
    ]


def _sums(model: nn.Module):
    def batch_sums(batch):
        logits = model(batch["inputs"])
        loss = nn.functional.cross_entropy(logits, batch["labels"], reduction="sum")
        correct = (logits.argmax(-1) == batch["labels"]).sum()
        return loss.double(), correct.double(), torch.tensor(len(batch["labels"]), dtype=torch.float64)

    return batch_sums


def test_in_place_sweep_equals_one_copy_per_alpha(tmp_path):
    a, b, alphas = _model(0), _model(1), evenly_spaced(7)
    model = copy.deepcopy(a)
    endpoint_a = [p.detach().clone() for p in a.parameters()]
    endpoint_b = [p.detach().clone() for p in b.parameters()]
    points = sweep(
        model,
        endpoint_a,
        endpoint_b,
        lambda: evaluate(_sums(model), _batches(), torch.device("cpu")),
        alphas,
        SweepStore.open(None, "k"),
        "naive",
    )
    for point, alpha in zip(points, alphas):
        copy_model = copy.deepcopy(a)
        with torch.no_grad():
            for p, pa, pb in zip(copy_model.parameters(), a.parameters(), b.parameters()):
                p.copy_((1 - alpha) * pa + alpha * pb)
        loss_sum, correct, count = evaluate(_sums(copy_model), _batches(), torch.device("cpu")).tolist()
        assert point["loss"] == pytest.approx(loss_sum / count, rel=1e-6)
        assert point["accuracy"] == pytest.approx(correct / count, abs=1e-12)
    for p, pa in zip(model.parameters(), a.parameters()):  # the model ends with end point A
        assert torch.equal(p, pa)


def test_barriers_follow_their_definitions():
    alphas = evenly_spaced(5)
    losses = [1.0, 1.6, 2.0, 1.5, 3.0]
    accuracies = [0.9, 0.7, 0.5, 0.6, 0.7]
    result = barriers(alphas, losses, accuracies)
    line = [1.0 + 2.0 * a for a in alphas]
    assert result["loss_barrier"] == pytest.approx(max(value - s for value, s in zip(losses, line)))
    acc_line = [0.9 - 0.2 * a for a in alphas]
    assert result["accuracy_barrier"] == pytest.approx(max(s - x for s, x in zip(acc_line, accuracies)))
    assert result["loss_barrier_rebasin"] == pytest.approx(3.0 - 2.0)
    assert result["accuracy_barrier_rebasin"] == pytest.approx(0.8 - 0.5)
    with pytest.raises(ValueError, match="at least 2 points"):
        evenly_spaced(1)


def test_a_killed_sweep_resumes_to_the_same_results(tmp_path):
    a, b, alphas = _model(0), _model(1), evenly_spaced(25)
    endpoint_a = [p.detach().clone() for p in a.parameters()]
    endpoint_b = [p.detach().clone() for p in b.parameters()]
    key = fingerprint(endpoint_a, endpoint_b, extra="test")
    model = copy.deepcopy(a)
    evaluated = []

    def dying_after(limit):
        def evaluate_point():
            if len(evaluated) == limit:
                raise KeyboardInterrupt  # the job is killed mid-sweep
            evaluated.append(1)
            return evaluate(_sums(model), _batches(), torch.device("cpu"))

        return evaluate_point

    path = tmp_path / "state.json"
    with pytest.raises(KeyboardInterrupt):
        sweep(model, endpoint_a, endpoint_b, dying_after(10), alphas, SweepStore.open(path, key), "aligned")
    assert len(json.loads(path.read_text())["points"]["aligned"]) == 10
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), endpoint_a))  # restored after the kill

    evaluated.clear()
    resumed = sweep(model, endpoint_a, endpoint_b, dying_after(99), alphas, SweepStore.open(path, key), "aligned")
    assert len(evaluated) == 15  # only the missing points
    fresh_model = copy.deepcopy(a)
    fresh = sweep(
        fresh_model,
        endpoint_a,
        endpoint_b,
        lambda: evaluate(_sums(fresh_model), _batches(), torch.device("cpu")),
        alphas,
        SweepStore.open(None, key),
        "aligned",
    )
    assert resumed == fresh


def test_a_state_file_from_another_sweep_is_ignored(tmp_path):
    path = tmp_path / "state.json"
    store = SweepStore.open(path, "first")
    store.put("naive", 0, {"alpha": 0.0, "loss": 1.0, "accuracy": 0.5}, write=True)
    assert SweepStore.open(path, "first").get("naive", 0) == {"alpha": 0.0, "loss": 1.0, "accuracy": 0.5}
    assert SweepStore.open(path, "second").get("naive", 0) is None
    assert not list(tmp_path.glob("*.tmp"))  # atomic writes leave no temporary files
