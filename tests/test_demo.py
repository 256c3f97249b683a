"""``aiokv demo`` works from an installed copy of the package, in any directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import aiokv


def test_demo_runs_from_the_package_alone_outside_the_repository(tmp_path: Path) -> None:
    # What a wheel installs: the aiokv package and nothing else of the repository.
    site = tmp_path / "site"
    shutil.copytree(
        Path(aiokv.__file__).parent, site / "aiokv", ignore=shutil.ignore_patterns("__pycache__")
    )
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "COLUMNS": "120"}

    def python(code: str) -> tuple[int, str]:
        """Exit code and output of ``python -c code`` run there, with only the copy."""
        proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True)
        return proc.returncode, (proc.stdout + proc.stderr).decode()

    where = python("import aiokv; print(aiokv.__file__)")[1]
    assert where.startswith(str(site)), where  # the copy runs, not the checkout
    code, out = python("import sys, aiokv.cli; sys.argv = ['aiokv', 'demo']; aiokv.cli.main()")
    assert code == 0, out
    assert "aiokv demo: local KV blocks" in out
    assert "swap block 0 back in: bytes identical = True" in out
    assert "aiokv demo: prefill → decode" in out
    assert out.count("byte-exact = True") == 2
    assert "done" in out
