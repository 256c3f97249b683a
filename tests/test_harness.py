"""The suite's own guard (tests/conftest.py): a test whose event loop was blocked fails,
and a garbage-collector pause inside a step is not blamed on the code under test."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = (Path(__file__).parent / "conftest.py").read_text()
TESTS = """
import gc
import time

HEAP = [[i] for i in range(1_500_000)]  # a full collection of this takes 0.1-0.5 s


async def test_blocks_the_loop():
    time.sleep(0.3)


async def test_only_collects():
    t0 = time.perf_counter()
    gc.collect()
    assert time.perf_counter() - t0 > 0.06, "the heap is too small to test the guard"
"""


def test_a_blocked_loop_fails_and_a_collection_does_not(pytester: pytest.Pytester) -> None:
    bar = "SLOW_CALLBACK_S = 0.5"
    assert bar in CONFTEST
    pytester.makeconftest(CONFTEST.replace(bar, "SLOW_CALLBACK_S = 0.05"))
    pytester.makeini(
        "[pytest]\nasyncio_mode = auto\nasyncio_debug = true\n"
        "asyncio_default_fixture_loop_scope = function\n"
    )
    pytester.makepyfile(test_loop=TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q", "-p", "no:randomly")
    # each test runs on asyncio and on uvloop; the blocking one fails at teardown
    result.assert_outcomes(passed=4, errors=2)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_blocks_the_loop*"])
    assert "test_only_collects" not in "\n".join(
        line for line in result.stdout.lines if line.startswith("ERROR")
    )
