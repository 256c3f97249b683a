"""Layer-wise transfers: overlapping dst_addrs refused at the call; synchronizers whose
repr raises, or that raise SystemExit; a timeout too large."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import aiokv.sync
from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import DataType
from aiokv import LLMConfig
from aiokv import LLMException
from aiokv import LLMRole
from aiokv import LLMStatusCode
from aiokv import Placement
from aiokv import TransferConfig
from aiokv import TransferWithCacheKeyConfig
from aiokv.testing import cluster_info
from aiokv.testing import linked_pair
from aiokv.testing import make_config

CODE = LLMStatusCode
DESC = CacheDesc(4, [8, 256], DataType.DT_UINT8, Placement.HOST)  # 2 layers of 8 blocks
KEY = BlocksCacheKey(2, 0)


def config(**kw: Any) -> LLMConfig:
    return make_config(pool=None, host_pool=4 << 20, **({"sync_kv_timeout": 3000} | kw))


class Ready:
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return True


async def test_overlapping_dst_addrs_are_refused_at_once() -> None:
    """The regions of a ``TransferConfig``'s ``dst_addrs`` may not overlap (the peer
    refuses such a request). Checked per request only, the same call succeeded when
    the layers were released one by one (layer 1 overwrote layer 0 on the peer) and
    failed with ``LLM_PARAM_INVALID`` when they were released together, after what it
    had sent: the outcome depended on the synchronizer's timing. A local property of
    the arguments: refused at the call, before anything is sent."""
    async with linked_pair(config()) as (p, d):
        src = await p.cache_manager.allocate_blocks_cache(DESC)
        for t in src.tensors:
            t.fill_(9)
        dst = await d.cache_manager.allocate_blocks_cache(DESC)
        for t in dst.tensors:
            t.zero_()
        a = dst.tensor_addrs
        for addrs in ([a[0], a[1], a[0], a[1]], [a[0], a[0] + 100, a[2], a[3]]):
            with pytest.raises(LLMException, match="overlap") as ei:
                p.cache_manager.transfer_cache_async(src, Ready(), [TransferConfig(2, addrs)])
            assert ei.value.status_code == CODE.LLM_PARAM_INVALID
        # blocks [0, 2] of 256 bytes spaced 512: 1280 bytes from each base; 1024 apart overlap
        with pytest.raises(LLMException, match="overlap"):
            p.cache_manager.transfer_cache_async(
                src,
                Ready(),
                [TransferConfig(2, [a[0], a[0] + 1024], range(0, 1))],
                [0, 1],
                [0, 2],
                512,
            )
        assert p.cache_manager.statistics().pins == 0
        assert not any(t.any() for t in dst.tensors)  # nothing was sent
        # regions that only touch are fine (one past the other's end)
        ok = [a[0], a[0] + 256, a[2], a[2] + 256]
        task = p.cache_manager.transfer_cache_async(
            src, Ready(), [TransferConfig(2, ok, range(0, 2))], [0], [0]
        )
        assert await asyncio.wait_for(task.get_results(), 10) == [CODE.LLM_SUCCESS]


async def test_a_synchronizer_whose_repr_raises_is_still_called() -> None:
    """The engine names a ``def`` synchronizer by its ``repr`` (thread labels, the
    warning of an abandoned one). A ``repr`` that raised stopped the transfer before
    the first layer (reported as cut short: ``[None]``, with "Task exception was never
    retrieved" logged), or, raising only on a later call, left the task waiting
    forever for a job that had died."""
    async with linked_pair(config()) as (p, d):
        src = await p.cache_manager.allocate_blocks_cache(DESC)
        for t in src.tensors:
            t.fill_(5)
        dst = await d.cache_manager.allocate_blocks_cache(DESC, KEY)

        class BadRepr:
            def __init__(self, good: int) -> None:
                self.good = good  # reprs that work before the first raises

            def __repr__(self) -> str:
                self.good -= 1
                if self.good < 0:
                    raise AttributeError("no repr")
                return "BadRepr"

            def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
                return True

        for good in (0, 1, 2):
            for t in dst.tensors:
                t.zero_()
            task = p.cache_manager.transfer_cache_async(
                src, BadRepr(good), [TransferWithCacheKeyConfig(KEY)]
            )
            try:
                results = await asyncio.wait_for(task.get_results(), 10)
            finally:
                task.cancel()
            assert results == [CODE.LLM_SUCCESS], (good, results, task.errors())
            assert all(bool((t == 5).all()) for t in dst.tensors)
        assert p.cache_manager.statistics().pins == 0


def test_a_def_synchronizers_awaitable_raising_system_exit_fails_its_destinations_only() -> None:
    """A ``def`` synchronizer may return an awaitable (awaited on the caller's loop, the
    engine loop with ``aiokv.sync``); one raising ``SystemExit`` escaped from the
    transfer task onto the engine loop and stopped the engine: the instance was dead
    ("the LLMDataDist was finalized while this ran"). Documented: a synchronizer
    raising anything, SystemExit too, fails the destinations, never the instance."""

    async def exits() -> bool:
        raise SystemExit(3)

    class Awaits:
        def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> Any:
            return exits() if layer_index == 1 else True

    with (
        aiokv.sync.LLMDataDist(LLMRole.PROMPT, 1, config()) as p,
        aiokv.sync.LLMDataDist(LLMRole.DECODER, 2, config()) as d,
    ):
        code, _ = d.link_clusters([cluster_info(1, p.listen_address)])
        assert code == CODE.LLM_SUCCESS
        d.cache_manager.allocate_blocks_cache(DESC, KEY)
        src = p.cache_manager.allocate_blocks_cache(DESC)
        task = p.cache_manager.transfer_cache_async(
            src, Awaits(), [TransferWithCacheKeyConfig(KEY)]
        )
        assert task.get_results() == [CODE.LLM_FAILED]
        assert task.errors() == ["synchronize_layer(1) raised SystemExit: 3"]
        # the instance still works
        task = p.cache_manager.transfer_cache_async(src, Ready(), [TransferWithCacheKeyConfig(KEY)])
        assert task.get_results() == [CODE.LLM_SUCCESS]
        assert p.cache_manager.statistics().pins == 0


def test_an_async_synchronizer_raising_system_exit_fails_its_destinations_only() -> None:
    """An ``async def`` synchronizer raising ``SystemExit`` on the caller's loop: the
    exception went on through that loop (``asyncio.run`` of the caller raised
    SystemExit) and the destination's reason read "synchronize_layer(1) was not
    called", although it was called and raised."""
    got: list[Any] = []

    class Exits:
        async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
            if layer_index == 1:
                raise SystemExit(3)
            return True

    async def main() -> None:
        async with linked_pair(config()) as (p, d):
            await d.cache_manager.allocate_blocks_cache(DESC, KEY)
            src = await p.cache_manager.allocate_blocks_cache(DESC)
            task = p.cache_manager.transfer_cache_async(
                src, Exits(), [TransferWithCacheKeyConfig(KEY)]
            )
            got.append(await asyncio.wait_for(task.get_results(), 10))
            got.append(task.errors())

    try:
        asyncio.run(main())
    except SystemExit:
        pytest.fail("the synchronizer's SystemExit went through the caller's event loop")
    assert got == [[CODE.LLM_FAILED], ["synchronize_layer(1) raised SystemExit: 3"]]


async def test_a_timeout_too_large_is_a_value_error() -> None:
    """``synchronize`` / ``get_results`` with a timeout past any float (``10**400``
    ms) raised ``OverflowError`` from the conversion to seconds; an int out of range is
    a ``ValueError`` (docs/contract.md, Errors). A uint64 still waits."""
    async with linked_pair(config()) as (p, d):
        await d.cache_manager.allocate_blocks_cache(DESC, KEY)
        src = await p.cache_manager.allocate_blocks_cache(DESC)
        task = p.cache_manager.transfer_cache_async(src, Ready(), [TransferWithCacheKeyConfig(KEY)])
        for call in (task.synchronize, task.get_results):
            with pytest.raises(ValueError, match="timeout_in_millis"):
                await call(10**400)
            with pytest.raises(ValueError, match="timeout_in_millis"):
                await call(2**64)
        assert await task.synchronize(2**64 - 1) == CODE.LLM_SUCCESS


async def test_a_destination_whose_layers_were_never_sent_is_not_reported_a_success(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A send that ends without landing and without an error (a stray cancellation of
    its task, which the task group ignores) leaves the destination's layers unsent: its
    result is a failure naming them, never ``LLM_SUCCESS`` by default."""
    import dataclasses

    from aiokv._layerwise import LayerPlan
    from aiokv._manager import _layers

    real = _layers.plan

    def stray(*args: Any) -> LayerPlan:
        p = real(*args)

        async def send(run: range) -> None:
            raise asyncio.CancelledError  # not the task's: nobody cancelled it

        return dataclasses.replace(p, send=send)

    monkeypatch.setattr(_layers, "plan", stray)
    async with linked_pair(config()) as (p, d):
        await d.cache_manager.allocate_blocks_cache(DESC, KEY)
        src = await p.cache_manager.allocate_blocks_cache(DESC)
        task = p.cache_manager.transfer_cache_async(src, Ready(), [TransferWithCacheKeyConfig(KEY)])
        assert await asyncio.wait_for(task.get_results(), 10) == [CODE.LLM_FAILED]
        assert "never sent" in str(task.errors()[0])
