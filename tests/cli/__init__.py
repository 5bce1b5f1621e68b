"""What the command-line tests share: running ``lmc`` and expecting a one-line user error."""

from __future__ import annotations

import re

import pytest

from lmc.cli import main

#: A plain progress line of lmc run, demo or repro (lmc.experiments.progress.describe).
PROGRESS_LINE = re.compile(r"^.+: .+ \[\d+/\d+\] \d+(:\d\d)+ elapsed(, about \d+(:\d\d)+ left)?$")


def error_lines(err: str) -> str:
    """Standard error without the progress lines a command showed before it stopped."""
    return "\n".join(line for line in err.strip().splitlines() if not PROGRESS_LINE.match(line))


def fails(argv: list[str], capsys, after_work: bool = False) -> str:
    """Run ``lmc`` expecting a user error: exit status 2 and one line on stderr, which is returned. With
    ``after_work`` (an error met once the command's stages began), the progress lines before it are allowed."""
    capsys.readouterr()  # what the test printed before
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    error = error_lines(error) if after_work else error.strip()
    assert len(error.splitlines()) == 1 and error.startswith("lmc: error: "), error
    return error


def exit_status(argv: list[str]) -> int:
    """Run ``lmc`` and return its exit status (0 when it returns)."""
    try:
        main(argv)
    except SystemExit as exit_info:
        return exit_info.code
    return 0
