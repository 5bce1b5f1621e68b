"""benchmarks/data_aware_ablation: its config is an ``lmc run`` protocol; its table reads the summaries right."""

import json
from pathlib import Path

from benchmarks.data_aware_ablation.report import LABELS, table
from lmc.experiments.protocol import alignment_labels, experiment_cli

ROOT = Path(__file__).resolve().parents[2]


def test_the_ablation_config_lists_each_switch_alone_and_together(monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)  # the configs name their files relative to the repository
    args = ["--config", "configs/study/llama_rope.yaml", "--config", "benchmarks/data_aware_ablation/ablation.yaml"]
    protocol = experiment_cli([*args, f"--protocol.output_dir={tmp_path}"], run=False).config_init.protocol
    assert alignment_labels(protocol.alignment_options) == list(LABELS)
    assert protocol.reinit == "first_block" and protocol.seeds == 5
    assert protocol.eval_samples == 182  # the study's own curve split for the LM families


def test_the_table_gives_mean_spread_and_wins_over_full(tmp_path):
    pairs = ["0_1", "0_2", "1_2"]
    ratios = {label: [10.0 * (i + 1) + k for k in range(3)] for i, label in enumerate(LABELS)}
    ratios["full-objective=data"] = [5.0, 50.0, 5.0]  # below full (10, 11, 12) in two pairs
    summary = {
        "pairs": pairs,
        "protocol": {"reinit": "first_block"},
        "alignments": {
            label: {"per_pair": {p: {"barrier_ratio": {"loss_barrier": v}} for p, v in zip(pairs, values)}}
            for label, values in ratios.items()
        },
    }
    run = tmp_path / "llama_rope"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps(summary))
    lines = table(run)
    assert lines[0] == "**llama_rope** (first_block, 3 pairs)"
    rows = {line.split(" | ")[0].lstrip("| "): line for line in lines[4:]}
    assert rows["weight (`full`)"] == "| weight (`full`) | 11.0 ± 1.0 | 0/3 | 10.0 11.0 12.0 |"
    assert rows["`objective: data` alone"] == "| `objective: data` alone | 20.0 ± 26.0 | 2/3 | 5.0 50.0 5.0 |"
