"""``transfer_cache_async`` as llm_datadist shapes it (issue #8 item 2).

- a plain method returning the started ``CacheTask`` at once (aiokv, trio and aiokv.sync);
- a blocks cache without block indices sends every block (bytes checked on the peer);
- ``synchronize_layer`` gets ``timeout_in_millis=None`` and is waited for past
  ``sync_kv_timeout``; argument errors raise at once and pin nothing.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import AsyncIterator
from collections.abc import Sequence
from typing import Any

import anyio
import pytest
import torch

import aiokv
import aiokv.sync
from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import CacheTask
from aiokv import DataType
from aiokv import LLMConfig
from aiokv import LLMDataDist
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
BLOCKS = 8
DESC = CacheDesc(4, [BLOCKS, 256], DataType.DT_UINT8, Placement.HOST)  # 2 layers
KEY = BlocksCacheKey(2, 0)


def config(**kw: Any) -> LLMConfig:
    return make_config(pool=None, host_pool=4 << 20, **({"sync_kv_timeout": 3000} | kw))


def pattern() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(1, 256, (BLOCKS, 256), generator=g, dtype=torch.uint8) for _ in range(4)]


#: the prompt, its blocks cache filled with ``pattern()``, the tensors of the decoder's
#: empty blocks cache keyed ``KEY``
Setup = tuple[LLMDataDist, aiokv.Cache, list[torch.Tensor]]


@pytest.fixture
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[Setup]:
    """Prompt 1 with a filled blocks cache; decoder 2 with an empty one keyed ``KEY``
    (``sync_kv_timeout`` of the prompt: the parameter, 3000 ms without one)."""
    timeout = getattr(request, "param", 3000)
    async with linked_pair(config(sync_kv_timeout=timeout), config()) as (p, d):
        await d.cache_manager.allocate_blocks_cache(DESC, KEY)
        yield p, await filled_source(p), peer_tensors(d)


class Recorder:
    """A blocking synchronizer recording its calls (runs on a worker thread)."""

    def __init__(self, hold_s: float = 0.0, until: threading.Event | None = None) -> None:
        self.calls: list[tuple[int, Any]] = []
        self.first = threading.Event()
        self.hold_s = hold_s
        self.until = until  # set: each call also waits for it (10 s at most)

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        self.calls.append((layer_index, timeout_in_millis))
        self.first.set()
        time.sleep(self.hold_s)
        if self.until is not None:
            self.until.wait(10)
        return True


async def filled_source(p: LLMDataDist) -> aiokv.Cache:
    src = await p.cache_manager.allocate_blocks_cache(DESC)
    for t, want in zip(src.tensors, pattern(), strict=True):
        t.copy_(want)
    return src


def holds_pattern(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether ``tensors`` are, layer by layer, equal to ``pattern()``."""
    want = pattern()
    return len(tensors) == len(want) and all(map(torch.equal, tensors, want))


def peer_tensors(d: LLMDataDist) -> list[torch.Tensor]:
    entry = next(e for e in d.cache_manager._registry.entries.values())
    return list(entry.cache.tensors)


def test_a_plain_method_on_both_apis() -> None:
    assert not inspect.iscoroutinefunction(aiokv.CacheManager.transfer_cache_async)
    assert not inspect.iscoroutinefunction(aiokv.sync.CacheManager.transfer_cache_async)


async def test_returns_the_started_task_at_once(pair: Setup) -> None:
    p, src, dst = pair
    sync = Recorder()
    task = p.cache_manager.transfer_cache_async(src, sync, [TransferWithCacheKeyConfig(KEY)])
    assert isinstance(task, CacheTask) and not asyncio.iscoroutine(task)
    # started on the engine without this loop awaiting anything of it
    assert await asyncio.to_thread(sync.first.wait, 5)
    assert await task == [CODE.LLM_SUCCESS]
    assert task.done()
    assert await task.synchronize() == CODE.LLM_SUCCESS
    assert holds_pattern(dst)
    assert p.cache_manager.statistics().pins == 0


async def test_blocks_cache_without_indices_sends_every_block(pair: Setup) -> None:
    p, src, dst = pair
    task = p.cache_manager.transfer_cache_async(src, Recorder(), [TransferWithCacheKeyConfig(KEY)])
    assert await task.synchronize() == CODE.LLM_SUCCESS
    assert holds_pattern(dst)
    # empty lists are "no indices" too (llm_datadist passes [] for None); raw addresses
    for t in dst:
        t.zero_()
    addrs = [t.data_ptr() for t in dst]
    task = p.cache_manager.transfer_cache_async(src, Recorder(), [TransferConfig(2, addrs)], [], [])
    assert await task == [CODE.LLM_SUCCESS]
    assert holds_pattern(dst)


@pytest.mark.parametrize("pair", [100], indirect=True)  # sync_kv_timeout = 100 ms
async def test_synchronizer_gets_none_and_may_take_longer_than_sync_kv_timeout(
    pair: Setup,
) -> None:
    p, src, dst = pair
    blocking = Recorder(hold_s=0.3)  # 3x sync_kv_timeout per layer
    task = p.cache_manager.transfer_cache_async(src, blocking, [TransferWithCacheKeyConfig(KEY)])
    assert await task.get_results() == [CODE.LLM_SUCCESS]
    assert blocking.calls == [(0, None), (1, None)]
    assert holds_pattern(dst)

    seen: list[Any] = []

    class Slow:
        async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
            seen.append(timeout_in_millis)
            await asyncio.sleep(0.3)
            return True

    task = p.cache_manager.transfer_cache_async(src, Slow(), [TransferWithCacheKeyConfig(KEY)])
    assert await task.synchronize() == CODE.LLM_SUCCESS
    assert seen == [None, None]


