"""``lmc demo``: the main job on the embedded default (offline, CPU)."""

from __future__ import annotations

from pathlib import Path


def demo(
    output_dir: Path = Path("runs/demo"), epochs: int | None = None, seeds: int | None = None, quiet: bool = False
) -> None:
    """The main job: pre-train, fine-tune seeds, align and sweep on 5,000 real MNIST digits (offline, CPU).

    Args:
        output_dir: Where checkpoints, logs and results go.
        epochs: Pre-training and fine-tuning epochs (default: the main job's 40 and 20).
        seeds: Fine-tuned seeds per encoding, every pair of them aligned (default: the main job's 4).
        quiet: Show no progress (else each encoding's stage, stages done, elapsed and estimated time
            on standard error: an updating line each on a terminal, plain lines elsewhere).
    """
    from lmc.experiments import demo as main_job

    if epochs is not None and epochs < 1:
        raise ValueError(f"--epochs must be at least 1, got {epochs}")
    if seeds is not None and seeds < 2:
        raise ValueError(f"--seeds must be at least 2 (a pair of fine-tuned runs), got {seeds}")
    main_job.run(output_dir, epochs=epochs, seeds=seeds, quiet=quiet)
