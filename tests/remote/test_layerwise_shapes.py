"""``transfer_cache_async`` beyond the paged caches of ``test_remote.py``: contiguous
caches (by ``CacheKeyByIdAndIndex`` and by raw addresses, from any batch slot and layer),
destination blocks spaced by ``dst_block_memory_size``, the argument checks (raised at
once, nothing pinned), and ``unregister_cache`` of the source cancelling the transfer.

Over the shipped pytest plugin's ``aiokv_pair`` (``aiokv.testing``), local and TCP.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _helpers import fill_randn
from _helpers import until

from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import CacheKey
from aiokv import CacheKeyByIdAndIndex
from aiokv import CacheTask
from aiokv import DataType
from aiokv import LLMDataDist
from aiokv import LLMException
from aiokv import LLMStatusCode
from aiokv import TransferConfig
from aiokv import TransferWithCacheKeyConfig

pytestmark = pytest.mark.parametrize("aiokv_transport", ["local", "tcp"])

CODE = LLMStatusCode
#: 2 layers (K, V each) of a batch of 3 slots, 256 bytes a slot
CONTIGUOUS = CacheDesc(4, [3, 16, 8], DataType.DT_FLOAT16)
#: 2 layers of 8 blocks of 64 bytes
PAGED = CacheDesc(4, [8, 64], DataType.DT_UINT8)
Pair = tuple[LLMDataDist, LLMDataDist]


class Ready:
    """A blocking synchronizer: every layer is written already."""

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return True


class Held:
    """An async synchronizer that releases no layer until ``release`` is set (the model
    has not finished them)."""

    def __init__(self) -> None:
        self.asked: list[int] = []
        self.release = asyncio.Event()

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        self.asked.append(layer_index)
        await self.release.wait()
        return True


async def finished(task: CacheTask) -> list[LLMStatusCode | None]:
    results = await asyncio.wait_for(task.get_results(), 10)
    assert task.errors() == [None] * len(results), task.errors()
    return results


async def test_contiguous_caches_by_key_and_by_address(aiokv_pair: Pair) -> None:
    p, d = aiokv_pair
    src = await p.cache_manager.allocate_cache(CONTIGUOUS)
    fill_randn(src, 3)
    dst = await d.cache_manager.allocate_cache(CONTIGUOUS)
    dt = dst.tensors

    # by key: slot 1 of the source into slot 2 of the peer's cache, every layer
    key = CacheKeyByIdAndIndex(2, dst.cache_id, 2)
    task = p.cache_manager.transfer_cache_async(
        src, Ready(), [TransferWithCacheKeyConfig(key, src_batch_index=1)]
    )
    assert await finished(task) == [CODE.LLM_SUCCESS]
    for td, ts in zip(dt, src.tensors, strict=True):
        assert torch.equal(td[2], ts[1])
        assert not td[:2].any()

    # by key, layer 1 of slot 0 into layer 0 of slot 1
    for t in dt:
        t.zero_()
    one = TransferWithCacheKeyConfig(
        CacheKeyByIdAndIndex(2, dst.cache_id, 1), range(1, 2), range(0, 1), 0
    )
    task = p.cache_manager.transfer_cache_async(src, Ready(), [one])
    assert await finished(task) == [CODE.LLM_SUCCESS]
    assert torch.equal(dt[0][1], src.tensors[2][0]) and torch.equal(dt[1][1], src.tensors[3][0])
    assert not any(t.any() for t in dt[2:]) and not dt[0][0].any() and not dt[0][2].any()

    # by raw addresses: layer 1 of slot 2 to the peer's tensors 0 and 1 at slot 1
    for t in dt:
        t.zero_()
    slot = dt[0][0].nbytes
    addrs = [dst.tensor_addrs[0] + slot, dst.tensor_addrs[1] + slot]
    task = p.cache_manager.transfer_cache_async(
        src, Ready(), [TransferConfig(2, addrs, range(1, 2), 2)]
    )
    assert await finished(task) == [CODE.LLM_SUCCESS]
    assert torch.equal(dt[0][1], src.tensors[2][2]) and torch.equal(dt[1][1], src.tensors[3][2])
    assert not any(t.any() for t in dt[2:]) and not dt[0][0].any() and not dt[1][2].any()


async def test_destination_blocks_spaced_by_dst_block_memory_size(aiokv_pair: Pair) -> None:
    p, d = aiokv_pair
    src = await p.cache_manager.allocate_blocks_cache(PAGED)
    fill_randn(src, 4)
    spaced = [torch.zeros(8, 128, dtype=torch.uint8) for _ in range(4)]  # 128-byte blocks
    dst = await d.cache_manager.register_blocks_cache(
        CacheDesc(4, [8, 128], DataType.DT_UINT8), spaced
    )
    task = p.cache_manager.transfer_cache_async(
        src, Ready(), [TransferConfig(2, dst.tensor_addrs)], [1, 2], [3, 5], 128
    )
    assert await finished(task) == [CODE.LLM_SUCCESS]
    for td, ts in zip(spaced, src.tensors, strict=True):
        assert torch.equal(td[3, :64], ts[1]) and torch.equal(td[5, :64], ts[2])
        td[3, :64] = 0
        td[5, :64] = 0
        assert not td.any()  # nothing else written: not the gaps, not the other blocks


async def test_argument_errors_raise_at_once_and_pin_nothing(aiokv_pair: Pair) -> None:
    p, d = aiokv_pair
    cm = p.cache_manager
    slots = await cm.allocate_cache(CONTIGUOUS)
    blocks = await cm.allocate_blocks_cache(PAGED)
    odd = await cm.allocate_blocks_cache(CacheDesc(3, [8, 64], DataType.DT_UINT8))
    peer_slots = await d.cache_manager.allocate_cache(CONTIGUOUS)
    peer_blocks = await d.cache_manager.allocate_blocks_cache(PAGED, BlocksCacheKey(2, 0))
    by_key = [TransferWithCacheKeyConfig(BlocksCacheKey(2, 0))]
    by_addr = [TransferConfig(2, peer_blocks.tensor_addrs)]
    start = cm.transfer_cache_async
    cases: list[tuple[Callable[[], Any], type[Exception], str]] = [
        (lambda: start(odd, Ready(), by_key), LLMException, "3 tensors is not a whole number"),
        (
            lambda: start(slots, Ready(), [TransferConfig(2, peer_slots.tensor_addrs)], [0], [0]),
            LLMException,
            "block indices need a blocks cache",
        ),
        (
            lambda: start(blocks, Ready(), by_addr, [0], None),
            LLMException,
            "give both src_block_indices and dst_block_indices",
        ),
        (
            lambda: start(blocks, Ready(), by_addr, [0], [0], 32),
            LLMException,
            "dst_block_memory_size 32 < source block size 64",
        ),
        (lambda: start(blocks, Ready(), by_addr, [0], [0], True), TypeError, "must be int"),
        (lambda: start(blocks, Ready(), by_addr, [0], [0], -5), ValueError, "out of range"),
        (
            lambda: start(
                blocks,
                Ready(),
                [TransferWithCacheKeyConfig(BlocksCacheKey(2, 0), range(0, 2), range(0, 1))],
            ),
            LLMException,
            "src_layer_range and dst_layer_range differ in length",
        ),
        (
            lambda: start(
                blocks,
                Ready(),
                [TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(2, peer_slots.cache_id, 0))],
            ),
            LLMException,
            "CacheKeyByIdAndIndex cannot name a destination of this cache",
        ),
        (
            lambda: start(slots, Ready(), by_key),
            LLMException,
            "BlocksCacheKey cannot name a destination of this cache",
        ),
        (
            lambda: start(slots, Ready(), [TransferWithCacheKeyConfig(CacheKey(2, 7))]),
            LLMException,
            "CacheKey cannot name a destination of this cache",
        ),
    ]
    for call, error, says in cases:
        with pytest.raises(error, match=says) as ei:
            call()
        if isinstance(ei.value, LLMException):
            assert ei.value.status_code == CODE.LLM_PARAM_INVALID, ei.value
    assert cm.statistics().pins == 0
    task = start(blocks, Ready(), by_key, [0], [0])
    bad: list[tuple[Any, type[Exception]]] = [(True, TypeError), (1.5, TypeError), (-1, ValueError)]
    for timeout, error in bad:
        with pytest.raises(error, match="timeout_in_millis"):
            await task.synchronize(timeout)
    assert await task.synchronize() == CODE.LLM_SUCCESS
    assert cm.statistics().pins == 0


async def test_unregistering_the_source_cancels_the_transfer(aiokv_pair: Pair) -> None:
    p, d = aiokv_pair
    tensors = [torch.full((8, 64), 7, dtype=torch.uint8) for _ in range(4)]
    src = await p.cache_manager.register_blocks_cache(PAGED, tensors)
    dst = await d.cache_manager.allocate_blocks_cache(PAGED, BlocksCacheKey(2, 0))
    for t in dst.tensors:
        t.zero_()
    held = Held()
    task = p.cache_manager.transfer_cache_async(
        src, held, [TransferWithCacheKeyConfig(BlocksCacheKey(2, 0))], [0, 1], [0, 1]
    )
    await until(lambda: held.asked == [0])
    assert p.cache_manager.statistics().pins == 1  # the task holds its source
    await asyncio.wait_for(p.cache_manager.unregister_cache(src.cache_id), 10)
    assert task.done()  # cancelled before unregister_cache returned
    assert await task.get_results() == [None]
    assert await task.synchronize() == CODE.LLM_FAILED
    assert held.asked == [0] and p.cache_manager.statistics().pins == 0
    assert not any(t.any() for t in dst.tensors)  # nothing of it was sent


async def test_deallocating_a_pool_source_lets_the_transfer_finish(aiokv_pair: Pair) -> None:
    p, d = aiokv_pair
    src = await p.cache_manager.allocate_blocks_cache(PAGED)
    fill_randn(src, 5)
    want = [t.clone() for t in src.tensors]
    dst = await d.cache_manager.allocate_blocks_cache(PAGED, BlocksCacheKey(2, 0))
    held = Held()
    task = p.cache_manager.transfer_cache_async(
        src, held, [TransferWithCacheKeyConfig(BlocksCacheKey(2, 0))], [0, 1], [0, 1]
    )
    await until(lambda: held.asked == [0])
    pool = p.cache_manager.get_pool_stats()
    assert pool is not None and pool.allocations == 4
    await p.cache_manager.deallocate_blocks_cache(src)  # returns at once; the task holds it
    assert not task.done() and p.cache_manager.get_pool_stats() == pool
    held.release.set()
    assert await finished(task) == [CODE.LLM_SUCCESS]
    for td, ts in zip(dst.tensors, want, strict=True):
        assert torch.equal(td[:2], ts[:2])  # the cache's bytes, not reused memory
    await until(lambda: p.cache_manager.get_pool_stats().allocations == 0)  # type: ignore[union-attr]
    assert p.cache_manager.statistics().pins == 0
