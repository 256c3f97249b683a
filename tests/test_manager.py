"""CacheManager local operations: allocation, refcounts, copies, swaps, and the error contract."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from _helpers import fill_randn
from _helpers import held_at
from _helpers import not_listening
from _helpers import snapshot

from aiokv import BlocksCacheKey
from aiokv import Cache
from aiokv import CacheDesc
from aiokv import CacheKey
from aiokv import CacheManager
from aiokv import DataType
from aiokv import KvCache
from aiokv import LLMConfig
from aiokv import LLMDataDist
from aiokv import LLMException
from aiokv import LLMRole
from aiokv import LLMStatusCode
from aiokv import NoneArgumentError
from aiokv import Placement
from aiokv._copy import _scheduler
from aiokv._registry import RegistryStats

POOL = 64 << 20
CODE = LLMStatusCode


def config(**kw: Any) -> LLMConfig:
    """Not listening, over TCP, a device and a host pool of ``POOL`` bytes."""
    return not_listening(**({"pool": POOL, "host_pool": POOL, "sync_kv_timeout": 1000} | kw))


@pytest.fixture
async def dd() -> AsyncIterator[LLMDataDist]:
    async with LLMDataDist(LLMRole.MIX, 1, config()) as d:
        yield d


@pytest.fixture
def cm(dd: LLMDataDist) -> CacheManager:
    return dd.cache_manager


def blocks_desc(placement: Placement, nblocks: int = 16, ntensors: int = 4) -> CacheDesc:
    return CacheDesc(ntensors, [nblocks, 8, 2, 16], DataType.DT_BF16, placement)


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(
        torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b, strict=True)
    )


def used(cm: CacheManager) -> tuple[int, int]:
    d, h = cm.get_pool_stats(Placement.DEVICE), cm.get_pool_stats(Placement.HOST)
    assert d is not None and h is not None
    return d.used, h.used


def stats(cm: CacheManager) -> dict[str, int]:
    """``cm.statistics()`` as a dict, to compare whole snapshots."""
    return dataclasses.asdict(cm.statistics())


NOTHING = dict.fromkeys((f.name for f in dataclasses.fields(RegistryStats)), 0)


# ---- lifecycle -----------------------------------------------------------------------------
async def test_lifecycle_and_modes() -> None:
    d = LLMDataDist(LLMRole.PROMPT, 7)
    with pytest.raises(RuntimeError, match="not initialized"):
        _ = d.cache_manager
    await d.init(config().generate_options())  # the dict form works too
    assert d.initialized and d.cache_manager.device.type == "cpu"
    with pytest.raises(LLMException) as ei:
        _ = d.kv_cache_manager
    assert ei.value.status_code == CODE.LLM_PARAM_INVALID  # the wrong manager
    await d.init(config())  # a second init is a no-op, as in llm_datadist
    assert d.initialized
    await d.finalize()
    await d.finalize()  # idempotent
    with pytest.raises(RuntimeError):
        _ = d.cache_manager
    with pytest.raises(TypeError):
        LLMDataDist(1, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        LLMDataDist(LLMRole.MIX, -1)


async def test_legacy_mode_role_gates() -> None:
    async with LLMDataDist(LLMRole.DECODER, 2, config(enable_cache_manager=False)) as d:
        kv = d.kv_cache_manager
        with pytest.raises(LLMException) as ei:
            await kv.remove_cache_key(CacheKey(2, 1))
        assert ei.value.status_code == CODE.LLM_FEATURE_NOT_ENABLED
        with pytest.raises(LLMException):
            _ = d.cache_manager
        cache = await kv.allocate_cache(CacheDesc(1, [2, 64], DataType.DT_FLOAT16))
        await kv.deallocate_cache(cache)
    async with LLMDataDist(LLMRole.PROMPT, 3, config(enable_cache_manager=False)) as p:
        await p.kv_cache_manager.remove_cache_key(CacheKey(3, 1))  # allowed for PROMPT


async def test_several_instances_in_one_process() -> None:
    async with (
        LLMDataDist(LLMRole.PROMPT, 1, config()) as a,
        LLMDataDist(LLMRole.DECODER, 2, config()) as b,
    ):
        ca = await a.cache_manager.allocate_cache(CacheDesc(1, [1, 1024], DataType.DT_UINT8))
        assert used(a.cache_manager)[0] > 0 and used(b.cache_manager) == (0, 0)
        with pytest.raises(LLMException) as ei:
            await b.cache_manager.deallocate_cache(ca)  # not b's cache
        assert ei.value.status_code == CODE.LLM_PARAM_INVALID


async def test_threads_joined_after_finalize() -> None:

    before = set(threading.enumerate())
    async with LLMDataDist(LLMRole.MIX, 9, config()) as d:
        src = await d.cache_manager.allocate_blocks_cache(blocks_desc(Placement.DEVICE))
        dst = await d.cache_manager.allocate_blocks_cache(blocks_desc(Placement.HOST))
        await d.cache_manager.swap_blocks(src, dst, {0: 1, 1: 2})
    assert set(threading.enumerate()) <= before


# ---- allocation and refcounts ---------------------------------------------------------------
async def test_allocate_cache_shapes_and_addresses(cm: CacheManager) -> None:
    desc = CacheDesc(3, [2, 100], DataType.DT_FLOAT16)
    cache = await cm.allocate_cache(desc)
    assert isinstance(cache, KvCache) and not cache.is_blocks_cache
    assert cache.placement == Placement.DEVICE and len(cache.tensors) == 3
    assert all(t.shape == (2, 100) and t.dtype == torch.float16 for t in cache.tensors)
    assert cache.tensor_addrs == [t.data_ptr() for t in cache.tensors]
    assert len(set(cache.tensor_addrs)) == 3
    assert used(cm)[0] == 3 * 4096  # 400 bytes rounded up to a 4 KiB page each
    await cm.deallocate_cache(cache)
    assert used(cm) == (0, 0)
    await cm.deallocate_cache(cache)  # already released: no-op


async def test_memory_returns_when_last_reference_goes(cm: CacheManager) -> None:
    k1, k2 = CacheKey(1, req_id=1), CacheKey(1, req_id=2)
    cache = await cm.allocate_cache(CacheDesc(1, [2, 4096], DataType.DT_UINT8), [k1, k2])
    await cm.deallocate_cache(cache)
    assert used(cm)[0] == 8192  # both keys still reference it
    await cm.remove_cache_key(k1)
    assert used(cm)[0] == 8192
    await cm.remove_cache_key(k1)  # already removed: no-op
    await cm.remove_cache_key(k2)
    assert used(cm) == (0, 0)
    # keys first, then the id
    c2 = await cm.allocate_cache(CacheDesc(1, [1, 4096], DataType.DT_UINT8), [k1])
    await cm.remove_cache_key(k1)
    assert used(cm)[0] == 4096
    await cm.deallocate_cache(c2)
    assert used(cm) == (0, 0)


async def test_placeholder_and_duplicate_keys(cm: CacheManager) -> None:
    # which slot a duplicate binds: tests/test_registry.py
    hold = CacheKey(1, req_id=2**64 - 1)
    k = CacheKey(1, req_id=5)
    cache = await cm.allocate_cache(CacheDesc(1, [3, 4096], DataType.DT_UINT8), [hold, k, k])
    assert cm.statistics().keys == 1  # the placeholder binds nothing; k binds once
    await cm.remove_cache_key(hold)  # never bound: a no-op
    assert cm.statistics().keys == 1
    await cm.deallocate_cache(cache)
    assert used(cm)[0] == 3 * 4096  # k still holds it
    await cm.remove_cache_key(k)
    assert used(cm) == (0, 0) and cm.statistics().keys == 0


async def test_statistics_track_public_operations(cm: CacheManager) -> None:
    want = dict(NOTHING)

    def expect(**delta: int) -> None:
        for name, d in delta.items():
            want[name] += d
        assert stats(cm) == want

    k1, k2, k3 = (CacheKey(1, req_id=i) for i in (1, 2, 3))
    a = await cm.allocate_cache(CacheDesc(1, [2, 64], DataType.DT_UINT8), [k1, k2])
    expect(caches=1, allocated=1, keys=2)
    b = await cm.allocate_blocks_cache(blocks_desc(Placement.HOST), BlocksCacheKey(1, 0))
    expect(caches=1, allocated=1, blocks_keys=1)
    desc = CacheDesc(1, [2, 64], DataType.DT_UINT8)
    u = await cm.register_cache(desc, [torch.zeros(2, 64, dtype=torch.uint8)], [k3])
    expect(caches=1, registered=1, keys=1)
    await cm.deallocate_cache(a)  # its keys keep it
    expect(released=1)
    await cm.remove_cache_key(k1)
    expect(keys=-1)
    await cm.remove_cache_key(k1)  # no-op
    expect()
    await cm.remove_cache_key(k2)  # the last reference
    expect(caches=-1, allocated=-1, released=-1, keys=-1)
    await cm.deallocate_blocks_cache(b)
    expect(caches=-1, allocated=-1, blocks_keys=-1)
    await cm.unregister_cache(u.cache_id)
    expect(caches=-1, registered=-1, keys=-1)
    assert want == NOTHING and used(cm) == (0, 0)


async def test_allocation_failures_change_nothing(cm: CacheManager) -> None:
    big = await cm.allocate_cache(CacheDesc(1, [POOL - 8192], DataType.DT_UINT8))
    before = used(cm)
    with pytest.raises(LLMException) as ei:
        await cm.allocate_cache(CacheDesc(3, [4096], DataType.DT_UINT8))  # 2 fit, the 3rd not
    assert ei.value.status_code == CODE.LLM_OUT_OF_MEMORY
    assert used(cm) == before
    with pytest.raises(LLMException) as ei:
        await cm.allocate_cache(
            CacheDesc(1, [2, 8], DataType.DT_UINT8), [CacheKey(1, i) for i in range(3)]
        )
    assert ei.value.status_code == CODE.LLM_PARAM_INVALID
    assert used(cm) == before
    await cm.deallocate_cache(big)
    async with LLMDataDist(LLMRole.MIX, 5, config(mem_pool_cfg=None)) as d:
        with pytest.raises(LLMException) as ei:
            await d.cache_manager.allocate_blocks_cache(blocks_desc(Placement.DEVICE))
        assert ei.value.status_code == CODE.LLM_FEATURE_NOT_ENABLED
        assert d.cache_manager.get_pool_stats(Placement.DEVICE) is None


async def test_deallocate_defers_while_pinned(cm: CacheManager) -> None:
    src = await cm.allocate_blocks_cache(blocks_desc(Placement.DEVICE))
    dst = await cm.allocate_blocks_cache(blocks_desc(Placement.HOST))
    fill_randn(src, 1)
    held = used(cm)
    task = asyncio.create_task(cm.swap_blocks(src, dst, {i: i for i in range(16)}))
    for _ in range(100):  # until the swap has started and pinned both caches
        if cm.statistics().pins:
            break
        await asyncio.sleep(0)
    assert cm.statistics().pins == 2
    # deallocate does not yield: the swap cannot finish (and unpin) between these lines
    await cm.deallocate_blocks_cache(src)
    await cm.deallocate_blocks_cache(dst)
    s = cm.statistics()
    assert (s.caches, s.released, s.pins) == (2, 2, 2)
    assert used(cm) == held  # the in-flight swap still uses both
    assert len(src.tensors) == len(dst.tensors) == 4  # their memory is still in use
    await task
    assert stats(cm) == NOTHING
    assert used(cm) == (0, 0)
    assert src.tensors == dst.tensors == [] and src.tensor_addrs == []  # back in the pools


async def test_a_released_cache_no_longer_reaches_pool_memory(cm: CacheManager) -> None:
    """The memory of a released cache goes to the next allocation: the released
    ``Cache`` no longer hands out views of it (llm_datadist empties its addresses)."""
    a = await cm.allocate_blocks_cache(blocks_desc(Placement.DEVICE))
    addrs = a.tensor_addrs
    await cm.deallocate_blocks_cache(a)
    assert a.tensors == [] and a.tensor_addrs == [] and a.per_device_tensor_addrs == [[]]
    b = await cm.allocate_blocks_cache(blocks_desc(Placement.DEVICE))
    assert b.tensor_addrs == addrs  # the same memory, now b's
    with pytest.raises(LLMException) as ei:
        await cm.copy_blocks(a, {0: [1]})
    assert ei.value.status_code == CODE.LLM_KV_CACHE_NOT_EXIST
    await cm.deallocate_blocks_cache(a)  # a no-op, as before
    assert len(b.tensors) == 4
    await cm.deallocate_blocks_cache(b)


# ---- user memory ------------------------------------------------------------------------------
async def test_create_cpu_cache_wraps_without_copy() -> None:
    desc = blocks_desc(Placement.HOST, 4, 2)
    ts = [torch.zeros(desc.shape, dtype=torch.bfloat16) for _ in range(2)]
    c1 = Cache.create_cpu_cache(desc, ts)
    c2 = Cache.create_cpu_cache(desc, [t.data_ptr() for t in ts])
    ts[1][2].fill_(3.0)
    assert bool((c1.tensors[1][2] == 3.0).all()) and bool((c2.tensors[1][2] == 3.0).all())
    assert c2.tensor_addrs == [t.data_ptr() for t in ts]
    with pytest.raises(LLMException):
        Cache.create_cpu_cache(blocks_desc(Placement.DEVICE, 4, 2), ts)
    with pytest.raises(LLMException):
        Cache.create_cpu_cache(desc, ts[:1])
    with pytest.raises(LLMException):
        Cache.create_cpu_cache(desc, [t.float() for t in ts])
    with pytest.raises(NoneArgumentError):
        Cache.create_cpu_cache(desc, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Cache.create_cpu_cache(desc, ["a", "b"])  # type: ignore[list-item]


async def test_register_and_unregister(cm: CacheManager, caplog: pytest.LogCaptureFixture) -> None:
    desc = blocks_desc(Placement.DEVICE, 4, 2)
    ts = [torch.zeros(desc.shape, dtype=torch.bfloat16) for _ in range(2)]
    key = BlocksCacheKey(1, 0)
    a = await cm.register_blocks_cache(desc, ts, key)
    assert a.tensor_addrs == [t.data_ptr() for t in ts] and used(cm) == (0, 0)
    ts2 = [torch.zeros(desc.shape, dtype=torch.bfloat16) for _ in range(2)]
    with caplog.at_level(logging.WARNING, logger="aiokv"):
        b = await cm.register_blocks_cache(desc, ts2, key)
    assert "now cache" in caplog.text
    s = cm.statistics()
    assert (s.registered, s.allocated, s.blocks_keys) == (2, 0, 1)  # the key moved to b
    await cm.unregister_cache(b.cache_id)
    s = cm.statistics()
    assert (s.registered, s.blocks_keys) == (1, 0)  # b held the key: it went with b
    await cm.unregister_cache(b.cache_id)  # no-op
    assert cm.statistics() == s
    c = await cm.register_cache(
        CacheDesc(1, [2, 8], DataType.DT_FLOAT), [torch.ones(2, 8)], [CacheKey(1, 9)]
    )
    assert cm.statistics().keys == 1
    await cm.unregister_cache(c.cache_id)
    s = cm.statistics()
    assert (s.registered, s.keys, s.released) == (1, 0, 0)  # user memory: keys die with it
    pool_cache = await cm.allocate_cache(CacheDesc(1, [8], DataType.DT_UINT8))
    with pytest.raises(LLMException):
        await cm.unregister_cache(pool_cache.cache_id)
    with pytest.raises(LLMException):
        await cm.deallocate_cache(a)  # registered memory is unregistered, not deallocated
    await cm.unregister_cache(a.cache_id)
    assert cm.statistics().registered == 0


# ---- copies ------------------------------------------------------------------------------------
async def test_copy_blocks_one_to_many(cm: CacheManager) -> None:
    c = await cm.allocate_blocks_cache(blocks_desc(Placement.DEVICE, 32))
    fill_randn(c)
    before = snapshot(c)
    await cm.copy_blocks(c, {1: [2, 3], 5: [20, 21, 22], 6: [23]})
    for i, t in enumerate(c.tensors):
        ref = before[i].clone()
        for s, ds in {1: [2, 3], 5: [20, 21, 22], 6: [23]}.items():
            for d in ds:
                ref[d] = before[i][s]
        assert torch.equal(t, ref)


@pytest.mark.parametrize(
    "info",
    [{1: [255]}, {1: [255, 254]}, {0: [128]}, {3: [4]}, {10: list(range(200, 240)), 2: [0, 1]}],
)
async def test_copy_blocks_patterns_within_one_tensor(
    cm: CacheManager, info: dict[int, list[int]]
) -> None:
    # regression: copies inside one tensor must not hand torch an aliasing out=/source view
    c = await cm.allocate_blocks_cache(CacheDesc(2, [256, 1024], DataType.DT_UINT8))
    for i, t in enumerate(c.tensors):
        t.copy_(torch.randint(0, 255, t.shape, generator=torch.Generator().manual_seed(i)))
    before = snapshot(c)
    await cm.copy_blocks(c, info)
    for i, t in enumerate(c.tensors):
        ref = before[i].clone()
        for s, ds in info.items():
            ref[ds] = before[i][s]
        assert torch.equal(t, ref)


async def test_copy_kv_blocks_all_directions(cm: CacheManager) -> None:
    dev = await cm.allocate_blocks_cache(blocks_desc(Placement.DEVICE, 32))
    dev2 = await cm.allocate_blocks_cache(blocks_desc(Placement.DEVICE, 32))
    host = await cm.allocate_blocks_cache(blocks_desc(Placement.HOST, 32))
    for i, c in enumerate((dev, dev2, host)):
        fill_randn(c, i)
    for src, dst in [(dev, dev2), (dev, host), (host, dev2)]:
        before_src, before_dst = snapshot(src), snapshot(dst)
        srcs, lists = [1, 2, 3, 9], [[4, 5, 6, 7], [30, 12, 11, 0]]
        await cm.copy_kv_blocks(src, dst, srcs, lists)
        for i, t in enumerate(dst.tensors):
            ref = before_dst[i].clone()
            for lst in lists:
                for s, d in zip(srcs, lst, strict=True):
                    ref[d] = before_src[i][s]
            assert torch.equal(t, ref)
    with pytest.raises(LLMException) as ei:
        await cm.copy_kv_blocks(host, host, [1], [[2]])
    assert ei.value.status_code == CODE.LLM_PARAM_INVALID


async def test_local_copies_take_block_arrays(cm: CacheManager) -> None:
    """copy_blocks and copy_kv_blocks take 1-D integer arrays where they take lists."""
    dev = await cm.allocate_blocks_cache(blocks_desc(Placement.DEVICE, 32))
    host = await cm.allocate_blocks_cache(blocks_desc(Placement.HOST, 32))
    fill_randn(dev, 1)
    before = snapshot(dev)
    await cm.copy_blocks(dev, {1: np.array([2, 3], dtype=np.int32)})
    for i, t in enumerate(dev.tensors):
        assert torch.equal(t[2], before[i][1]) and torch.equal(t[3], before[i][1])
    srcs = np.array([4, 5, 6], dtype=np.uint8)
    await cm.copy_kv_blocks(dev, host, srcs, [np.array([30, 31, 0])])
    for td, ts in zip(host.tensors, dev.tensors, strict=True):
        assert torch.equal(td[[30, 31, 0]], ts[[4, 5, 6]])
    with pytest.raises(TypeError):
        await cm.copy_blocks(dev, {1: np.array([2.0])})


async def test_swap_in_and_out_coalesced_and_random(cm: CacheManager) -> None:
    dev = await cm.allocate_blocks_cache(blocks_desc(Placement.DEVICE, 64))
    host = await cm.allocate_blocks_cache(blocks_desc(Placement.HOST, 64))
    fill_randn(dev, 1)
    fill_randn(host, 2)
    g = torch.Generator().manual_seed(3)
    perm = torch.randperm(64, generator=g).tolist()
    mapping = {i: 10 + i for i in range(20)}  # one contiguous run
    mapping.update({20 + i: perm[i] for i in range(10) if perm[i] < 10})  # plus random pairs
    for src, dst in [(dev, host), (host, dev)]:
        bs, bd = snapshot(src), snapshot(dst)
        await cm.swap_blocks(src, dst, mapping)
        for i, t in enumerate(dst.tensors):
            ref = bd[i].clone()
            for s, d in mapping.items():
                ref[d] = bs[i][s]
            assert torch.equal(t, ref)
        assert same(snapshot(src), bs)


async def test_swap_with_user_cpu_cache(cm: CacheManager) -> None:
    dev = await cm.allocate_blocks_cache(blocks_desc(Placement.DEVICE, 8, 2))
    fill_randn(dev, 4)
    ts = [torch.zeros((8, 8, 2, 16), dtype=torch.bfloat16) for _ in range(2)]
    cpu = Cache.create_cpu_cache(blocks_desc(Placement.HOST, 8, 2), [t.data_ptr() for t in ts])
    await cm.swap_blocks(dev, cpu, {1: 2, 3: 4})
    assert torch.equal(ts[0][2], dev.tensors[0][1]) and torch.equal(ts[1][4], dev.tensors[1][3])
    assert not bool(ts[0][0].any())


async def test_copy_cache_slots_offset_size(cm: CacheManager) -> None:
    desc = CacheDesc(2, [4, 256], DataType.DT_FLOAT16)
    src = await cm.allocate_cache(desc)
    dst = await cm.allocate_cache(desc)
    fill_randn(src, 5)
    fill_randn(dst, 6)
    bd = snapshot(dst)
    await cm.copy_cache(dst, src, 0, 1)
    await cm.copy_cache(dst, src, 2, 3, offset=128, size=64)
    for i in range(2):
        assert torch.equal(dst.tensors[i][0], src.tensors[i][1])
        assert torch.equal(dst.tensors[i][1], bd[i][1])
        row = dst.tensors[i][2].view(torch.uint8)
        assert torch.equal(row[128:192], src.tensors[i][3].view(torch.uint8)[128:192])
        assert torch.equal(row[:128], bd[i][2].view(torch.uint8)[:128])
        assert torch.equal(row[192:], bd[i][2].view(torch.uint8)[192:])


async def test_copy_cache_along_another_batch_dimension(cm: CacheManager) -> None:
    # slots along dimension 1 (strided); dst with its batch first: shapes equal but for it
    src = await cm.allocate_cache(CacheDesc(2, [4, 3, 8], DataType.DT_FLOAT16, batch_dim_index=1))
    dst = await cm.allocate_cache(CacheDesc(2, [5, 4, 8], DataType.DT_FLOAT16))
    fill_randn(src, 7)
    fill_randn(dst, 8)
    bd = snapshot(dst)
    await cm.copy_cache(dst, src, 4, 2)
    for i in range(2):
        assert torch.equal(dst.tensors[i][4], src.tensors[i][:, 2])
        assert torch.equal(dst.tensors[i][:4], bd[i][:4])
    with pytest.raises(LLMException, match="offset/size need batch_dim_index 0") as ei:
        await cm.copy_cache(dst, src, 0, 1, offset=16)
    assert ei.value.status_code == CODE.LLM_PARAM_INVALID
    assert torch.equal(dst.tensors[0][0], bd[0][0])


# ---- the error contract -----------------------------------------------------------------------
async def test_error_contract_changes_nothing(cm: CacheManager) -> None:
    dev = await cm.allocate_blocks_cache(blocks_desc(Placement.DEVICE, 16))
    host = await cm.allocate_blocks_cache(blocks_desc(Placement.HOST, 16))
    other = await cm.allocate_blocks_cache(
        CacheDesc(4, [16, 4, 2, 16], DataType.DT_BF16, Placement.HOST)
    )
    three = await cm.allocate_blocks_cache(blocks_desc(Placement.HOST, 16, 3))
    contig = await cm.allocate_cache(CacheDesc(4, [2, 1024], DataType.DT_BF16))
    contig2 = await cm.allocate_cache(CacheDesc(4, [2, 512], DataType.DT_BF16))
    for c in (dev, host, other, three, contig, contig2):
        fill_randn(c, c.cache_id)
    bytes_before = snapshot(dev, host, other, three, contig, contig2)
    pools_before = used(cm)
    P = LLMException
    cases: list[tuple[Callable[[], Any], type[BaseException], LLMStatusCode | None]] = [
        (lambda: cm.swap_blocks(None, host, {0: 1}), NoneArgumentError, None),  # type: ignore[arg-type]
        (lambda: cm.swap_blocks(dev, None, {0: 1}), AttributeError, None),  # type: ignore[arg-type]
        (lambda: cm.swap_blocks(dev, host, None), TypeError, None),  # type: ignore[arg-type]
        (lambda: cm.swap_blocks(dev, host, [(0, 1)]), TypeError, None),  # type: ignore[arg-type]
        (lambda: cm.swap_blocks(dev, host, {"0": 1}), TypeError, None),  # type: ignore[dict-item]
        (lambda: cm.swap_blocks(dev, host, {-1: 1}), P, CODE.LLM_PARAM_INVALID),
        (lambda: cm.swap_blocks(dev, host, {0: 16}), P, CODE.LLM_PARAM_INVALID),
        (lambda: cm.swap_blocks(dev, host, {0: 1, 2: 1}), P, CODE.LLM_PARAM_INVALID),
        (lambda: cm.swap_blocks(host, other, {0: 1}), P, CODE.LLM_PARAM_INVALID),
        (lambda: cm.swap_blocks(dev, other, {0: 1}), P, CODE.LLM_PARAM_INVALID),
        (lambda: cm.swap_blocks(dev, three, {0: 1}), P, CODE.LLM_PARAM_INVALID),
        (lambda: cm.swap_blocks(dev, contig, {0: 1}), P, CODE.LLM_PARAM_INVALID),
        (lambda: cm.copy_blocks(dev, {0: [16]}), P, CODE.LLM_PARAM_INVALID),
        (lambda: cm.copy_blocks(dev, {0: [1], 1: [2]}), P, CODE.LLM_PARAM_INVALID),
        (lambda: cm.copy_blocks(dev, {0: [1, 1]}), P, CODE.LLM_PARAM_INVALID),
        (lambda: cm.copy_blocks(dev, {0: 1}), TypeError, None),  # type: ignore[dict-item]
        (lambda: cm.copy_blocks(dev, {True: [1]}), TypeError, None),
        (lambda: cm.copy_kv_blocks(dev, host, [0, 1], [[2]]), P, CODE.LLM_PARAM_INVALID),
        (lambda: cm.copy_kv_blocks(dev, host, [0], [[2], [2]]), P, CODE.LLM_PARAM_INVALID),
        (lambda: cm.copy_kv_blocks(dev, dev, [0], [[0]]), P, CODE.LLM_PARAM_INVALID),
        (lambda: cm.copy_kv_blocks(dev, host, [0], [[99]]), P, CODE.LLM_PARAM_INVALID),
        (lambda: cm.copy_kv_blocks(dev, host, [0], None), NoneArgumentError, None),  # type: ignore[arg-type]
        (lambda: cm.copy_kv_blocks(dev, host, (0.5,), [[1]]), TypeError, None),  # type: ignore[arg-type]
        (lambda: cm.copy_cache(contig, contig2), P, CODE.LLM_PARAM_INVALID),
        (lambda: cm.copy_cache(contig, contig, 2, 0), P, CODE.LLM_PARAM_INVALID),
        (lambda: cm.copy_cache(contig, contig, 0, 1, offset=2048), P, CODE.LLM_PARAM_INVALID),
        (
            lambda: cm.copy_cache(contig, contig, 0, 1, offset=1024, size=1025),
            P,
            CODE.LLM_PARAM_INVALID,
        ),
        (lambda: cm.copy_cache(contig, contig, 0, 1, size=-2), ValueError, None),
        (lambda: cm.copy_cache(contig, contig, "0", 1), TypeError, None),  # type: ignore[arg-type]
        (lambda: cm.copy_cache(contig, None), NoneArgumentError, None),  # type: ignore[arg-type]
        (lambda: cm.allocate_cache(None), NoneArgumentError, None),  # type: ignore[arg-type]
        (lambda: cm.allocate_cache("desc"), TypeError, None),  # type: ignore[arg-type]
        (lambda: cm.allocate_cache(blocks_desc(Placement.DEVICE), [1]), TypeError, None),  # type: ignore[list-item]
        (
            lambda: cm.allocate_blocks_cache(blocks_desc(Placement.DEVICE), CacheKey(1, 1)),
            TypeError,
            None,
        ),  # type: ignore[arg-type]
        (lambda: cm.remove_cache_key(None), NoneArgumentError, None),  # type: ignore[arg-type]
        (lambda: cm.remove_cache_key(BlocksCacheKey(1)), TypeError, None),  # type: ignore[arg-type]
        (lambda: cm.deallocate_cache(None), NoneArgumentError, None),  # type: ignore[arg-type]
        (lambda: cm.deallocate_cache(dev), P, CODE.LLM_PARAM_INVALID),  # a blocks cache
        (lambda: cm.unregister_cache(-1), ValueError, None),
        (lambda: cm.unregister_cache("1"), TypeError, None),  # type: ignore[arg-type]
    ]
    for i, (call, exc, code) in enumerate(cases):
        with pytest.raises(exc) as ei:
            await call()
        if code is not None:
            assert isinstance(ei.value, LLMException) and ei.value.status_code == code, i
        assert used(cm) == pools_before, f"case {i} changed pool usage"
    assert same(snapshot(dev, host, other, three, contig, contig2), bytes_before)


async def test_released_cache_is_rejected(cm: CacheManager) -> None:
    dev = await cm.allocate_blocks_cache(blocks_desc(Placement.DEVICE, 4))
    host = await cm.allocate_blocks_cache(blocks_desc(Placement.HOST, 4))
    await cm.deallocate_blocks_cache(dev)
    with pytest.raises(LLMException) as ei:
        await cm.swap_blocks(dev, host, {0: 1})
    assert ei.value.status_code == CODE.LLM_KV_CACHE_NOT_EXIST


# ---- cancellation -----------------------------------------------------------------------------
async def test_cancel_large_swap_in_flight_keeps_everything_consistent() -> None:
    cfg = config(
        mem_pool_cfg=f'{{"memory_size": {512 << 20}, "page_shift": 16}}',
        host_mem_pool_cfg=f'{{"memory_size": {512 << 20}, "page_shift": 16}}',
    )
    async with LLMDataDist(LLMRole.MIX, 1, cfg) as d:
        cm = d.cache_manager
        desc_d = CacheDesc(4, [1024, 64 << 10], DataType.DT_UINT8, Placement.DEVICE)
        desc_h = CacheDesc(4, [1024, 64 << 10], DataType.DT_UINT8, Placement.HOST)
        dev = await cm.allocate_blocks_cache(desc_d)
        host = await cm.allocate_blocks_cache(desc_h)
        # 256 MiB of test setup and checks run off the loop: the loop-blocking guard is on
        await asyncio.to_thread(lambda: [t.fill_(7) for t in dev.tensors])
        mapping = {i: 1023 - i for i in range(1024)}
        task = asyncio.create_task(cm.swap_blocks(dev, host, mapping))
        await asyncio.sleep(0)  # let it start
        task.cancel()
        try:
            await task
            returned = True
        except asyncio.CancelledError:
            returned = False
        # raised or returned, never both: a raised cancellation means the copy never
        # ran; a return, that it ran to its end
        sums = await asyncio.to_thread(lambda: {int(t.sum()) for t in host.tensors})
        assert sums == ({7 * (64 << 20)} if returned else {0})
        assert stats(cm) == NOTHING | {"caches": 2, "allocated": 2}  # no pin left behind
        await cm.deallocate_blocks_cache(host)
        await cm.deallocate_blocks_cache(dev)
        assert used(cm) == (0, 0)
        # and the manager keeps working
        a = await cm.allocate_blocks_cache(blocks_desc(Placement.DEVICE, 8))
        b = await cm.allocate_blocks_cache(blocks_desc(Placement.HOST, 8))
        fill_randn(a, 8)
        await cm.swap_blocks(a, b, {0: 0})
        assert torch.equal(a.tensors[0][0], b.tensors[0][0])


async def test_a_second_unregister_of_memory_in_use_waits_like_the_first(
    cm: CacheManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``unregister_cache`` returns once no copy touches the memory: a second call for
    the same cache while the first still waits for a copy waits too (it returned at
    once: its caller could free memory a worker still wrote)."""
    started, gate = held_at(monkeypatch, _scheduler, "copy_many_job", 10)
    desc = CacheDesc(1, [1, 1 << 20], DataType.DT_UINT8, Placement.HOST)
    src = await cm.register_cache(desc, [torch.full((1, 1 << 20), 7, dtype=torch.uint8)])
    dst_memory = torch.zeros(1, 1 << 20, dtype=torch.uint8)
    dst = await cm.register_cache(desc, [dst_memory])
    copy = asyncio.create_task(cm.copy_cache(dst, src))
    try:
        assert await asyncio.to_thread(started.wait, 10)  # the worker is on it
        first = asyncio.create_task(cm.unregister_cache(dst.cache_id))
        second = asyncio.create_task(cm.unregister_cache(dst.cache_id))
        await asyncio.sleep(0.1)
        assert not first.done() and not second.done()
    finally:
        gate.set()
    await asyncio.wait_for(asyncio.gather(copy, first, second), 10)
    assert bool((dst_memory == 7).all())  # the copy ended before either returned


async def test_a_failed_allocation_changes_no_pool_statistic(cm: CacheManager) -> None:
    """A cache whose first tensors fit in the pool and whose last does not fails with
    ``LLM_OUT_OF_MEMORY`` and leaves the pool as it was: ``peak_used`` too (the
    rolled-back tensors showed as the peak though never handed out)."""
    before = cm.get_pool_stats(Placement.DEVICE)
    assert before is not None and before.peak_used == 0
    desc = CacheDesc(4, [POOL // 3], DataType.DT_UINT8, Placement.DEVICE)  # 2 of 4 fit
    with pytest.raises(LLMException) as info:
        await cm.allocate_cache(desc)
    assert info.value.status_code == CODE.LLM_OUT_OF_MEMORY
    after = cm.get_pool_stats(Placement.DEVICE)
    assert after is not None and after == before and after.peak_used == 0
    assert after.failed_allocations == before.failed_allocations + 1
