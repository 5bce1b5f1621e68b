"""Where a benchmark ran and how much memory it took: the one place every benchmark reads them from.

Memory is read from ``/proc/self/status`` (Linux): ``VmHWM`` is the peak resident memory of this
process's own address space, ``VmRSS`` the resident memory now, ``RssAnon`` what the process
allocated (without mapped files). ``ru_maxrss`` is the fallback for the peak elsewhere: on Linux it
would also count the parent's resident memory at the moment it started this process.
"""

from __future__ import annotations

import os
import platform
import resource
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).parents[1]


def _lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def _status_bytes(field: str) -> int | None:
    """A ``/proc/self/status`` field in bytes (its value is in kB), ``None`` where it is missing."""
    for line in _lines("/proc/self/status"):
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return None


def peak_rss() -> int:
    """This process's peak resident memory (bytes): ``VmHWM``, else ``ru_maxrss``."""
    peak = _status_bytes("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss() -> int:
    """This process's resident memory now (bytes, ``VmRSS``)."""
    now = _status_bytes("VmRSS")
    if now is None:
        raise RuntimeError("no VmRSS in /proc/self/status: this measurement needs Linux")
    return now


def rss_anon() -> int:
    """This process's resident anonymous memory now (bytes, ``RssAnon``; 0 where not reported)."""
    return _status_bytes("RssAnon") or 0


def reset_peak_rss() -> None:
    """Reset ``VmHWM`` to the resident memory now, so that :func:`peak_rss` measures from here (Linux)."""
    Path("/proc/self/clear_refs").write_text("5")


def processor_name() -> str:
    """The processor's model name (``/proc/cpuinfo``), or what :mod:`platform` knows of it elsewhere."""
    for line in _lines("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def lmc_commit() -> str:
    """The commit of the lmc measured (this checkout's), ``+changes`` where lmc/ or benchmarks/ differ from it."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short=10", "HEAD") or "unknown"
    return commit + ("+changes" if git("status", "--porcelain", "--", "lmc", "benchmarks") else "")


def machine() -> dict[str, Any]:
    """Where a measurement runs: CPU, cores, memory, torch version, the load average before it, lmc's commit."""
    import torch

    memory = next((int(line.split()[1]) * 1024 for line in _lines("/proc/meminfo") if line.startswith("MemTotal:")), 0)
    return {
        "cpu": processor_name(),
        "cores": os.cpu_count(),
        "memory_bytes": memory,
        "torch": torch.__version__,
        "load_average_before": os.getloadavg()[0],
        "lmc_commit": lmc_commit(),
    }


def machine_line() -> str:
    """:func:`machine` as one line of a report: processor, cores, torch with its threads, Python."""
    import torch

    software = f"torch {torch.__version__} ({torch.get_num_threads()} threads); Python {platform.python_version()}"
    return f"{processor_name()}; {os.cpu_count()} cores; {software}"
