"""The help of the commands over Lightning's Trainer, kept on disk: ``lmc fit|validate|test|predict|run --help``.

Their options are Lightning's Trainer's and lmc's model's, which only Lightning can list, and
importing torch alone takes longer than a help should. The first plain ``lmc COMMAND --help`` (or
``-h``, with no other argument) renders the help live and keeps its text in
``$XDG_CACHE_HOME/lmc/help/COMMAND-wWIDTH.json`` (``~/.cache/lmc/help``), one per width of the
terminal, which argparse wraps the text to; the next ones print the kept text, importing nothing
of torch, while its :func:`help_key` holds: the versions of Python, lmc and the libraries that make
the text, and the size and time stamp of every module of lmc (an edit renders anew). ``make
install`` renders them once (:func:`lmc.cli.keep_help`), so a new user's first help is fast too.

A help after other arguments is always rendered live: ``lmc run --config X --help`` shows X's
values as the defaults. A kept help that cannot be read or written is passed over silently: the
help is rendered live, as without a cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import io
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import lmc
from lmc.cli.train import TRAINING_COMMANDS

#: The commands whose help is kept: the ones that need Lightning to list their options.
KEPT_HELP_COMMANDS = (*TRAINING_COMMANDS, "run")
#: The arguments that ask for a command's help.
HELP_FLAGS = ("-h", "--help")
#: The distributions whose code writes the help's text, besides lmc's own (:func:`_sources`).
LIBRARIES = ("lightning", "jsonargparse", "docstring-parser", "torch")


def kept_help_asked(argv: list[str]) -> bool:
    """Whether ``lmc ARGV...`` asks for a kept help: ``COMMAND --help`` (or ``-h``) and nothing else."""
    return len(argv) == 2 and argv[0] in KEPT_HELP_COMMANDS and argv[1] in HELP_FLAGS


def help_folder() -> Path:
    """Where the kept helps are: ``$XDG_CACHE_HOME/lmc/help``, ``~/.cache/lmc/help`` without it."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lmc" / "help"


def help_path(command: str) -> Path:
    """The file of ``lmc COMMAND --help`` at this terminal's width: argparse wraps the help to it (``COLUMNS``,
    else the terminal's, else 80), so a help piped to ``less`` (80) and one on a wide terminal are two."""
    return help_folder() / f"{command}-w{shutil.get_terminal_size().columns}.json"


def help_key(command: str) -> str:
    """What ``lmc COMMAND --help``'s text depends on besides the width, as a hash (a few milliseconds: no import)."""
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    described = [command, sys.version, lmc.__version__, versions, _sources()]
    return hashlib.sha256(json.dumps(described).encode()).hexdigest()


def _sources() -> list[tuple[str, int, int]]:
    """Every module of lmc: its path in the package, size and time of last change (ns)."""
    root = Path(lmc.__file__).parent
    stats = ((path, path.stat()) for path in root.rglob("*.py"))
    return sorted((str(path.relative_to(root)), stat.st_size, stat.st_mtime_ns) for path, stat in stats)


def show_help(command: str, render: Callable[[], None]) -> NoReturn:
    """Print ``lmc COMMAND --help``: the kept text if its key holds, else ``render()``'s, kept for next time;
    exit with status 0, as argparse's help does.

    Args:
        command: One of :data:`KEPT_HELP_COMMANDS`.
        render: Prints the help live to standard output (and exits, as argparse does).
    """
    key, path = help_key(command), help_path(command)
    text = _kept(path, key)
    if text is None:
        text = _rendered(render)
        _keep(path, key, text)
    sys.stdout.write(text)
    raise SystemExit(0)


def keep_help(command: str, render: Callable[[], None]) -> None:
    """Render ``lmc COMMAND --help`` and keep it, unless the kept text's key holds; print nothing."""
    key, path = help_key(command), help_path(command)
    if _kept(path, key) is None:
        _keep(path, key, _rendered(render))


def _kept(path: Path, key: str) -> str | None:
    """The text kept at ``path`` under ``key`` (``None``: none, another key's, or unreadable)."""
    try:
        kept = json.loads(path.read_text())
        return kept["text"] if kept["key"] == key and isinstance(kept["text"], str) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _keep(path: Path, key: str, text: str) -> None:
    from lmc.io import atomic_write_json

    if not text:  # a render that printed nothing is no help to keep
        return
    with contextlib.suppress(OSError):  # an unwritable cache: the next help renders live again
        atomic_write_json(path, {"key": key, "text": text})


def _rendered(render: Callable[[], None]) -> str:
    """What ``render()`` prints to standard output. A render that fails prints what it printed and raises."""
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            render()
    except SystemExit as exit_info:
        if exit_info.code not in (0, None):
            sys.stdout.write(buffer.getvalue())
            raise
    return buffer.getvalue()
