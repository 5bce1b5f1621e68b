"""DataInfo: the typed link from data to model, from each DataModule's ``info`` to each model family and checkpoint."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

import lmc.data
from lmc.adapters import adapter_for
from lmc.data import Digits, LMCDataModule, PythonDocsLM, PythonTextKinds
from lmc.experiments.protocol import experiment_cli
from lmc.models import create_model, list_models, register_model, zoo
from lmc.tasks import TASKS, DataInfo
from lmc.training import LMCModule
from tests.runs import trainer

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

# ---------------------------------------------------------------------------------------------
# DataInfo validation.
# ---------------------------------------------------------------------------------------------

VALID = {
    "image_classification": dict(num_classes=10, image_size=8, in_channels=1),
    "text_classification": dict(num_classes=4, vocab_size=257, sequence_length=64),
    "causal_lm": dict(vocab_size=257, sequence_length=64),
}


def test_every_task_has_a_valid_example_with_only_its_fields():
    assert set(VALID) == set(TASKS)
    for task, sizes in VALID.items():
        info = DataInfo(task, **sizes)
        assert {k: v for k, v in dataclasses.asdict(info).items() if v is not None} == {"task": task, **sizes}
    assert DataInfo("causal_lm", vocab_size=257).sequence_length is None  # sequence_length is optional


@pytest.mark.parametrize(
    "task, sizes, message",
    [
        ("regression", {}, "task='regression'): choose one of image_classification, text_classification, causal_lm"),
        ("image_classification", dict(image_size=8, in_channels=1), "needs num_classes"),
        ("image_classification", dict(num_classes=10), "needs image_size, in_channels"),
        ("text_classification", dict(num_classes=4), "needs vocab_size"),
        ("text_classification", dict(vocab_size=257), "needs num_classes"),
        ("causal_lm", dict(sequence_length=64), "needs vocab_size"),
        ("causal_lm", dict(vocab_size=257, num_classes=257), "vocab_size, not num_classes"),
        ("image_classification", dict(VALID["image_classification"], vocab_size=257), "no use for vocab_size"),
        ("text_classification", dict(VALID["text_classification"], image_size=8), "no use for image_size"),
        ("causal_lm", dict(vocab_size=0), "vocab_size=0): sizes are positive integers"),
        ("causal_lm", dict(vocab_size=257, sequence_length=6.5), "sequence_length=6.5)"),
        ("image_classification", dict(VALID["image_classification"], in_channels=True), "in_channels=True)"),
    ],
)
def test_bad_data_info_is_refused_with_the_fix(task, sizes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        DataInfo(task, **sizes)


def test_data_info_is_frozen():
    info = DataInfo("causal_lm", vocab_size=257)
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.vocab_size = 10


# ---------------------------------------------------------------------------------------------
# Every DataModule's info: classification fields versus language-modelling fields.
# ---------------------------------------------------------------------------------------------

IMAGE, TEXT, LM = "image_classification", "text_classification", "causal_lm"
EXPECTED_INFO = {
    "Digits": (Digits(), DataInfo(IMAGE, num_classes=10, image_size=8, in_channels=1)),
    "MNIST": (lmc.data.MNIST(), DataInfo(IMAGE, num_classes=10, image_size=28, in_channels=1)),
    "MNIST5k": (lmc.data.MNIST5k(), DataInfo(IMAGE, num_classes=10, image_size=28, in_channels=1)),
    "CIFAR10": (lmc.data.CIFAR10(), DataInfo(IMAGE, num_classes=10, image_size=32, in_channels=3)),
    "CIFAR100": (lmc.data.CIFAR100(), DataInfo(IMAGE, num_classes=100, image_size=32, in_channels=3)),
    "ImageNet": (lmc.data.ImageNet(image_size=96), DataInfo(IMAGE, num_classes=1000, image_size=96, in_channels=3)),
    "PythonTextKinds": (
        PythonTextKinds(snippet_length=40),
        DataInfo(TEXT, num_classes=4, vocab_size=257, sequence_length=40),
    ),
    "BibleDivisions": (
        lmc.data.BibleDivisions(sequence_length=96),
        DataInfo(TEXT, num_classes=5, vocab_size=257, sequence_length=96),
    ),
    "AGNews": (lmc.data.AGNews(sequence_length=48), DataInfo(TEXT, num_classes=4, vocab_size=257, sequence_length=48)),
    "IMDB": (lmc.data.IMDB(), DataInfo(TEXT, num_classes=2, vocab_size=257, sequence_length=128)),
    "DBPedia": (lmc.data.DBPedia(), DataInfo(TEXT, num_classes=14, vocab_size=257, sequence_length=128)),
    "PythonDocsLM": (PythonDocsLM(sequence_length=16), DataInfo(LM, vocab_size=257, sequence_length=16)),
    "WikiText103": (lmc.data.WikiText103(sequence_length=16), DataInfo(LM, vocab_size=257, sequence_length=16)),
    "Enwik8": (lmc.data.Enwik8(), DataInfo(LM, vocab_size=257, sequence_length=256)),
    "OneBillionWord": (lmc.data.OneBillionWord(), DataInfo(LM, vocab_size=257, sequence_length=256)),
}


def test_every_exported_data_module_is_checked():
    exported = {
        name
        for name in lmc.data.__all__
        if isinstance(getattr(lmc.data, name), type)
        and issubclass(getattr(lmc.data, name), LMCDataModule)
        and not name.startswith(("LMC", "Byte"))  # the bases
    }
    assert exported == set(EXPECTED_INFO)


@pytest.mark.parametrize("name", list(EXPECTED_INFO))
def test_info_reports_the_task_and_sizes_of_the_data(name):
    module, expected = EXPECTED_INFO[name]
    assert module.info == expected
    assert module.info.task == module.task


def test_info_matches_the_batches():
    """The sizes in info are those of the data: labels below num_classes / vocab_size, inputs of the stated shape."""
    for module in (Digits(batch_size=512), PythonTextKinds(snippets_per_class=40), PythonDocsLM(sequence_length=16)):
        module.setup()
        info, batch = module.info, next(iter(module.val_dataloader()))
        if info.task == IMAGE:
            assert batch["inputs"].shape[1:] == (info.in_channels, info.image_size, info.image_size)
            assert batch["labels"].max() == info.num_classes - 1  # 512 validation digits hold every class
        else:
            assert batch["inputs"].shape[1] == info.sequence_length
            assert batch["inputs"].max() < info.vocab_size
        if info.task == LM:
            assert batch["labels"].max() < info.vocab_size and info.num_classes is None
        if info.task == TEXT:
            assert batch["labels"].max() < info.num_classes


# ---------------------------------------------------------------------------------------------
# Every model family sized by a DataInfo.
# ---------------------------------------------------------------------------------------------

# Sizes that no tiny default has (those are 8 x 8 x 1 images, 10 or 4 classes, 64 tokens, 32 positions),
# so a size that does not reach the model shows in the logits or breaks the forward pass.
IMAGES = DataInfo(IMAGE, num_classes=7, image_size=12, in_channels=3)
TEXTS = DataInfo(TEXT, num_classes=3, vocab_size=300, sequence_length=40)
TOKENS = DataInfo(LM, vocab_size=300, sequence_length=40)
FAMILY_DATA = {
    "reference-vit-tiny": IMAGES,
    "vit-tiny": IMAGES,
    "hf-vit-tiny": IMAGES,
    "rope-vit-tiny": IMAGES,
    "eva02-tiny": IMAGES,
    "reference-bert-tiny": TEXTS,
    "bert-tiny": TEXTS,
    "roformer-tiny": TEXTS,
    "reference-tiny": TOKENS,
    "gpt2-tiny": TOKENS,
    "llama-tiny": TOKENS,
    "mistral-tiny": TOKENS,
    "qwen2-tiny": TOKENS,
    "qwen3-tiny": TOKENS,
    "olmo2-tiny": TOKENS,
    "gemma-tiny": TOKENS,
    "gemma2-tiny": TOKENS,
    "phi3-tiny": TOKENS,
    "gpt-neox-tiny": TOKENS,
}


def _batch(info: DataInfo, size: int = 2) -> dict[str, torch.Tensor]:
    """A batch as the DataModules of ``info``'s task give it, using the largest token id and every position."""
    if info.task == IMAGE:
        return {"inputs": torch.randn(size, info.in_channels, info.image_size, info.image_size)}
    ids = torch.randint(1, info.vocab_size, (size, info.sequence_length))
    ids[:, -1] = info.vocab_size - 1
    return {"inputs": ids, "attention_mask": torch.ones_like(ids)} if info.task == TEXT else {"inputs": ids}


