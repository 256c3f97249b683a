"""Helpers of this test suite that a user of aiokv would not need (those live in
``aiokv.testing``): asserting an ``LLMException``'s code, waiting for what a peer does on
its own thread."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from aiokv import LLMException, LLMStatusCode


async def raises(code: LLMStatusCode, coro: Awaitable[Any]) -> LLMException:
    """Await ``coro``; it must raise ``LLMException`` with ``code``, which is returned."""
    with pytest.raises(LLMException) as ei:
        await coro
    assert ei.value.status_code == code, ei.value
    return ei.value


async def until(cond: Callable[[], bool], seconds: float = 5.0, step: float = 0.005) -> None:
    """Wait (at most ``seconds``) for ``cond()``: something the peer's side or an engine
    thread does on its own."""
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(step)
