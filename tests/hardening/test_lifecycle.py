"""Cancellation-safe ``finalize`` (issue #9 item 11).

Reported on an older main: ``finalize`` cancelled after a few loop turns left a worker
thread alive; cancelled by a timeout during a layer-wise transfer it left the listener
accepting while ``initialized`` was False, and a second ``finalize`` did nothing.

The guarantee tested here (docs/design.md, Lifecycle): once ``finalize`` has been
called, the teardown runs to its end on the engine whatever happens to the caller;
``initialized`` stays True until it has (listener and links closed, workers joined,
pools released), and turns False only then; ``finalize`` again waits for the end and
returns with no thread of the instance left. Cancelled at ANY loop turn, the listener
still closes by itself, without a retry.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import socket
import threading
import time
import weakref
from typing import Any

import pytest

from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import DataType
from aiokv import LLMConfig
from aiokv import LLMDataDist
from aiokv import LLMRole
from aiokv import LLMStatusCode
from aiokv import Placement
from aiokv import TransferWithCacheKeyConfig
from aiokv.testing import cluster_info as info
from aiokv.testing import make_config

LAYERS = 16
DESC = CacheDesc(2 * LAYERS, [8, 1024], DataType.DT_UINT8, Placement.DEVICE)


def config() -> LLMConfig:
    return make_config("tcp", pool=1 << 20, host_pool=1 << 20)


def aiokv_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("aiokv"))


def refuses(address: tuple[str, int]) -> bool:
    """Whether nothing accepts connections at ``address`` any more."""
    try:
        socket.create_connection(address, timeout=1).close()
    except ConnectionRefusedError:
        return True
    except ConnectionResetError:
        return False  # accepted into the backlog of a listener that is closing: ask again
    return False


def regions(dd: LLMDataDist) -> list[weakref.ref[Any]]:
    """Weak references to the instance's pool memory (what 'released' means here)."""
    mgr = dd.cache_manager
    return [weakref.ref(p.region) for p in mgr._pools.values() if p is not None]


def released(refs: list[weakref.ref[Any]]) -> bool:
    gc.collect()
    return all(r() is None for r in refs)


