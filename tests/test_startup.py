"""Start-up cost: ``aiokv --version``, ``aiokv --help`` and the pytest plugin's registration
import neither torch nor numpy, and cost at most ``BUDGET_S`` above what they are compared
with (a bare interpreter; the same pytest run without the plugin), measured in the same
run, best of ``TRIES``. On a loaded machine the budget grows with the load per core
(importing torch costs several seconds even on an idle one, so it still shows)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from _helpers import checkout_env

ROOT = Path(__file__).resolve().parents[1]
ENV = checkout_env(COLUMNS="100")
#: what a fast start must not import
HEAVY = ("torch", "numpy")
#: seconds a command may cost above its baseline (the best of TRIES runs of each)
BUDGET_S = 0.5
TRIES = 5
#: the ``aiokv`` console script, run as installed (``aiokv._console:main``)
SCRIPT = "import sys; sys.argv[0] = 'aiokv'; from aiokv._console import main; main()"
#: the same, reporting the heavy modules it imported on exit (on stderr)
PROBE = (
    "import atexit, sys\n"
    f"atexit.register(lambda: print('heavy:', [m for m in {HEAVY!r} if m in sys.modules], "
    "file=sys.stderr))\n" + SCRIPT.replace("; ", "\n")
)


def _plugin() -> tuple[str, ...]:
    """pytest's arguments that load the plugin: none where aiokv is installed (its entry
    point registers it), else ``-p aiokv.testing``."""
    names = {ep.name for ep in entry_points(group="pytest11")}
    return () if "aiokv" in names else ("-p", "aiokv.testing")


def _run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=120
    )


def _budget() -> float:
    """``BUDGET_S``, scaled by the run queue per core when the machine is busy."""
    return BUDGET_S * max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def _best(*args: str, cwd: Path = ROOT) -> float:
    best = float("inf")
    for _ in range(TRIES):
        t0 = time.perf_counter()
        done = _run(*args, cwd=cwd)
        best = min(best, time.perf_counter() - t0)
        assert done.returncode in (0, 5), done.stderr  # 5: pytest collected nothing
    return best


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["bench", "--help"]])
def test_cli_imports_no_heavy_module(argv: list[str]) -> None:
    done = _run("-c", PROBE, *argv)
    assert done.returncode == 0, done.stderr
    assert "heavy: []" in done.stderr, done.stderr


def _heavy_in_a_pytest_run(tmp_path: Path, fixture: str, *plugin: str) -> list[str]:
    """The HEAVY modules imported by the time a one-test pytest run in ``tmp_path`` runs
    its test (which asks for ``fixture``, if any), with ``plugin``'s arguments."""
    (tmp_path / "test_nothing.py").write_text(
        f"import sys\n\ndef test_light({fixture}):\n"
        f"    print('heavy:', [m for m in {HEAVY!r} if m in sys.modules])\n"
    )
    done = _run("-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", *plugin, ".", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("heavy:")]
    return [m for m in HEAVY if repr(m) in line]


def test_plugin_registration_imports_no_heavy_module(tmp_path: Path) -> None:
    """With the plugin (one of its fixtures in use) no HEAVY module is imported that the
    same run without it does not import (another installed pytest plugin may import one)."""
    without = _heavy_in_a_pytest_run(tmp_path, "", "-p", "no:aiokv")
    with_it = _heavy_in_a_pytest_run(tmp_path, "aiokv_transport", *_plugin())
    assert set(with_it) <= set(without), f"the plugin imports {set(with_it) - set(without)}"


@pytest.mark.parametrize("argv", [["--version"], ["--help"]])
def test_cli_starts_within_budget_of_a_bare_interpreter(argv: list[str]) -> None:
    bare = _best("-c", "pass")
    took = _best("-c", SCRIPT, *argv)
    budget = _budget()
    assert took - bare <= budget, f"aiokv {argv[0]}: {took:.2f} s vs bare {bare:.2f} s"


def test_plugin_costs_within_budget_of_a_run_without_it(tmp_path: Path) -> None:
    (tmp_path / "test_nothing.py").write_text("def test_nothing():\n    pass\n")
    run = ("-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path))
    without = _best(*run, "-p", "no:aiokv", cwd=tmp_path)
    took = _best(*run, *_plugin(), cwd=tmp_path)
    budget = _budget()
    assert took - without <= budget, f"with the plugin {took:.2f} s, without {without:.2f} s"
