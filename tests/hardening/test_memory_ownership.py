"""Memory ownership: finalize releases the pools even while caches are held; registering
memory refuses a pool's memory and addresses not aligned to the dtype (found in review;
each test fails on the code before its fix)."""

from __future__ import annotations

import dataclasses
import gc
import weakref
from typing import Any

import pytest
import torch
from _helpers import not_listening

from aiokv import CacheDesc
from aiokv import CacheManager
from aiokv import DataType
from aiokv import LLMDataDist
from aiokv import LLMException
from aiokv import LLMRole
from aiokv import LLMStatusCode
from aiokv import Placement

POOL = 1 << 20


def config() -> Any:
    return not_listening(pool=POOL, host_pool=POOL)


def state(cm: CacheManager) -> tuple[Any, ...]:
    """Everything a failed call must leave as it was: pool usage and the bookkeeping."""
    return (
        cm.get_pool_stats(Placement.DEVICE),
        cm.get_pool_stats(Placement.HOST),
        dataclasses.asdict(cm.statistics()),
    )


async def test_finalize_releases_pools_while_caches_are_held() -> None:
    """``finalize`` releases the pools ("Caches handed out before become unusable"): a
    ``Cache`` object the user still holds (an engine's attribute, a list of caches) must
    not keep the whole pool region alive past ``finalize`` — a re-``init`` would reserve
    a second region next to it (on a GPU: out of device memory)."""
    dd = LLMDataDist(LLMRole.MIX, 1, config())
    await dd.init(config())
    cm = dd.cache_manager
    desc = CacheDesc(1, [2, 1024], DataType.DT_FLOAT16, Placement.HOST)
    kept = [
        await cm.allocate_cache(desc),
        await cm.allocate_blocks_cache(desc),
        await cm.allocate_cache(CacheDesc(1, [2, 1024], DataType.DT_FLOAT16)),  # device pool
    ]
    refs = [weakref.ref(p.region) for p in cm._pools.values() if p is not None]
    assert len(refs) == 2
    del cm
    await dd.finalize()
    gc.collect()
    assert all(c.tensors == [] and c.tensor_addrs == [] for c in kept)
    assert all(r() is None for r in refs), "a held Cache keeps its pool region alive"


async def test_register_refuses_pool_memory() -> None:
    """``register_*`` adopts memory the caller owns. Pool memory is aiokv's: registered
    as user memory it outlives ``deallocate_cache`` of the cache it belongs to, and the
    next allocation's bytes are then reachable (and overwritten) through it. Refused with
    ``LLM_PARAM_INVALID`` before anything changes, as tensors and as addresses."""
    async with LLMDataDist(LLMRole.MIX, 1, config()) as dd:
        cm = dd.cache_manager
        desc = CacheDesc(2, [4, 1024], DataType.DT_FLOAT16, Placement.HOST)
        pooled = await cm.allocate_cache(desc)
        part = CacheDesc(1, [8], DataType.DT_FLOAT16, Placement.HOST)
        inside = pooled.tensors[1].view(-1)[16:24]  # a slice well inside the pool
        before = state(cm)
        for memory, d in (
            (pooled.tensors, desc),
            (pooled.tensor_addrs, desc),
            ([inside], part),
            ([inside.data_ptr()], part),
        ):
            for register in (cm.register_cache, cm.register_blocks_cache):
                with pytest.raises(LLMException) as ei:
                    await register(d, memory)
                assert ei.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
                assert "pool" in str(ei.value)
                assert state(cm) == before
        # the device pool too (here on the CPU, like the host pool)
        dev = await cm.allocate_cache(CacheDesc(1, [4, 1024], DataType.DT_FLOAT16))
        before = state(cm)
        with pytest.raises(LLMException) as ei:
            await cm.register_cache(CacheDesc(1, [4, 1024], DataType.DT_FLOAT16), dev.tensors)
        assert ei.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        assert state(cm) == before
        # memory next to the pool, and the user's own memory, are still registered
        mine = torch.zeros(4, 1024, dtype=torch.float16)
        ok = await cm.register_cache(CacheDesc(1, [4, 1024], DataType.DT_FLOAT16), [mine])
        await cm.unregister_cache(ok.cache_id)


async def test_register_refuses_unaligned_addresses() -> None:
    """An address not aligned to the dtype's element size gives tensors no kernel may
    read (on CUDA: a sticky 'misaligned address' fault): ``register_*`` refuses it with
    ``LLM_PARAM_INVALID`` before anything changes."""
    async with LLMDataDist(LLMRole.MIX, 1, config()) as dd:
        cm = dd.cache_manager
        buf = torch.zeros(4096, dtype=torch.uint8)
        desc = CacheDesc(2, [4, 4], DataType.DT_FLOAT, Placement.HOST)
        before = state(cm)
        for register in (cm.register_cache, cm.register_blocks_cache):
            with pytest.raises(LLMException) as ei:
                await register(desc, [buf.data_ptr() + 64, buf.data_ptr() + 1026])
            assert ei.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
            assert "align" in str(ei.value)
            assert state(cm) == before
        # aligned ones, and any address for a 1-byte dtype, are fine
        ok = await cm.register_cache(desc, [buf.data_ptr() + 64, buf.data_ptr() + 1024])
        one = CacheDesc(1, [4], DataType.DT_UINT8, Placement.HOST)
        ok2 = await cm.register_cache(one, [buf.data_ptr() + 3001])
        await cm.unregister_cache(ok.cache_id)
        await cm.unregister_cache(ok2.cache_id)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
async def test_register_refuses_a_tensor_on_another_device_index() -> None:
    """An instance of ``cuda:0`` given ``cuda:1`` tensors: the type matched, so they
    were accepted, and every copy or transfer on that cache then crossed devices (or a
    kernel faulted). ``register_*`` refuses them, naming the device it expects."""
    cfg = not_listening(pool=POOL, host_pool=POOL, device_type="cuda", device_id=0)
    async with LLMDataDist(LLMRole.MIX, 1, cfg) as dd:
        cm = dd.cache_manager
        desc = CacheDesc(1, [4, 4], DataType.DT_FLOAT, Placement.DEVICE)
        other = torch.zeros(4, 4, device="cuda:1")
        before = state(cm)
        for register in (cm.register_cache, cm.register_blocks_cache):
            with pytest.raises(LLMException) as ei:
                await register(desc, [other])
            assert ei.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
            assert "cuda:0" in str(ei.value)
            assert state(cm) == before
        ok = await cm.register_cache(desc, [torch.zeros(4, 4, device="cuda:0")])
        await cm.unregister_cache(ok.cache_id)