async def test_errors_say_why_each_destination_failed(pair: Setup) -> None:
    """The codes say that a destination failed; ``errors()`` says why (aiokv's
    addition), for a synchronizer that raised, one that returned something else than
    True, and a send the peer refused; None where nothing failed."""
    p, src, _ = pair
    cm = p.cache_manager

    class Raises:
        def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
            if layer_index == 1:
                raise RuntimeError("the model crashed")
            return True

    class SaysNo:
        async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> Any:
            return "no"

    task = cm.transfer_cache_async(src, Raises(), [TransferWithCacheKeyConfig(KEY)])
    assert task.errors() == [None]  # nothing failed yet (it may not have started)
    assert await task.get_results() == [CODE.LLM_FAILED]
    assert task.errors() == ["synchronize_layer(1) raised RuntimeError: the model crashed"]
    gone = TransferWithCacheKeyConfig(BlocksCacheKey(2, 7))  # no such key on the peer
    task = cm.transfer_cache_async(src, Recorder(), [TransferWithCacheKeyConfig(KEY), gone])
    assert (await task)[0] == CODE.LLM_SUCCESS
    errors = task.errors()
    assert errors[0] is None
    assert errors[1] is not None and errors[1].startswith("layers 0-")
    assert "to destination 1: LLMException: " in errors[1] and "no cache" in errors[1]
    task = cm.transfer_cache_async(src, SaysNo(), [TransferWithCacheKeyConfig(KEY)])
    assert await task.synchronize() != CODE.LLM_SUCCESS
    assert task.errors() == ["synchronize_layer(0) returned 'no', not True"]
    task = cm.transfer_cache_async(src, Recorder(), [TransferWithCacheKeyConfig(KEY)])
    assert await task == [CODE.LLM_SUCCESS] and task.errors() == [None]


async def test_bad_arguments_raise_at_once_and_pin_nothing(pair: Setup) -> None:
    p, src, _ = pair
    cm = p.cache_manager
    cfg = [TransferWithCacheKeyConfig(KEY)]
    for srcs, dsts in [([0], None), (None, [0]), ([0], []), ([0], [1, 2]), ([BLOCKS], [0])]:
        with pytest.raises(LLMException) as ei:
            cm.transfer_cache_async(src, Recorder(), cfg, srcs, dsts)
        assert ei.value.status_code == CODE.LLM_PARAM_INVALID, (srcs, dsts)
    with pytest.raises(LLMException) as ei:
        cm.transfer_cache_async(src, Recorder(), [TransferWithCacheKeyConfig(BlocksCacheKey(9))])
    assert ei.value.status_code == CODE.LLM_NOT_YET_LINK
    assert cm.statistics().pins == 0


def test_from_trio() -> None:
    async def main() -> None:
        async with linked_pair(config()) as (p, d):
            await d.cache_manager.allocate_blocks_cache(DESC, KEY)
            src = await filled_source(p)

            class OnTrio:  # an async synchronizer runs on the caller's (trio) loop
                async def synchronize_layer(self, layer: int, timeout_ms: int | None) -> bool:
                    await anyio.sleep(0.01)
                    return timeout_ms is None

            task = p.cache_manager.transfer_cache_async(
                src, OnTrio(), [TransferWithCacheKeyConfig(KEY)]
            )
            assert isinstance(task, CacheTask)
            assert await task.synchronize() == CODE.LLM_SUCCESS
            assert holds_pattern(peer_tensors(d))

    anyio.run(main, backend="trio")


def test_blocking_api_returns_a_blocking_task() -> None:
    with (
        aiokv.sync.LLMDataDist(LLMRole.PROMPT, 1, config(sync_kv_timeout=400)) as p,
        aiokv.sync.LLMDataDist(LLMRole.DECODER, 2, config()) as d,
    ):
        code, _ = d.link_clusters([cluster_info(1, p.listen_address)])
        assert code == CODE.LLM_SUCCESS
        dst = d.cache_manager.allocate_blocks_cache(DESC, KEY)
        src = p.cache_manager.allocate_blocks_cache(DESC)
        for t, want in zip(src.tensors, pattern(), strict=True):
            t.copy_(want)
        sync = Recorder(hold_s=0.6)  # longer than sync_kv_timeout
        task = p.cache_manager.transfer_cache_async(src, sync, [TransferWithCacheKeyConfig(KEY)])
        assert isinstance(task, aiokv.sync.CacheTask)
        assert sync.first.wait(5)  # already running
        assert task.synchronize() == CODE.LLM_SUCCESS
        assert task.get_results() == [CODE.LLM_SUCCESS]
        assert task.done()
        assert sync.calls == [(0, None), (1, None)]
        assert holds_pattern(dst.tensors)
        with pytest.raises(LLMException):
            p.cache_manager.transfer_cache_async(src, sync, [TransferWithCacheKeyConfig(KEY)], [0])
        assert p.cache_manager.statistics().pins == 0
        # cancelled from this thread while its synchronizer holds layer 0
        release = threading.Event()
        held = Recorder(hold_s=0.0, until=release)
        task = p.cache_manager.transfer_cache_async(src, held, [TransferWithCacheKeyConfig(KEY)])
        assert held.first.wait(5) and not task.done() and task.errors() == [None]
        task.cancel()
        assert task.synchronize() == CODE.LLM_FAILED  # waits for the end
        assert task.done() and task.get_results() == [None] and task.errors() == [None]
        release.set()
        assert held.calls == [(0, None)] and p.cache_manager.statistics().pins == 0
        assert (p.cluster_id, d.cluster_id, p.cache_manager.device.type) == (1, 2, "cpu")
        assert repr(p) == "LLMDataDist(role=PROMPT, cluster_id=1, initialized)"
