"""BERT's seeded masked-LM evaluation (lmc.formats.masked_lm) and `lmc interpolate` on MultiBERTs' folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import BertForMaskedLM, BertForPreTraining

from lmc.adapters import adapter_for, random_symmetry
from lmc.cli import main
from lmc.data.base import NOT_SCORED
from lmc.formats import EvaluationDataOptions, evaluation_data
from lmc.formats.external import load_external
from lmc.formats.masked_lm import CHOSEN_FRACTION, MASK_FRACTION, RANDOM_FRACTION, mask_tokens
from lmc.training import module as training_module
from tests.cli import fails
from tests.formats.checkpoints import model, save_bert_tokenizer, save_hf, sentences

BERT_MODELS = ["bert-mlm-tiny", "bert-pretraining-tiny"]


def _bert_folder(folder: Path, name: str = "bert-mlm-tiny", seed: int = 0, network=None) -> Path:
    """A float64 BERT save_pretrained folder with its word-piece tokenizer ([CLS], [SEP], [MASK])."""
    network = model(name, {}, seed=seed, dtype=torch.float64) if network is None else network
    save_hf(network, folder, tokenizer=False)
    save_bert_tokenizer(folder)
    return folder


def _texts(count: int, seed: int = 0) -> list[str]:
    """Texts of 21 words: 3 of them chosen in each (round(0.15 * 21))."""
    words = sentences(3 * count, seed)
    return [" ".join(words[3 * i : 3 * i + 3]) for i in range(count)]


def _text_file(folder: Path, count: int = 10) -> Path:
    path = folder / "eval.txt"
    path.write_text("\n".join(_texts(count)) + "\n\n")  # a blank line is no text
    return path


def _pairs_table(folder: Path, count: int = 8, labels: list | None = None) -> Path:
    """Sentence pairs with next-sentence labels (0: the second follows the first, 1: random)."""
    labels = [i % 2 for i in range(count)] if labels is None else labels
    first, second = sentences(count, seed=1), sentences(count, seed=2)
    path = folder / "pairs.csv"
    path.write_text("text,text_pair,label\n" + "".join(f"{a},{b},{y}\n" for a, b, y in zip(first, second, labels)))
    return path


def _samples(folder: Path, data: Path, **options) -> dict[str, torch.Tensor]:
    """The evaluation tensors (one row per sequence) lmc builds from ``data`` for the model in ``folder``."""
    network = load_external(folder).model
    return evaluation_data(data, network, folder, EvaluationDataOptions(**options)).dataset.tensors


def _hf_losses(folder: Path, samples: dict[str, torch.Tensor]) -> dict[str, float]:
    """HF's own ``labels=`` losses of the model in ``folder`` on ``samples``: the masked-LM loss (the
    folder's MLM head loaded into ``BertForMaskedLM``), and with next-sentence labels the pre-training
    model's total (MLM + NSP) loss and its next-sentence accuracy."""
    inputs = {"input_ids": samples["inputs"], "attention_mask": samples["attention_mask"]}
    if "token_type_ids" in samples:
        inputs["token_type_ids"] = samples["token_type_ids"]
    with torch.no_grad():
        masked_lm = BertForMaskedLM.from_pretrained(folder, dtype=torch.float64, local_files_only=True)
        losses = {"loss": float(masked_lm(**inputs, labels=samples["labels"]).loss)}
        if "next_sentence_label" in samples:
            pretraining = BertForPreTraining.from_pretrained(folder, dtype=torch.float64, local_files_only=True)
            labels = samples["next_sentence_label"]
            output = pretraining(**inputs, labels=samples["labels"], next_sentence_label=labels)
            losses["total"] = float(output.loss)
            correct = output.seq_relationship_logits.argmax(-1) == labels
            losses["next_sentence_accuracy"] = float(correct.double().mean())
    return losses


def _curves(folder: Path) -> dict:
    (result,) = json.loads((folder / "lmc_results.json").read_text())["references"].values()
    return result["curves"]


def test_the_masks_follow_berts_recipe_on_the_candidates_only():
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 64, (2000, 60), generator=generator)
    lengths = torch.randint(0, 61, (2000,), generator=generator)
    candidates = torch.arange(60) < lengths[:, None]
    candidates[:, 0] = False  # a [CLS]
    replacements = torch.arange(5, 64)
    inputs, labels = mask_tokens(ids, candidates, mask_id=4, replacement_ids=replacements, seed=3)

    chosen = labels != NOT_SCORED
    assert not (chosen & ~candidates).any()
    expected = [max(1, round(CHOSEN_FRACTION * n)) if n else 0 for n in candidates.sum(1).tolist()]
    assert chosen.sum(1).tolist() == expected  # 15 % of each sequence's candidates, at least one
    assert torch.equal(labels[chosen], ids[chosen]) and torch.equal(inputs[~chosen], ids[~chosen])
    masked, changed = chosen & (inputs == 4), chosen & (inputs != ids) & (inputs != 4)
    assert torch.isin(inputs[changed], replacements).all()
    total = int(chosen.sum())  # about 9,000: each share below is within 0.005 of its expectation (one std)
    assert float(masked.sum()) / total == pytest.approx(MASK_FRACTION, abs=0.02)
    # A random token equals the original one with probability 1 / 59: that share counts as kept.
    random_share = RANDOM_FRACTION * (1 - 1 / len(replacements))
    assert float(changed.sum()) / total == pytest.approx(random_share, abs=0.02)
    assert float((chosen & (inputs == ids)).sum()) / total == pytest.approx(1 - MASK_FRACTION - random_share, abs=0.02)


