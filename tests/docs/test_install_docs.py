"""The install instructions tell the truth: aiokv is not on PyPI, so README and the
quick start install from a checkout or a wheel (named with the current version), and say
when to install torch first."""

from __future__ import annotations

import re
from pathlib import Path

import aiokv

ROOT = Path(__file__).resolve().parents[2]


def _install_section() -> str:
    text = (ROOT / "docs" / "quickstart.md").read_text()
    return text.split("## Install\n", 1)[1].split("\n## ", 1)[0]


def _commands(text: str) -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    return [line.split("#")[0].strip() for b in blocks for line in b.splitlines()]


def test_no_install_from_pypi_by_name() -> None:
    for text in (_install_section(), (ROOT / "README.md").read_text()):
        for cmd in _commands(text) + re.findall(r"`(pip install [^`]*)`", text):
            assert not re.search(r"pip install\s+'?aiokv\b", cmd), cmd
    assert "not on PyPI" in _install_section()
    assert "not on PyPI" in (ROOT / "README.md").read_text()


def test_checkout_and_wheel_commands_name_this_version() -> None:
    cmds = _commands(_install_section())
    assert "pip install ." in cmds and "pip install '.[cli]'" in cmds
    assert "pip wheel --no-deps -w dist ." in cmds
    wheel = f"dist/aiokv-{aiokv.__version__}-py3-none-any.whl"
    assert f"pip install '{wheel}[cli]'" in cmds


def test_says_when_torch_goes_first() -> None:
    section = " ".join(_install_section().split())
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in section
    assert "only to keep a CPU-only torch" in section
    assert "what a GPU machine wants" in section
