"""Fixtures of the transport tests: the data sets of the scatter/gather and concurrency
tests (see ``spans.py``)."""

from __future__ import annotations

import pytest
from spans import ManyOps
from spans import Scatter
from spans import make_many_ops
from spans import make_scatter


@pytest.fixture(scope="module")
def scatter() -> Scatter:
    """1500 source spans and 1100 destination spans over ~6 MiB; shared by a module's
    tests, which must not write to its ``src``."""
    return make_scatter()


@pytest.fixture
def many_ops() -> ManyOps:
    """Fresh data for 200 concurrent ops (tests write into its buffers)."""
    return make_many_ops()
