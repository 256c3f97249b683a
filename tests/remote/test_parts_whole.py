"""A pull or push cut into parts is checked, read and released as the whole transfer:
tensors per layer and the block list's top checked at the first part, a key rebound
between parts not read across two caches, a failed pull marking nothing read, a staged
pull failing here not releasing its key."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
from _helpers import fill_bytes
from _helpers import raises

from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import CacheKey
from aiokv import CacheKeyByIdAndIndex
from aiokv import DataType
from aiokv import LLMDataDist
from aiokv import LLMException
from aiokv import LLMRole
from aiokv import LLMStatusCode
from aiokv import Placement
from aiokv._copy import _staging
from aiokv._remote import _client as client_mod
from aiokv._remote._protocol import SlotReq
from aiokv.testing import cluster_info
from aiokv.testing import make_config

CODE = LLMStatusCode
MiB = 1 << 20


@pytest.fixture
def small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The requester cuts every transfer over 1 MiB into parts."""
    monkeypatch.setattr(client_mod, "MAX_STAGED_BYTES", 1 * MiB)


@contextlib.asynccontextmanager
async def linked() -> AsyncIterator[tuple[LLMDataDist, LLMDataDist]]:
    cfg = make_config("tcp", pool=32 << 20, host_pool=8 << 20, page_shift=16, sync_kv_timeout=20000)
    async with (
        LLMDataDist(LLMRole.PROMPT, 1, cfg) as p,
        LLMDataDist(LLMRole.DECODER, 2, cfg) as d,
    ):
        code, _ = await d.link_clusters([cluster_info(1, p.listen_address)])
        assert code == CODE.LLM_SUCCESS
        yield p, d


def slot_desc(tensors: int, per_tensor: int) -> CacheDesc:
    return CacheDesc(tensors, [1, per_tensor], DataType.DT_UINT8)


def slot_bytes(cache: Any, tensors: range) -> list[bytes]:
    return [cache.tensors[t].view(torch.uint8).numpy().tobytes() for t in tensors]


def hook_parts(d: LLMDataDist, before: Any) -> None:
    """Run ``await before(request)`` on the requester's engine loop before each of its
    transfer requests (``SlotReq`` parts only)."""
    client = d.cache_manager._client  # type: ignore[attr-defined]
    real = client.transfer

    async def transfer(op: str, link: Any, request: Any, views: Any, **kw: Any) -> bool:
        if isinstance(request, SlotReq):
            await before(request)
        return await real(op, link, request, views, **kw)  # type: ignore[no-any-return]

    client.transfer = transfer


# ---- (1) parts cut inside layers skip the owner's tensor_num_per_layer check --------------
async def test_parts_inside_layers_check_tensor_num_per_layer(small_parts: None) -> None:
    """The owner's cache has 3 tensors: ``tensor_num_per_layer=2`` does not divide them,
    so a layer-ranged pull is refused as one request; cut inside its layer (one layer is
    over a part) it must be refused too, not read as single tensors."""
    async with linked() as (p, d):
        src = await p.cache_manager.allocate_cache(slot_desc(3, 768 << 10))
        small = await d.cache_manager.allocate_cache(slot_desc(2, 1 << 10))
        big = await d.cache_manager.allocate_cache(slot_desc(2, 768 << 10))  # 1.5 MiB a layer
        other = await p.cache_manager.allocate_cache(slot_desc(3, 1 << 10))
        one = range(0, 1)
        await raises(
            CODE.LLM_PARAM_INVALID,
            d.cache_manager.pull_cache(
                CacheKeyByIdAndIndex(1, other.cache_id, 0),
                small,
                0,
                src_layer_range=one,
                dst_layer_range=one,
            ),
            "does not divide",
        )
        await raises(
            CODE.LLM_PARAM_INVALID,
            d.cache_manager.pull_cache(
                CacheKeyByIdAndIndex(1, src.cache_id, 0),
                big,
                0,
                src_layer_range=one,
                dst_layer_range=one,
            ),
            "does not divide",
        )


# ---- (2) a pull by CacheKey in parts reads two caches when the key is rebound -------------
async def test_a_key_rebound_between_parts_is_not_read_across_two_caches(
    small_parts: None,
) -> None:
    """A pull by CacheKey cut into two parts (a layer each); between them the owner
    rebinds the key to another cache. The pull must not land bytes of two caches and
    report success, nor release the key on the cache it barely read."""
    desc = slot_desc(4, 512 << 10)  # 1 MiB a layer: two parts
    key = CacheKey(1, req_id=5)
    first_done, go = threading.Event(), threading.Event()
    async with linked() as (p, d):
        a = await p.cache_manager.allocate_cache(desc, [key])
        fill_bytes(a, 1)
        b = await p.cache_manager.allocate_cache(desc)
        fill_bytes(b, 2)
        dst = await d.cache_manager.allocate_cache(desc)

        async def before(request: SlotReq) -> None:
            assert request.tensors.layers is not None
            if request.tensors.layers[0] > 0:  # the second part: after the rebind
                first_done.set()
                assert await asyncio.to_thread(go.wait, 10)

        hook_parts(d, before)
        pull = asyncio.ensure_future(d.cache_manager.pull_cache(key, dst))
        assert await asyncio.to_thread(first_done.wait, 10)
        await p.cache_manager.allocate_cache(desc, [key])  # a third cache takes the key
        go.set()
        failed = await asyncio.wait_for(asyncio.gather(pull, return_exceptions=True), 20)
        if isinstance(failed[0], LLMException):
            assert failed[0].status_code == CODE.LLM_KV_CACHE_NOT_EXIST, failed[0]
        else:  # then every byte comes from the one cache the key named
            got = slot_bytes(dst, range(4))
            assert got == slot_bytes(a, range(4)), "a pull by one key landed two caches' bytes"
        await asyncio.sleep(0.2)  # (a release happens when the owner's grant ends)
        assert p.cache_manager.statistics().keys == 1, "the rebound key was released"


