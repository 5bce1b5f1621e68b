"""``lmc repro``: the paper's study at small scale, then its report."""

from __future__ import annotations

from pathlib import Path


def repro(
    study: list[Path] = [Path("configs/study/repro.yaml")],
    quick: bool = False,
    jobs: int = 2,
) -> None:
    """The paper's study at small scale: every family and strategy, Table 1, then docs/results.md.

    Runs resume after a kill (finished fits and sweep points are kept). Each run computes in a worker
    with one thread, so the numbers do not depend on --jobs.

    Args:
        study: Study configs, later ones overriding earlier ones (configs/study/*.yaml).
        quick: The same pipeline in its tiny form (configs/study/quick.yaml: a few steps, 2 seeds;
            its numbers mean nothing; it writes runs/repro_quick/results.md, not docs/results.md).
        jobs: Runs at a time (one CPU thread each).
    """
    from lmc.experiments.study import repro as run_study

    run_study([*study, *([Path("configs/study/quick.yaml")] if quick else [])], jobs=jobs)
