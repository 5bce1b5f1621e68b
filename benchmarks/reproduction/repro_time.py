"""`make repro` from a fresh clone, timed (issue #18: under 90 minutes on 2 cores).

Clones ``--repo`` at ``--commit`` into ``--workdir`` (a clean clone: no virtual environment, no runs),
then runs ``make install`` and ``make repro`` there, each timed by the wall clock. Beside the times it
measures how quiet the machine was: the CPU time of every process on the machine (``/proc/stat``)
against the CPU time of the two commands and their children, so a record says how much else ran.
It reads the study's own files (``runs/repro/times.json``, ``runs/repro/machine.json``) and the
line the study prints (``study finished in ... s (... s of work) with ... jobs``).

The run appends a record to ``--output`` (JSON) and renders every record to the Markdown beside it,
each atomically; the text after ``EARLIER`` in that Markdown (measurements recorded by hand before
this script) is kept as it is. ``--report`` copies the regenerated ``docs/results.md`` and
``docs/results/`` back into ``--repo``. ``--render`` renders the Markdown again, measuring nothing.

    python -m benchmarks repro_time --report          # ~65-80 minutes on 2 cores
    python -m benchmarks repro_time --render
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import resource
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.machine import ROOT
from lmc.io import atomic_write_json, atomic_write_text

OUTPUT = Path(__file__).parent / "results" / "repro_time.json"
EARLIER = "## Earlier measurements (recorded by hand before `benchmarks/repro_time.py`)"
STRATEGIES = ("pretrain", "first_attention", "all_attention", "first_block", "full_model")
TARGET_MINUTES = 90
STUDY_LINE = re.compile(r"study finished in (\d+) s \((\d+) s of work\) with (\d+) jobs")


def busy_seconds() -> float:
    """CPU seconds every processor of this machine has spent outside idle and iowait since boot."""
    fields = [int(value) for value in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def children_seconds() -> float:
    """CPU seconds (user and system) of this process's finished children and their descendants."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(command: list[str], cwd: Path, log: Path) -> dict[str, float]:
    """Run ``command`` in ``cwd`` (output to ``log``); its wall time, its CPU time and the machine's."""
    busy, own, start = busy_seconds(), children_seconds(), time.monotonic()
    with log.open("w") as out:
        completed = subprocess.run(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    wall = time.monotonic() - start
    if completed.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed with status {completed.returncode}: see {log}")
    return {"wall": wall, "cpu": children_seconds() - own, "machine_cpu": busy_seconds() - busy}


def clone(repo: Path, commit: str, workdir: Path) -> str:
    """A fresh clone of ``repo`` at ``commit`` in ``workdir``; its short revision. Nothing is left behind on failure."""
    if workdir.exists():
        raise SystemExit(f"{workdir} exists: remove it or pass another --workdir (the clone must be fresh)")
    steps = (["clone", "--quiet", "--no-local", str(repo), str(workdir)], ["checkout", "--quiet", commit])
    for arguments in steps:
        run = subprocess.run(
            ["git", *arguments], cwd=workdir if workdir.exists() else None, capture_output=True, text=True
        )
        if run.returncode:
            shutil.rmtree(workdir, ignore_errors=True)
            raise SystemExit(
                f"git {arguments[0]} failed: {run.stderr.strip()} (check --repo {repo} and --commit {commit})"
            )
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=workdir, check=True, capture_output=True, text=True
    ).stdout.strip()


def measure(repo: Path, commit: str, workdir: Path) -> dict[str, Any]:
    """Clone ``repo`` at ``commit`` into ``workdir`` and time ``make install`` and ``make repro`` there."""
    revision = clone(repo, commit, workdir)
    started = datetime.datetime.now(datetime.timezone.utc)
    install = timed(["make", "install"], workdir, workdir / "install.log")
    study = timed(["make", "repro"], workdir, workdir / "repro.log")
    printed = STUDY_LINE.search((workdir / "repro.log").read_text())
    output = workdir / "runs" / "repro"
    return {
        "commit": revision,
        "started": started.isoformat(timespec="seconds"),
        "cores": os.cpu_count(),
        "machine": json.loads((output / "machine.json").read_text()),
        "install": install,
        "repro": study,
        "study_wall": float(printed.group(1)) if printed else None,
        "study_work": float(printed.group(2)) if printed else None,
        "study_jobs": int(printed.group(3)) if printed else None,
        "tasks": json.loads((output / "times.json").read_text()),
    }


