"""The user's own evaluation data for external models, as lmc batches (:mod:`lmc.data.base`).

- causal LMs: a ``.txt`` file, or a table (a local HF dataset folder written by
  ``save_to_disk``, ``.json`` / ``.jsonl`` / ``.csv`` / ``.parquet``) with a text column;
  tokenized with the model directory's own tokenizer, joined (EOS between texts when the
  tokenizer has one) and cut into non-overlapping windows of ``sequence_length`` tokens;
- sequence classifiers: a table with a text and a label column (integers, or names from the
  config's ``label2id``); texts truncated to ``sequence_length`` tokens;
- BERT masked-LM and pre-training models: a ``.txt`` file (one text per non-empty line) or a
  table with a text column, each text one sequence ``[CLS] text [SEP]`` truncated to
  ``sequence_length`` tokens, masked once with BERT's seeded recipe (:mod:`lmc.formats.masked_lm`);
  a table with a pair column gives ``[CLS] A [SEP] B [SEP]`` pairs, and a pre-training model
  is then also scored on their next-sentence labels (the label column);
- timm image models: an image folder with one subfolder per class (torchvision
  ``ImageFolder``): one folder per class of the model, whose sorted names are labels 0, 1, ...,
  or folders named by class index (``3/``, ``7/``) for a subset of the classes; resized and
  normalized with the model's timm data config;
- Hugging Face image classifiers (``ViTForImageClassification``): the same folders, resized to the
  config's ``image_size`` and normalized with the ``image_mean``/``image_std`` of the model
  directory's ``preprocessor_config.json`` (``ViTImageProcessor``'s 0.5 and 0.5 without one).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.data import Dataset

from lmc.data.base import TensorDictDataset, TokenWindows
from lmc.formats.evaluation_options import EvaluationDataOptions
from lmc.formats.masked_lm import CHOSEN_FRACTION, MASK_FRACTION, RANDOM_FRACTION, mask_tokens
from lmc.tasks import Task

TABLE_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet")
#: Tokens per sequence of the user's text unless the model covers fewer positions or --sequence_length says.
DEFAULT_SEQUENCE_LENGTH = 128
#: HF ``DatasetDict`` split names tried for each curve split.
DATASET_SPLITS = {"val": ("validation", "val", "valid", "dev"), "test": ("test",)}
#: What an external model is evaluated on: lmc's tasks, and BERT's masked-LM objective (evaluation only).
EvaluationTask = Task | Literal["masked_lm"]


@dataclass(frozen=True)
class EvaluationData:
    """User data ready to evaluate.

    Attributes:
        dataset: Samples in lmc's batch format.
        task: ``"causal_lm"``, ``"text_classification"``, ``"image_classification"`` or ``"masked_lm"``.
        identity: What identifies the data in a sweep's key (path, settings, size and time stamp).
        note: What the evaluation leaves out, to tell the user (``None``: nothing).
    """

    dataset: Dataset
    task: EvaluationTask
    identity: dict[str, Any]
    note: str | None = None


def model_task(model: nn.Module) -> EvaluationTask:
    """The task of a supported HF or timm model, from its class."""
    name = type(model).__name__
    if name.endswith(("ForCausalLM", "LMHeadModel")):
        return "causal_lm"
    if name.endswith(("ForMaskedLM", "ForPreTraining")):
        return "masked_lm"
    if name.endswith("ForSequenceClassification"):
        return "text_classification"
    if name.endswith("ForImageClassification"):
        return "image_classification"
    if type(model).__module__.startswith("timm."):
        return "image_classification"
    raise ValueError(
        f"lmc does not know which data {name} evaluates on: it measures causal LMs, masked LMs, text and image "
        "classifiers; lmc align and lmc equivalent take it"
    )


def read_columns(path: str | Path, columns: list[str], split: str, optional: tuple[str, ...] = ()) -> dict[str, list]:
    """The named columns of a local HF dataset folder or a ``.json``/``.jsonl``/``.csv``/``.parquet`` file,
    and those of the ``optional`` ones it has.

    Raises:
        ValueError: Not a table lmc reads, or a column is missing (the message lists those present).
    """
    path = Path(path)
    if path.is_dir():
        table = _load_from_disk(path, split)
    elif path.suffix == ".parquet":
        import pyarrow.parquet

        table = pyarrow.parquet.read_table(path).to_pydict()
    elif path.suffix == ".csv":
        import pyarrow.csv

        table = pyarrow.csv.read_csv(path).to_pydict()
    elif path.suffix in (".json", ".jsonl"):
        table = _read_json(path)
    else:
        raise ValueError(f"{path}: lmc reads .txt, {', '.join(TABLE_SUFFIXES)} files or a save_to_disk folder")
    missing = [c for c in columns if c not in table]
    if missing:
        raise ValueError(
            f"{path} has no column {missing[0]!r} (columns: {', '.join(map(str, table))}); "
            "name the right one with --text_column / --label_column"
        )
    return {c: list(table[c]) for c in [*columns, *optional] if c in table}


def _read_json(path: Path) -> dict[str, list]:
    text = path.read_text()
    try:
        rows = json.loads(text)
    except ValueError:  # JSON lines
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    if isinstance(rows, dict):  # {"column": [values]}
        return rows
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{path} holds neither records ([{{...}}] or one object per line) nor columns")
    columns = dict.fromkeys(k for r in rows for k in r)
    return {c: [r.get(c) for r in rows] for c in columns}


def _load_from_disk(path: Path, split: str) -> dict[str, list]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as error:
        raise ValueError(f"{path} is a folder but not a dataset written by save_to_disk ({error})") from error
    if isinstance(loaded, datasets.DatasetDict):
        names = [n for n in DATASET_SPLITS[split] if n in loaded]
        if not names:
            raise ValueError(
                f"{path} has splits {sorted(loaded)}, none of them a {split} split ({'/'.join(DATASET_SPLITS[split])})"
            )
        loaded = loaded[names[0]]
    return loaded.to_dict()


def _stamp(path: Path) -> dict[str, int]:
    """Size, file count and latest modification of a file or folder: a change of the data changes the sweep key."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    stats = [p.stat() for p in files]
    return {
        "files": len(files),
        "bytes": sum(s.st_size for s in stats),
        "modified_ns": max((s.st_mtime_ns for s in stats), default=0),
    }


