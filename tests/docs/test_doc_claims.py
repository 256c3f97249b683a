"""Doc claims checked through the public interface: a bench failure is one line on a
stderr that is not a terminal; the migration table lists what legacy mode has."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_failure_is_one_line_on_stderr_when_it_is_not_a_terminal() -> None:
    """docs/cli.md: progress bars draw nothing when stderr is not a terminal, and a
    failure while running exits 1 with one line on stderr: nothing else there (a
    script that reads the first line of stderr gets the reason, not a blank line)."""
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "aiokv.cli",
                "bench",
                "transfer",
                "--connect",
                f"127.0.0.1:{port}",
            ],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"aiokv bench transfer: --connect 127.0.0.1:{port}: connection refused: "
        "start 'aiokv bench transfer --listen HOST:PORT' on that host first"
    ]


def _row(table: str, name: str) -> tuple[str, str]:
    """The (legacy, cache manager) cells of the row ``name`` of a markdown table."""
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] == name:
            return cells[1], cells[2]
    raise AssertionError(f"no row {name!r}")


def _ops(cell: str) -> set[str]:
    """The operations a cell names: backticked identifiers, ``register_*`` expanded."""
    import re

    out: set[str] = set()
    for name in re.findall(r"`([a-z_*]+)(?:\([^`]*\))?`", cell):
        if name.endswith("_*"):
            out |= {f"{name[:-1]}cache", f"{name[:-1]}blocks_cache"}
        else:
            out.add(name)
    return out


def test_migration_legacy_table_does_not_hide_operations_legacy_mode_has() -> None:
    """docs/migration.md, "Legacy mode and cache-manager mode": an operation its table
    gives to cache-manager mode only ("the same plus ...") must not be one legacy mode's
    ``KvCacheManager`` has: a port in legacy mode would otherwise switch modes (and lose
    the 1 GiB default pool) for ``swap_blocks``, ``register_cache`` or ``push_blocks``,
    which legacy mode already runs."""
    from aiokv import KvCacheManager

    text = (ROOT / "docs" / "migration.md").read_text()
    section = text.split("## Legacy mode and cache-manager mode", 1)[1].split("\n## ", 1)[0]
    table = "\n".join(line for line in section.splitlines() if line.startswith("|"))
    for row in ("caches", "transfers"):
        legacy, cache_manager = _row(table, row)
        only_cm = _ops(cache_manager) - _ops(legacy)
        hidden = sorted(op for op in only_cm if hasattr(KvCacheManager, op))
        assert not hidden, f"row {row!r}: legacy mode has {hidden}, the table says it does not"
