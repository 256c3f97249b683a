"""Grant lifetime and the serving side's limits (issue #9 items 1, 5, 6, 8, 9, 13, 15).

Real peers: a pushing peer in its own process (``grants_peer.py``), a raw-socket peer
that requests a pull and never reads; the rest in one process over the local transport
or straight against ``PeerService``. Everything binds 127.0.0.1, port 0, bounded in time.
"""

from __future__ import annotations

import asyncio
import inspect
import multiprocessing as mp
import socket
import time
from typing import Any

import grants_peer
import numpy as np
import pytest
import torch
from _helpers import raises
from _helpers import raw_link
from _helpers import until

from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import CacheKey
from aiokv import CacheKeyByIdAndIndex
from aiokv import DataType
from aiokv import LLMConfig
from aiokv import LLMDataDist
from aiokv import LLMException
from aiokv import LLMRole
from aiokv import LLMStatusCode
from aiokv import Placement
from aiokv._cache import Cache
from aiokv._pool import MemPool
from aiokv._pool import Span
from aiokv._registry import CacheRegistry
from aiokv._remote._protocol import AddrsReq
from aiokv._remote._protocol import BlocksReq
from aiokv._remote._protocol import KeyByBlocks
from aiokv._remote._protocol import KeyById
from aiokv._remote._protocol import KeyByReq
from aiokv._remote._protocol import SlotReq
from aiokv._remote._protocol import Tensors
from aiokv._remote._protocol import encode
from aiokv._remote._protocol import pack_blocks
from aiokv._remote._service import PeerService
from aiokv._remote._service import _LayoutMemo
from aiokv._remote._service import _Refused
from aiokv.testing import linked_pair
from aiokv.testing import make_config
from aiokv.transport import PeerInfo
from aiokv.transport import _wire as wire

CODE = LLMStatusCode
MIB = 1 << 20
NONE = 2**64 - 1
PEER = PeerInfo(2, ("127.0.0.1", 1))


def config(backend: str = "local", **kw: Any) -> LLMConfig:
    """8 MiB device and 4 MiB host pools; refuses pushes unless told otherwise."""
    options = {"enable_remote_cache_accessible": False, "sync_kv_timeout": 3000}
    return make_config(backend, pool=8 * MIB, host_pool=4 * MIB, **(options | kw))


# ---- 1: no write after unregister_cache -------------------------------------------------
async def test_no_write_after_unregister_of_memory_a_peer_process_pushes_into() -> None:
    n = 64 * MIB
    cfg = config("tcp", enable_remote_cache_accessible=True, sync_kv_timeout=10000)
    async with LLMDataDist(LLMRole.DECODER, 1, cfg) as owner:
        cm = owner.cache_manager
        buf = torch.zeros(1, n, dtype=torch.uint8)
        desc = CacheDesc(1, [1, n], DataType.DT_UINT8, Placement.HOST)
        cache = await cm.register_cache(desc, [buf], remote_accessible=True)
        assert owner.listen_address is not None
        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe()
        args = (child, owner.listen_address[1], cache.cache_id, n)
        proc = ctx.Process(target=grants_peer.serve, args=args, daemon=True)
        await asyncio.to_thread(proc.start)  # spawning blocks for a while
        try:
            assert await asyncio.to_thread(conn.poll, 60), "the peer did not start"
            assert conn.recv() == CODE.LLM_SUCCESS  # linked
            conn.send("push")
            for _ in range(40_000):  # unregister as the first bytes land
                if buf[0, 0]:
                    break
                await asyncio.sleep(0.0005)
            assert buf[0, 0] == 0xAB and buf[0, -1] == 0, "the push was not caught in flight"
            await cm.unregister_cache(cache.cache_id)
            buf.fill_(0x5A)  # the memory is the user's again
            assert await asyncio.to_thread(conn.poll, 20), "the push never ended"
            assert conn.recv() == CODE.LLM_KV_CACHE_NOT_EXIST  # not success
            await asyncio.sleep(0.2)
            assert bool((buf == 0x5A).all()), "bytes landed after unregister_cache returned"
            stats = cm.statistics()
            assert (stats.caches, stats.pins) == (0, 0)
            conn.send("stop")
        finally:
            await asyncio.to_thread(proc.join, 20)
            if proc.is_alive():
                proc.kill()
                proc.join()


