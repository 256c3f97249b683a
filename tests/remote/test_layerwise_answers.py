"""Layer-wise transfers read a synchronizer's answer as llm_datadist's callers give it:
a numpy bool is the bool it stands for.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import aiokv
from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import DataType
from aiokv import LLMStatusCode
from aiokv import Placement
from aiokv import TransferWithCacheKeyConfig
from aiokv.testing import linked_pair
from aiokv.testing import make_config

CODE = LLMStatusCode
DESC = CacheDesc(4, [8, 256], DataType.DT_UINT8, Placement.HOST)  # 2 layers of 8 blocks
KEY = BlocksCacheKey(2, 0)


def config(**kw: Any) -> aiokv.LLMConfig:
    return make_config(pool=None, host_pool=4 << 20, **({"sync_kv_timeout": 3000} | kw))


class Answers:
    """def synchronizer answering ``answer`` for every layer."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> Any:
        return self.answer


class AsyncAnswers(Answers):
    async def synchronize_layer(  # type: ignore[override]
        self, layer_index: int, timeout_in_millis: int | None
    ) -> Any:
        return self.answer


class AwaitableAnswers(Answers):
    """def synchronizer returning an awaitable of ``answer`` (awaited on the caller's loop)."""

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> Any:
        async def later() -> Any:
            return self.answer

        return later()


@pytest.mark.parametrize("kind", [Answers, AsyncAnswers, AwaitableAnswers])
async def test_a_synchronizer_answering_numpys_true_releases_its_layer(
    kind: type[Answers],
) -> None:
    """A synchronizer "returning bool" may compute it with numpy (``return
    np.all(flags)``: ``np.True_``), which llm_datadist's ``if not
    synchronize_layer(...)`` reads as true. aiokv accepted only the object ``True`` and
    failed every destination with ``LLM_PARAM_INVALID`` ("returned np.True_, not
    True"): nothing was sent. ``np.False_`` still fails its layer, as ``False``, and so
    does any value that is not a bool (``1``, ``None``, an object returned in place of
    its state)."""
    async with linked_pair(config()) as (p, d):
        dst = await d.cache_manager.allocate_blocks_cache(DESC, KEY)
        src = await p.cache_manager.allocate_blocks_cache(DESC)
        for i, t in enumerate(src.tensors):
            t.fill_(i + 1)
        task = p.cache_manager.transfer_cache_async(
            src, kind(np.True_), [TransferWithCacheKeyConfig(KEY)]
        )
        results = await asyncio.wait_for(task.get_results(), 10)
        assert results == [CODE.LLM_SUCCESS], (results, task.errors())
        assert all(bool((t == i + 1).all()) for i, t in enumerate(dst.tensors))
        for answer, shown in ((np.False_, "False"), (1, "1"), (None, "None")):
            task = p.cache_manager.transfer_cache_async(
                src, kind(answer), [TransferWithCacheKeyConfig(KEY)]
            )
            assert await asyncio.wait_for(task.get_results(), 10) == [CODE.LLM_PARAM_INVALID]
            assert task.errors() == [f"synchronize_layer(0) returned {shown}, not True"]
        assert p.cache_manager.statistics().pins == 0
