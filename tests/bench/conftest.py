"""The ``small_pools`` and ``one_transfer_row`` fixtures of the ``aiokv bench`` tests."""

from __future__ import annotations

from typing import Any

import pytest

from aiokv._bench import _harness
from aiokv._bench import transfer

#: the participants' pools in the tests: the benchmarks' 1 GiB, zeroed by each of up to
#: six processes, costs seconds each; the tests' rows need a few MiB
SMALL_POOL_BYTES = 32 << 20


async def _skipped(*args: Any, **kwargs: Any) -> None:
    return None


@pytest.fixture
def small_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmark's participants (``run_remote``'s pair, ``bench transfer``'s NIXL
    contenders) get ``SMALL_POOL_BYTES`` pools instead of ``POOL_BYTES``."""
    monkeypatch.setattr(_harness, "POOL_BYTES", SMALL_POOL_BYTES)
    monkeypatch.setattr(transfer, "POOL_BYTES", SMALL_POOL_BYTES)


@pytest.fixture
def one_transfer_row(monkeypatch: pytest.MonkeyPatch, small_pools: None) -> None:
    """``bench transfer --quick`` times one small row (128 blocks of 16 KiB) between
    participants with small pools, and skips the overlap and concurrency parts (they
    have tests of their own)."""
    monkeypatch.setattr(transfer, "QUICK", [(16 << 10, 128)])
    monkeypatch.setattr(transfer, "overlap", _skipped)
    monkeypatch.setattr(transfer, "_concurrent", _skipped)