@pytest.mark.parametrize("name", list(FAMILY_DATA))
def test_each_family_fits_its_output_and_inputs_to_the_data(name):
    """Logits are (B, num_classes) or (B, T, vocab_size) of the data, for inputs of the data's shape."""
    info = FAMILY_DATA[name]
    model = create_model(name, data=info)
    adapter = adapter_for(model)
    with torch.no_grad():
        logits = adapter.forward(model, adapter.model_inputs(model, _batch(info)))
    expected = (2, info.sequence_length, info.vocab_size) if info.task == LM else (2, info.num_classes)
    assert logits.shape == expected


MASKED_LM = ("bert-mlm-tiny", "bert-pretraining-tiny")  # no lmc task to size them by


def test_every_tiny_variant_is_checked():
    """Each family has a tiny variant: a new one must show here which data it takes."""
    assert {name for name in list_models() if name.endswith("-tiny")} == set(FAMILY_DATA) | set(MASKED_LM)


@pytest.mark.parametrize("name", MASKED_LM)
def test_masked_lm_models_refuse_data_they_cannot_be_trained_on(name):
    for info in (TOKENS, TEXTS):
        with pytest.raises(ValueError, match=f"take no data set \\({info.task} data given\\).*no masked-LM task"):
            create_model(name, data=info)


