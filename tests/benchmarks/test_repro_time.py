"""benchmarks/reproduction/repro_time.py: a fresh clone timed, every committed figure one the script writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.reproduction.repro_time import EARLIER, render

ROOT = Path(__file__).parents[2]
RESULTS = ROOT / "benchmarks" / "reproduction" / "results"

STUDY = """install:
\ttrue
repro:
\tmkdir -p runs/repro docs/results
\techo '{"processor": "P", "kernels": "K", "torch": "T", "threads": 1}' > runs/repro/machine.json
\techo '{"a/pretrain": 3.0, "a/first_attention": 10.0, "b/pretrain": 4.0}' > runs/repro/times.json
\techo '# report' > docs/results.md
\techo figure > docs/results/a.png
\techo 'study finished in 12 s (17 s of work) with 2 jobs at a time x 1 thread'
"""


def test_the_committed_markdown_is_the_rendering_of_the_committed_json():
    markdown = (RESULTS / "repro_time.md").read_text()
    records = json.loads((RESULTS / "repro_time.json").read_text())
    assert markdown == render(records, markdown[markdown.index(EARLIER) :])


def test_a_fresh_clone_is_timed_and_its_report_copied_back(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "Makefile").write_text(STUDY)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "."], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "study"], cwd=repo, check=True)
    (repo / "docs" / "results").mkdir(parents=True)
    (repo / "docs" / "results" / "stale.png").write_text("old")
    output = tmp_path / "results" / "repro_time.json"
    output.parent.mkdir()
    output.with_suffix(".md").write_text(f"# old\n\n{EARLIER}\n\nby hand\n")
    command = [sys.executable, "-m", "benchmarks", "repro_time", "--repo", str(repo), "--output", str(output)]
    run = subprocess.run(
        [*command, "--workdir", str(tmp_path / "clone"), "--report"], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    (record,) = json.loads(output.read_text())
    assert (record["study_wall"], record["study_work"], record["study_jobs"]) == (12.0, 17.0, 2)
    assert record["tasks"] == {"a/pretrain": 3.0, "a/first_attention": 10.0, "b/pretrain": 4.0}
    assert record["machine"]["processor"] == "P" and record["install"]["wall"] > 0
    markdown = output.with_suffix(".md").read_text()
    assert "| a | 3 | 10 | n/a | n/a | n/a | 13 |" in markdown and "| b | 4 | n/a" in markdown
    assert "workers busy 70.8%" in markdown  # 17 s of work on 2 workers over 12 s
    assert markdown.endswith(f"{EARLIER}\n\nby hand\n")  # the hand-recorded text kept as it is
    assert (repo / "docs" / "results.md").read_text() == "# report\n"
    assert sorted(p.name for p in (repo / "docs" / "results").iterdir()) == ["a.png"]
    # The clone must be fresh: a second run into the same folder is refused.
    again = subprocess.run([*command, "--workdir", str(tmp_path / "clone")], cwd=ROOT, capture_output=True, text=True)
    assert again.returncode != 0 and "the clone must be fresh" in again.stderr
    # A commit the repository lacks: one line naming it, and no clone left behind to block the next run.
    missing = subprocess.run(
        [*command, "--workdir", str(tmp_path / "other"), "--commit", "0000000"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert missing.returncode != 0 and missing.stderr.strip().splitlines()[-1].startswith("git checkout failed: ")
    assert "--commit 0000000" in missing.stderr and not (tmp_path / "other").exists()
