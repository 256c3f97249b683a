"""Issue #8 item 6: keys and lookups as llm_datadist — a ``BlocksCacheKey`` is found by
``model_id``, a ``CacheKey`` by ``(req_id or prefix_id, model_id)``; the cluster id only
chooses the link. ``check_cache_key``; the same key registered twice: last wins, warned.
Real prompt/decoder pairs linked over TCP on 127.0.0.1."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
from _helpers import raises
from _helpers import snapshot
from _helpers import until
from participants import participant
from participants import pool

from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import CacheKey
from aiokv import CacheKeyByIdAndIndex
from aiokv import CacheManager
from aiokv import DataType
from aiokv import LLMConfig
from aiokv import LLMDataDist
from aiokv import LLMException
from aiokv import LLMRole
from aiokv import LLMStatusCode
from aiokv import Placement
from aiokv.testing import cluster_info

CODE = LLMStatusCode
NONE = 2**64 - 1  # neither a request nor a prefix


def config(**kw: Any) -> LLMConfig:
    return participant(**{"mem_pool_cfg": pool(1 << 20), **kw})


@contextlib.asynccontextmanager
async def linked(**prompt: Any) -> AsyncIterator[tuple[CacheManager, CacheManager]]:
    """Managers of a prompt (cluster 1, ``prompt`` config overrides) and a decoder
    (cluster 2) linked to it."""
    async with (
        LLMDataDist(LLMRole.PROMPT, 1, config(**prompt)) as p,
        LLMDataDist(LLMRole.DECODER, 2, config()) as d,
    ):
        assert p.listen_address is not None
        peer = cluster_info(1, p.listen_address)
        assert await d.link_clusters([peer]) == (CODE.LLM_SUCCESS, [CODE.LLM_SUCCESS])
        yield p.cache_manager, d.cache_manager


def blocks_desc() -> CacheDesc:
    return CacheDesc(2, [4, 64], DataType.DT_UINT8)


def slots_desc(batch: int = 2) -> CacheDesc:
    return CacheDesc(2, [batch, 64], DataType.DT_UINT8)


def fill(cache: Any, seed: int) -> None:
    for i, t in enumerate(cache.tensors):
        t.copy_(torch.arange(t.numel(), dtype=torch.int64).view(t.shape).add(seed + i) % 251)


def state(cm: CacheManager) -> dict[str, Any]:
    pool = cm.get_pool_stats(Placement.DEVICE)
    assert pool is not None
    return {**dataclasses.asdict(cm.statistics()), "used": pool.used}


async def test_blocks_key_is_found_by_model_id() -> None:
    async with linked() as (pm, dm):
        # the owner may spell any cluster id: only model_id names the cache
        src = await pm.allocate_blocks_cache(blocks_desc(), BlocksCacheKey(99, 3))
        fill(src, 7)
        dst = await dm.allocate_blocks_cache(blocks_desc())
        fill(dst, 100)
        await dm.pull_blocks(BlocksCacheKey(1, 3), dst, [0, 2], [1, 3])
        for s, d in zip(src.tensors, dst.tensors, strict=True):
            assert torch.equal(d[1], s[0]) and torch.equal(d[3], s[2])
        before = snapshot(dst)
        await raises(
            CODE.LLM_KV_CACHE_NOT_EXIST, dm.pull_blocks(BlocksCacheKey(1, 4), dst, [0], [0])
        )
        assert all(torch.equal(a, b) for a, b in zip(before, dst.tensors, strict=True))
        # the cluster id chooses the link: cluster 99 is not linked
        await raises(CODE.LLM_NOT_YET_LINK, dm.pull_blocks(BlocksCacheKey(99, 3), dst, [0], [0]))


async def test_cache_key_is_found_by_req_id_and_model_id() -> None:
    async with linked() as (pm, dm):
        keys = [CacheKey(42, req_id=5, model_id=1), CacheKey(42, req_id=5, model_id=2)]
        src = await pm.allocate_cache(slots_desc(), keys)
        fill(src, 3)
        await pm.deallocate_cache(src)  # only the keys hold it now
        dst = await dm.allocate_cache(slots_desc(1))
        # (req 5, model 2) is slot 1, whatever cluster id the owner wrote
        await dm.pull_cache(CacheKey(1, 5, 2), dst)
        for s, d in zip(src.tensors, dst.tensors, strict=True):
            assert torch.equal(d[0], s[1])
        await until(lambda: pm.statistics().keys == 1)  # a successful pull released it
        await raises(CODE.LLM_KV_CACHE_NOT_EXIST, dm.pull_cache(CacheKey(1, 5, 2), dst))
        await raises(CODE.LLM_KV_CACHE_NOT_EXIST, dm.pull_cache(CacheKey(1, 6, 1), dst))
        # remove_cache_key finds it the same way: the last key frees the memory
        await pm.remove_cache_key(CacheKey(7, 5, 1))
        assert state(pm)["used"] == 0 and pm.statistics().caches == 0


async def test_prefix_keys_are_their_own_names() -> None:
    async with linked() as (pm, dm):
        prefix = CacheKey(1, req_id=NONE, model_id=0, prefix_id=9)
        request = CacheKey(1, req_id=9)  # the same number as a request: another key
        src = await pm.allocate_cache(slots_desc(), [prefix, request])
        fill(src, 11)
        dst = await dm.allocate_cache(slots_desc(1))
        await dm.pull_cache(CacheKey(1, NONE, 0, 9), dst)
        assert all(torch.equal(d[0], s[0]) for s, d in zip(src.tensors, dst.tensors, strict=True))
        await dm.pull_cache(request, dst)
        assert all(torch.equal(d[0], s[1]) for s, d in zip(src.tensors, dst.tensors, strict=True))
        # the request key is released by its pull; a prefix key never is (llm_datadist)
        await until(lambda: pm.statistics().keys == 1)
        await dm.pull_cache(CacheKey(1, NONE, 0, 9), dst)  # still there for the next one


async def test_check_cache_key() -> None:
    async with linked() as (pm, dm):
        CacheManager.check_cache_key(CacheKey(1, 5))
        CacheManager.check_cache_key(CacheKey(1, NONE, 0, 5))
        neither, both = CacheKey(1, NONE), CacheKey(1, 5, 0, 5)
        for bad in (neither, both):
            with pytest.raises(LLMException) as ei:
                CacheManager.check_cache_key(bad)
            assert ei.value.status_code == CODE.LLM_PARAM_INVALID
        with pytest.raises(TypeError):
            CacheManager.check_cache_key(BlocksCacheKey(1))  # type: ignore[arg-type]
        # the pulls check it before anything is sent: nothing changes
        src = await pm.allocate_cache(slots_desc(1), [CacheKey(1, 5)])
        dst = await dm.allocate_blocks_cache(blocks_desc())
        slot = await dm.allocate_cache(slots_desc(1))
        fill(dst, 1)
        fill(slot, 2)
        before = (snapshot(dst), snapshot(slot), state(pm), state(dm))
        for bad in (neither, both):
            await raises(CODE.LLM_PARAM_INVALID, dm.pull_cache(bad, slot))
            await raises(CODE.LLM_PARAM_INVALID, dm.pull_blocks(bad, dst, [], [0]))
        after = (snapshot(dst), snapshot(slot), state(pm), state(dm))
        assert all(
            torch.equal(a, b)
            for a, b in zip(before[0] + before[1], after[0] + after[1], strict=True)
        )
        assert before[2:] == after[2:]
        # a key naming both is refused when binding too (a placeholder binds nothing)
        await raises(CODE.LLM_PARAM_INVALID, pm.allocate_cache(slots_desc(), [neither, both]))
        assert state(pm) == before[2]
        await pm.deallocate_cache(src)


async def test_same_key_twice_last_wins_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    async with linked() as (pm, dm):
        first = await pm.allocate_cache(slots_desc(1), [CacheKey(1, 8)])
        await pm.deallocate_cache(first)  # the key alone holds it
        used_one = state(pm)["used"]
        with caplog.at_level(logging.WARNING, logger="aiokv"):
            second = await pm.allocate_cache(slots_desc(1), [CacheKey(3, 8)])  # same (8, 0)
        assert "now cache" in caplog.text
        assert state(pm)["used"] == used_one  # the first cache's memory went back
        fill(second, 21)
        dst = await dm.allocate_cache(slots_desc(1))
        await dm.pull_cache(CacheKey(1, 8), dst)
        assert all(torch.equal(a, b) for a, b in zip(second.tensors, dst.tensors, strict=True))

        caplog.clear()
        t1 = [torch.zeros(4, 64, dtype=torch.uint8) for _ in range(2)]
        t2 = [torch.full((4, 64), 5, dtype=torch.uint8) for _ in range(2)]
        r1 = await pm.register_blocks_cache(blocks_desc(), t1, BlocksCacheKey(1, 6))
        with caplog.at_level(logging.WARNING, logger="aiokv"):
            r2 = await pm.register_blocks_cache(blocks_desc(), t2, BlocksCacheKey(50, 6))
        assert "model_id 6" in caplog.text
        got = await dm.allocate_blocks_cache(blocks_desc())
        await dm.pull_blocks(BlocksCacheKey(1, 6), got, [2], [0])
        assert all(bool((t[0] == 5).all()) for t in got.tensors)  # the later one
        # unregistering the first leaves the key with the second
        await pm.unregister_cache(r1.cache_id)
        await dm.pull_blocks(BlocksCacheKey(1, 6), got, [1], [1])
        await pm.unregister_cache(r2.cache_id)
        await raises(
            CODE.LLM_KV_CACHE_NOT_EXIST, dm.pull_blocks(BlocksCacheKey(1, 6), got, [0], [0])
        )
        assert pm.statistics().blocks_keys == 0


async def test_cache_key_by_id_ignores_nothing_else() -> None:
    # by id, the cache id and slot name the memory; the cluster id chooses the link
    # (reads by id need a remote-accessible cache: see tests/hardening/test_grants.py)
    async with linked(enable_remote_cache_accessible=True) as (pm, dm):
        src = await pm.allocate_cache(slots_desc())
        fill(src, 4)
        dst = await dm.allocate_cache(slots_desc(1))
        await dm.pull_cache(CacheKeyByIdAndIndex(1, src.cache_id, 1), dst)
        assert all(torch.equal(d[0], s[1]) for s, d in zip(src.tensors, dst.tensors, strict=True))