def test_the_same_seed_draws_the_same_masks_and_another_seed_others(tmp_path):
    folder = _bert_folder(tmp_path / "m")
    text = _text_file(tmp_path)
    first, again, other = (_samples(folder, text, mask_seed=s) for s in (0, 0, 1))
    assert torch.equal(first["inputs"], again["inputs"]) and torch.equal(first["labels"], again["labels"])
    assert not torch.equal(first["labels"] != NOT_SCORED, other["labels"] != NOT_SCORED)
    assert torch.equal(first["attention_mask"], other["attention_mask"])
    # The texts themselves: [CLS] text [SEP], never masked; one sequence per non-empty line.
    assert len(first["inputs"]) == 10 and (first["labels"][:, 0] == NOT_SCORED).all()
    assert ((first["labels"] != NOT_SCORED).sum(1) == 3).all()


@pytest.mark.parametrize("name", BERT_MODELS)
def test_the_masked_lm_loss_is_hfs_own_labels_loss_for_the_same_masks(name, tmp_path):
    folder = _bert_folder(tmp_path / "m", name)
    samples = _samples(folder, _text_file(tmp_path))
    network = load_external(folder).model
    assert next(network.parameters()).dtype == torch.float64
    with torch.no_grad():
        output = network(**adapter_for(network).model_inputs(network, samples))
    sums = training_module.masked_lm_sums(output, samples)
    assert set(sums) == {"count", "loss", "accuracy"}  # no sentence pairs: the masked-LM head only
    assert float(sums["count"]) == 30  # 3 chosen tokens in each of the 10 texts
    assert float(sums["loss"] / sums["count"]) == pytest.approx(_hf_losses(folder, samples)["loss"], rel=1e-12)
    # Per sequence: its chosen tokens' negative log-likelihoods, computed apart.
    per_sequence = training_module.masked_lm_sums(output, samples, per_sample=True)
    chosen = samples["labels"] != NOT_SCORED
    logits = output["prediction_logits"] if "prediction_logits" in output else output["logits"]
    log_likelihoods = logits.log_softmax(-1).gather(-1, samples["labels"].clamp(min=0)[..., None])[..., 0]
    torch.testing.assert_close(per_sequence["count"], chosen.sum(1).double(), rtol=0, atol=0)
    torch.testing.assert_close(per_sequence["loss"], -(log_likelihoods * chosen).sum(1), rtol=1e-12, atol=1e-12)
    assert per_sequence["accuracy"].shape == (10,) and float(per_sequence["accuracy"].sum()) == float(sums["accuracy"])


@pytest.mark.parametrize("name", BERT_MODELS)
def test_interpolate_two_bert_folders_end_points_are_each_models_masked_lm_loss(name, tmp_path, capsys):
    a, b = (_bert_folder(tmp_path / f"m{s}", name, seed=s) for s in (0, 1))
    text = _text_file(tmp_path)
    out = tmp_path / "lmc"
    main(["interpolate", str(a), str(b), "--data", str(text), "--output-dir", str(out), "--num-alphas", "5"])
    printed = capsys.readouterr().out
    assert ("only the masked-LM head is evaluated" in printed) == (name == "bert-pretraining-tiny")
    curves = _curves(out)
    naive, aligned = curves["naive"]["points"], curves["aligned"]["points"]
    assert len(naive) == len(aligned) == 5 and "perplexity" not in naive[0]
    assert set(naive[0]) == {"alpha", "loss", "accuracy"}
    assert naive[0]["loss"] == pytest.approx(_hf_losses(a, _samples(a, text))["loss"], rel=1e-12)
    assert naive[-1]["loss"] == pytest.approx(_hf_losses(b, _samples(b, text))["loss"], rel=1e-12)
    # Alpha 1 of the aligned curve is B moved by a symmetry: B's function, so B's loss (float64 rounding).
    assert aligned[0] == naive[0] and aligned[-1]["loss"] == pytest.approx(naive[-1]["loss"], rel=1e-10)


