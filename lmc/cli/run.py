"""``lmc run``: the paper's protocol end to end from one experiment config (lmc.experiments.run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def main(argv: list[str]) -> dict[str, Any]:
    """Parse an experiment config, run its protocol and print the summary table; returns the summary."""
    from lmc.experiments.jobs import ignore_srun_hint
    from lmc.experiments.protocol import experiment_cli
    from lmc.experiments.run import Experiment
    from lmc.experiments.summary import summary_table

    ignore_srun_hint()
    cli = experiment_cli(argv, run=False)
    summary = Experiment(cli).run()
    print(summary_table(summary))
    print(f"Results: {Path(cli.config_init.protocol.output_dir)}/summary.md (.json, .csv, figures, tensorboard/)")
    return summary
