"""``lmc repro``: the paper's study at small scale, then its report."""

from __future__ import annotations

from pathlib import Path

from lmc.experiments.jobs import Cluster


def repro(
    study: Path | list[Path] = [Path("configs/study/repro.yaml")],
    quick: bool = False,
    jobs: int = 2,
    output_dir: Path | None = None,
    report: Path | None = None,
    cluster: Cluster = Cluster(),
    summarize: bool = False,
    quiet: bool = False,
) -> None:
    """The paper's study at small scale: every family and strategy, Table 1, then docs/results.md.

    Each pre-training and each run is a job: processes on this machine by default, or a SLURM cluster
    (--executor slurm; docs/reproduction.md). Runs resume after a kill (finished fits and sweep
    points are kept) and a rerun submits only the unfinished jobs. Each job computes with one
    thread, so the numbers do not depend on --jobs or on where the jobs run. With --tasks_per_node
    (or --gpus_per_job, --nodes) above 1 every fit is a Lightning DDP job of its own, which trains
    other models than one process (docs/reproduction.md).

    Args:
        study: A study config, or a list of them, later ones overriding earlier ones
            (configs/study/*.yaml; configs/... is read from the working folder, else from lmc's own).
        quick: The same pipeline in its tiny form (configs/study/quick.yaml: a few steps, 2 seeds;
            its numbers mean nothing; it writes runs/repro_quick/results.md, not docs/results.md).
        jobs: Jobs at a time (one CPU thread each), unless --max_jobs says otherwise.
        output_dir: The run folders' root instead of the study's (runs/repro; runs/repro_quick with --quick).
        report: The Markdown report instead of the study's (docs/results.md; runs/repro_quick/results.md
            with --quick); its figures go into a folder of the same name without .md.
        cluster: Where the jobs run (its fields are this command's flags: --executor, --partition,
            --gpus_per_job, ...).
        summarize: Run nothing: summarize the finished runs again (a newer lmc's measures read
            their recorded sweeps) and write the report, keeping the runs' recorded times.
        quiet: Show no progress (else the running jobs and each run's stage, stages done, elapsed
            and estimated time on standard error: an updating line each on a terminal, plain lines elsewhere).
    """
    from lmc.experiments.jobs import ignore_srun_hint
    from lmc.experiments.study import repro as run_study

    ignore_srun_hint()
    studies = [study] if isinstance(study, Path) else list(study)
    overrides = {"output_dir": output_dir, "report": report}
    run_study(
        [*studies, *([Path("configs/study/quick.yaml")] if quick else [])],
        jobs=jobs,
        cluster=cluster,
        overrides={name: str(value) for name, value in overrides.items() if value is not None},
        summarize=summarize,
        quiet=quiet,
    )