# ---- (3) the owner serves early parts of a pull it will refuse -----------------------------
async def test_a_pull_in_parts_with_a_bad_block_is_refused_before_any_part_moves(
    small_parts: None,
) -> None:
    """40 blocks (2.5 MiB, four parts) whose last source block is past the owner's
    cache: refused as the whole request would be, before the owner serves a byte."""
    desc = CacheDesc(4, [96, 8192], DataType.DT_FLOAT16, Placement.DEVICE)  # 16 KiB blocks
    async with linked() as (p, d):
        await p.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(1, 0))
        dst = await d.cache_manager.allocate_blocks_cache(desc)
        srcs = [*range(39), 96]
        await raises(
            CODE.LLM_PARAM_INVALID,
            d.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, srcs, list(range(40))),
            "96",
        )
        served = p.statistics().links[2].served
        assert served.granted == 0 and served.bytes == 0, served


# ---- (4) a failed pull in parts still marks layers as read ---------------------------------
async def test_a_failed_layer_pull_in_parts_marks_nothing_read(small_parts: None) -> None:
    """A pull of layers 0..1 by CacheKey in two parts whose second part fails: the
    pull failed, so layer 0 is not read. A later pull of layers 1..3 leaves the key
    bound (layer 0 never arrived), and layer 0 can still be pulled by it."""
    desc = slot_desc(8, 512 << 10)  # 4 layers of 1 MiB
    key = CacheKey(1, req_id=6)
    async with linked() as (p, d):
        src = await p.cache_manager.allocate_cache(desc, [key])
        fill_bytes(src, 3)
        dst = await d.cache_manager.allocate_cache(desc)
        failing = True

        async def before(request: SlotReq) -> None:
            assert request.tensors.layers is not None
            if failing and request.release:  # the last part: this side fails it
                raise LLMException("injected", status_code=CODE.LLM_TIMEOUT)

        hook_parts(d, before)
        two = range(0, 2)
        await raises(
            CODE.LLM_TIMEOUT,
            d.cache_manager.pull_cache(key, dst, src_layer_range=two, dst_layer_range=two),
        )
        failing = False
        rest = range(1, 4)
        await d.cache_manager.pull_cache(key, dst, src_layer_range=rest, dst_layer_range=rest)
        await asyncio.sleep(0.2)  # (a release happens when the owner's grant ends)
        assert p.cache_manager.statistics().keys == 1, "released: the failed pull counted"
        first = range(0, 1)
        await d.cache_manager.pull_cache(key, dst, src_layer_range=first, dst_layer_range=first)
        assert slot_bytes(dst, range(8)) == slot_bytes(src, range(8))


# ---- (5) a staged pull that released its key can still fail here ---------------------------
async def test_a_staged_pull_failing_here_does_not_release_the_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A staged pull by CacheKey whose last host->device copy fails: the pull failed
    ("a CacheKey is not released"), so the key must still be bound on the owner."""
    monkeypatch.setattr(_staging, "_STAGE_HOST", True)
    monkeypatch.setattr(client_mod, "PART_BYTES", 1 * MiB)
    desc = slot_desc(4, 512 << 10)
    key = CacheKey(1, req_id=7)
    async with linked() as (p, d):
        src = await p.cache_manager.allocate_cache(desc, [key])
        fill_bytes(src, 4)
        dst = await d.cache_manager.allocate_cache(desc)
        real = _staging._scatter
        calls = 0
        lock = threading.Lock()

        def scatter(host: torch.Tensor, buffers: Any, layout: Any, device: Any) -> None:
            nonlocal calls
            with lock:
                calls += 1
                n = calls
            if n == 2:  # the last of two parts (a layer each): after the key's release
                raise RuntimeError("injected: the host->device copy failed")
            real(host, buffers, layout, device)

        monkeypatch.setattr(_staging, "_scatter", scatter)
        with pytest.raises((LLMException, RuntimeError)):
            await d.cache_manager.pull_cache(key, dst)
        assert calls == 2
        await asyncio.sleep(0.2)  # (a release happens when the owner's grant ends)
        assert p.cache_manager.statistics().keys == 1, "a failed pull released the key"
        monkeypatch.setattr(_staging, "_scatter", real)
        await d.cache_manager.pull_cache(key, dst)
        assert slot_bytes(dst, range(4)) == slot_bytes(src, range(4))