async def test_unregister_refuses_new_work_and_cancels_layerwise_reads() -> None:
    async with linked_pair(config(enable_remote_cache_accessible=True), config()) as (p, d):
        pm = p.cache_manager
        buf = torch.ones(2, 1024, dtype=torch.uint8)
        desc = CacheDesc(1, [2, 1024], DataType.DT_UINT8, Placement.HOST)
        cache = await pm.register_cache(desc, [buf], [CacheKey(1, req_id=3)], True)
        dst = await d.cache_manager.allocate_cache(CacheDesc(1, [2, 1024], DataType.DT_UINT8))
        await d.cache_manager.pull_cache(CacheKeyByIdAndIndex(1, cache.cache_id, 1), dst, 1)
        await pm.unregister_cache(cache.cache_id)
        await raises(
            CODE.LLM_KV_CACHE_NOT_EXIST,
            d.cache_manager.pull_cache(CacheKeyByIdAndIndex(1, cache.cache_id, 0), dst),
        )
        await raises(
            CODE.LLM_KV_CACHE_NOT_EXIST, d.cache_manager.pull_cache(CacheKey(1, req_id=3), dst)
        )
        assert pm.statistics().caches == 0


# ---- 9: grants expire --------------------------------------------------------------------
def _raw_pull(port: int, meta: bytes, size: int) -> socket.socket:
    """Link as cluster 7 without a secret, ask for ``size`` bytes, and never read them."""
    s = raw_link(port)
    s.sendall(wire.encode_frame(wire.FrameType.READ_REQ, 0, meta=meta, size=size))
    return s


async def test_a_grant_nobody_reads_expires_and_memory_returns_to_the_pool() -> None:
    n = 6 * MIB
    cfg = config("tcp", enable_remote_cache_accessible=True, sync_kv_timeout=400)
    async with LLMDataDist(LLMRole.PROMPT, 1, cfg) as owner:
        cm = owner.cache_manager
        cache = await cm.allocate_cache(CacheDesc(1, [1, n], DataType.DT_UINT8))
        assert owner.listen_address is not None
        meta = encode(SlotReq(KeyById(1, cache.cache_id, 0), Tensors(1), n, exact=True))
        sock = await asyncio.to_thread(_raw_pull, owner.listen_address[1], meta, n)
        try:
            await until(lambda: cm.statistics().pins == 1)
            t0 = time.monotonic()
            await cm.deallocate_cache(cache)  # the grant keeps it pinned...
            assert cm.statistics().caches == 1
            await until(lambda: cm.statistics().caches == 0)  # ...until it expires
            assert time.monotonic() - t0 > 0.2
            stats = cm.get_pool_stats()
            assert stats is not None and stats.used == 0
            assert cm.statistics().pins == 0
        finally:
            sock.close()


# ---- 5: a finished pull releases only the binding it read ---------------------------------
def _slot_cache(value: int, n: int = 4096) -> Cache:
    desc = CacheDesc(1, [1, n], DataType.DT_UINT8)
    return Cache(desc, [torch.full((1, n), value, dtype=torch.uint8)], is_blocks_cache=False)


def _pooled_slot_cache(pool: MemPool, value: int, n: int = 4096) -> tuple[Cache, Span]:
    """A one-slot cache in ``pool`` (owned memory: a pull by its key releases the key)."""
    span = pool.allocate(n)
    tensor = pool.view(span).view(1, n)
    tensor.fill_(value)
    return Cache(CacheDesc(1, [1, n], DataType.DT_UINT8), [tensor], is_blocks_cache=False), span


async def test_a_finished_pull_keeps_a_key_rebound_meanwhile() -> None:
    reg = CacheRegistry()
    key = CacheKey(1, req_id=5)
    pool = MemPool(torch.zeros(4 * 4096, dtype=torch.uint8), 12, "test pool")
    (old, old_span), (new, new_span) = _pooled_slot_cache(pool, 1), _pooled_slot_cache(pool, 2)
    reg.add(old, [(pool, old_span)], remote_accessible=False, keys=[key])
    service = PeerService(1, reg, config())
    meta = encode(SlotReq(KeyByReq(1, 5, 0, NONE), Tensors(1), 4096, exact=True, release=True))
    grant = await service.grant_read(PEER, meta)  # a pull of `old` in flight
    assert grant.status == CODE.LLM_SUCCESS and bytes(grant.buffers[0][:1]) == b"\x01"
    reg.add(new, [(pool, new_span)], remote_accessible=False, keys=[key])  # moves to `new`
    assert grant.done is not None
    grant.done(True)
    hit = reg.by_key(key)
    assert hit is not None and hit[0].cache is new  # still bound to the new cache
    grant = await service.grant_read(PEER, meta)  # a pull of `new` releases it
    assert grant.done is not None
    grant.done(True)
    assert reg.by_key(key) is None


