"""``lmc fit|validate|test|predict``: Lightning's own commands over lmc's model and data (LightningCLI)."""

from __future__ import annotations

TRAINING_COMMANDS = ("fit", "validate", "test", "predict")


def main(argv: list[str]) -> None:
    """Run a LightningCLI subcommand; an experiment config's ``protocol`` group is accepted and ignored."""
    from lmc.experiments.protocol import experiment_cli

    experiment_cli(argv)