async def eventually(cond: Any, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


async def check_finished(dd: LLMDataDist, address: tuple[str, int], allowed: set[str]) -> None:
    """After a completed finalize: nothing of ``dd`` is left."""
    assert not dd.initialized
    assert f"aiokv-engine-{dd.cluster_id}" not in aiokv_threads()
    assert set(aiokv_threads()) <= allowed
    assert refuses(address)
    with pytest.raises(RuntimeError):
        dd.cache_manager  # noqa: B018
    await dd.finalize()  # idempotent


async def check_after_cancel(dd: LLMDataDist, address: tuple[str, int], mgr: Any) -> bool:
    """After a cancelled finalize: a consistent state. Either finalize never began (its
    task was cancelled before it first ran: the instance is untouched and usable) or
    it began: new operations are refused and the teardown completes without a retry
    (the listener closes by itself). Returns whether it began."""
    try:
        cache = await mgr.allocate_blocks_cache(DESC)
    except RuntimeError:
        began = True
    else:
        began = False
        await mgr.deallocate_blocks_cache(cache)
    if began:
        with pytest.raises(RuntimeError):
            dd.cache_manager  # noqa: B018
        assert await eventually(lambda: refuses(address))
        assert await eventually(lambda: not dd.initialized)  # complete, nobody waiting
    else:
        assert dd.initialized and not refuses(address)
    return began


@pytest.mark.parametrize("turns", range(0, 12))
async def test_finalize_cancelled_after_n_loop_turns_then_retried(turns: int) -> None:
    before = set(aiokv_threads())
    dd = LLMDataDist(LLMRole.PROMPT, 100 + turns, config())
    await dd.init(config())
    address = dd.listen_address
    assert address is not None
    mgr = dd.cache_manager
    await mgr.allocate_blocks_cache(DESC, BlocksCacheKey(1, 0))  # some pool memory in use
    refs = regions(dd)
    task = asyncio.create_task(dd.finalize())
    for _ in range(turns):
        await asyncio.sleep(0)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert await check_after_cancel(dd, address, mgr) or turns == 0
    await dd.finalize()  # a retry completes (or finds complete) what the first began
    del mgr
    await check_finished(dd, address, before)
    assert released(refs)


class SlowSync:
    """An ``async def`` synchronizer: one layer per 50 ms."""

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        await asyncio.sleep(0.05)
        return True


class SlowBlockingSync:
    """A blocking ``def`` synchronizer (a device event): one layer per 50 ms."""

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        time.sleep(0.05)
        return True


async def finalize_within(dd: LLMDataDist, seconds: float) -> None:
    async with asyncio.timeout(seconds):
        await dd.finalize()
        await asyncio.sleep(10)  # finalize finished in time: time out here


@pytest.mark.parametrize("timeout_s", [0.0, 0.001, 0.005, 0.02, 0.1])
@pytest.mark.parametrize("sync", [SlowSync, SlowBlockingSync])
async def test_finalize_timed_out_during_layerwise_transfer(timeout_s: float, sync: type) -> None:
    before = set(threading.enumerate())
    names = set(aiokv_threads())
    d_started: set[threading.Thread] = set()

    def d_threads() -> set[str]:  # the decoder's (named like the prompt's workers)
        return {t.name for t in d_started if t.is_alive()}

    p = LLMDataDist(LLMRole.PROMPT, 201, config())
    d = LLMDataDist(LLMRole.DECODER, 202, config())
    await d.init(config())
    await d.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(202, 0))
    d_started.update(t for t in threading.enumerate() if t not in before)
    await p.init(config())
    try:
        address = p.listen_address
        assert address is not None
        code, _ = await p.link_clusters([info(202, d.listen_address)])
        assert code == LLMStatusCode.LLM_SUCCESS
        mgr = p.cache_manager
        src = await mgr.allocate_blocks_cache(DESC)
        refs = regions(p)
        blocks = list(range(8))
        cfg = TransferWithCacheKeyConfig(BlocksCacheKey(202, 0))
        task = mgr.transfer_cache_async(src, sync(), [cfg], blocks, blocks)
        await asyncio.sleep(0.06)  # a layer or two sent
        with pytest.raises(TimeoutError):
            await finalize_within(p, timeout_s)
        assert await check_after_cancel(p, address, mgr)
        await p.finalize()
        assert await task.synchronize(5000) != LLMStatusCode.LLM_SUCCESS  # cut short
        del mgr, src, task
        await check_finished(p, address, names | d_threads())
        assert released(refs)
    finally:
        await p.finalize()
        await d.finalize()
    assert aiokv_threads() == sorted(names)
    # the def synchronizer's executor thread too: nothing is left behind
    assert await eventually(lambda: set(threading.enumerate()) <= before)


@pytest.mark.parametrize("delay_s", [0.0, 0.0005, 0.002, 0.01])
def test_blocking_finalize_interrupted_then_retried(delay_s: float) -> None:
    """``aiokv.sync``: Ctrl-C (SIGINT -> KeyboardInterrupt) while ``finalize`` blocks."""
    import aiokv.sync as sync_api

    before = set(aiokv_threads())
    dd = sync_api.LLMDataDist(LLMRole.PROMPT, 301)
    dd.init(config())
    address = dd.listen_address
    assert address is not None
    armed = True

    def on_sigint(signum: int, frame: Any) -> None:
        if armed:  # a late signal (finalize already returned) is dropped, not raised
            raise KeyboardInterrupt

    old = signal.signal(signal.SIGINT, on_sigint)
    main = threading.main_thread().ident
    assert main == threading.get_ident()
    timer = threading.Timer(delay_s, signal.pthread_kill, (main, signal.SIGINT))
    try:
        try:
            try:
                timer.start()
                dd.finalize()
            finally:
                timer.join()
                time.sleep(0.01)  # the handler runs here at the latest
        except KeyboardInterrupt:
            pass
        armed = False
    finally:
        signal.signal(signal.SIGINT, old)
    assert refuses(address) or dd.initialized
    dd.finalize()  # the retry completes it
    assert not dd.initialized
    assert set(aiokv_threads()) <= before
    assert refuses(address)
    dd.finalize()