def test_explicit_overrides_win_over_the_data():
    model = create_model("gpt2-tiny", data=PythonDocsLM(sequence_length=16).info, vocab_size=300)
    assert model.config.vocab_size == 300 and model.config.n_positions == 16


def test_the_paper_models_take_sizes_the_tiny_defaults_lack():
    """``reference-vit`` has no image size of its own: MNIST's 28 x 28 x 1 must reach it, and a long sequence too."""
    vit = create_model("reference-vit", data=lmc.data.MNIST().info, width=32)
    assert (vit.config.image_size, vit.config.in_channels, vit.config.num_classes) == (28, 1, 10)
    assert vit.config.max_positions == (28 // 2) ** 2 + 1
    bert = create_model("bert", data=lmc.data.DBPedia(sequence_length=512).info, num_hidden_layers=1)
    assert (bert.config.num_labels, bert.config.vocab_size, bert.config.max_position_embeddings) == (14, 257, 512)


@pytest.mark.parametrize(
    "name, data, message",
    [
        ("gpt2-tiny", Digits, "decoder language models take causal_lm data, not image_classification data"),
        ("llama-tiny", PythonTextKinds, "decoder language models take causal_lm data, not text_classification"),
        ("bert-tiny", PythonDocsLM, "encoder models take text_classification data, not causal_lm data"),
        ("vit-tiny", PythonTextKinds, "timm vision models take image_classification data, not text_classification"),
    ],
)
def test_a_family_refuses_data_of_another_task(name, data, message):
    with pytest.raises(ValueError, match=message):
        create_model(name, data=data().info)


def test_data_must_be_a_data_info():
    with pytest.raises(TypeError, match="data must be a DataInfo"):
        create_model("gpt2-tiny", data={"task": "causal_lm", "num_classes": 257})


def test_a_registered_model_receives_the_data_info_and_the_overrides():
    received = []

    @register_model("test-info-echo")
    def echo(data: DataInfo | None, overrides: dict) -> torch.nn.Module:
        received.append((data, overrides))
        return torch.nn.Linear(1, 1)

    try:
        info = PythonDocsLM().info
        create_model("test-info-echo", data=info, bias=False)
        create_model("test-info-echo")
        assert received == [(info, {"bias": False}), (None, {})]
    finally:
        zoo._MODELS.pop("test-info-echo")


# ---------------------------------------------------------------------------------------------
# Checkpoints keep the DataInfo as plain data.
# ---------------------------------------------------------------------------------------------


def _fitted_checkpoint(module: LMCModule, data: LMCDataModule, path: Path) -> Path:
    run = trainer(path.parent, steps=1)
    run.fit(module, data)
    run.save_checkpoint(path)
    return path


def test_checkpoint_loads_with_weights_only_and_rebuilds_the_same_model(tmp_path):
    data = PythonDocsLM(batch_size=4, sequence_length=16)
    module = LMCModule("gpt2-tiny", data=data.info)
    path = _fitted_checkpoint(module, data, tmp_path / "lm.ckpt")

    checkpoint = torch.load(path, map_location="cpu", weights_only=True)  # refuses any class it does not know
    assert checkpoint["hyper_parameters"]["data"] == dataclasses.asdict(data.info)
    restored = LMCModule.load_from_checkpoint(path, map_location="cpu")
    assert restored.model.config.vocab_size == 257 and restored.model.config.n_positions == 16
    state, expected = restored.state_dict(), module.state_dict()
    assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in expected)


def test_cli_checkpoint_loads_with_weights_only(tmp_path, monkeypatch):
    """The CLI links ``data.info`` into ``model.data``: its checkpoints must hold plain data as well."""
    monkeypatch.chdir(tmp_path)
    experiment, fast = CONFIGS / "experiment" / "digits_vit_ape.yaml", CONFIGS / "debug" / "fast.yaml"
    cli = experiment_cli(["fit", "--config", str(experiment), "--config", str(fast), "--trainer.max_steps=1"])
    path = tmp_path / "cli.ckpt"
    cli.trainer.save_checkpoint(path)

    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    assert checkpoint["hyper_parameters"]["data"] == dataclasses.asdict(Digits().info)
    restored = LMCModule.load_from_checkpoint(path, map_location="cpu")
    assert restored.model.config.image_size == 8 and restored.model.config.num_classes == 10