def evaluation_data(
    path: str | Path,
    model: nn.Module,
    tokenizer_folder: str | Path | None,
    options: EvaluationDataOptions = EvaluationDataOptions(),
) -> EvaluationData:
    """The user's data at ``path`` as samples for ``model`` (see the module docstring for the layouts).

    Args:
        path: A ``.txt`` file, a table file, a ``save_to_disk`` folder or an image folder.
        model: The model to evaluate (its class says the task).
        tokenizer_folder: The HF model directory holding the tokenizer (text models).
        options: The split of a ``DatasetDict`` folder, the tables' column names, the tokens
            per window (causal LMs) or per text at most (classifiers, masked LMs) and the seed
            of a masked LM's masks.

    Raises:
        ValueError: Data the model cannot evaluate, or that does not fit it (the message names the fix).
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"the data {path} does not exist")
    split, text_column, label_column = options.split, options.text_column, options.label_column
    sequence_length = options.sequence_length
    task = model_task(model)
    if split != "val" and not path.is_dir():
        raise ValueError(
            f"{path} is one file, not a data set with splits: --split {split} applies to a DataModule or a "
            "save_to_disk DatasetDict folder; leave --split at its default for a file"
        )
    identity = {"path": str(path.resolve()), "task": task, **_stamp(path)}
    if task == "image_classification":
        return EvaluationData(_image_folder(path, model, tokenizer_folder), task, identity)
    positions = _positions(model.config)
    if sequence_length is None:
        sequence_length = DEFAULT_SEQUENCE_LENGTH if positions is None else min(DEFAULT_SEQUENCE_LENGTH, positions)
    if positions is not None and sequence_length > positions:
        raise ValueError(
            f"--sequence_length {sequence_length} is longer than the {positions} positions of {type(model).__name__}: "
            f"choose at most {positions}"
        )
    tokenizer = _tokenizer(tokenizer_folder)
    identity.update(text_column=text_column, sequence_length=sequence_length)
    if task == "masked_lm":
        return _masked_lm_data(path, model, tokenizer, options, sequence_length, identity)
    if task == "causal_lm":
        texts = [_text(path)] if path.suffix == ".txt" else read_columns(path, [text_column], split)[text_column]
        tokens = _token_stream(tokenizer, [str(t) for t in texts], model.config.vocab_size)
        if len(tokens) < sequence_length + 1:
            raise ValueError(
                f"{path} gives {len(tokens)} tokens, fewer than one sequence of {sequence_length} + 1: "
                "lower --sequence_length or give more text"
            )
        return EvaluationData(TokenWindows(tokens, sequence_length), task, identity)
    if path.suffix == ".txt":
        raise ValueError(f"{path} holds no labels: a sequence classifier needs a table with text and label columns")
    identity["label_column"] = label_column
    table = read_columns(path, [text_column, label_column], split)
    labels = _labels(table[label_column], model.config, path)
    encoded = _padded(tokenizer, [str(t) for t in table[text_column]], sequence_length, model.config.vocab_size)
    dataset = TensorDictDataset(inputs=encoded["input_ids"], attention_mask=encoded["attention_mask"], labels=labels)
    return EvaluationData(dataset, task, identity)


def _masked_lm_data(
    path: Path,
    model: nn.Module,
    tokenizer,
    options: EvaluationDataOptions,
    sequence_length: int,
    identity: dict[str, Any],
) -> EvaluationData:
    """BERT masked-LM samples (:mod:`lmc.formats.masked_lm`), with next-sentence labels for a pre-training
    model given sentence pairs."""
    name, vocab_size = type(model).__name__, model.config.vocab_size
    if tokenizer.mask_token_id is None:
        raise ValueError(
            f"the tokenizer of {tokenizer.name_or_path} has no mask token: {name} is evaluated on masked tokens; "
            "save the tokenizer it was trained with (BERT's has [MASK]) beside the model"
        )
    pretraining = name.endswith("ForPreTraining")
    if path.suffix == ".txt":
        table = {options.text_column: [line for line in _text(path).splitlines() if line.strip()]}
    else:
        optional = (options.pair_column, options.label_column) if pretraining else (options.pair_column,)
        table = read_columns(path, [options.text_column], options.split, optional)
    texts = [str(t) for t in table[options.text_column]]
    pairs = [str(t) for t in table[options.pair_column]] if options.pair_column in table else None
    if not texts:
        raise ValueError(f"{path} holds no text: give {name} one text per line of a .txt file or per table row")
    encoded = _padded(tokenizer, texts, sequence_length, vocab_size, pairs)
    ids, attention = encoded["input_ids"], encoded["attention_mask"]
    special = torch.tensor(sorted(tokenizer.all_special_ids))
    candidates = attention.bool() & ~torch.isin(ids, special)
    if not candidates.any():
        raise ValueError(f"{path} gives no token to mask: every token is special or padding; give more text")
    vocabulary = torch.tensor(sorted(tokenizer.get_vocab().values()))
    replacements = vocabulary[~torch.isin(vocabulary, special) & (vocabulary < vocab_size)]
    inputs, labels = mask_tokens(ids, candidates, tokenizer.mask_token_id, replacements, options.mask_seed)
    samples = {"inputs": inputs, "attention_mask": attention, "labels": labels}
    recipe = {"chosen": CHOSEN_FRACTION, "masked": MASK_FRACTION, "random": RANDOM_FRACTION}
    identity.update(mask_seed=options.mask_seed, masking=recipe)
    note = None
    if pairs is not None:
        identity["pair_column"] = options.pair_column
        samples["token_type_ids"] = encoded["token_type_ids"]
    if pretraining and pairs is None:
        note = (
            f"{name}: only the masked-LM head is evaluated; its next-sentence head needs sentence pairs "
            f"(a table with a {options.pair_column!r} column, --pair_column, and 0/1 labels, --label_column)"
        )
    elif pretraining:
        if options.label_column not in table:
            raise ValueError(
                f"{path} gives sentence pairs but no next-sentence labels (no column {options.label_column!r}): "
                "add 0/1 labels (0: the second sentence follows the first, 1: it is random) or name their column "
                "with --label_column"
            )
        identity["label_column"] = options.label_column
        samples["next_sentence_label"] = _next_sentence_labels(table[options.label_column], path)
    return EvaluationData(TensorDictDataset(**samples), "masked_lm", identity, note)


def _next_sentence_labels(values: list, path: Path) -> torch.Tensor:
    """BERT's next-sentence labels ``(N,)``: 0 when the second sentence follows the first, 1 when it is random."""
    bad = [v for v in values if isinstance(v, bool) or v not in (0, 1)]
    if bad:
        raise ValueError(
            f"{path}: next-sentence label {bad[0]!r} is neither 0 (the second sentence follows the first) nor 1 "
            "(it is a random sentence)"
        )
    return torch.tensor([int(v) for v in values], dtype=torch.long)


