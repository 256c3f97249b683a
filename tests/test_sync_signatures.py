"""``aiokv.sync`` is visible to type checkers: each blocking method is made from its
async method (aiokv/_blocking.py) and has its signature, for ``inspect.signature``,
``help()`` and mypy --strict alike: a blocking llm_datadist-style program passes, a
wrong argument or result type fails."""

from __future__ import annotations

import inspect
import pydoc
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _helpers import checkout_env

import aiokv
import aiokv.sync

ROOT = Path(__file__).resolve().parents[1]


FACES = [
    (aiokv.sync.CacheManager, aiokv.CacheManager),
    (aiokv.sync.KvCacheManager, aiokv.KvCacheManager),
    (aiokv.sync.CacheTask, aiokv.CacheTask),
    (aiokv.sync.LLMDataDist, aiokv.LLMDataDist),
]


@pytest.mark.parametrize(("blocking", "async_cls"), FACES, ids=lambda c: c.__name__)
def test_every_async_method_has_a_blocking_twin_with_its_signature(
    blocking: type, async_cls: type
) -> None:
    for name, fn in inspect.getmembers(async_cls, inspect.iscoroutinefunction):
        if name.startswith("_"):
            continue
        twin = getattr(blocking, name, None)
        assert twin is not None and not inspect.iscoroutinefunction(twin), name
        assert inspect.signature(twin) == inspect.signature(fn), name
        assert twin.__doc__ and len(twin.__doc__) > 40, name  # a real docstring


def test_transfer_cache_async_has_the_async_signature() -> None:
    blocking = inspect.signature(aiokv.sync.CacheManager.transfer_cache_async)
    assert blocking == inspect.signature(aiokv.CacheManager.transfer_cache_async)


def test_help_shows_the_async_signature_summary_and_contract() -> None:
    text = pydoc.render_doc(aiokv.sync.CacheManager.pull_blocks, renderer=pydoc.plaintext)
    # (Python 3.13's pydoc writes a long signature one parameter per line)
    flat = re.sub(r"\(\s+", "(", re.sub(r",\s+", ", ", text))
    assert "pull_blocks(self, src_cache_key: 'BlocksCacheKey | CacheKey" in flat
    assert "Pull blocks of a peer's cache" in text
    assert "Blocking form of [`CacheManager.pull_blocks`][aiokv.CacheManager.pull_blocks]" in text
    assert aiokv.sync.CacheManager.pull_blocks.__qualname__ == "CacheManager.pull_blocks"
    assert aiokv.sync.CacheManager.pull_blocks.__module__ == "aiokv.sync"


def test_a_blocking_program_passes_mypy_strict_and_wrong_types_fail() -> None:
    """Signatures, return types, and what llm_datadist programs assign
    (``cfg.mem_pool_cfg = '{"memory_size": ...}'``, a digit-string timeout) check; mypy
    reports an error on each line of blocking_mistakes.py marked ``# error:``, no other."""
    pytest.importorskip("mypy", reason="a development tool: pip install -e '.[dev]'")
    mistakes = "tests/typing/blocking_mistakes.py"
    env = checkout_env()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "tests/typing/blocking_client.py",
            mistakes,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    errors = [line for line in proc.stdout.splitlines() if ": error:" in line]
    assert all(line.startswith(mistakes) for line in errors), proc.stdout
    lines = (ROOT / mistakes).read_text().splitlines()
    expected = {n for n, line in enumerate(lines, 1) if "  # error:" in line}
    assert {int(line.split(":")[1]) for line in errors} == expected, proc.stdout
