"""A notebook cell re-run without ``finalize`` (issue #12: "re-creating an LLMDataDist
without finalizing leaks its pools and listener, with no warning").

IPython's output history keeps the old instance alive, so it is never collected and
its ``__del__`` warning never fires. ``init`` therefore warns when another initialized
instance has the same cluster id, as a ``ResourceWarning`` and as a log warning (which
a notebook shows), naming the fix."""

from __future__ import annotations

import logging
import threading
import warnings

import pytest

from aiokv import LLMConfig
from aiokv import LLMDataDist
from aiokv import LLMRole
from aiokv import sync
from aiokv.testing import make_config

WARNING = "finalize the old one"


def config() -> LLMConfig:
    options = {"enable_remote_cache_accessible": False, "sync_kv_timeout": 1000}
    return make_config("tcp", pool=None, host_pool=1 << 20, **options)


def aiokv_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("aiokv-")]


async def test_rerun_cell_warns_and_finalize_releases(caplog: pytest.LogCaptureFixture) -> None:
    history: list[LLMDataDist] = []  # what IPython's Out[] does: holds every cell's result

    async def cell() -> None:
        dd = LLMDataDist(LLMRole.PROMPT, 7, config())
        await dd.init(config())
        history.append(dd)

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always", ResourceWarning)
        for _ in range(3):  # the same cell, three times
            await cell()
    ours = [w for w in record if WARNING in str(w.message)]
    assert len(ours) == 2  # runs 2 and 3
    assert ours[0].category is ResourceWarning
    assert "cluster id 7" in str(ours[0].message)
    logged = [r for r in caplog.records if r.levelno == logging.WARNING and WARNING in r.message]
    assert len(logged) == 2
    assert all(d.initialized for d in history)  # nothing is torn down behind the user's back
    for d in history:
        await d.finalize()
    assert aiokv_threads() == []


async def test_finalized_or_distinct_instances_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        async with LLMDataDist(LLMRole.PROMPT, 7, config()):
            pass
        async with (  # the cell re-run as it should be: the old one finalized first
            LLMDataDist(LLMRole.PROMPT, 7, config()),
            LLMDataDist(LLMRole.DECODER, 8, config()),
        ):
            pass
    assert aiokv_threads() == []


def test_blocking_face_warns_too() -> None:
    first = sync.LLMDataDist(LLMRole.MIX, 9)
    first.init(config())
    second = sync.LLMDataDist(LLMRole.MIX, 9)
    try:
        with pytest.warns(ResourceWarning, match=WARNING):
            second.init(config())
    finally:
        second.finalize()
        first.finalize()
    assert aiokv_threads() == []
