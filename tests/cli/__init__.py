"""What the command-line tests share: running ``lmc`` and expecting a one-line user error."""

from __future__ import annotations

import pytest

from lmc.cli import main


def fails(argv: list[str], capsys) -> str:
    """Run ``lmc`` expecting a user error: exit status 2 and one line on stderr, which is returned."""
    capsys.readouterr()  # what the test printed before
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and error.startswith("lmc: error: "), error
    return error


def exit_status(argv: list[str]) -> int:
    """Run ``lmc`` and return its exit status (0 when it returns)."""
    try:
        main(argv)
    except SystemExit as exit_info:
        return exit_info.code
    return 0
