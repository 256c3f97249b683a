"""Fixtures of the copy-engine tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from copy_helpers import CPU

from aiokv._copy import CopyScheduler


@pytest.fixture
async def sched() -> AsyncIterator[CopyScheduler]:
    s = CopyScheduler(CPU)
    yield s
    await s.aclose()
