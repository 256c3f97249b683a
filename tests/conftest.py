"""Shared test harness.

- every async test runs on asyncio AND uvloop (the ``pytest_asyncio_loop_factories`` hook);
- every event loop runs in debug mode (PYTHONASYNCIODEBUG), and a test fails if the loop
  logged a slow callback (something blocked it for more than ``slow_callback_duration``).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Iterator

import pytest

os.environ.setdefault("PYTHONASYNCIODEBUG", "1")

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dev dependency
    uvloop = None


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Run each async test once per event loop implementation."""
    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
        "asyncio": asyncio.new_event_loop
    }
    if uvloop is not None:
        factories["uvloop"] = uvloop.new_event_loop
    return factories


@pytest.fixture(autouse=True)
def _no_slow_callbacks(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Fail a test whose event loop was blocked (asyncio debug mode logs 'Executing ... took')."""
    caplog.set_level(logging.WARNING, logger="asyncio")
    yield
    slow = [
        r.getMessage()
        for r in caplog.get_records("call")
        if r.name == "asyncio" and "took" in r.getMessage()
    ]
    assert not slow, f"event loop blocked: {slow}"
