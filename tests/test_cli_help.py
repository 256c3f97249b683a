"""The ``aiokv`` help as a terminal shows it: every help text of every command and option
appears as written (rich markup must not eat ``[nixl]``, ``[plot]``), and no reST
markup (````aiokv demo````) leaks into it."""

from __future__ import annotations

from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from aiokv.cli import app

#: wide enough that no help text wraps
WIDE = {"COLUMNS": "400", "TERMINAL_WIDTH": "400"}


def _commands(command: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """Every command under ``command`` (typer's click objects), with its argv path."""
    found = [(path, command)]
    for name, sub in getattr(command, "commands", {}).items():
        found += _commands(sub, (*path, name))
    return found


ROOT = typer.main.get_command(app)
COMMANDS = _commands(ROOT)


def _flat(text: str) -> str:
    return " ".join(text.split())


def _written(help_text: str) -> str:
    """What the reader must see: the help as written, less its markup escapes."""
    return _flat(help_text.replace("\\[", "["))


def test_every_command_is_walked() -> None:
    names = {" ".join(p) for p, _ in COMMANDS}
    assert {"", "demo", "info", "bench", "bench transfer", "bench device"} <= names


@pytest.mark.parametrize("path", [p for p, _ in COMMANDS], ids=lambda p: " ".join(p) or "aiokv")
def test_help_shows_every_text_as_written(path: tuple[str, ...]) -> None:
    command = dict(COMMANDS)[path]
    shown = CliRunner(env=WIDE).invoke(app, [*path, "--help"])
    assert shown.exit_code == 0, shown.output
    out = _flat(shown.output)
    assert "``" not in out and ":func:" not in out
    first = (command.help or "").split("\n\n")[0]
    assert _written(first) in out, (first, out)
    for param in command.params:
        text = getattr(param, "help", None)
        if text:
            assert _written(text) in out, (param.name, text, out)


def test_extras_in_brackets_survive() -> None:
    demo = _flat(CliRunner(env=WIDE).invoke(app, ["demo", "--help"]).output)
    assert "nixl needs aiokv[nixl]." in demo
    transfer = _flat(CliRunner(env=WIDE).invoke(app, ["bench", "transfer", "--help"]).output)
    assert "(needs aiokv[nixl])" in transfer and "matplotlib: aiokv[plot]" in transfer


@pytest.mark.parametrize("group", [(), ("bench",)], ids=["aiokv", "bench"])
def test_a_command_list_reflows_each_summary_to_the_terminal(group: tuple[str, ...]) -> None:
    """No line break of the source survives into ``aiokv [bench] --help``'s list of
    commands: on a wide terminal each summary is one line (not cut where the docstring
    was)."""
    shown = CliRunner(env=WIDE).invoke(app, [*group, "--help"])
    assert shown.exit_code == 0, shown.output
    lines = [_flat(line) for line in shown.output.splitlines()]
    for name, command in dict(COMMANDS)[group].commands.items():
        summary = _written((command.help or "").split("\n\n")[0])
        assert "\n" not in (command.help or "").split("\n\n")[0], name
        assert any(summary in line for line in lines), (name, summary, shown.output)


def test_the_top_level_help_names_every_bench_command() -> None:
    names = "|".join(dict(COMMANDS)[("bench",)].commands)
    shown = CliRunner(env=WIDE).invoke(app, ["--help"])
    assert f"aiokv bench [{names}]" in _flat(shown.output)
