"""`lmc interpolate` of Hugging Face and timm checkpoints on the user's own data files."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from lmc.cli import main
from lmc.formats.external import load_external
from tests.cli import fails
from tests.formats.checkpoints import model, save_hf, save_timm, sentences


def _result(folder: Path) -> dict:
    (result,) = json.loads((folder / "lmc_results.json").read_text())["references"].values()
    return result


def _window_loss(folder: str, ids: list[int], length: int) -> float:
    """Mean next-token cross-entropy of the model in ``folder`` on non-overlapping windows of ``ids``."""
    ids = torch.tensor(ids)
    windows = torch.stack([ids[i * length : i * length + length + 1] for i in range((len(ids) - 1) // length)])
    with torch.no_grad():
        logits = load_external(folder).model(input_ids=windows[:, :-1]).logits
    return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(), windows[:, 1:].reshape(-1)))


def _scalars(folder: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return set(events.Tags()["scalars"])


@pytest.fixture(scope="module")
def gpt2_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt2")
    return [save_hf(model("gpt2-tiny", {}, seed=s), root / f"m{s}") for s in (0, 1)]


def test_causal_lm_curves_on_a_text_file_with_perplexity_and_every_output(gpt2_pair, tmp_path, capsys):
    text = tmp_path / "eval.txt"
    text.write_text("\n".join(sentences(12)))
    out = tmp_path / "lmc"
    a, b = map(str, gpt2_pair)
    main(["interpolate", a, b, "--data", str(text), "--output-dir", str(out), "--sequence-length", "16"])
    assert "perplexity" in capsys.readouterr().out
    result = _result(out)
    naive, aligned = result["curves"]["naive"]["points"], result["curves"]["aligned"]["points"]
    assert len(naive) == len(aligned) == 25
    for point in naive + aligned:
        assert point["perplexity"] == pytest.approx(math.exp(point["loss"]), rel=1e-12)

    # End point A, evaluated independently: the model on its tokenizer's windows of 16 (+1) tokens.
    tokenizer = AutoTokenizer.from_pretrained(a, local_files_only=True)
    assert naive[0]["loss"] == pytest.approx(_window_loss(a, tokenizer(text.read_text())["input_ids"], 16), rel=1e-6)
    assert aligned[0] == naive[0] and aligned[-1]["loss"] == pytest.approx(naive[-1]["loss"], rel=1e-4)

    rows = list(csv.DictReader((out / "lmc_results.csv").open()))
    assert len(rows) == 50 and "perplexity" in rows[0]
    assert (out / "lmc_interpolation_0.png").stat().st_size > 0
    scalars = _scalars(out / "tensorboard")
    assert {"lmc/reference_0/aligned/perplexity", "lmc/reference_0/naive/loss_barrier"} <= scalars


@pytest.mark.parametrize(
    "name",
    [
        "mistral-tiny",
        "qwen2-tiny",
        "qwen3-tiny",
        "olmo2-tiny",
        "gemma-tiny",
        "gemma2-tiny",
        "phi3-tiny",
        "gpt-neox-tiny",
    ],
)
def test_llama_like_decoders_interpolate_with_aligned_end_points_equal(name, tmp_path):
    a, b = (str(save_hf(model(name, {}, seed=s), tmp_path / f"m{s}")) for s in (0, 1))
    text = tmp_path / "eval.txt"
    text.write_text("\n".join(sentences(12)))
    out = tmp_path / "lmc"
    main(["interpolate", a, b, "--data", str(text), "--output-dir", str(out), "--sequence-length", "16"])
    curves = _result(out)["curves"]
    naive, aligned = curves["naive"]["points"], curves["aligned"]["points"]
    assert len(naive) == len(aligned) == 25
    # Alpha 0 is the target, alpha 1 the source: aligned only by a symmetry, it keeps its loss.
    assert aligned[0] == naive[0] and aligned[-1]["loss"] == pytest.approx(naive[-1]["loss"], rel=1e-4)


def test_one_command_detects_each_checkpoint_and_parses_its_config_json_once(gpt2_pair, tmp_path, monkeypatch):
    """Format, config and timm settings are one value per checkpoint (lmc.formats.Checkpoint), read once."""
    reads = []
    read_text = Path.read_text

    def counted(self, *args, **kwargs):
        if self.name == "config.json":
            reads.append(self.parent)
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", counted)
    text = tmp_path / "eval.txt"
    text.write_text("\n".join(sentences(12)))
    a, b = gpt2_pair
    flags = ["--output-dir", str(tmp_path / "o"), "--num-alphas", "2", "--sequence-length", "8"]
    main(["interpolate", str(a), str(b), "--data", str(text), *flags])
    assert sorted(reads) == [a, b]
    reads.clear()
    main(["align", str(a), str(b), "--output", str(tmp_path / "aligned")])  # in memory (full_model)
    assert sorted(p for p in reads if p in (a, b)) == [a, b]  # besides the written model, read back once


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv", "parquet", "save_to_disk"])
def test_causal_lm_tables_with_a_text_column(kind, gpt2_pair, tmp_path):
    texts = sentences(10)
    path = tmp_path / f"eval.{kind}"
    if kind == "jsonl":
        path.write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    elif kind == "json":
        path.write_text(json.dumps([{"body": t} for t in texts]))
    elif kind == "csv":
        path.write_text("body\n" + "".join(f"{t}\n" for t in texts))
    elif kind == "parquet":
        import pyarrow
        import pyarrow.parquet

        pyarrow.parquet.write_table(pyarrow.table({"body": texts}), path)
    else:
        import datasets

        splits = {"train": texts[:2], "validation": texts}
        datasets.DatasetDict({k: datasets.Dataset.from_dict({"body": v}) for k, v in splits.items()}).save_to_disk(
            str(path)
        )
    a, b = map(str, gpt2_pair)
    argv = ["interpolate", a, b, "--data", str(path), "--output-dir", str(tmp_path / "o"), "--num-alphas", "3"]
    main([*argv, "--text-column", "body", "--sequence-length", "8"])
    (first, *_) = _result(tmp_path / "o")["curves"]["naive"]["points"]
    # The validation split's texts, joined with EOS between them, in windows of 8 (+1) tokens.
    tokenizer = AutoTokenizer.from_pretrained(a, local_files_only=True)
    ids = [i for t in texts for i in tokenizer(t)["input_ids"] + [tokenizer.eos_token_id]][:-1]
    assert first["loss"] == pytest.approx(_window_loss(a, ids, 8), rel=1e-6)


def test_sequence_classifiers_on_a_table_with_text_and_labels(tmp_path, capsys):
    folders = [save_hf(model("bert-tiny", {}, seed=s), tmp_path / f"m{s}") for s in (0, 1)]
    texts = sentences(16)
    labels = [i % 4 for i in range(16)]
    table = tmp_path / "eval.csv"
    table.write_text("sentence,y\n" + "".join(f"{t},{y}\n" for t, y in zip(texts, labels)))
    out = tmp_path / "o"
    a, b = map(str, folders)
    flags = ["--text-column", "sentence", "--label-column", "y", "--num-alphas", "3", "--sequence-length", "12"]
    main(["interpolate", a, b, "--data", str(table), "--output-dir", str(out), *flags])
    naive = _result(out)["curves"]["naive"]["points"]
    assert "perplexity" not in naive[0]

    tokenizer = AutoTokenizer.from_pretrained(a, local_files_only=True)
    encoded = tokenizer(texts, padding="max_length", max_length=12, truncation=True, return_tensors="pt")
    network = load_external(a).model
    with torch.no_grad():
        logits = network(input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"]).logits
    expected = F.cross_entropy(logits.double(), torch.tensor(labels))
    assert naive[0]["loss"] == pytest.approx(float(expected), rel=1e-5)
    assert naive[0]["accuracy"] == pytest.approx(float((logits.argmax(-1) == torch.tensor(labels)).double().mean()))

    assert "no column 'text'" in fails(["interpolate", a, b, "--data", str(table), "--output-dir", str(out)], capsys)


def test_timm_models_on_an_image_folder(tmp_path):
    from PIL import Image

    folders = [save_timm(model("eva02-tiny", {}, seed=s), tmp_path / f"m{s}") for s in (0, 1)]
    generator = torch.Generator().manual_seed(0)
    images = tmp_path / "images"
    for label in ("3", "7"):  # two of the model's classes, named by index
        (images / label).mkdir(parents=True)
        for index in range(3):
            pixels = torch.randint(256, (12, 12), generator=generator, dtype=torch.uint8).numpy()
            Image.fromarray(pixels, mode="L").save(images / label / f"{index}.png")
    out = tmp_path / "o"
    a, b = map(str, folders)
    main(["interpolate", a, b, "--data", str(images), "--output-dir", str(out), "--num-alphas", "3"])
    result = _result(out)
    naive, aligned = result["curves"]["naive"]["points"], result["curves"]["aligned"]["points"]
    assert aligned[0] == naive[0] and aligned[-1]["loss"] == pytest.approx(naive[-1]["loss"], rel=1e-4)
    from lmc.formats.evaluation_data import evaluation_data

    dataset = evaluation_data(images, load_external(a).model, None).dataset
    assert [int(dataset[i]["labels"]) for i in range(len(dataset))] == [3, 3, 3, 7, 7, 7]  # the folders' indices
    # The accuracy of 6 images is a multiple of 1/6: every image was evaluated once.
    assert all(round(6 * p["accuracy"], 9) == round(6 * p["accuracy"]) for p in naive)


def test_hugging_face_vit_on_an_image_folder_normalized_as_its_processor_says(tmp_path):
    from PIL import Image

    from lmc.formats.evaluation_data import evaluation_data

    folders = [save_hf(model("hf-vit-tiny", {}, seed=s), tmp_path / f"m{s}", tokenizer=False) for s in (0, 1)]
    (folders[0] / "preprocessor_config.json").write_text(json.dumps({"image_mean": [0.25], "image_std": [0.5]}))
    images = tmp_path / "images"
    pixels = torch.randint(256, (2, 3, 16, 16), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    for label in ("2", "9"):
        (images / label).mkdir(parents=True)
        for index in range(3):
            Image.fromarray(pixels[int(label == "9"), index].numpy(), mode="L").save(images / label / f"{index}.png")
    out = tmp_path / "o"
    a, b = map(str, folders)
    main(["interpolate", a, b, "--data", str(images), "--output-dir", str(out), "--num-alphas", "3"])
    naive, aligned = (_result(out)["curves"][kind]["points"] for kind in ("naive", "aligned"))
    assert aligned[0] == naive[0] and aligned[-1]["loss"] == pytest.approx(naive[-1]["loss"], rel=1e-4)
    assert all(round(6 * p["accuracy"], 9) == round(6 * p["accuracy"]) for p in naive)  # 6 images, once each
    dataset = evaluation_data(images, load_external(a).model, a).dataset
    assert [int(dataset[i]["labels"]) for i in range(6)] == [2, 2, 2, 9, 9, 9]
    with Image.open(images / "2" / "0.png") as image:  # resized as ViTImageProcessor does, then (x - 0.25) / 0.5
        resized = torch.tensor(list(image.resize((8, 8), Image.BILINEAR).getdata()), dtype=torch.float64)
    expected = (resized.reshape(1, 8, 8) / 255 - 0.25) / 0.5
    torch.testing.assert_close(dataset[0]["inputs"].double(), expected, rtol=0, atol=1e-6)


def test_data_that_would_be_measured_wrongly_is_refused_by_name(gpt2_pair, tmp_path, capsys):
    """Each of these used to run to exit 0 and measure something else than the user's data."""
    a, b = map(str, gpt2_pair)
    out = ["--output-dir", str(tmp_path / "o")]
    text = tmp_path / "eval.txt"
    text.write_text("\n".join(sentences(12)))
    positions = load_external(a).model.config.n_positions
    error = fails(["interpolate", a, b, "--data", str(text), *out, "--sequence-length", str(positions + 1)], capsys)
    assert f"longer than the {positions} positions of GPT2LMHeadModel" in error
    assert "not a data set with splits" in fails(
        ["interpolate", a, b, "--data", str(text), *out, "--split", "test"], capsys
    )
    latin = tmp_path / "latin.txt"
    latin.write_bytes("café au lait ".encode("latin-1") * 20)
    assert f"{latin} is not UTF-8 text" in fails(["interpolate", a, b, "--data", str(latin), *out], capsys)

    bare = [save_hf(model("bert-tiny", {}, seed=s), tmp_path / f"bare{s}", tokenizer=False) for s in (0, 1)]
    table = tmp_path / "eval.csv"
    table.write_text("text,label\n" + "".join(f"{t},{i % 4}\n" for i, t in enumerate(sentences(8))))
    error = fails(["interpolate", str(bare[0]), str(bare[1]), "--data", str(table), *out], capsys)
    assert "has no tokenizer files" in error  # it used to read every text as [CLS] [UNK] ... [SEP]
    folders = [save_hf(model("bert-tiny", {}, seed=s), tmp_path / f"bert{s}") for s in (0, 1)]
    fractional = tmp_path / "fractional.csv"
    fractional.write_text("text,label\n" + "".join(f"{t},{i % 4 + 0.5}\n" for i, t in enumerate(sentences(8))))
    error = fails(["interpolate", *map(str, folders), "--data", str(fractional), *out], capsys)
    assert "label 0.5 is not a class index" in error  # it used to truncate 0.5, 1.5, ... to 0, 1, ...
    assert not (tmp_path / "o").exists()


