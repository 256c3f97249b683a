"""A staged grant (device memory, through host staging) ends once, and nothing of it
runs after its end: a push cancelled right after its last byte is not scattered into the
cache after the owner was told it ended (and its memory unregistered), and a push whose
staging waited while ``unregister_cache`` began is refused, not served into memory that
is the user's again. Host caches take the staged path here (``_STAGE_HOST``).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch
from _helpers import raw_link
from _helpers import recv_frame

from aiokv import CacheDesc
from aiokv import CacheKeyByIdAndIndex
from aiokv import DataType
from aiokv import LLMDataDist
from aiokv import LLMException
from aiokv import LLMRole
from aiokv import LLMStatusCode
from aiokv import Placement
from aiokv._copy import Stager
from aiokv._copy import _staging
from aiokv._remote._protocol import KeyById
from aiokv._remote._protocol import SlotReq
from aiokv._remote._protocol import Tensors
from aiokv._remote._protocol import encode
from aiokv.testing import linked_pair
from aiokv.testing import make_config
from aiokv.transport import _wire as wire

F = wire.FrameType


def _push_then_cancel(port: int, meta: bytes, n: int) -> list[str]:
    """A raw peer: WRITE_REQ, wait for WRITE_GRANT, then every DATA byte and a CANCEL
    in one send (a requester cancelled right after its last byte went out); returns the
    frames it got until CANCEL_ACK."""
    s = raw_link(port)
    try:
        s.sendall(wire.encode_frame(F.WRITE_REQ, 0, meta=meta, size=n))
        seen = []
        while True:
            h = recv_frame(s)
            seen.append(h.type.name)
            if h.type is F.WRITE_GRANT:
                assert h.status == 0, h
                break
        payload = b"\xab" * n
        s.sendall(wire.encode_frame(F.DATA, 0, size=n) + payload + wire.encode_frame(F.CANCEL, 0))
        while True:
            h = recv_frame(s)
            seen.append(h.type.name)
            if h.type is F.CANCEL_ACK:
                return seen
    finally:
        s.close()


async def test_a_cancelled_staged_push_is_not_scattered_after_its_grant_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_staging, "_STAGE_HOST", True)  # host caches take the staged path
    n = 1024
    cfg = make_config(
        "tcp",
        pool=8 << 20,
        host_pool=4 << 20,
        enable_remote_cache_accessible=True,
        sync_kv_timeout=5000,
    )
    async with LLMDataDist(LLMRole.DECODER, 1, cfg) as owner:
        cm = owner.cache_manager
        registry = cm._registry
        buf = torch.zeros(1, n, dtype=torch.uint8)
        desc = CacheDesc(1, [1, n], DataType.DT_UINT8, Placement.HOST)
        cache = await cm.register_cache(desc, [buf], remote_accessible=True)
        cid = cache.cache_id

        scatters: list[dict[str, Any]] = []
        real_scatter = Stager.scatter

        async def scatter(self: Stager, staged: Any, buffers: Any, layout: Any) -> None:
            entry = registry.entries.get(cid)
            scatters.append(
                {
                    "pins": None if entry is None else entry.pins,
                    "id_held": None if entry is None else entry.id_held,
                    "staged_released": staged._budget is None,
                }
            )
            await real_scatter(self, staged, buffers, layout)

        monkeypatch.setattr(Stager, "scatter", scatter)
        meta = encode(SlotReq(KeyById(1, cid, 0), Tensors(1), n, exact=True))
        assert owner.listen_address is not None
        seen = await asyncio.to_thread(_push_then_cancel, owner.listen_address[1], meta, n)
        # the requester was told (CANCEL_ACK) that nothing of the push lands any more
        assert seen[-1] == "CANCEL_ACK", seen
        # the owner unregisters its memory; it returns at once: nothing pins it
        await cm.unregister_cache(cid)
        buf.fill_(0x5A)  # the user's memory again
        await asyncio.sleep(1.0)
        landed = int((buf == 0xAB).sum())
        assert not scatters and landed == 0, (
            f"the commit of a cancelled push scattered after its grant ended ({scatters}); "
            f"{landed} bytes of it landed after unregister_cache returned"
        )


async def test_a_push_waiting_for_staging_room_fails_once_unregister_cache_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_staging, "_STAGE_HOST", True)  # host caches take the staged path
    n = 4096
    cfg = make_config("tcp", pool=8 << 20, host_pool=4 << 20, sync_kv_timeout=5000)
    async with linked_pair(cfg) as (p, d):
        pm, dm = p.cache_manager, d.cache_manager
        buf = torch.zeros(1, n, dtype=torch.uint8)
        desc = CacheDesc(1, [1, n], DataType.DT_UINT8, Placement.HOST)
        cache = await pm.register_cache(desc, [buf], remote_accessible=True)
        src = await dm.allocate_cache(CacheDesc(1, [1, n], DataType.DT_UINT8))
        src.tensors[0].fill_(0xAB)

        entered, gate = threading.Event(), threading.Event()
        real_reserve = Stager.reserve

        async def reserve(self: Stager, *args: Any, **kw: Any) -> Any:
            entered.set()
            # waiting for budget room (another transfer holds it)
            assert await asyncio.to_thread(gate.wait, 10)
            return await real_reserve(self, *args, **kw)

        monkeypatch.setattr(Stager, "reserve", reserve)
        push = asyncio.create_task(dm.push_cache(CacheKeyByIdAndIndex(1, cache.cache_id, 0), src))
        assert await asyncio.to_thread(entered.wait, 10)
        unregister = asyncio.create_task(pm.unregister_cache(cache.cache_id))
        for _ in range(1000):  # until the unregistration began
            if pm._registry.by_id(cache.cache_id) is None:
                break
            await asyncio.sleep(0.01)
        else:
            pytest.fail("unregister_cache never began")
        gate.set()
        outcome: object
        try:
            await asyncio.wait_for(push, 10)
            outcome = LLMStatusCode.LLM_SUCCESS
        except LLMException as exc:
            outcome = exc.status_code
        await asyncio.wait_for(unregister, 10)
        landed = int((buf == 0xAB).sum())
        print("push outcome:", outcome, "bytes landed:", landed)
        assert outcome == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST and landed == 0, (
            f"a push into a cache being unregistered was served: {outcome}, "
            f"{landed} bytes written after unregister_cache started"
        )


@pytest.mark.parametrize("backend", ["tcp", "local"])
@pytest.mark.parametrize("end", ["cancel", "unregister"])
async def test_a_push_ended_during_its_commit_returns_once_the_commit_ended(
    monkeypatch: pytest.MonkeyPatch, backend: str, end: str
) -> None:
    """A staged push's bytes land in the cache in its commit (staging → cache). The push
    cancelled by its caller, or revoked by the owner's ``unregister_cache``, while that
    commit runs raises only once the commit ended: nothing of it lands after."""
    monkeypatch.setattr(_staging, "_STAGE_HOST", True)
    n = 4096
    cfg = make_config(backend, pool=8 << 20, host_pool=4 << 20, sync_kv_timeout=5000)
    async with linked_pair(cfg) as (p, d):
        buf = torch.zeros(1, n, dtype=torch.uint8)
        desc = CacheDesc(1, [1, n], DataType.DT_UINT8, Placement.HOST)
        cache = await p.cache_manager.register_cache(desc, [buf], remote_accessible=True)
        src = await d.cache_manager.allocate_cache(CacheDesc(1, [1, n], DataType.DT_UINT8))
        src.tensors[0].fill_(0xAB)
        started, finished = threading.Event(), threading.Event()
        real_scatter = Stager.scatter

        async def scatter(self: Stager, *args: Any) -> None:  # a slow host→device copy
            started.set()
            await asyncio.sleep(0.3)
            await real_scatter(self, *args)
            finished.set()

        monkeypatch.setattr(Stager, "scatter", scatter)
        key = CacheKeyByIdAndIndex(1, cache.cache_id, 0)
        push = asyncio.create_task(d.cache_manager.push_cache(key, src))
        assert await asyncio.to_thread(started.wait, 10)
        if end == "cancel":
            push.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(push, 10)
            landed = finished.is_set()
        else:
            unregister = asyncio.create_task(p.cache_manager.unregister_cache(cache.cache_id))
            with pytest.raises(LLMException) as ei:
                await asyncio.wait_for(push, 10)
            landed = finished.is_set()
            assert ei.value.status_code is LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
            await asyncio.wait_for(unregister, 10)
        assert landed, "the push raised while its bytes were still landing"
        assert d.cache_manager.statistics().pins == 0