# ---- 6: reads by id: llm_datadist's rules per mode, aiokv's stricter one as an option ----
async def test_reads_by_cache_id_follow_llm_datadist_per_mode() -> None:
    desc = CacheDesc(1, [2, 256], DataType.DT_UINT8)
    host = CacheDesc(1, [2, 256], DataType.DT_UINT8, Placement.HOST)
    # without enable_remote_cache_accessible the owner serves reads by id (by request)
    async with linked_pair(config()) as (p, d):
        src = await p.cache_manager.allocate_cache(desc, [CacheKey(1, req_id=1)])
        dst = await d.cache_manager.allocate_cache(desc)
        await d.cache_manager.pull_cache(CacheKeyByIdAndIndex(1, src.cache_id, 0), dst)
        # the slot's key went with that pull, as on llm_datadist (a pull by the key)
        await raises(
            CODE.LLM_KV_CACHE_NOT_EXIST, d.cache_manager.pull_cache(CacheKey(1, req_id=1), dst)
        )
    # with it, the cache must be remote_accessible (llm_datadist: LLM_PARAM_INVALID)
    async with linked_pair(config(enable_remote_cache_accessible=True), config()) as (p, d):
        private = await p.cache_manager.register_cache(host, [torch.zeros(2, 256).byte()])
        shared = await p.cache_manager.register_cache(host, [torch.zeros(2, 256).byte()], (), True)
        dst = await d.cache_manager.allocate_cache(desc)
        await raises(
            CODE.LLM_PARAM_INVALID,
            d.cache_manager.pull_cache(CacheKeyByIdAndIndex(1, private.cache_id, 0), dst),
            f"cache {private.cache_id} of cluster 1 is not remote accessible",  # the cause
            "remote_accessible=True",  # the remedy
        )
        await d.cache_manager.pull_cache(CacheKeyByIdAndIndex(1, shared.cache_id, 0), dst)


async def test_restrict_reads_by_id_is_the_owners_opt_in() -> None:
    desc = CacheDesc(1, [2, 256], DataType.DT_UINT8)
    async with linked_pair(config(restrict_reads_by_id=True), config()) as (p, d):
        src = await p.cache_manager.allocate_cache(desc, [CacheKey(1, req_id=1)])
        dst = await d.cache_manager.allocate_cache(desc)
        await raises(
            CODE.LLM_FEATURE_NOT_ENABLED,
            d.cache_manager.pull_cache(CacheKeyByIdAndIndex(1, src.cache_id, 0), dst),
            "restrict_reads_by_id",
            "enable_remote_cache_accessible",
        )
        await d.cache_manager.pull_cache(CacheKey(1, req_id=1), dst)  # by key: allowed
    async with linked_pair(
        config(restrict_reads_by_id=True, enable_remote_cache_accessible=True), config()
    ) as (p, d):
        src = await p.cache_manager.allocate_cache(desc)
        dst = await d.cache_manager.allocate_cache(desc)
        await d.cache_manager.pull_cache(CacheKeyByIdAndIndex(1, src.cache_id, 0), dst)


async def test_cache_ids_count_from_1_per_instance_as_llm_datadist() -> None:
    desc = CacheDesc(1, [2, 256], DataType.DT_UINT8)
    async with linked_pair(config()) as (p, d):
        ids = [(await p.cache_manager.allocate_cache(desc)).cache_id for _ in range(3)]
        user = await p.cache_manager.register_cache(
            CacheDesc(1, [2, 256], DataType.DT_UINT8, Placement.HOST), [torch.zeros(2, 256).byte()]
        )
        assert [*ids, user.cache_id] == [1, 2, 3, 4]
        await p.cache_manager.deallocate_cache(await p.cache_manager.allocate_cache(desc))
        assert (await p.cache_manager.allocate_cache(desc)).cache_id == 6  # never reused
        # another instance (the decoder, same process) numbers its own from 1
        assert (await d.cache_manager.allocate_cache(desc)).cache_id == 1
    # a cache no LLMDataDist tracks: -1, as llm_datadist's create_cpu_cache
    cpu = Cache.create_cpu_cache(
        CacheDesc(1, [2, 256], DataType.DT_UINT8, Placement.HOST), [torch.zeros(2, 256).byte()]
    )
    assert cpu.cache_id == -1