def test_an_image_folder_needs_one_folder_per_class_of_the_model(tmp_path, capsys):
    from PIL import Image

    folders = [save_timm(model("eva02-tiny", {}, seed=s), tmp_path / f"m{s}") for s in (0, 1)]
    classes = load_external(folders[0]).model.num_classes
    images = tmp_path / "images" / "only"
    images.mkdir(parents=True)
    Image.fromarray(torch.zeros(12, 12, dtype=torch.uint8).numpy(), mode="L").save(images / "0.png")
    error = fails(
        ["interpolate", *map(str, folders), "--data", str(images.parent), "--output-dir", str(tmp_path / "o")], capsys
    )
    assert f"has 1 class folders, but the model has {classes} classes" in error  # it used to label everything 0
    (images.parent / str(classes)).mkdir()
    Image.fromarray(torch.zeros(12, 12, dtype=torch.uint8).numpy(), mode="L").save(
        images.parent / str(classes) / "0.png"
    )
    (images / "0.png").rename(images.parent / str(classes) / "1.png")
    images.rmdir()
    error = fails(
        ["interpolate", *map(str, folders), "--data", str(images.parent), "--output-dir", str(tmp_path / "o")], capsys
    )
    assert f"class folder {classes} is not one of the model's {classes} classes" in error
