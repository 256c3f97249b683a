"""Calls of ``aiokv.sync``'s blocking methods that ``mypy --strict`` must reject (never
run): tests/test_sync_signatures.py checks that mypy reports an error on each line
marked ``# error:`` and on no other, so the blocking methods carry the async types."""

from __future__ import annotations

import aiokv.sync as llm_datadist
from aiokv.sync import BlocksCacheKey
from aiokv.sync import CacheDesc
from aiokv.sync import DataType
from aiokv.sync import LLMStatusCode


def mistakes(datadist: llm_datadist.LLMDataDist, sync: llm_datadist.LayerSynchronizer) -> None:
    manager = datadist.cache_manager
    dst = manager.allocate_blocks_cache(CacheDesc(2, [4, 16], DataType.DT_FLOAT))
    manager.pull_blocks(BlocksCacheKey(0), dst, src_blocks=[0], dst_blocks=[1])
    manager.pull_blocks("key", dst)  # error: a string is no cache key
    manager.pull_blocks(BlocksCacheKey(0), dst, src_blockz=[0])  # error: no such parameter
    manager.pull_blocks(BlocksCacheKey(0), dst, [0], [1], range(2))  # error: keyword-only
    done: int = manager.pull_blocks(BlocksCacheKey(0), dst)  # error: it returns None
    llm_datadist.CacheManager.pull_blocks(manager, 7, dst)  # error: through the class too
    linked: str = datadist.link_clusters([], 1000)  # error: it returns a tuple
    task = manager.transfer_cache_async(dst, sync, [])
    code: LLMStatusCode = task.synchronize(1000)
    task.synchronize("1000")  # error: milliseconds are an int
    assert code and done and linked
