"""A fit that stops at one training batch the first time it gets there, until its job is killed."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import lightning


class PauseOnce(lightning.Callback):
    """Pauses stage ``stage`` at training batch ``batch`` on its first attempt, after writing
    ``marker`` (the process id and the SLURM job id), so a test can kill or requeue the job mid-fit.

    A later attempt finds the marker and trains through. Cosmetic for ``lmc run``: callbacks are
    no part of a stage's key, so the stage's results are those of a run without it. In a DDP fit
    rank 0 pauses; the other ranks wait for it in the step's gradient all-reduce.
    """

    def __init__(self, marker: str, stage: str, batch: int = 2, seconds: float = 120.0):
        self.marker, self.stage, self.batch, self.seconds = Path(marker), stage, batch, seconds

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if trainer.logger is None or trainer.logger.name != self.stage or batch_idx != self.batch:
            return
        if trainer.global_rank != 0:
            return
        if self.marker.exists():
            return
        job = {"pid": os.getpid(), "slurm_job_id": os.environ.get("SLURM_JOB_ID")}
        temporary = self.marker.with_suffix(".tmp")
        temporary.write_text(json.dumps(job))
        temporary.rename(self.marker)
        time.sleep(self.seconds)
        raise RuntimeError(f"{self.stage} was not killed within {self.seconds} s of pausing")
