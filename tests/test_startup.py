"""Start-up cost: ``aiokv --version``, ``aiokv --help`` and the pytest plugin's registration
import neither torch nor numpy (importing torch costs seconds), and the plugin adds no
installed package to a pytest run but ``aiokv`` itself. These are checks on what is
imported, not on wall-clock time: a shared machine's timings are noise at this scale.
The seconds themselves are measured by ``scripts/startup_time.py`` (docs/benchmarks.md)."""

from __future__ import annotations

import ast
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from _helpers import checkout_env

ROOT = Path(__file__).resolve().parents[1]
ENV = checkout_env(COLUMNS="100")
#: what a fast start must not import
HEAVY = ("torch", "numpy")
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


def _packages_in_a_pytest_run(tmp_path: Path, *plugin: str) -> set[str]:
    """The top-level packages outside the standard library imported by the time a one-test
    pytest run in ``tmp_path`` runs its test, with ``plugin``'s arguments."""
    (tmp_path / "test_nothing.py").write_text(
        "import sys\n\ndef test_light():\n"
        "    top = {m.partition('.')[0] for m in list(sys.modules)}\n"
        "    print('packages:', sorted(top - set(sys.stdlib_module_names)))\n"
    )
    done = _run("-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", *plugin, ".", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("packages:")]
    return set(ast.literal_eval(line.partition(":")[2].strip()))


def test_plugin_registration_adds_no_package_but_aiokv(tmp_path: Path) -> None:
    """Registering the plugin (no fixture of it in use) imports ``aiokv`` and nothing else
    that the same run without the plugin does not import: what a test run pays for it."""
    without = _packages_in_a_pytest_run(tmp_path, "-p", "no:aiokv")
    with_it = _packages_in_a_pytest_run(tmp_path, *_plugin())
    assert "aiokv" in with_it, with_it
    assert with_it - without <= {"aiokv"}, f"the plugin imports {with_it - without - {'aiokv'}}"
