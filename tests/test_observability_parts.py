"""statistics(): one pull or push is one operation, however many requests it is cut into."""

from __future__ import annotations

import pytest

from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import DataType
from aiokv import LLMException
from aiokv import LLMStatusCode
from aiokv.testing import linked_pair
from aiokv.testing import make_config

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
# 70 blocks of 1 MiB: one pull of more than one request's worth (64 MiB), cut in 2 parts
BLOCKS = 70
BIG = CacheDesc(1, [BLOCKS, MiB], DataType.DT_UINT8)


@pytest.mark.parametrize("transport", ["local", "tcp"])
async def test_a_pull_cut_into_parts_counts_as_one_operation(transport: str) -> None:
    """One ``pull_blocks`` is one operation in ``statistics()`` (ops, latency count),
    however many requests it took; a failed one is one failure, with no bytes counted
    as moved and no ``CANCELLED`` that nobody asked for."""
    cfg = make_config(transport, pool=(BLOCKS + 2) * MiB, page_shift=20)
    async with linked_pair(cfg) as (p, d):
        await p.cache_manager.allocate_blocks_cache(BIG, BlocksCacheKey(1, 0))
        dst = await d.cache_manager.allocate_blocks_cache(BIG)
        every = list(range(BLOCKS))
        await d.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, every, every)
        r = d.statistics().links[1].requests
        assert (r.ops, r.latency.count, r.bytes) == (1, 1, BLOCKS * MiB)
        assert dict(r.failures) == {} and r.in_flight == 0

        # the last block is out of range on the owner: the pull fails
        with pytest.raises(LLMException) as ei:
            await d.cache_manager.pull_blocks(
                BlocksCacheKey(1, 0), dst, [*every[:-1], 10_000], every
            )
        assert ei.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        r = d.statistics().links[1].requests
        assert dict(r.failures) == {"LLM_PARAM_INVALID": 1}
        assert (r.ops, r.latency.count) == (2, 2)
        assert r.bytes == BLOCKS * MiB  # the failed pull adds none
        assert r.in_flight == 0
