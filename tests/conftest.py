"""Shared test harness.

- every async test runs on asyncio AND uvloop (the ``event_loop_policy`` fixture);
- every event loop runs in debug mode (PYTHONASYNCIODEBUG), and a test fails if the loop
  logged a slow callback (something blocked it for more than ``slow_callback_duration``).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("PYTHONASYNCIODEBUG", "1")

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dev dependency
    uvloop = None

_POLICIES = ["asyncio"] + (["uvloop"] if uvloop is not None else [])


@pytest.fixture(params=_POLICIES, scope="session")
def event_loop_policy(request: pytest.FixtureRequest) -> asyncio.AbstractEventLoopPolicy:
    """Run each async test once per event loop implementation."""
    if request.param == "uvloop":
        assert uvloop is not None
        return uvloop.EventLoopPolicy()
    return asyncio.DefaultEventLoopPolicy()


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