def copy_report(workdir: Path, repo: Path) -> None:
    """Copy the clone's regenerated report (``docs/results.md``, ``docs/results/``) into ``repo``."""
    source, target = workdir / "docs" / "results", repo / "docs" / "results"
    staged = target.with_name(target.name + ".new")
    shutil.rmtree(staged, ignore_errors=True)
    shutil.copytree(source, staged)
    shutil.rmtree(target, ignore_errors=True)
    staged.rename(target)
    atomic_write_text(repo / "docs" / "results.md", (workdir / "docs" / "results.md").read_text())


def render_record(record: dict[str, Any]) -> list[str]:
    """One record's Markdown section."""
    install, study, cores = record["install"], record["repro"], record["cores"]
    total = install["wall"] + study["wall"]
    others = (install["machine_cpu"] + study["machine_cpu"] - install["cpu"] - study["cpu"]) / total
    machine = record["machine"]
    verdict = "under" if total / 60 < TARGET_MINUTES else "over"
    lines = [
        f"## {machine['processor']}, {record['started'][:10]}: commit {record['commit']}",
        "",
        f"Fresh clone at {record['commit']} ({record['started']}), {cores} cores, `{machine['kernels']}` kernels, "
        f"torch {machine['torch']}; `make install`, then `make repro` ({machine['threads']} thread per job).",
        "",
        f"- `make install` then `make repro`: **{total / 60:.1f} min** ({total:,.0f} s; {verdict} the "
        f"{TARGET_MINUTES} minutes of issue #18); `make install` {install['wall']:.0f} s.",
        f"- Quiet: other processes used {others:.2f} cores on average over that time "
        f"(the machine's CPU time less the commands' own, {study['cpu']:,.0f} s for `make repro`).",
    ]
    if record["study_wall"] is not None:
        busy = record["study_work"] / (record["study_jobs"] * record["study_wall"])
        lines.append(
            f"- The study printed `study finished in {record['study_wall']:.0f} s ({record['study_work']:.0f} s "
            f"of work) with {record['study_jobs']} jobs`: its workers busy {busy:.1%} of its wall time."
        )
    families = list(dict.fromkeys(name.split("/")[0] for name in record["tasks"]))  # in the study's order
    lines += [
        "",
        "Per task (seconds, the study's `runs/repro/times.json`):",
        "",
        "| family | " + " | ".join(STRATEGIES) + " | sum |",
        "|---|" + "---|" * (len(STRATEGIES) + 1),
    ]
    for family in families:
        cells = [record["tasks"].get(f"{family}/{strategy}") for strategy in STRATEGIES]
        row = ["n/a" if cell is None else f"{cell:.0f}" for cell in cells]
        lines.append(f"| {family} | " + " | ".join(row) + f" | {sum(c for c in cells if c is not None):.0f} |")
    return [*lines, ""]


def render(records: list[dict[str, Any]], earlier: str) -> str:
    """The Markdown: every record, newest first, then the earlier hand-recorded text."""
    lines = [
        "# `make repro` from a fresh clone: wall time",
        "",
        "Written by `python -m benchmarks repro_time` from `repro_time.json`; never edit it by hand.",
        "",
    ]
    for record in reversed(records):
        lines += render_record(record)
    return "\n".join(lines) + ("\n" + earlier if earlier else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=ROOT, help="the repository to clone")
    parser.add_argument("--commit", default="HEAD", help="the commit to check out")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/lmc-repro-time"), help="where to clone")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    parser.add_argument("--report", action="store_true", help="copy the regenerated report into --repo")
    parser.add_argument("--render", action="store_true", help="render the Markdown again, measuring nothing")
    args = parser.parse_args()
    records = json.loads(args.output.read_text()) if args.output.is_file() else []
    markdown = args.output.with_suffix(".md")
    previous = markdown.read_text() if markdown.is_file() else ""
    earlier = previous[previous.index(EARLIER) :] if EARLIER in previous else ""
    if not args.render:
        records.append(measure(args.repo, args.commit, args.workdir))
        atomic_write_json(args.output, records)
        if args.report:
            copy_report(args.workdir, args.repo)
    atomic_write_text(markdown, render(records, earlier))
    print(f"wrote {markdown}")


if __name__ == "__main__":
    main()
