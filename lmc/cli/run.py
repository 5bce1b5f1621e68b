"""``lmc run``: the paper's protocol end to end from one experiment config (lmc.experiments.run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: ``lmc run``'s own flag beside the experiment config's: no progress lines (:mod:`lmc.experiments.progress`).
QUIET = "--quiet"


def main(argv: list[str]) -> dict[str, Any]:
    """Parse an experiment config, run its protocol and print the summary table; returns the summary.

    The stages' progress goes to standard error (an updating line per running stage on a terminal,
    plain lines elsewhere) unless ``--quiet`` is given.
    """
    from lmc.experiments.jobs import ignore_srun_hint
    from lmc.experiments.progress import Display
    from lmc.experiments.protocol import experiment_cli
    from lmc.experiments.report.run_summary import summary_table
    from lmc.experiments.run import Experiment

    ignore_srun_hint()
    # Not a config key: a run's recorded configs stay those of the experiment.
    quiet = QUIET in argv
    cli = experiment_cli([arg for arg in argv if arg != QUIET], run=False)
    with Display("quiet" if quiet else "auto") as display:
        summary = Experiment(cli).run(display=display)
    print(summary_table(summary))
    print(f"Results: {Path(cli.config_init.protocol.output_dir)}/summary.md (.json, .csv, figures, tensorboard/)")
    return summary