#: The files that hold a tokenizer's vocabulary: without one, AutoTokenizer may build one that maps every word to
#: its unknown token.
VOCABULARY_FILES = (
    "tokenizer.json",
    "vocab.txt",
    "vocab.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)


def _positions(config) -> int | None:
    """The positions a text model covers (GPT-2's ``n_positions``, the others' ``max_position_embeddings``)."""
    for name in ("n_positions", "max_position_embeddings"):
        if isinstance(getattr(config, name, None), int):
            return getattr(config, name)
    return None


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{path} is not UTF-8 text ({error.reason} at byte {error.start}): save it as UTF-8"
        ) from error


def _tokenizer(folder: str | Path | None):
    from transformers import AutoTokenizer

    if folder is None or not any((Path(folder) / name).is_file() for name in VOCABULARY_FILES):
        raise ValueError(
            f"{folder} has no tokenizer files ({', '.join(VOCABULARY_FILES)}): text data is read with the model "
            "directory's own tokenizer; save it beside the model (tokenizer.save_pretrained(folder))"
        )
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"cannot load the tokenizer of {folder} ({str(error).splitlines()[0]}): the model directory needs its "
            "tokenizer files (tokenizer.json, tokenizer_config.json, ...) to read text data"
        ) from error


def _check_vocabulary(ids: torch.Tensor, vocab_size: int) -> None:
    if len(ids) and int(ids.max()) >= vocab_size:
        raise ValueError(
            f"the tokenizer gives id {int(ids.max())}, outside the model's vocabulary of {vocab_size}: "
            "the tokenizer files do not belong to this model"
        )


