"""The ``one_transfer_row`` fixture of the ``aiokv bench transfer`` tests."""

from __future__ import annotations

from typing import Any

import pytest

from aiokv._bench import transfer


async def _skipped(*args: Any, **kwargs: Any) -> None:
    return None


@pytest.fixture
def one_transfer_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench transfer --quick`` times one small row (128 blocks of 16 KiB) and skips
    the overlap and concurrency parts (they have tests of their own)."""
    monkeypatch.setattr(transfer, "QUICK", [(16 << 10, 128)])
    monkeypatch.setattr(transfer, "overlap", _skipped)
    monkeypatch.setattr(transfer, "_concurrent", _skipped)