# ---- 8: request amplification ------------------------------------------------------------
def _blocks_service(tensors: int = 64, blocks: int = 64, bb: int = 4096) -> PeerService:
    reg = CacheRegistry()
    desc = CacheDesc(tensors, [blocks, bb], DataType.DT_UINT8)
    ts = [torch.zeros(blocks, bb, dtype=torch.uint8) for _ in range(tensors)]
    reg.add(Cache(desc, ts, is_blocks_cache=True), [], remote_accessible=True,
            blocks_key=BlocksCacheKey(1, 0))  # fmt: skip
    return PeerService(1, reg, config(enable_remote_cache_accessible=True))


async def test_an_amplified_request_is_refused_before_anything_is_built() -> None:
    service = _blocks_service()
    many = np.tile(np.array([0, 2], dtype=np.int64), 65_000)  # ~1 MiB, at the meta cap
    meta = encode(BlocksReq(KeyByBlocks(1, 0), Tensors(64), pack_blocks(many), 4096))
    await asyncio.sleep(0)  # the set-up above is not what the loop guard should time
    t0 = time.perf_counter()
    grant = await service.grant_read(PEER, meta)
    assert time.perf_counter() - t0 < 0.5  # it was 7.7 s and +1.6 GiB before the cap
    assert grant.status == CODE.LLM_PARAM_INVALID and not grant.buffers
    await asyncio.sleep(0)
    # up to the cache's own block count is served (a whole-cache read)
    full = np.tile(np.array([0, 2], dtype=np.int64), 32)
    meta = encode(BlocksReq(KeyByBlocks(1, 0), Tensors(64), pack_blocks(full), 4096))
    grant = await service.grant_read(PEER, meta)
    assert grant.status == CODE.LLM_SUCCESS and len(grant.buffers) == 64 * 64
    assert grant.done is not None
    grant.done(False)
    # a write naming a block twice is refused
    twice = np.array([1, 2, 1], dtype=np.int64)
    meta = encode(BlocksReq(KeyByBlocks(1, 0), Tensors(64), pack_blocks(twice), 4096))
    grant = await service.grant_write(PEER, meta, 3 * 4096 * 64)
    assert grant.status == CODE.LLM_PARAM_INVALID


async def test_a_block_list_laid_out_once_is_still_checked_per_cache_and_direction() -> None:
    """The serving side lays out a repeated block list once (a layer-wise transfer sends
    the same list with every layer); what it keeps never serves a request it would have
    refused: the limit, the direction (a write's blocks distinct) and the stride are
    part of what was checked, and a refused list is checked again."""
    memo = _LayoutMemo()
    raw = pack_blocks(np.array([1, 2, 1], dtype=np.int64))
    read = memo.get(raw, 4, unique=False, block_bytes=4096)
    assert memo.get(raw, 4, unique=False, block_bytes=4096) is read  # laid out once
    for limit, unique, stride in ((4, True, None), (2, False, None), (8, True, 8192)):
        with pytest.raises(_Refused):
            memo.get(raw, limit, unique=unique, block_bytes=4096, stride=stride)
    service = _blocks_service()
    meta = encode(BlocksReq(KeyByBlocks(1, 0), Tensors(64), raw, 4096))
    for _ in range(2):  # a read may name a block twice; a write of the same list may not
        grant = await service.grant_read(PEER, meta)
        assert grant.status == CODE.LLM_SUCCESS and grant.done is not None
        grant.done(False)
        grant = await service.grant_write(PEER, meta, 3 * 4096 * 64)
        assert grant.status == CODE.LLM_PARAM_INVALID


async def test_raw_address_regions_may_not_overlap() -> None:
    reg = CacheRegistry()
    desc = CacheDesc(1, [1, MIB], DataType.DT_UINT8, Placement.HOST)
    cache = Cache(desc, [torch.zeros(1, MIB, dtype=torch.uint8)], is_blocks_cache=False)
    reg.add(cache, [], remote_accessible=True)
    service = PeerService(1, reg, config(enable_remote_cache_accessible=True))
    base = cache.tensor_addrs[0]
    blocks = pack_blocks(np.array([0, 1], dtype=np.int64))
    overlapping = encode(AddrsReq([base, base + 4096, base], 4096, 4096, blocks))
    grant = await service.grant_write(PEER, overlapping, 6 * 4096)
    assert grant.status == CODE.LLM_PARAM_INVALID
    apart = encode(AddrsReq([base, base + 8192], 4096, 4096, blocks))
    grant = await service.grant_write(PEER, apart, 4 * 4096)
    assert grant.status == CODE.LLM_SUCCESS and grant.done is not None
    grant.done(False)


