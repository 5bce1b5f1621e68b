"""``lmc run`` end to end on the Hugging Face families beyond the paper's (issue #20): Pythia's layout,
Mistral's window, Qwen2's biases, Qwen3's and OLMo-2's QK-norms, Phi-3's fused blocks, Gemma's norms
and Gemma 2's soft-capping, transformers' own ViT.

Each run pre-trains, fine-tunes two seeds under ``first_block`` (an attention layer and an FFN) and
aligns their pair with the full method. The aligned model is the target moved inside its group, so
the aligned curve must end where the naive one does: the same source at alpha 0, bit for bit, and
at alpha 1 the target's function, up to float32 rounding of the moved weights.
"""

from __future__ import annotations

import csv

import pytest
import yaml

from lmc.cli import main

DECODERS = ("gpt-neox", "mistral", "qwen2", "qwen3", "olmo2", "phi3", "gemma", "gemma2")
FAMILIES = {**{f"{name}-tiny": "lmc.data.PythonDocsLM" for name in DECODERS}, "hf-vit-tiny": "lmc.data.Digits"}


def _curves(path) -> dict[str, dict[float, float]]:
    curves: dict[str, dict[float, float]] = {}
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            curves.setdefault(row["curve"], {})[float(row["alpha"])] = float(row["loss"])
    return curves


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_run_on_the_family_aligns_its_pair_inside_the_group(name, tmp_path):
    config = {
        "seed_everything": 0,
        "model": {"model": name, "lr": 3e-3},
        "data": {"class_path": FAMILIES[name], "init_args": {"batch_size": 16}},
        "trainer": {
            "accelerator": "cpu",
            "max_epochs": 1,
            "limit_train_batches": 4,
            "limit_val_batches": 1,
            "num_sanity_val_steps": 0,
            "enable_progress_bar": False,
            "enable_model_summary": False,
        },
        "cluster": {"executor": "inline"},
        "protocol": {
            "output_dir": str(tmp_path / "run"),
            "reinit": "first_block",
            "seeds": 2,
            "num_alphas": 3,
            "eval_samples": 32,
            "alignments": [{"method": "full"}],
        },
    }
    path = tmp_path / "experiment.yaml"
    path.write_text(yaml.safe_dump(config))
    main(["run", "--config", str(path)])

    curves = _curves(tmp_path / "run" / "pairs" / "0_1" / "full" / "lmc_results.csv")
    naive, aligned = curves["naive"], curves["aligned"]
    assert sorted(aligned) == sorted(naive) == [0.0, 0.5, 1.0]
    assert aligned[0.0] == naive[0.0]
    assert aligned[1.0] == pytest.approx(naive[1.0], rel=1e-6, abs=0)
    # The pair differs inside the scope: the midpoint is another model, not either end point.
    assert aligned[0.5] != aligned[0.0] and naive[0.5] != naive[1.0]
