"""benchmarks/speed/streamed_align: every committed figure is one the script writes; its Markdown renders its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.speed.streamed_align import SHAPES, merged, render

ROOT = Path(__file__).parents[2]
RESULTS = ROOT / "benchmarks" / "speed" / "results"
RUNNER = [sys.executable, "-m", "benchmarks", "streamed_align"]


def _leaves(value: object, prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """The key paths of a JSON object's leaves; a mapping keyed by data (the assignments' sizes, the memory by
    phase) is one leaf."""
    if not isinstance(value, dict) or prefix[-1:] in (
        ("assignment_seconds_by_size",),
        ("peak_by_phase",),
        ("after_steps",),
        ("split_by_phase",),
    ):
        return {prefix}
    return set().union(*(_leaves(v, (*prefix, k)) for k, v in value.items())) if value else {prefix}


def test_the_committed_markdown_is_the_rendering_of_the_committed_json():
    results = json.loads((RESULTS / "streamed_align.json").read_text())
    assert (RESULTS / "streamed_align.md").read_text() == render(results, "streamed_align.json")


def test_rendering_a_missing_json_is_one_line_naming_it(tmp_path):
    missing = tmp_path / "none.json"
    run = subprocess.run([*RUNNER, "--render", "--output", str(missing)], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 2 and f"--render reads {missing}, which does not exist" in run.stderr
    assert "Traceback" not in run.stderr and not list(tmp_path.iterdir())


def test_rows_of_one_shape_from_runs_that_measured_different_things_are_joined(tmp_path):
    output = tmp_path / "results.json"
    attention = {"threads": 2, "note": "first", "floor": {"seconds": 1.0}, "all_attention": {"seconds": 2.0}}
    output.write_text(json.dumps({"8b": attention, "1b": {"note": "other shape"}}))
    # A --full-model-only run joins the attention row; its own context apart.
    full = {
        "threads": 1,
        "note": "second",
        "full_model_floor": {"seconds": 3.0},
        "full_model_streamed": {"seconds": 4.0},
    }
    joined = merged(output, "8b", full, full_model_only=True)
    assert joined["1b"] == {"note": "other shape"}
    assert joined["8b"] == {
        **attention,
        "full_model_floor": {"seconds": 3.0},
        "full_model_streamed": {"seconds": 4.0},
        "full_model_run": {"threads": 1, "note": "second"},
    }
    # An attention run afterwards replaces the attention measurements and keeps the full_model ones.
    output.write_text(json.dumps(joined))
    again = {"threads": 2, "note": "third", "floor": {"seconds": 5.0}, "all_attention": {"seconds": 6.0}}
    assert merged(output, "8b", again, full_model_only=False)["8b"] == {**joined["8b"], **again}
    # Also where both were measured by one run: the earlier run's context goes with its full_model rows.
    output.write_text(json.dumps({"8b": {**attention, "full_model_streamed": {"seconds": 7.0}}}))
    assert merged(output, "8b", again, full_model_only=False)["8b"] == {
        **again,
        "full_model_streamed": {"seconds": 7.0},
        "full_model_run": {"threads": 2, "note": "first"},
    }
    # A run that measured full_model replaces it.
    assert merged(output, "8b", full, full_model_only=False)["8b"] == full


@pytest.mark.slow
def test_the_script_writes_both_files_and_every_committed_field(tmp_path):
    """A run on the tiny shape writes the JSON and its rendering; the committed rows hold no field it does not."""
    output = tmp_path / "results" / "streamed.json"
    command = [*RUNNER, "--shapes", "tiny", "neox-tiny", "--threads", "1", "--compare-release"]
    run = subprocess.run(
        [*command, "--workdir", str(tmp_path / "work"), "--output", str(output), "--note", "a test run"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    written = json.loads(output.read_text())
    assert list(written) == ["tiny", "neox-tiny"]
    assert output.with_suffix(".md").read_text() == render(written, output.name)
    fields = _leaves(written["tiny"])
    assert _leaves(written["neox-tiny"]) == fields  # GPT-NeoX measured as fully as Llama
    assert ("machine", "load_average_before") in fields and ("full_model", "peak_rss") in fields
    assert ("full_model_streamed", "split", "assignment") in fields and ("full_model_floor", "seconds") in fields
    assert ("io_floor", "seconds") in fields
    # The in-memory reference saves its aligned model, as the streamed run writes its own, within its time.
    for row in written.values():
        assert 0 < row["full_model"]["save_seconds"] < row["full_model"]["seconds"] - row["full_model"]["load_seconds"]
    # The streamed full_model's memory by phase, with and without releasing the freed memory: the same alignment.
    for shape, row in written.items():
        unreleased, released = row["full_model_streamed_unreleased"], row["full_model_streamed"]
        assert unreleased["distance_ratio"] == released["distance_ratio"]
        phases = list(released["memory"]["peak_by_phase"])
        assert phases[:2] == ["setup", "round 1"] and phases[-3:] == ["stage 2", "write", "check"], (shape, phases)
        blocks = SHAPES[shape][1]
        assert len(released["memory"]["after_steps"]["stage 2"]) == blocks  # one Stage 2 step per layer
    # Streamed full_model on the GPT-NeoX pair finds the in-memory alignment (its distances up to summation order).
    neox = written["neox-tiny"]
    assert neox["full_model_streamed"]["distance_ratio"] == pytest.approx(
        neox["full_model"]["distance_ratio"], rel=1e-9
    )
    assert "a test run" in output.with_suffix(".md").read_text()
    # Each phase's time split into kinds of work, exclusive of one another: they add up to at most its wall
    # time, and the phases' wall times to the run's (measured from just before it to just after).
    for shape, row in written.items():
        run = row["full_model_streamed"]
        split = run["split_by_phase"]
        assert list(split) == list(run["memory"]["peak_by_phase"]), shape
        assert all(value >= -1e-9 for kinds in split.values() for value in kinds.values()), (shape, split)
        assert {"read", "gemm", "assignment"} <= set(split["round 1"]), split["round 1"]
        assert run["seconds"] <= sum(kinds["seconds"] for kinds in split.values()) <= run["seconds"] + 1.0
        by_size = sum(run["assignment_seconds_by_size"].values())  # timed inside the split's timer: a wrapper less
        assert by_size <= run["split"]["assignment"] <= by_size + 1e-4 * run["assignments"]
    # A --full-model-only run joins the shape's row: the earlier measurements stay, its own context apart.
    again = [*RUNNER, "--shapes", "tiny", "--threads", "1", "--full-model-only", "--note", "a second run"]
    run = subprocess.run(
        [*again, "--workdir", str(tmp_path / "work"), "--output", str(output)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    joined = json.loads(output.read_text())
    assert list(joined) == ["tiny", "neox-tiny"] and joined["neox-tiny"] == written["neox-tiny"]
    assert joined["tiny"]["all_attention"] == written["tiny"]["all_attention"]
    assert joined["tiny"]["note"] == "a test run" and joined["tiny"]["full_model_run"]["note"] == "a second run"
    assert joined["tiny"]["full_model_streamed"] != written["tiny"]["full_model_streamed"]  # measured again
    assert "a second run" in output.with_suffix(".md").read_text()
    written, fields = joined, _leaves(joined["tiny"])
    committed = json.loads((RESULTS / "streamed_align.json").read_text())
    for shape, row in committed.items():
        assert _leaves(row) <= fields, (shape, sorted(_leaves(row) - fields))
    # Rendering again from the JSON alone gives the same Markdown.
    output.with_suffix(".md").unlink()
    subprocess.run([*RUNNER, "--render", "--output", str(output)], check=True, timeout=120, cwd=ROOT)
    assert output.with_suffix(".md").read_text() == render(written, output.name)
