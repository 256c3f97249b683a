"""NIXL: the agent holds every registered range after a cancelled first link; a run over
adjacent registrations moves over NIXL; a registration NIXL refused never takes away
another one of the same range when it is released."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
import torch
from _helpers import until

from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import DataType
from aiokv import LLMDataDist
from aiokv import LLMRole
from aiokv import LLMStatusCode
from aiokv.testing import cluster_info
from aiokv.testing import make_config
from aiokv.testing import requires_transport

needs_nixl = requires_transport("nixl")


def _config(**kw: Any) -> Any:
    return make_config("nixl", pool=16 << 20, page_shift=16, **({"sync_kv_timeout": 5000} | kw))


def _desc() -> CacheDesc:
    return CacheDesc(2, [8, 4, 64], DataType.DT_FLOAT16)


@needs_nixl
async def test_a_cancelled_first_link_leaves_the_pool_registered_with_the_agent() -> None:
    """A decoder that does not listen makes its NIXL agent on its first link. Cancel that
    ``link_clusters`` while the agent is being made, link again, and pull: the pull must
    succeed (over NIXL). Before the fix the abandoned agent creation had already marked
    the pool registered (with an agent nobody used), the new agent skipped it, and every
    NIXL transfer of the pool failed with ``LLM_FAILED`` for the life of the instance."""
    async with (
        LLMDataDist(LLMRole.PROMPT, 1, _config()) as p,
        LLMDataDist(LLMRole.DECODER, 2, _config(listen_ip_info="")) as d,
    ):
        transport: Any = d._transport
        assert transport.agent is None  # not listening: no agent yet
        info = cluster_info(1, p.listen_address)
        first = asyncio.ensure_future(d.link_clusters([info], timeout=5000))
        await until(lambda: "NIXL agent creation" in transport.wait_lane.running(), seconds=10)
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await first
        await until(lambda: not transport.wait_lane.running(), seconds=10)  # it ran to its end
        code, _ = await d.link_clusters([info], timeout=5000)
        assert code == LLMStatusCode.LLM_SUCCESS
        key = BlocksCacheKey(1, 0)
        src = await p.cache_manager.allocate_blocks_cache(_desc(), key)
        dst = await d.cache_manager.allocate_blocks_cache(_desc())
        for t in src.tensors:
            t.copy_(torch.randn(t.shape).to(t.dtype))
        await d.cache_manager.pull_blocks(key, dst, [1, 2], [3, 4])
        assert all(
            torch.equal(s[[1, 2]], t[[3, 4]]) for s, t in zip(src.tensors, dst.tensors, strict=True)
        )
        assert transport.moved >= 1  # over NIXL, not around it


class _Grants:
    """Grants ``int(meta)`` bytes of ``buf`` from offset 0."""

    def __init__(self, buf: bytearray) -> None:
        self.buf = buf

    async def grant_read(self, peer: Any, meta: bytes) -> Any:
        from aiokv.transport import Grant

        return Grant(
            LLMStatusCode.LLM_SUCCESS, [memoryview(self.buf)[: int(meta)]], lambda ok: None
        )

    async def grant_write(self, peer: Any, meta: bytes, nbytes: int) -> Any:
        return await self.grant_read(peer, meta)


@needs_nixl
async def test_memory_registered_as_the_agent_starts_is_registered_with_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Memory may be registered from any thread at any time (the registry's hooks). Memory
    registered just after the agent's creation registered the regions it knew, but before
    the agent was published on the loop, was counted as registered yet never given to
    NIXL: every transfer of it then failed with ``LLM_FAILED``. Here the registration
    comes from the creating thread right after the creation (the worst moment)."""
    from aiokv.transport import get_transport
    from aiokv.transport.nixl._descs import address_of

    cls: Any = get_transport("nixl")
    owner_buf = bytearray(b"\x5a") * 65536
    owner, me = cls(2, _Grants(owner_buf)), cls(1, _Grants(bytearray(1)))
    make = owner._make_agent

    def make_then_register() -> Any:
        agent = make()
        owner.register_memory(address_of(memoryview(owner_buf)), len(owner_buf))
        return agent

    monkeypatch.setattr(owner, "_make_agent", make_then_register)
    mine = bytearray(65536)
    me.register_memory(address_of(memoryview(mine)), len(mine))
    try:
        link = await me.connect(*await owner.listen("127.0.0.1", 0), timeout=5)
        await link.read(b"65536", [memoryview(mine)], timeout=5)
        assert mine == owner_buf and me.moved == 1
    finally:
        await me.aclose()
        await owner.aclose()