# ---- 13: copy_cache between overlapping registered memory --------------------------------
async def test_copy_cache_between_overlapping_memory_is_refused_and_writes_nothing() -> None:
    async with LLMDataDist(LLMRole.MIX, 3, config()) as dd:
        cm = dd.cache_manager
        backing = torch.arange(3 * 4096, dtype=torch.int64).to(torch.uint8)
        before = backing.clone()
        desc = CacheDesc(2, [1, 4096], DataType.DT_UINT8, Placement.HOST)
        a0 = backing.data_ptr()
        src = await cm.register_cache(desc, [a0, a0 + 4096])
        dst = await cm.register_cache(desc, [a0 + 2048, a0 + 8192])  # dst 0 overlaps src
        await raises(CODE.LLM_PARAM_INVALID, cm.copy_cache(dst, src))
        assert torch.equal(backing, before)
        apart = await cm.register_cache(desc, [a0 + 8192 + 2048, a0 + 8192 + 2048])
        with pytest.raises(LLMException):  # its two tensors alias each other
            await cm.copy_cache(apart, src)
        assert torch.equal(backing, before)
        for c in (src, dst, apart):
            await cm.unregister_cache(c.cache_id)


# ---- 15: one dtype rule; a manager after finalize -----------------------------------------
async def test_caches_of_different_dtypes_are_refused_everywhere() -> None:
    fp16 = CacheDesc(2, [4, 64], DataType.DT_FLOAT16)
    bf16 = CacheDesc(2, [4, 64], DataType.DT_BF16)
    async with linked_pair(config()) as (p, d):
        await p.cache_manager.allocate_blocks_cache(fp16, BlocksCacheKey(1, 0))
        dm = d.cache_manager
        mine = await dm.allocate_blocks_cache(bf16)
        await raises(CODE.LLM_PARAM_INVALID, dm.pull_blocks(BlocksCacheKey(1, 0), mine, [0], [0]))
        other = await dm.allocate_blocks_cache(fp16)
        await raises(CODE.LLM_PARAM_INVALID, dm.copy_kv_blocks(other, mine, [0], [[1]]))
        host = CacheDesc(2, [4, 64], DataType.DT_FLOAT16, Placement.HOST)
        on_host = await dm.allocate_blocks_cache(host)
        await raises(CODE.LLM_PARAM_INVALID, dm.swap_blocks(on_host, mine, {0: 1}))
        await dm.swap_blocks(on_host, other, {0: 1})  # same dtype: fine
        contiguous = await dm.allocate_cache(CacheDesc(2, [1, 256], DataType.DT_BF16))
        source = await dm.allocate_cache(CacheDesc(2, [1, 256], DataType.DT_FLOAT16))
        await raises(CODE.LLM_PARAM_INVALID, dm.copy_cache(contiguous, source))


async def _call(fn: Any, args: list[Any]) -> None:
    result = fn(*args)
    if inspect.isawaitable(result):
        await result


_STILL_ALLOWED = {"check_cache_key", "statistics", "is_initialized", "device"}


@pytest.mark.parametrize("legacy", [False, True], ids=["CacheManager", "KvCacheManager"])
async def test_every_manager_call_after_finalize_raises_runtime_error(legacy: bool) -> None:
    dd = LLMDataDist(LLMRole.MIX, 4, config(enable_cache_manager=not legacy))
    await dd.init(config(enable_cache_manager=not legacy))
    cm: Any = dd.kv_cache_manager if legacy else dd.cache_manager
    cache = await cm.allocate_cache(CacheDesc(1, [1, 64], DataType.DT_UINT8))
    await dd.finalize()
    names = [n for n in dir(cm) if not n.startswith("_") and n not in _STILL_ALLOWED]
    assert {"deallocate_cache", "unregister_cache", "get_pool_stats"} <= set(names)
    for name in names:
        fn = getattr(cm, name)
        params = inspect.signature(fn).parameters.values()
        args = [cache if p.name in ("cache", "src_cache", "dst_cache", "src", "dst") else 1
                for p in params if p.default is p.empty]  # fmt: skip
        with pytest.raises(RuntimeError, match="finalized"):
            await _call(fn, args)
    if legacy:
        assert cm.is_initialized() is False
