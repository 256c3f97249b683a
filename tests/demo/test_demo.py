"""``aiokv demo``: prefill and decode processes serve a tiny transformer; the decoders'
tokens are identical to a colocated run, from an installed copy of the package, in any
directory."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

import aiokv
from aiokv.cli import app

#: A small demo: 2 decoders (one prefill feeding several), 2 layers, short prompts.
ARGS = ["demo", "--prompts", "3", "--prompt-len", "40", "--layers", "2", "--steps", "4"]


def test_demo_tokens_identical_from_the_package_alone_outside_the_repository(
    tmp_path: Path,
) -> None:
    # What a wheel installs: the aiokv package and nothing else of the repository.
    site = tmp_path / "site"
    shutil.copytree(
        Path(aiokv.__file__).parent, site / "aiokv", ignore=shutil.ignore_patterns("__pycache__")
    )
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    # the copy, and no checkout (the dependencies may come from PYTHONPATH: they stay)
    checkout = Path(__file__).resolve().parents[2]
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    kept = [p for p in kept if Path(p).resolve() != checkout]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *kept]), "COLUMNS": "160"}
    argv = ["aiokv", *ARGS, "--decoders", "2"]
    code = f"import sys, aiokv.cli; print(aiokv.__file__); sys.argv = {argv!r}; aiokv.cli.main()"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, timeout=120
    )
    out = (proc.stdout + proc.stderr).decode()
    assert proc.returncode == 0, out
    assert out.startswith(str(site)), out  # the copy ran, not the checkout
    assert out.count("tokens identical") == 3 + 1, out  # each request, and the verdict
    assert "tokens identical for all 3 requests" in out
    for line in ("bytes moved", "time to first token", "layer-wise saved", "decode throughput"):
        assert line in out, out
    assert "Traceback" not in out


def test_demo_bad_option_exits_2_with_the_reason_and_starts_nothing() -> None:
    result = CliRunner().invoke(app, ["demo", "--decoders", "5", "--prompts", "2"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "aiokv demo: 5 decoders for 2 prompts: some would idle"
    ]
    assert not multiprocessing.active_children()
