"""Corruption tables of end points and midpoints (paper Appendix L): exact sums, shared corrupted batches, reuse."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lmc.connectivity.robustness
from lmc.connectivity import Evaluation
from lmc.connectivity.interpolation import point_metrics
from lmc.connectivity.robustness import corruption_generator, corruption_table, midpoint_robustness
from lmc.data.corruptions import corruptions_for
from lmc.tasks import DataInfo

IMAGES = DataInfo("image_classification", num_classes=10, image_size=8, in_channels=1)
TEXT = DataInfo("text_classification", num_classes=4, vocab_size=257, sequence_length=32)


class MeanTokens(nn.Module):
    """A tiny text classifier: the mean embedding of the tokens the mask keeps, then a linear head."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(257, 8), nn.Linear(8, 4)

    def forward(self, batch):
        mask = batch["attention_mask"].unsqueeze(-1).to(torch.float64)
        return self.head((self.embed(batch["inputs"]) * mask).sum(1) / mask.sum(1))


def tiny(info: DataInfo, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if info.task == "image_classification":
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 10)).double()
    return MeanTokens().double()


def batches(info: DataInfo) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    if info.task == "image_classification":
        return [
            {"inputs": torch.randn(16, 1, 8, 8, generator=g), "labels": torch.randint(10, (16,), generator=g)}
            for _ in range(3)
        ]
    out = []
    for _ in range(3):
        ids = torch.randint(1, 257, (16, 32), generator=g)
        ids[:, 24:] = 0
        out.append({"inputs": ids, "attention_mask": (ids != 0).long(), "labels": torch.randint(4, (16,), generator=g)})
    return out


def metric_sums_of(model: nn.Module):
    def metric_sums(batch):
        logits = model(batch["inputs"].double() if batch["inputs"].is_floating_point() else batch)
        labels = batch["labels"]
        return {
            "count": torch.tensor(float(len(labels)), dtype=torch.float64),
            "loss": F.cross_entropy(logits, labels, reduction="sum"),
            "accuracy": (logits.argmax(-1) == labels).sum().double(),
        }

    return metric_sums


def evaluation(model: nn.Module, info: DataInfo) -> Evaluation:
    return Evaluation(metric_sums_of(model), batches(info), "val", {"class": "tiny"}, {"model": "tiny"})


@pytest.mark.parametrize("info", [IMAGES, TEXT], ids=lambda i: i.task)
def test_the_table_equals_a_hand_evaluation_on_the_same_corrupted_batches(info):
    model, other = tiny(info, 0), tiny(info, 1)
    own = [p.detach().clone() for p in model.parameters()]
    weights = {"a": own, "b": [p.detach() for p in other.parameters()]}
    corruptions = corruptions_for(info)
    table = corruption_table(model, weights, evaluation(model, info), corruptions, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), own))  # left with its own weights
    assert list(table) == ["a", "b"] and list(table["b"]) == ["clean", *corruptions]
    name = next(iter(corruptions))
    for severity in (1, 2, 3):
        sums = {}  # by hand: model b on each batch corrupted with its own generator
        for index, batch in enumerate(batches(info)):
            corrupted = corruptions[name](batch, severity, corruption_generator(3, name, severity, index))
            with torch.no_grad():
                for key, value in metric_sums_of(other)(corrupted).items():
                    sums[key] = sums.get(key, 0.0) + float(value)
        assert table["b"][name][severity - 1] == point_metrics(sums)
    # Every model sees the same corrupted batches: a copy of a model scores exactly the same.
    copies = {"b": weights["b"], "b copy": [w.clone() for w in weights["b"]]}
    again = corruption_table(model, copies, evaluation(model, info), corruptions, seed=3)
    assert again["b"] == again["b copy"] == table["b"]
    shifted = corruption_table(model, {"b": weights["b"]}, evaluation(model, info), corruptions, seed=4)
    assert shifted["b"]["clean"] == table["b"]["clean"] and shifted["b"][name] != table["b"][name]


def test_midpoints_are_the_averages_of_the_weights_and_a_saved_table_is_reused(tmp_path, monkeypatch):
    target, source, aligned = tiny(IMAGES, 0), tiny(IMAGES, 1), tiny(IMAGES, 2)
    path = tmp_path / "robustness.json"
    result = midpoint_robustness(target, source, {"full": aligned}, evaluation(target, IMAGES), IMAGES, path)
    assert list(result["models"]) == ["target", "source", "naive_midpoint", "aligned_midpoint:full"]
    assert result["settings"]["severities"] == {"gaussian_noise": [0.25, 0.5, 1.0], "gaussian_blur": [0.5, 1.0, 1.5]}
    assert json.loads(path.read_text()) == json.loads(json.dumps(result))
    midpoint = tiny(IMAGES, 0)
    with torch.no_grad():
        for p, a, b in zip(midpoint.parameters(), target.parameters(), aligned.parameters()):
            p.copy_(torch.lerp(a, b, 0.5))
    weights = {"m": [p.detach().clone() for p in midpoint.parameters()]}
    by_hand = corruption_table(midpoint, weights, evaluation(midpoint, IMAGES), corruptions_for(IMAGES))["m"]
    assert result["models"]["aligned_midpoint:full"] == by_hand

    def never(*args, **kwargs):
        raise AssertionError("the saved table was measured again")

    monkeypatch.setattr(lmc.connectivity.robustness, "corruption_table", never)
    again = midpoint_robustness(target, source, {"full": aligned}, evaluation(target, IMAGES), IMAGES, path)
    assert again == json.loads(path.read_text())
    with torch.no_grad():
        next(aligned.parameters())[0, 0] += 1.0  # another aligned model: another key
    with pytest.raises(AssertionError, match="measured again"):
        midpoint_robustness(target, source, {"full": aligned}, evaluation(target, IMAGES), IMAGES, path)
