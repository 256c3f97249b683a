"""Issue #8 item 7: legacy ``KvCacheManager`` mode as a drop-in — an implicit device pool
when the options give none, ``KvCache.per_device_tensor_addrs``, ``get_cache_tensors``,
``is_initialized`` (async and ``aiokv.sync``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from _helpers import raises

import aiokv.sync as llm_datadist
from aiokv import CacheDesc
from aiokv import DataType
from aiokv import KvCache
from aiokv import LLMConfig
from aiokv import LLMDataDist
from aiokv import LLMException
from aiokv import LLMRole
from aiokv import LLMStatusCode
from aiokv import Placement
from aiokv._datadist import LEGACY_POOL

CODE = LLMStatusCode


def config(**kw: Any) -> LLMConfig:
    return LLMConfig(device_type="cpu", **kw)


def desc(placement: Placement = Placement.DEVICE) -> CacheDesc:
    return CacheDesc(2, [4, 128], DataType.DT_FLOAT16, placement)


async def test_legacy_mode_reserves_a_device_pool() -> None:
    async with LLMDataDist(LLMRole.DECODER, 1, config()) as d:  # llm_datadist's default mode
        kv = d.kv_cache_manager
        stats = kv.get_pool_stats(Placement.DEVICE)
        assert stats is not None and stats.total == LEGACY_POOL.memory_size
        assert kv.get_pool_stats(Placement.HOST) is None
        cache = await kv.allocate_cache(desc())
        blocks = await kv.allocate_blocks_cache(desc())
        used = kv.get_pool_stats(Placement.DEVICE)
        assert used is not None and used.used >= 2 * 2 * desc().size
        await kv.deallocate_cache(cache)
        await kv.deallocate_blocks_cache(blocks)
        after = kv.get_pool_stats(Placement.DEVICE)
        assert after is not None and after.used == 0
        # no host pool was asked for: that still refuses
        await raises(CODE.LLM_FEATURE_NOT_ENABLED, kv.allocate_cache(desc(Placement.HOST)))


async def test_given_pool_wins_and_cache_manager_mode_reserves_none() -> None:
    small = '{"memory_size": 65536, "page_shift": 12}'
    async with LLMDataDist(LLMRole.PROMPT, 1, config(mem_pool_cfg=small)) as p:
        stats = p.kv_cache_manager.get_pool_stats(Placement.DEVICE)
        assert stats is not None and stats.total == 65536
    async with LLMDataDist(LLMRole.PROMPT, 2, config(enable_cache_manager=True)) as c:
        cm = c.cache_manager
        assert cm.get_pool_stats(Placement.DEVICE) is None
        await raises(CODE.LLM_FEATURE_NOT_ENABLED, cm.allocate_cache(desc()))


async def test_per_device_tensor_addrs_and_get_cache_tensors() -> None:
    d = LLMDataDist(LLMRole.DECODER, 1, config())
    await d.init(config())
    kv = d.kv_cache_manager
    assert kv.is_initialized()
    cache = await kv.allocate_cache(desc())
    assert cache.per_device_tensor_addrs == [cache.tensor_addrs]
    assert len(cache.per_device_tensor_addrs[0]) == 2
    got = kv.get_cache_tensors(cache, 1)
    assert isinstance(got, list) and len(got) == 1  # one device
    assert got[0].data_ptr() == cache.tensor_addrs[1]
    got[0].fill_(3.0)  # the same memory, no copy
    assert bool((cache.tensors[1] == 3.0).all())
    assert kv.get_cache_tensors(cache)[0].data_ptr() == cache.tensor_addrs[0]
    before = dataclasses.asdict(kv.statistics())
    for bad, exc in [(2, LLMException), (-1, LLMException), ("0", TypeError), (None, TypeError)]:
        with pytest.raises(exc) as ei:
            kv.get_cache_tensors(cache, bad)  # type: ignore[arg-type]
        if exc is LLMException:
            assert ei.value.status_code == CODE.LLM_PARAM_INVALID  # type: ignore[attr-defined]
    assert dataclasses.asdict(kv.statistics()) == before
    await kv.deallocate_cache(cache)
    with pytest.raises(LLMException) as ei:
        kv.get_cache_tensors(cache)
    assert ei.value.status_code == CODE.LLM_KV_CACHE_NOT_EXIST
    await d.finalize()
    assert not kv.is_initialized()


async def test_kv_cache_create_cpu_cache_per_device_form() -> None:
    host = desc(Placement.HOST)
    mem = [torch.arange(4 * 128, dtype=torch.float16).view(4, 128) for _ in range(2)]
    addrs = [t.data_ptr() for t in mem]
    flat = KvCache.create_cpu_cache(host, addrs)
    nested = KvCache.create_cpu_cache(host, [addrs])  # llm_datadist's per-device form
    today = KvCache.create_cpu_cache(host, tensors_or_addrs=mem)  # today's keyword
    for c in (flat, nested, today):
        assert c.per_device_tensor_addrs == [addrs]
        assert torch.equal(c.tensors[1], mem[1])
    with pytest.raises(LLMException) as ei:
        KvCache.create_cpu_cache(host, [addrs, addrs])  # two devices
    assert ei.value.status_code == CODE.LLM_PARAM_INVALID


def test_blocking_legacy_manager() -> None:
    with llm_datadist.LLMDataDist(LLMRole.DECODER, 1, config()) as d:
        kv = d.kv_cache_manager
        assert kv.is_initialized()
        npu = kv.allocate_blocks_cache(desc())
        host_mem = [torch.rand(4, 128).to(torch.float16) for _ in range(2)]
        cpu = llm_datadist.KvCache.create_cpu_cache(
            desc(Placement.HOST), [[t.data_ptr() for t in host_mem]]
        )
        kv.swap_blocks(src=cpu, dst=npu, src_to_dst={1: 2})  # the legacy keywords
        t = kv.get_cache_tensors(npu, 0)[0]
        assert torch.equal(t[2], host_mem[0][1])
        kv.swap_blocks(npu, cpu, {2: 0})
        assert torch.equal(host_mem[1][0], host_mem[1][1])
        kv.deallocate_blocks_cache(npu)
    assert not kv.is_initialized()
