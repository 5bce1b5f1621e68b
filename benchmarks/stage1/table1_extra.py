"""Table 1 of a study's family again with more Stage 1 settings, in a copy of its run.

The study's ``first_attention`` run of a family (its stages, pairs and every evaluated curve point)
is copied, and ``lmc run`` runs it again with the study's own configs plus ``--alignment``
settings: only what is new is computed (the new alignments' curves, and any head order they need
whole); the points already evaluated are read. Each family's rank, rank within noise, ties, ``L_hat``
and loss ratio of the full method's Stage 1 settings go to the result files.

    python -m benchmarks table1_extra --family gpt2_ape --alignment '{"method": "full", "metric": "balanced"}'
    # writes runs/table1_extra/<family>/first_attention and (merging by family)
    # benchmarks/stage1/results/table1_extra.{json,md}
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
from pathlib import Path

import torch

from lmc.experiments.jobs import Cluster
from lmc.experiments.protocol import alignment_labels, experiment_cli
from lmc.experiments.run import Experiment
from lmc.experiments.spread import cell
from lmc.experiments.study import load_study
from lmc.io import atomic_write_json, atomic_write_text
from lmc.matching import AlignOptions

RESULTS = Path(__file__).parent / "results" / "table1_extra"
STRATEGY = "first_attention"


def run_family(study_path: str, family_name: str, output: Path, extra: list[AlignOptions]) -> dict:
    """The family's Table 1 run with ``extra`` alignments beside the study's, in ``output``; its summary."""
    study = load_study([study_path])
    family = study.family(family_name)
    source = Path(study.output_dir) / family.name / STRATEGY
    if not (source / "summary.json").is_file():
        raise SystemExit(f"{source} is no finished run of the study: run `lmc repro --study {study_path}` first")
    copy = output / family.name / STRATEGY
    if not copy.exists():
        shutil.copytree(source, copy, symlinks=True)
    cli = experiment_cli(study.arguments(family, STRATEGY), run=False)
    protocol = study.protocol(family, STRATEGY, cli)
    alignments = [
        *protocol.alignment_options,
        *(options for options in extra if options not in protocol.alignment_options),
    ]
    protocol = dataclasses.replace(protocol, output_dir=str(copy), alignments=alignments)
    return Experiment(cli, protocol).run(Cluster(executor="inline"))


def rows(summary: dict) -> dict[str, dict]:
    """Per full-method Stage 1 setting: its Table 1 statistics (loss barrier) and loss ratio."""
    table = {}
    for label, orders in summary["head_orders"]["alignments"].items():
        if label.startswith("full"):
            loss = orders["loss_barrier"]
            table[label] = {
                "rank": loss["rank"],
                "rank_within_noise": loss["rank_within_noise"],
                "ties": f"{loss['ties']} of {loss['noise_pairs']}",
                "l_hat": loss["l_hat"],
                "ratio": summary["alignments"][label]["barrier_ratio"]["loss_barrier"],
                "alphas": len(summary["alignments"][label]["mean_curves"]["aligned"]),
            }
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--study", default="configs/study/repro.yaml")
    parser.add_argument("--family", required=True, help="a family of the study with a Table 1 run")
    parser.add_argument("--alignment", action="append", required=True, help="AlignOptions as JSON, repeatable")
    parser.add_argument("--output", type=Path, default=Path("runs/table1_extra"))
    args = parser.parse_args()
    try:
        extra = [AlignOptions(**json.loads(text)) for text in args.alignment]
    except (ValueError, TypeError) as error:
        raise SystemExit(f"--alignment: {error}") from None
    torch.set_num_threads(1)
    summary = run_family(args.study, args.family, args.output, extra)
    path = RESULTS.with_suffix(".json")
    results = json.loads(path.read_text()) if path.is_file() else {}
    results[args.family] = {"pairs": len(summary["pairs"]), "extra": alignment_labels(extra), "rows": rows(summary)}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, results)
    lines = [
        "# Table 1 with more Stage 1 settings",
        "",
        "Written by `python -m benchmarks table1_extra`: each family's `first_attention` run of "
        "`configs/study/repro.yaml` "
        "again with the settings named, in a copy that reads every point the study evaluated. Mean ± std over "
        "pairs, loss barrier; `alphas`: the points of the setting's curves (its ratio against the naive barrier "
        "on the same alphas).",
    ]
    for family, entry in results.items():
        lines += [
            "",
            f"## {family} ({entry['pairs']} pairs; added: {', '.join(f'`{label}`' for label in entry['extra'])})",
            "",
            "| Stage 1 | rank | within noise | tied | L_hat % | loss ratio | alphas |",
            "|---|---|---|---|---|---|---|",
        ]
        for label, row in entry["rows"].items():
            pairs = entry["pairs"]
            lines.append(
                f"| `{label}` | {cell(row['rank'], of=pairs)} | {cell(row['rank_within_noise'], of=pairs)} "
                f"| {row['ties']} | {cell(row['l_hat'], of=pairs)} | {cell(row['ratio'], unit=' %', of=pairs)} "
                f"| {row['alphas']} |"
            )
    atomic_write_text(RESULTS.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
