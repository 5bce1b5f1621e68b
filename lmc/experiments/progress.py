"""Progress of ``lmc run``, ``lmc demo`` and ``lmc repro``: which stage each running job is at, how far
it is, and how long it has run and has left.

A run reports each change of its running stages to a :class:`Progress` (``lmc run``'s jobs: the
pre-training, each seed's fine-tuning, each pair's alignments and sweeps), which writes the latest
:class:`Event` to the run folder's ``progress.json`` and shows it on a :class:`Display`. A command
that runs jobs as processes whose output goes to their logs (``lmc demo``'s two encodings, ``lmc
repro``'s runs) shows theirs by following those files (:class:`Follower`).

The time left is estimated from the stages done so far: the mean wall time of the stages this
invocation finished, times the stages still to do (stages finished by an earlier invocation are
not timed). Stages differ in length (a pre-training is longer than a sweep), so it is a rough
guide that improves as the run goes on.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, TextIO

from lmc.io import atomic_write_json

#: The file of a run folder that holds its latest :class:`Event`.
PROGRESS_FILE = "progress.json"
#: Seconds between two redraws of a terminal's lines, and between two looks at followed files.
TICK_SECONDS = 0.5

#: ``auto``: ``tty`` where the stream is a terminal, else ``plain``; ``quiet``: nothing shown.
Mode = Literal["auto", "tty", "plain", "quiet"]


@dataclass(frozen=True)
class Event:
    """Where a job stands.

    Attributes:
        stage: What it is running now (``pre-train``, ``fine-tune seed 1``, ...; ``done`` at the end).
        done: Stages finished (those of earlier invocations included).
        total: Stages in all.
        elapsed: Seconds since the job started.
        left: Estimated seconds still to go (``None`` before a stage of this invocation has finished).
    """

    stage: str
    done: int
    total: int
    elapsed: float
    left: float | None = None


def duration(seconds: float) -> str:
    """``m:ss``, or ``h:mm:ss`` from an hour on."""
    minutes, second = divmod(int(seconds), 60)
    hours, minute = divmod(minutes, 60)
    return f"{hours}:{minute:02d}:{second:02d}" if hours else f"{minute}:{second:02d}"


def describe(job: str, event: Event, since: float = 0.0) -> str:
    """One line for ``job`` at ``event``, ``since`` seconds after it was reported."""
    line = f"{job}: {event.stage} [{event.done}/{event.total}] {duration(event.elapsed + since)} elapsed"
    if event.left is not None and event.done < event.total:
        line += f", about {duration(max(0.0, event.left - since))} left"
    return line


class Display:
    """Shows the latest :class:`Event` of each running job on ``stream`` (standard error).

    On a terminal each running job has one line, redrawn in place as it changes and as its time
    goes on; elsewhere (a log, a pipe) each event is one plain line; ``quiet`` shows nothing.
    Thread-safe; use it as a context manager, which ends the redrawing and leaves the cursor below.

    Args:
        mode: How to show it (:data:`Mode`).
        stream: Where (``None``: ``sys.stderr`` at the time of each write).
        clock: Seconds of a monotonic clock (a test's fake).
    """

    def __init__(self, mode: Mode = "auto", stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic):
        self._stream, self.clock = stream, clock
        if mode == "auto":
            mode = "tty" if self.stream.isatty() else "plain"
        self.mode = mode
        self._jobs: dict[str, tuple[Event, float]] = {}  # job -> (latest event, when it came)
        self._drawn = 0  # lines of the last drawing on a terminal
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        if mode == "tty":
            self._ticker = threading.Thread(target=self._tick, name="lmc-progress", daemon=True)
            self._ticker.start()

    @property
    def stream(self) -> TextIO:
        return self._stream or sys.stderr

    def show(self, job: str, event: Event) -> None:
        """Show ``job`` at ``event``; on a terminal a job at ``done == total`` leaves the running
        lines for a last line of its own above them."""
        with self._lock:
            if self.mode == "plain":
                print(describe(job, event), file=self.stream, flush=True)
            elif self.mode == "tty":
                if event.done < event.total:
                    self._jobs[job] = (event, self.clock())
                else:
                    self._jobs.pop(job, None)
                    self._erase()
                    self.stream.write(describe(job, event) + "\n")
                self._draw()

    def say(self, line: str) -> None:
        """Print ``line`` on standard output, above a terminal's running lines (nothing when quiet)."""
        with self._lock:
            if self.mode == "quiet":
                return
            if self.mode == "tty":
                self._erase()
            print(line, flush=True)
            if self.mode == "tty":
                self._draw()

    def _erase(self) -> None:
        if self._drawn:
            # Back to the first running line, then clear it and everything below.
            self.stream.write(f"\x1b[{self._drawn}F\x1b[J")
            self.stream.flush()
            self._drawn = 0

    def _draw(self) -> None:
        now = self.clock()
        lines = [describe(job, event, now - at) for job, (event, at) in self._jobs.items()]
        # Each line starts at the left edge and clears what a longer earlier line left behind.
        text = "".join(f"\r{line}\x1b[K\n" for line in lines)
        up = f"\x1b[{self._drawn}F" if self._drawn else ""
        self.stream.write(up + text + "\x1b[J")
        self.stream.flush()
        self._drawn = len(lines)

    def _tick(self) -> None:
        while not self._stop.wait(TICK_SECONDS):
            with self._lock:
                if self._jobs:
                    self._draw()

    def __enter__(self) -> Display:
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()


class Progress:
    """What a run reports its stages to: writes each change to ``folder/progress.json`` and shows it.

    Args:
        job: How the display names the run.
        total: Its stages in all.
        folder: The run folder (``None``: no file).
        display: Where it is shown.
        label: How a stage's name reads (``seed1`` -> ``fine-tune seed 1``).
        clock: Seconds of a monotonic clock (a test's fake); the run starts at construction.
    """

    def __init__(
        self,
        job: str,
        total: int,
        folder: Path | None,
        display: Display,
        label: Callable[[str], str] = str,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.job, self.total, self.folder, self.display = job, total, folder, display
        self.label, self.clock = label, clock
        self.start = clock()
        self._first_done: int | None = None  # stages finished before this invocation's first report
        self._last: tuple[tuple[str, ...], int] | None = None

    def update(self, running: list[str], done: int) -> None:
        """The run is at the stages ``running`` (none: finished) with ``done`` stages finished;
        a repeat of the last report is ignored."""
        if self._last == (tuple(running), done):
            return
        self._last = (tuple(running), done)
        if self._first_done is None:
            self._first_done = done
        elapsed = self.clock() - self.start
        timed = done - self._first_done
        left = elapsed / timed * (self.total - done) if timed else None
        stage = ", ".join(self.label(name) for name in running) or "done"
        event = Event(stage, done, self.total, elapsed, left)
        if self.folder is not None:
            atomic_write_json(self.folder / PROGRESS_FILE, asdict(event))
        self.display.show(self.job, event)


class Follower:
    """Shows the progress of runs in other processes: polls each run folder's ``progress.json``
    and shows the events written since the follower started.

    Use it as a context manager around the wait for those processes.

    Args:
        folders: Job name -> its run folder.
        display: Where their events are shown.
    """

    def __init__(self, folders: dict[str, Path], display: Display):
        self.folders, self.display = folders, display
        # A file as it was at the start is an earlier invocation's: only a file written since is shown.
        self._seen = {job: _signature(folder / PROGRESS_FILE) for job, folder in folders.items()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="lmc-progress-follower", daemon=True)

    def poll(self) -> None:
        """Show each followed run's event written since the last look."""
        for job, folder in self.folders.items():
            path = folder / PROGRESS_FILE
            written = _signature(path)
            if written is None or written == self._seen[job]:
                continue
            try:
                event = Event(**json.loads(path.read_text()))
            except (OSError, ValueError, TypeError):  # replaced while read, or of another lmc
                continue
            self._seen[job] = written
            self.display.show(job, event)

    def _follow(self) -> None:
        while not self._stop.wait(TICK_SECONDS):
            self.poll()

    def __enter__(self) -> Follower:
        if self.display.mode != "quiet":
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
            self.poll()  # the last events, written since the last look


def _signature(path: Path) -> tuple[int, int, int] | None:
    """What tells one writing of ``path`` from another (each is a new file, :func:`atomic_write_json`)."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns, stat.st_size
