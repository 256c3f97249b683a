"""Packaging (issue #12): the library imports without the CLI extra, the ``aiokv`` script
without it says what to install, one version source, floors that scripts/floors.sh tests."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from _helpers import checkout_env
from _helpers import run_python

import aiokv
from aiokv._console import CLI_MODULES

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
BLOCK = "import sys\nfor m in {mods!r}: sys.modules[m] = None  # as if not installed\n"


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-W", "error", "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_library_imports_without_the_cli_extra() -> None:
    code = BLOCK.format(mods=CLI_MODULES) + (
        "import aiokv, aiokv.sync, aiokv.metrics, aiokv.testing\n"
        "assert not [m for m in ('typer', 'rich', 'click') if sys.modules.get(m)]\n"
        "print(aiokv.__version__)\n"
    )
    done = _run(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == aiokv.__version__ and done.stderr == ""


def test_script_without_the_cli_extra_names_it() -> None:
    done = _run(BLOCK.format(mods=("typer", "rich")) + "from aiokv._console import main; main()")
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "aiokv: the command line needs typer, rich: pip install 'aiokv[cli]'"
    ]


def test_script_runs_the_cli() -> None:
    done = _run(
        "import sys; sys.argv = ['aiokv', '--version']\nfrom aiokv._console import main; main()"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"aiokv {aiokv.__version__}"


def test_python_m_aiokv_runs_the_cli() -> None:
    done = run_python("-m", "aiokv", "--help", env=checkout_env(COLUMNS="100"), timeout=60)
    assert done.returncode == 0, done.stderr
    assert "Usage: python -m aiokv [OPTIONS] COMMAND" in done.stdout
    assert all(command in done.stdout for command in ("demo", "info", "bench"))


def test_one_version_source() -> None:
    project = PYPROJECT["project"]
    assert "version" not in project and project["dynamic"] == ["version"]
    assert PYPROJECT["tool"]["hatch"]["version"]["path"] == "aiokv/__init__.py"
    assert re.fullmatch(r"\d+\.\d+\.\d+", aiokv.__version__)
    assert project["scripts"]["aiokv"] == "aiokv._console:main"


def _floors(specs: list[str]) -> dict[str, str]:
    out = {}
    for spec in specs:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^]]*\])?>=([0-9.]+)(?:,<[0-9.]+)?(?:;.*)?", spec)
        if m:
            out[m.group(1).lower()] = m.group(2)
    return out


def test_floors_file_pins_each_declared_floor() -> None:
    """scripts/floors.txt (what scripts/floors.sh installs) is exactly the floors of the
    dependencies and of the cli and testing extras (torch: 2.13.0 is installed instead)."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    declared = _floors(PYPROJECT["project"]["dependencies"] + extras["cli"] + extras["testing"])
    assert declared.pop("torch") == "2.8"
    pins = {}
    for line in (ROOT / "scripts" / "floors.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.lower()] = version
    assert {k: v.removesuffix(".0") for k, v in pins.items()} == {
        k: v.removesuffix(".0") for k, v in declared.items()
    }


def test_npu_extras_pin_matching_pairs() -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    npu = {k: v for k, v in extras.items() if k.startswith("npu")}
    assert "npu" in npu and len(npu) >= 2
    for specs in npu.values():
        torch = next(s for s in specs if s.startswith("torch=="))
        npu_spec = next(s for s in specs if s.startswith("torch_npu=="))
        version = torch.removeprefix("torch==")
        assert npu_spec == f"torch_npu=={version}.*"
        assert tuple(int(p) for p in version.split(".")[:2]) >= (2, 8)  # the torch floor