@needs_nixl
@pytest.mark.parametrize("side", ["owner", "requester"])
async def test_a_registered_cache_whose_tensors_adjoin_moves_over_nixl(side: str) -> None:
    """A cache registered from one allocation (its tensors adjoin, as vLLM's layers of
    one KV buffer do) is registered with NIXL tensor by tensor; a transfer whose runs
    cross from one tensor into the next (every block of the cache) was not recognised
    as registered memory and moved over TCP (docs/nixl.md: registered caches move over
    NIXL; for device memory the same check made the transfer fail)."""
    async with (
        LLMDataDist(LLMRole.PROMPT, 1, _config()) as p,
        LLMDataDist(LLMRole.DECODER, 2, _config()) as d,
    ):
        code, _ = await d.link_clusters([cluster_info(1, p.listen_address)])
        assert code == LLMStatusCode.LLM_SUCCESS
        key, desc = BlocksCacheKey(1, 0), _desc()
        kv = torch.randn(2, 8, 4, 64).to(torch.float16)  # one allocation, layers adjoining
        if side == "owner":
            src = await p.cache_manager.register_blocks_cache(
                desc, [kv[0], kv[1]], key, remote_accessible=True
            )
            dst = await d.cache_manager.allocate_blocks_cache(desc)
        else:
            src = await p.cache_manager.allocate_blocks_cache(desc, key)
            for t in src.tensors:
                t.copy_(torch.randn(t.shape).to(t.dtype))
            dst = await d.cache_manager.register_blocks_cache(desc, [kv[0], kv[1]])
        transport: Any = d._transport
        blocks = list(range(8))
        before = transport.moved
        await d.cache_manager.pull_blocks(key, dst, blocks, blocks)
        assert all(torch.equal(s, t) for s, t in zip(src.tensors, dst.tensors, strict=True))
        assert transport.moved == before + 1  # over NIXL


@needs_nixl
async def test_a_refused_registration_does_not_take_away_a_later_one() -> None:
    """Register R1, then R2 overlapping it (NIXL cannot register R2: it counts nothing),
    release R1, register R3 with exactly R2's range (NIXL registers it), then release
    R2: R3 is still registered with aiokv, so its bytes must still be NIXL-addressable.
    Before the fix releasing R2 deregistered R3's NIXL region (the transport matched
    deregistrations by range only), so R3 lost the direct path while registered."""
    n = 64 << 10
    buf = torch.zeros(4 * n, dtype=torch.uint8)
    desc = CacheDesc(1, [n], DataType.DT_UINT8)
    async with LLMDataDist(LLMRole.PROMPT, 1, _config()) as p:
        transport: Any = p._transport
        cm = p.cache_manager
        base = buf.data_ptr()
        r1 = await cm.register_blocks_cache(desc, [base])
        r2 = await cm.register_blocks_cache(desc, [base + n // 2])  # overlaps R1
        assert transport.addressable("cpu", base, n)
        assert not transport.addressable("cpu", base + n // 2, n)
        await cm.unregister_cache(r1.cache_id)
        r3 = await cm.register_blocks_cache(desc, [base + n // 2])  # R2's range, now free
        assert transport.addressable("cpu", base + n // 2, n)
        await cm.unregister_cache(r2.cache_id)
        assert transport.addressable("cpu", base + n // 2, n)  # R3 still registered
        await cm.unregister_cache(r3.cache_id)
        assert not transport.addressable("cpu", base + n // 2, n)
