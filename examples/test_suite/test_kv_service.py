"""An application's asyncio test suite on the ``aiokv.testing`` pytest plugin.

Installing aiokv registers the plugin (``pip install '.[testing]'`` adds
pytest-asyncio); its fixtures give each test an initialised ``LLMDataDist``
(``aiokv_datadist``) or a linked prompt/decoder pair (``aiokv_pair``), finalised after
the test. Run: ``python -m pytest examples/test_suite``.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import DataType
from aiokv import LLMDataDist
from aiokv import LLMException
from aiokv import LLMStatusCode

DESC = CacheDesc(4, [16, 8, 64], DataType.DT_FLOAT)  # 2 layers x (K, V), 16 blocks
Pair = tuple[LLMDataDist, LLMDataDist]


@pytest.mark.asyncio
async def test_allocate_and_free_returns_the_pool(aiokv_datadist: LLMDataDist) -> None:
    cm = aiokv_datadist.cache_manager

    def used() -> int:
        stats = cm.get_pool_stats()  # None: the instance has no pool
        assert stats is not None
        return stats.used

    before = used()
    cache = await cm.allocate_blocks_cache(DESC)
    assert used() > before
    await cm.deallocate_blocks_cache(cache)
    assert used() == before


# every test below runs twice: in memory, and over loopback TCP
@pytest.fixture(params=["local", "tcp"])
def aiokv_transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.mark.asyncio
async def test_decoder_pulls_the_prompts_blocks(aiokv_pair: Pair) -> None:
    prompt, decoder = aiokv_pair
    src = await prompt.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(1))
    for i, t in enumerate(src.tensors):
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(i)))
    dst = await decoder.cache_manager.allocate_blocks_cache(DESC)
    await decoder.cache_manager.pull_blocks(BlocksCacheKey(1), dst, [5, 9], [0, 1])
    for s, d in zip(src.tensors, dst.tensors, strict=True):
        assert torch.equal(d[:2], s[[5, 9]])


@pytest.mark.asyncio
async def test_concurrent_pulls_each_land_in_their_blocks(aiokv_pair: Pair) -> None:
    prompt, decoder = aiokv_pair
    src = await prompt.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(1))
    for t in src.tensors:
        t.copy_(torch.arange(16, dtype=torch.float).view(-1, 1, 1).expand_as(t))
    dst = await decoder.cache_manager.allocate_blocks_cache(DESC)
    pulls = [
        decoder.cache_manager.pull_blocks(BlocksCacheKey(1), dst, [15 - b], [b]) for b in range(16)
    ]
    await asyncio.gather(*pulls)
    assert torch.equal(dst.tensors[0][:, 0, 0], torch.arange(15, -1, -1, dtype=torch.float))


@pytest.mark.asyncio
async def test_a_missing_cache_is_an_error_code(aiokv_pair: Pair) -> None:
    _, decoder = aiokv_pair
    dst = await decoder.cache_manager.allocate_blocks_cache(DESC)
    with pytest.raises(LLMException) as err:  # the prompt has no blocks cache under key 1
        await decoder.cache_manager.pull_blocks(BlocksCacheKey(1), dst, [0], [0])
    assert err.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST


@pytest.mark.asyncio
async def test_a_pull_under_a_deadline_is_cancelled_cleanly(aiokv_pair: Pair) -> None:
    prompt, decoder = aiokv_pair
    await prompt.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(1))
    dst = await decoder.cache_manager.allocate_blocks_cache(DESC)

    async def pull_under_deadline() -> None:
        async with asyncio.timeout(0):
            await decoder.cache_manager.pull_blocks(BlocksCacheKey(1), dst, [0], [0])
            # A pull that completed as the deadline hit keeps its result ("raised or
            # returned, never both"), and the cancellation comes back at the next await:
            # the block still ends in TimeoutError, never a silent overrun.
            await asyncio.sleep(30)

    with pytest.raises(TimeoutError):
        await pull_under_deadline()
    # the link is still usable afterwards
    await decoder.cache_manager.pull_blocks(BlocksCacheKey(1), dst, [1], [1])
