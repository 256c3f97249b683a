"""Every program in the top-level ``examples/`` folder runs to its end as a user runs it
(a fresh interpreter, from the repository root) and reports the checks it made; the
example test suite passes under pytest with the ``aiokv.testing`` plugin. Each program
checks its own bytes and exits non-zero when they differ."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from _helpers import checkout_env
from _helpers import run_python

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
ENV = checkout_env()

#: program -> lines its output must contain (each a check the program made)
PROGRAMS = {
    "async_service.py": [
        "{'ok': 60, 'timeout': 1, 'cancelled': 3}",
        "every block back in the free list: True",
        "timed out: request 40 only: True",
    ],
    "threaded_engine.py": [
        "48 requests on ",
        ": 47 ok",
        "request 13 failed alone: LLM_PARAM_INVALID",
        "every block back: True",
    ],
    "engine_integration.py": [
        "pull: pulled, blocks ",
        "push layer by layer: ",
        "pull from a scheduler thread: ",
        "prefill gone: recomputed (",
    ],
}


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return run_python(*args, env=ENV, timeout=180)


def test_every_program_is_listed() -> None:
    shipped = {p.name for p in EXAMPLES.glob("*.py") if "def main(" in p.read_text()}
    assert shipped == set(PROGRAMS)


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_program_runs_and_checks_its_bytes(name: str) -> None:
    done = _run(str(EXAMPLES / name))
    assert done.returncode == 0, done.stdout + done.stderr
    for line in PROGRAMS[name]:
        assert line in done.stdout, done.stdout + done.stderr
    if name == "engine_integration.py":  # every check it printed came out True
        assert done.stdout.count(": True") == 4, done.stdout
    assert "Traceback" not in done.stderr, done.stderr


def test_the_example_test_suite_passes_with_the_plugin() -> None:
    """As a user runs it with only ``aiokv[testing]`` installed (no pytest-timeout): its
    own settings, no warning about the repository's."""
    done = _run(
        *("-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:timeout"),
        *("-W", "error::pytest.PytestConfigWarning", str(EXAMPLES / "test_suite")),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "10 passed" in done.stdout and "warning" not in done.stdout, done.stdout


def test_the_engine_guide_includes_every_section_of_the_program() -> None:
    """docs/engines.md shows the program's code by its marked sections (snippets)."""
    import re

    guide = (ROOT / "docs" / "engines.md").read_text()
    program = (EXAMPLES / "engine_integration.py").read_text()
    included = re.findall(r'--8<-- "examples/engine_integration\.py:(\w+)"', guide)
    starts = re.findall(r"# --8<-- \[start:(\w+)\]", program)
    ends = re.findall(r"# --8<-- \[end:(\w+)\]", program)
    assert starts == ends and len(set(starts)) == len(starts)
    assert sorted(included) == sorted(starts)
    assert len(starts) >= 6


def test_the_async_service_runs_with_its_engines_inline() -> None:
    """``--inline``: both engines on the program's own loop (``engine_thread=False``),
    the same outcomes and checks."""
    done = _run(str(EXAMPLES / "async_service.py"), "--inline")
    assert done.returncode == 0, done.stdout + done.stderr
    for line in PROGRAMS["async_service.py"]:
        assert line in done.stdout, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
