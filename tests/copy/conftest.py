"""Fixtures of the copy-engine tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from copy_helpers import CPU

from aiokv._copy import CopyScheduler
from aiokv._copy import SchedulerConfig


@pytest.fixture
async def sched() -> AsyncIterator[CopyScheduler]:
    s = CopyScheduler(CPU)
    yield s
    await s.aclose()


@pytest.fixture
async def sched1() -> AsyncIterator[CopyScheduler]:
    """A CPU copy scheduler with a single worker thread (closed after the test)."""
    s = CopyScheduler(CPU, SchedulerConfig(swap_out_threads=1))
    yield s
    await s.aclose()
