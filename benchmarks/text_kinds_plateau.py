"""Why does every BERT of the study end at validation accuracy 0.747 on the embedded text kinds?

Pre-trains the study's BERT family (``configs/study/bert_ape.yaml``: 32-byte snippets of
``lmc.data.PythonTextKinds``, its 30 epochs on half A) with ``lmc fit`` and writes the confusion
matrix of its predictions on the training and validation splits, beside a byte-histogram logistic
regression fitted on the same training snippets (what a bag of bytes can separate).

    python -m benchmarks.text_kinds_plateau   # writes benchmarks/results/text_kinds_plateau.{json,md}; one thread
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import yaml
from sklearn.linear_model import LogisticRegression
from torch.utils.data import DataLoader

from lmc.data import PythonTextKinds
from lmc.io import atomic_write_json, atomic_write_text
from lmc.training.module import load_trained

ROOT = Path(__file__).parent.parent
RESULTS = Path(__file__).parent / "results" / "text_kinds_plateau"
STUDY = ROOT / "configs" / "study" / "bert_ape.yaml"
CLASSES = ["help prose", "library source", "Unicode names", "HTML entities"]


def pretrain(folder: Path) -> Path:
    """The study's pre-training of the family (its epochs, half A), by ``lmc fit``; the final checkpoint."""
    epochs = yaml.safe_load(STUDY.read_text())["protocol"]["pretrain"]["max_epochs"]
    command = [sys.executable, "-m", "lmc", "fit", "--config", str(STUDY)]
    command += ["--config", str(ROOT / "configs" / "reinit" / "pretrain.yaml"), "--trainer.max_epochs", str(epochs)]
    command += ["--trainer.logger.init_args.save_dir", str(folder), "--trainer.enable_progress_bar", "false"]
    subprocess.run(command, check=True, cwd=folder, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True)
    return next(folder.glob("**/checkpoints/final.ckpt"))


def confusion(labels: np.ndarray, predictions: np.ndarray) -> list[list[int]]:
    matrix = np.zeros((len(CLASSES), len(CLASSES)), dtype=int)
    np.add.at(matrix, (labels, predictions), 1)
    return matrix.tolist()


def main() -> None:
    torch.set_num_threads(1)
    data_config = yaml.safe_load((ROOT / "configs" / "data" / "python_text_kinds_short.yaml").read_text())
    data = PythonTextKinds(**{**data_config["init_args"], "part": "A"})
    data.setup("fit")
    splits = {name: next(iter(DataLoader(data.split(name), batch_size=10_000))) for name in ("train", "val")}
    with tempfile.TemporaryDirectory() as folder:
        module = load_trained(pretrain(Path(folder)))[0].eval()
        with torch.no_grad():
            bert = {
                name: module.adapter.forward(module.model, module.adapter.model_inputs(module.model, batch)).argmax(-1)
                for name, batch in splits.items()
            }
    histograms = {
        name: np.stack([np.bincount(ids, minlength=260) for ids in b["inputs"].numpy()]) for name, b in splits.items()
    }
    labels = {name: b["labels"].numpy() for name, b in splits.items()}
    baseline = LogisticRegression(max_iter=5000).fit(histograms["train"], labels["train"])
    results = {"classes": CLASSES, "bert": {}, "byte_histogram_logistic_regression": {}}
    for name in splits:
        for key, predicted in (
            ("bert", bert[name].numpy()),
            ("byte_histogram_logistic_regression", baseline.predict(histograms[name])),
        ):
            results[key][name] = {
                "accuracy": float((predicted == labels[name]).mean()),
                "confusion": confusion(labels[name], predicted),
            }
    atomic_write_json(RESULTS.with_suffix(".json"), results)
    lines = [
        "# The 0.747 plateau of the text-kinds BERT",
        "",
        "Written by `benchmarks/text_kinds_plateau.py`: the study's BERT pre-training (`configs/study/bert_ape.yaml`,",
        "32-byte snippets, half A) and a byte-histogram logistic regression on the same training snippets.",
        "Rows: true class; columns: predicted class.",
        "",
    ]
    for key, title in (("bert", "BERT"), ("byte_histogram_logistic_regression", "byte-histogram logistic regression")):
        for name, entry in results[key].items():
            lines += [
                f"## {title}, {name} split: accuracy {entry['accuracy']:.4f}",
                "",
                "| true \\ predicted | " + " | ".join(CLASSES) + " |",
            ]
            lines += ["|---" * (len(CLASSES) + 1) + "|"]
            lines += [
                f"| {CLASSES[i]} | " + " | ".join(map(str, row)) + " |" for i, row in enumerate(entry["confusion"])
            ]
            lines.append("")
    atomic_write_text(RESULTS.with_suffix(".md"), "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
