"""The progress of lmc run, demo and repro: plain lines, a terminal's updating lines, followed files."""

from __future__ import annotations

import io
import json
import re

from lmc.experiments.progress import PROGRESS_FILE, Display, Event, Follower, Progress


class Clock:
    """A fake monotonic clock: seconds set by the test."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _stage(name: str) -> str:
    return {"pretrain": "pre-train"}.get(name, name)


def test_plain_lines_give_the_stage_how_far_and_the_time_left_from_the_stages_done():
    clock, stream = Clock(), io.StringIO()
    progress = Progress("APE", 4, None, Display("plain", stream), _stage, clock)
    progress.update(["pretrain"], 0)
    clock.now += 60
    progress.update(["seed0"], 1)  # one stage in a minute: three to go
    clock.now += 5
    progress.update(["seed0"], 1)  # nothing changed: no line
    clock.now += 55
    progress.update(["seed0", "seed1"], 2)
    clock.now += 3580
    progress.update([], 4)
    assert stream.getvalue().splitlines() == [
        "APE: pre-train [0/4] 0:00 elapsed",
        "APE: seed0 [1/4] 1:00 elapsed, about 3:00 left",
        "APE: seed0, seed1 [2/4] 2:00 elapsed, about 2:00 left",
        "APE: done [4/4] 1:01:40 elapsed",
    ]


def test_stages_finished_by_an_earlier_invocation_are_not_timed(tmp_path):
    clock, stream = Clock(), io.StringIO()
    progress = Progress("run", 5, tmp_path, Display("plain", stream), _stage, clock)
    progress.update(["pair0_1"], 3)  # a resumed run: three stages were done before it started
    clock.now += 30
    progress.update(["summarize"], 4)
    assert stream.getvalue().splitlines() == [
        "run: pair0_1 [3/5] 0:00 elapsed",
        "run: summarize [4/5] 0:30 elapsed, about 0:30 left",
    ]
    # The run folder holds the latest event, for a parent command to show.
    assert Event(**json.loads((tmp_path / PROGRESS_FILE).read_text())) == Event("summarize", 4, 5, 30.0, 30.0)


def _screen(output: str) -> list[str]:
    """The lines a terminal shows after ``output``: the control sequences the display writes applied."""
    lines, row, column = [""], 0, 0
    for token in re.findall(r"\x1b\[(\d*)([FJK])|(\r)|(\n)|([^\x1b\r\n]+)", output):
        count, command, carriage, newline, text = token
        if command == "F":
            row, column = row - int(count), 0
        elif command == "J":
            lines[row] = lines[row][:column]
            del lines[row + 1 :]
        elif command == "K":
            lines[row] = lines[row][:column]
        elif carriage:
            column = 0
        elif newline:
            row, column = row + 1, 0
            if row == len(lines):
                lines.append("")
        else:
            lines[row] = lines[row][:column] + text + lines[row][column + len(text) :]
            column += len(text)
    return lines


def test_a_terminal_shows_one_updating_line_per_running_job_and_a_last_line_for_each_finished_one():
    clock, stream = Clock(), io.StringIO()
    with Display("tty", stream, clock) as display:
        display.show("APE", Event("pre-train", 0, 9, 0.0))
        display.show("RoPE", Event("pre-train", 0, 9, 0.0))
        clock.now += 70
        display.show("APE", Event("fine-tune seed 0", 1, 9, 70.0, 560.0))
        clock.now += 10  # RoPE's time goes on without an event of its own
        display.show("APE", Event("fine-tune seed 1", 2, 9, 80.0, 280.0))
        output = stream.getvalue()
        assert "\r" in output
        assert _screen(output) == [
            "APE: fine-tune seed 1 [2/9] 1:20 elapsed, about 4:40 left",
            "RoPE: pre-train [0/9] 1:20 elapsed",
            "",
        ]
        display.show("APE", Event("done", 9, 9, 300.0))
        display.say("APE: its summary")  # another line of the command's, above the running ones
        assert _screen(stream.getvalue()) == [
            "APE: done [9/9] 5:00 elapsed",
            "RoPE: pre-train [0/9] 1:20 elapsed",
            "",
        ]


def test_quiet_shows_nothing(tmp_path, capsys):
    stream = io.StringIO()
    with Display("quiet", stream) as display:
        progress = Progress("run", 2, tmp_path, display, _stage, Clock())
        progress.update(["pretrain"], 0)
        display.say("pretrain: submitted (local job 1)")
        progress.update([], 2)
    assert stream.getvalue() == "" and capsys.readouterr().out == ""
    assert json.loads((tmp_path / PROGRESS_FILE).read_text())["stage"] == "done"  # the file is still written


def test_a_follower_shows_what_runs_in_other_processes_wrote_since_it_started(tmp_path):
    ape, rope = tmp_path / "APE", tmp_path / "RoPE"
    ape.mkdir(), rope.mkdir()
    (rope / PROGRESS_FILE).write_text(json.dumps({"stage": "done", "done": 9, "total": 9, "elapsed": 1.0}))
    stream = io.StringIO()
    follower = Follower({"APE": ape, "RoPE": rope}, Display("plain", stream))
    follower.poll()
    assert stream.getvalue() == ""  # RoPE's file is an earlier run's
    Progress("APE", 9, ape, Display("quiet"), _stage, Clock()).update(["pretrain"], 0)
    follower.poll()
    follower.poll()  # shown once
    assert stream.getvalue().splitlines() == ["APE: pre-train [0/9] 0:00 elapsed"]