def _token_stream(tokenizer, texts: list[str], vocab_size: int) -> torch.Tensor:
    separator = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    stream = []
    for ids in tokenizer(texts)["input_ids"]:
        stream += ids + separator
    tokens = torch.tensor(stream[: len(stream) - len(separator)], dtype=torch.long)
    _check_vocabulary(tokens, vocab_size)
    return tokens


def _padded(
    tokenizer, texts: list[str], length: int, vocab_size: int, pairs: list[str] | None = None
) -> dict[str, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` ``(N, length)`` of the texts (or of the pairs ``text, pair``,
    then with ``token_type_ids``), truncated and padded to ``length`` tokens."""
    encoded = tokenizer(texts, pairs, truncation=True, max_length=length)
    pad = tokenizer.pad_token_id or 0
    ids = torch.full((len(texts), length), pad, dtype=torch.long)
    result = {"input_ids": ids, "attention_mask": torch.zeros_like(ids)}
    if pairs is not None:
        result["token_type_ids"] = torch.zeros_like(ids)
    for row, sequence in enumerate(encoded["input_ids"]):
        ids[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        result["attention_mask"][row, : len(sequence)] = 1
        if pairs is not None:
            result["token_type_ids"][row, : len(sequence)] = torch.tensor(encoded["token_type_ids"][row])
    _check_vocabulary(ids, vocab_size)
    return result


def _labels(values: list, config, path: Path) -> torch.Tensor:
    names = getattr(config, "label2id", None) or {}
    fractional = [v for v in values if isinstance(v, float) and not v.is_integer()]
    if fractional:
        raise ValueError(
            f"{path}: label {fractional[0]} is not a class index (labels are integers, or the model's label names "
            f"{sorted(names)})"
        )
    try:
        labels = torch.tensor([names[v] if isinstance(v, str) else int(v) for v in values], dtype=torch.long)
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(
            f"{path}: label {error} is neither a class index nor one of the model's label names {sorted(names)}"
        ) from error
    if len(labels) == 0:
        raise ValueError(f"{path} holds no rows")
    if int(labels.min()) < 0 or int(labels.max()) >= config.num_labels:
        raise ValueError(f"{path}: labels must lie in [0, {config.num_labels}), the model's classes")
    return labels


def _image_transform(model: nn.Module, model_folder: str | Path | None) -> tuple[Any, int, int]:
    """The evaluation transform of a timm or Hugging Face image model, its channels and its classes."""
    if type(model).__module__.startswith("timm."):
        from timm.data import create_transform, resolve_data_config

        config = resolve_data_config({}, model=model)
        return create_transform(**config, is_training=False), config["input_size"][0], model.num_classes
    from torchvision import transforms

    config = model.config
    processor = Path(model_folder) / "preprocessor_config.json" if model_folder is not None else None
    settings = json.loads(processor.read_text()) if processor is not None and processor.is_file() else {}
    channels = config.num_channels
    mean, std = settings.get("image_mean", [0.5] * channels), settings.get("image_std", [0.5] * channels)
    steps = [transforms.Resize((config.image_size, config.image_size)), transforms.ToTensor()]
    return transforms.Compose([*steps, transforms.Normalize(mean, std)]), channels, config.num_labels


def _image_folder(path: Path, model: nn.Module, model_folder: str | Path | None) -> Dataset:
    from PIL import Image
    from torchvision.datasets import ImageFolder

    if not path.is_dir():
        raise ValueError(
            f"{path} is not a folder: an image model evaluates on an image folder, one subfolder per class"
        )
    transform, channels, num_classes = _image_transform(model, model_folder)

    def load(file: str) -> Image.Image:
        with Image.open(file) as image:
            return image.convert("L" if channels == 1 else "RGB")

    try:
        folder = ImageFolder(str(path), transform=transform, loader=load)
    except (FileNotFoundError, OSError) as error:
        raise ValueError(f"{path}: {error}; put the images in one subfolder per class") from error
    if all(name.isdigit() for name in folder.classes):  # folders named by class index: any subset of the classes
        indices = [int(name) for name in folder.classes]
        if max(indices) >= num_classes:
            raise ValueError(f"{path}: class folder {max(indices)} is not one of the model's {num_classes} classes")
        folder.target_transform = indices.__getitem__
    elif len(folder.classes) != num_classes:
        raise ValueError(
            f"{path} has {len(folder.classes)} class folders, but the model has {num_classes} classes: "
            "labels are the folders' places in sorted order, so give one folder per class of the model, or name "
            "each folder by its class index (0, 1, ...)"
        )
    return _ImageSamples(folder)


class _ImageSamples(Dataset):
    """``ImageFolder``'s ``(image, label)`` pairs as lmc samples."""

    def __init__(self, folder: Dataset):
        self.folder = folder

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        image, label = self.folder[index]
        return {"inputs": image, "labels": torch.tensor(label)}
