"""Local copies at their edges (found in review; each failed before its fix): slots of
one cache that interleave along a batch dimension other than 0, a copy under trio in
a scope already cancelled, and the staging budget's empty grants."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import torch
from _helpers import fill_randn
from _helpers import not_listening
from _helpers import snapshot

from aiokv import CacheDesc
from aiokv import CacheManager
from aiokv import DataType
from aiokv import LLMDataDist
from aiokv import LLMRole

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
