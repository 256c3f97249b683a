"""Shared test harness.

- every async test runs on asyncio AND uvloop (the ``pytest_asyncio_loop_factories`` hook);
- every event loop runs in debug mode (``asyncio_debug = true`` in pyproject), and a test
  fails if the loop logged a slow callback: something blocked it for more than
  ``SLOW_CALLBACK_S``, not counting the garbage collector's pauses inside that step
  (process-wide, not the code under test).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import re
import time
from collections import deque
from collections.abc import Callable
from collections.abc import Iterator

import pytest

# What counts as blocking the loop. Real blocking (a synchronous copy, a busy-wait) costs
# seconds; this shared 2-core VM stalls any process for 0.2-0.3 s at times, so the bar
# sits above that noise. On a loaded machine a step's wall-clock time grows with the run
# queue, so the bar a test is judged by grows with the load per core (_bar).
SLOW_CALLBACK_S = 0.5


def _bar() -> float:
    """``SLOW_CALLBACK_S``, scaled by the 1-minute load per core when that is above 1."""
    return SLOW_CALLBACK_S * max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


# torch's import leaves a large heap; a full collection of it takes ~80 ms on this VM
# and would be blamed on whatever callback it interrupted. Freeze what exists now.
gc.collect()
gc.freeze()

# The heap still grows over a long run, and a full collection under CI load has taken
# 0.5 s inside a reader task's step. Record each collection's wall-clock span, to take it
# out of the time a slow step is blamed for.
_GC_SPANS: deque[tuple[float, float]] = deque(maxlen=4096)
_gc_started = 0.0


def _time_collections(phase: str, info: dict[str, int]) -> None:
    global _gc_started
    if phase == "start":
        _gc_started = time.time()
    else:
        _GC_SPANS.append((_gc_started, time.time()))


gc.callbacks.append(_time_collections)
_TOOK = re.compile(r" took (\d+(?:\.\d+)?) seconds")


def _blocked_s(record: logging.LogRecord) -> float:
    """How long a step asyncio logged as slow blocked the loop, less the collector's
    pauses within it (the record is logged right as the step ends)."""
    m = _TOOK.search(record.getMessage())
    took = float(m.group(1)) if m else float("inf")
    end, start = record.created, record.created - took
    in_gc = sum(max(0.0, min(e, end) - max(s, start)) for s, e in _GC_SPANS)
    return took - in_gc


try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dev dependency
    uvloop = None


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Run each async test once per event loop implementation."""

    def make(new: Callable[[], asyncio.AbstractEventLoop]) -> asyncio.AbstractEventLoop:
        loop = new()
        loop.slow_callback_duration = SLOW_CALLBACK_S
        return loop

    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
        "asyncio": lambda: make(asyncio.new_event_loop)
    }
    if uvloop is not None:
        factories["uvloop"] = lambda: make(uvloop.new_event_loop)
    return factories


@pytest.fixture(autouse=True)
def _no_slow_callbacks(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Fail a test whose event loop was blocked (asyncio debug mode logs 'Executing ... took')."""
    caplog.set_level(logging.WARNING, logger="asyncio")
    yield
    bar = _bar()
    slow = [
        r.getMessage()
        for r in caplog.get_records("call")
        if r.name == "asyncio" and "took" in r.getMessage() and _blocked_s(r) > bar
    ]
    assert not slow, f"event loop blocked (bar {bar:.2f} s): {slow}"
