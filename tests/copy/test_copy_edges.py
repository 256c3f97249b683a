"""Local copies at their edges (found in review; each failed before its fix): slots of
one cache that interleave along a batch dimension other than 0, a copy under trio in
a scope already cancelled, the staging budget's empty grants, and a copy whose worker
thread cannot start."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import pytest
import torch
from _helpers import fill_randn
from _helpers import held_at
from _helpers import not_listening
from _helpers import snapshot

from aiokv import CacheDesc
from aiokv import CacheManager
from aiokv import DataType
from aiokv import LLMDataDist
from aiokv import LLMException
from aiokv import LLMRole
from aiokv import Placement
from aiokv._copy import _scheduler

POOL = 64 << 20


@pytest.fixture
async def cm() -> AsyncIterator[CacheManager]:
    async with LLMDataDist(LLMRole.MIX, 1, not_listening(pool=POOL, host_pool=POOL)) as d:
        yield d.cache_manager


async def test_copy_cache_between_interleaved_slots_of_one_cache(cm: CacheManager) -> None:
    """Slots along batch dim 1 of ONE cache are interleaved but share no byte: copying
    slot 0 into slot 1 must work, as it does for a cache with its batch first."""
    c = await cm.allocate_cache(CacheDesc(2, [4, 3, 8], DataType.DT_FLOAT16, batch_dim_index=1))
    fill_randn(c, 1)
    before = snapshot(c)
    await cm.copy_cache(c, c, 1, 0)
    for i in range(2):
        assert torch.equal(c.tensors[i][:, 1], before[i][:, 0])
        assert torch.equal(c.tensors[i][:, 0], before[i][:, 0])
        assert torch.equal(c.tensors[i][:, 2], before[i][:, 2])


def test_trio_copy_in_an_already_cancelled_scope_never_starts() -> None:
    """Under trio, a copy awaited in a scope that is already cancelled must raise its
    cancellation without copying (docs/cancellation.md: a job that never started when
    the cancellation came raises it), as the inline (small) path does. The worker path
    submits the job to the engine before its first checkpoint, so it usually copies."""
    import anyio

    from aiokv import Placement

    async def main() -> None:
        async with LLMDataDist(LLMRole.MIX, 1, not_listening(pool=POOL, host_pool=POOL)) as dd:
            cm = dd.cache_manager
            desc = [16, 1 << 20]  # 1 MiB blocks: past the inline bound, a worker job
            host = await cm.allocate_blocks_cache(
                CacheDesc(1, desc, DataType.DT_UINT8, Placement.HOST)
            )
            dev = await cm.allocate_blocks_cache(
                CacheDesc(1, desc, DataType.DT_UINT8, Placement.DEVICE)
            )
            copied = 0
            for _ in range(20):
                host.tensors[0].zero_()
                dev.tensors[0].fill_(1)
                with anyio.CancelScope() as scope:
                    scope.cancel()
                    await cm.swap_blocks(dev, host, {0: 0})
                copied += bool(host.tensors[0][0].any())
            assert copied == 0, f"copied in {copied} of 20 pre-cancelled calls"
            assert cm.statistics().pins == 0

    anyio.run(main, backend="trio")


async def test_staging_budget_two_empty_requests_of_one_owner() -> None:
    """Budget.take(owner, 0) is accepted; two such grants held at once by one owner must
    each be given back without error, leaving the budget whole."""
    from aiokv._copy._staging import Budget

    b = Budget(100)
    await b.take("peer", 0, 1.0)
    await b.take("peer", 0, 1.0)
    b.give("peer", 0)
    b.give("peer", 0)  # it raised KeyError: 'peer'
    assert b.free == 100 and not b.held


async def test_copy_cache_between_large_interleaved_slots_of_one_cache(cm: CacheManager) -> None:
    """Slots along batch dim 1 of one cache share no byte, however large: a slot of
    8 Mi elements (2048 runs of 8 KiB) copies like a small one, instead of being refused
    as "the memory of src and dst overlaps" (the exact check was bounded by elements,
    though its cost grows with the runs)."""
    desc = CacheDesc(1, [2048, 2, 4096], DataType.DT_FLOAT16, Placement.HOST, batch_dim_index=1)
    c = await cm.allocate_cache(desc)
    c.tensors[0][:, 0].fill_(1.0)
    c.tensors[0][:, 1].fill_(2.0)
    await cm.copy_cache(c, c, dst_batch_index=1, src_batch_index=0)
    assert bool((c.tensors[0][:, 1] == 1.0).all())
    assert bool((c.tensors[0][:, 0] == 1.0).all())


async def test_a_copy_whose_worker_thread_cannot_start_never_runs_later(
    cm: CacheManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy whose job needs a new worker thread that cannot start (the process is out
    of threads) fails, and its job must never run afterwards: it stayed queued and the
    next free worker wrote the destination after the call had raised (its memory may
    be another cache's by then)."""
    entered, go = held_at(monkeypatch, _scheduler, "copy_blocks_job", 10)
    desc_d = CacheDesc(4, [4, 64 << 10], DataType.DT_UINT8, Placement.DEVICE)
    desc_h = CacheDesc(4, [4, 64 << 10], DataType.DT_UINT8, Placement.HOST)
    src = await cm.allocate_blocks_cache(desc_d)
    dst1 = await cm.allocate_blocks_cache(desc_h)
    dst2 = await cm.allocate_blocks_cache(desc_h)
    for t in src.tensors:
        t.fill_(7)
    first = asyncio.create_task(cm.copy_kv_blocks(src, dst1, [0], [[0]]))  # > inline size
    try:
        assert await asyncio.to_thread(entered.wait, 10)  # the only worker is busy with it
        start = threading.Thread.start

        def no_thread(self: threading.Thread) -> None:
            if self.name.startswith("aiokv-"):
                raise RuntimeError("can't start new thread")
            start(self)

        monkeypatch.setattr(threading.Thread, "start", no_thread)
        with pytest.raises(LLMException):
            await cm.copy_kv_blocks(src, dst2, [1], [[1]])
        monkeypatch.setattr(threading.Thread, "start", start)
    finally:
        go.set()
    await asyncio.wait_for(first, 10)
    await asyncio.wait_for(cm.copy_kv_blocks(src, dst1, [2], [[2]]), 10)  # behind it, FIFO
    assert all(int(t[1].max()) == 0 for t in dst2.tensors), "the failed copy ran afterwards"
    assert all(int(t[0].min()) == 7 and int(t[2].min()) == 7 for t in dst1.tensors)