def test_interpolate_bert_pretraining_on_sentence_pairs_scores_the_next_sentence_head_too(tmp_path, capsys):
    a, b = (_bert_folder(tmp_path / f"m{s}", "bert-pretraining-tiny", seed=s) for s in (0, 1))
    table = _pairs_table(tmp_path)
    out = tmp_path / "lmc"
    main(["interpolate", str(a), str(b), "--data", str(table), "--output-dir", str(out), "--num-alphas", "3"])
    assert "only the masked-LM head" not in capsys.readouterr().out
    naive = _curves(out)["naive"]["points"]
    assert set(naive[0]) == {"alpha", "loss", "accuracy", "next_sentence/loss", "next_sentence/accuracy"}
    for point, folder in ((naive[0], a), (naive[-1], b)):
        samples = _samples(folder, table)
        assert (samples["token_type_ids"] == 1).any()  # [CLS] A [SEP] B [SEP]: B's tokens are of type 1
        expected = _hf_losses(folder, samples)
        assert point["loss"] == pytest.approx(expected["loss"], rel=1e-12)  # the curve's loss: the masked LM's
        total = point["loss"] + point["next_sentence/loss"]  # each mean over its own count (tokens, pairs)
        assert total == pytest.approx(expected["total"], rel=1e-12)
        assert point["next_sentence/accuracy"] == pytest.approx(expected["next_sentence_accuracy"], rel=1e-12)


def test_every_point_of_both_curves_sees_the_same_masks(tmp_path, monkeypatch):
    seen = []
    sums = training_module.masked_lm_sums

    def recording(output, batch, per_sample=False):
        seen.append((batch["inputs"].clone(), batch["labels"].clone()))
        return sums(output, batch, per_sample)

    monkeypatch.setattr(training_module, "masked_lm_sums", recording)
    a, b = (_bert_folder(tmp_path / f"m{s}", seed=s) for s in (0, 1))
    out = tmp_path / "lmc"
    main(["interpolate", str(a), str(b), "--data", str(_text_file(tmp_path)), "--output-dir", str(out)])
    main(["interpolate", str(a), str(b), "--data", str(_text_file(tmp_path)), "--output-dir", str(tmp_path / "o")])
    assert len(seen) >= 2 * (2 * 25 - 1)  # two sweeps: one batch per point of both curves (alpha 0 shared at most)
    inputs, labels = seen[0]
    assert (inputs == 4).any()  # masked tokens ([MASK] is id 4)
    assert all(torch.equal(x, inputs) and torch.equal(y, labels) for x, y in seen)


@pytest.mark.parametrize("name", BERT_MODELS)
def test_an_aligned_planted_copy_has_a_flat_curve(name, tmp_path):
    source = model(name, {}, seed=0, dtype=torch.float64)
    copy = random_symmetry(source, scope="full_model", seed=5)
    a, b = _bert_folder(tmp_path / "a", network=source), _bert_folder(tmp_path / "b", network=copy)
    out = tmp_path / "lmc"
    main(["interpolate", str(a), str(b), "--data", str(_text_file(tmp_path)), "--output-dir", str(out)])
    curves = _curves(out)
    losses = {curve: [p["loss"] for p in data["points"]] for curve, data in curves.items()}
    # Float64 rounding only: the aligned copy is the source to ~1e-16 per entry.
    assert max(abs(loss - losses["aligned"][0]) for loss in losses["aligned"]) < 1e-10
    assert abs(curves["aligned"]["loss_barrier"]) < 1e-10
    assert max(abs(loss - losses["naive"][0]) for loss in losses["naive"]) > 1e-3  # the naive curve is not flat


def test_bad_masked_lm_inputs_name_what_is_missing_and_how_to_provide_it(tmp_path, capsys):
    out = ["--output-dir", str(tmp_path / "o")]
    text = _text_file(tmp_path)
    bare = [save_hf(model("bert-mlm-tiny", {}, seed=s), tmp_path / f"bare{s}", tokenizer=False) for s in (0, 1)]
    error = fails(["interpolate", *map(str, bare), "--data", str(text), *out], capsys)
    assert f"{bare[0]} has no tokenizer files" in error and "tokenizer.save_pretrained(folder)" in error
    unmasked = [save_hf(model("bert-mlm-tiny", {}, seed=s), tmp_path / f"word{s}") for s in (0, 1)]
    error = fails(["interpolate", *map(str, unmasked), "--data", str(text), *out], capsys)
    assert f"the tokenizer of {unmasked[0]} has no mask token" in error and "[MASK]" in error

    folders = [str(_bert_folder(tmp_path / f"m{s}", "bert-pretraining-tiny", seed=s)) for s in (0, 1)]
    assert "--data FILE_OR_CLASS is required" in fails(["interpolate", *folders, *out], capsys)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    error = fails(["interpolate", *folders, "--data", str(empty), *out], capsys)
    assert f"{empty} holds no text: give BertForPreTraining one text per line" in error
    unlabelled = tmp_path / "unlabelled.csv"
    unlabelled.write_text("text,text_pair\n" + "".join(f"{t},{t}\n" for t in sentences(4)))
    error = fails(["interpolate", *folders, "--data", str(unlabelled), *out], capsys)
    assert "gives sentence pairs but no next-sentence labels (no column 'label')" in error
    error = fails(["interpolate", *folders, "--data", str(_pairs_table(tmp_path, 4, [0, 1, 2, 0])), *out], capsys)
    assert "next-sentence label 2 is neither 0" in error
    assert not (tmp_path / "o").exists()
