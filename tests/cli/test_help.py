"""The kept help of the commands over Lightning's Trainer (lmc.cli.help_cache): the live text, without torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmc.cli import help_cache, main

ROOT = Path(__file__).parents[2]


def _help(argv: list[str], capsys) -> str:
    """What ``lmc ARGV`` prints, expecting argparse's help exit (status 0)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def _printing(text: str):
    """A live render that prints ``text`` and exits as argparse's help does, counting its calls."""

    def render() -> None:
        render.calls += 1
        print(text, end="")
        raise SystemExit(0)

    render.calls = 0
    return render


@pytest.mark.parametrize("command", help_cache.KEPT_HELP_COMMANDS)
def test_a_kept_help_is_the_live_text_and_loads_no_torch(command, capsys, monkeypatch):
    """lmc run --help took 15-30 s: Lightning lists the Trainer's options, and torch alone takes over 2 s."""
    monkeypatch.setenv("COLUMNS", "100")  # the same width here and in the subprocess, whose output is a pipe
    live = _help([command, "--help"], capsys)  # rendered here (torch is loaded in the tests) and kept
    assert live.startswith(f"usage: lmc {command} [-h] ") and "--trainer.max_epochs" in live
    code = f"import sys\nfrom lmc.cli import main\ntry:\n    main({[command, '-h']!r})\nexcept SystemExit:\n    pass\n"
    code += "print(sorted({'torch', 'lightning', 'jsonargparse'} & set(sys.modules)), file=sys.stderr)"
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout == live and result.stderr.splitlines()[-1] == "[]"


def test_a_change_of_lmcs_modules_renders_the_help_again(tmp_path, monkeypatch, capsys):
    package = tmp_path / "lmc"
    package.mkdir()
    module = package / "module.py"
    module.write_text("VALUE = 1\n")
    monkeypatch.setattr(help_cache.lmc, "__file__", str(package / "__init__.py"))
    first, second = _printing("the first help\n"), _printing("the help after an edit\n")
    for render, expected in ((first, "the first help\n"), (second, "the first help\n")):
        with pytest.raises(SystemExit):
            help_cache.show_help("run", render)
        assert capsys.readouterr().out == expected
    assert (first.calls, second.calls) == (1, 0)  # the second was kept
    module.write_text("VALUE = 22\n")  # an edit: another size
    with pytest.raises(SystemExit):
        help_cache.show_help("run", second)
    assert capsys.readouterr().out == "the help after an edit\n" and second.calls == 1
    os.utime(module, ns=(0, 0))  # another time stamp, the same size
    with pytest.raises(SystemExit):
        help_cache.show_help("run", second)
    assert second.calls == 2


def test_a_kept_help_is_one_per_terminal_width(monkeypatch, capsys):
    narrow, wide = _printing("narrow\n"), _printing("wide\n")
    for width, render in (("80", narrow), ("160", wide), ("80", narrow), ("160", wide)):
        monkeypatch.setenv("COLUMNS", width)
        with pytest.raises(SystemExit):
            help_cache.show_help("fit", render)
    assert capsys.readouterr().out == "narrow\nwide\nnarrow\nwide\n" and (narrow.calls, wide.calls) == (1, 1)


@pytest.mark.parametrize("damage", ["not json {", '{"key": 1}', "[]", ""])
def test_a_damaged_kept_help_is_rendered_live_and_kept_again(damage, capsys):
    path = help_cache.help_path("run")
    path.parent.mkdir(parents=True)
    path.write_text(damage)
    render = _printing("live help\n")
    with pytest.raises(SystemExit) as exit_info:
        help_cache.show_help("run", render)
    assert exit_info.value.code == 0 and capsys.readouterr().out == "live help\n"
    assert json.loads(path.read_text())["text"] == "live help\n"


def test_an_unwritable_cache_still_prints_the_help(tmp_path, monkeypatch, capsys):
    blocked = tmp_path / "a_file"
    blocked.write_text("a file where the cache folder would be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    render = _printing("live help\n")
    for _ in range(2):
        with pytest.raises(SystemExit) as exit_info:
            help_cache.show_help("validate", render)
        assert exit_info.value.code == 0 and capsys.readouterr() == ("live help\n", "")
    assert render.calls == 2


def test_a_help_that_fails_prints_what_it_printed_and_keeps_nothing(capsys):
    def failing() -> None:
        print("usage: lmc run ...")
        raise SystemExit(2)

    with pytest.raises(SystemExit) as exit_info:
        help_cache.show_help("run", failing)
    assert exit_info.value.code == 2 and capsys.readouterr().out == "usage: lmc run ...\n"
    assert not help_cache.help_path("run").exists()


def test_lmc_prints_the_kept_help_without_rendering_it(capsys):
    """The kept text is what main prints: a text no render would give shows it was not rendered again."""
    path = help_cache.help_path("test")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"key": help_cache.help_key("test"), "text": "kept help of lmc test\n"}))
    assert _help(["test", "--help"], capsys) == "kept help of lmc test\n"
    assert _help(["test", "-h"], capsys) == "kept help of lmc test\n"


@pytest.mark.parametrize(
    ("argv", "kept"),
    [
        (["run", "--help"], True),
        (["predict", "-h"], True),
        (["run", "--config", "x.yaml", "--help"], False),  # the config's values are the help's defaults
        (["run", "--help", "--config", "x.yaml"], False),
        (["align", "--help"], False),  # its help loads no torch: rendered live
        (["--help"], False),
        (["run"], False),
    ],
)
def test_only_a_plain_help_of_a_trainer_command_is_kept(argv, kept):
    assert help_cache.kept_help_asked(argv) == kept


def test_keep_help_renders_each_trainer_commands_help_once(monkeypatch, capsys):
    """What make install runs, so that a new user's first lmc run --help is fast too."""
    import lmc.cli

    rendered = []

    def render(name: str, argv: list[str]) -> None:
        rendered.append((name, argv))
        print(f"help of lmc {name}")
        raise SystemExit(0)

    monkeypatch.setattr(lmc.cli, "_run_command", render)
    for _ in range(2):
        lmc.cli.keep_help()
    assert rendered == [(name, ["--help"]) for name in help_cache.KEPT_HELP_COMMANDS]  # once each
    assert capsys.readouterr().out == ""
    for name in help_cache.KEPT_HELP_COMMANDS:
        assert _help([name, "--help"], capsys) == f"help of lmc {name}\n"
