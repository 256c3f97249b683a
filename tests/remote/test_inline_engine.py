"""``engine_thread=False`` (issue #24): the engine runs inline on the asyncio loop that
awaits ``init``, with no thread of its own and no hop per operation.

- bytes arrive both ways between inline instances, and between an inline and a threaded
  one, over tcp and nixl; nothing of aiokv is left on the loop or as a thread after
  ``finalize``; memory is back in the pools;
- a pull cancelled mid-flight is over when its cancellation is seen; the link and the
  caches serve on;
- where there is no asyncio loop to run on (``aiokv.sync``, trio), the option is refused
  and nothing starts.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import anyio
import numpy as np
import pytest
from _helpers import fill_bytes
from _helpers import loop_turns
from _helpers import same_rows

import aiokv.sync as blocking
from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import DataType
from aiokv import LLMConfig
from aiokv import LLMDataDist
from aiokv import LLMException
from aiokv import LLMRole
from aiokv import LLMStatusCode
from aiokv.testing import linked_pair
from aiokv.testing import make_config
from aiokv.testing import skip_unless_transport

BLOCKS = 96
DESC = CacheDesc(2, [BLOCKS, 4096], DataType.DT_UINT8)


def config(transport: str = "tcp", **kw: Any) -> LLMConfig:
    return make_config(transport, engine_thread=False, **kw)


def engine_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("aiokv-engine")]


def aiokv_tasks() -> list[asyncio.Task[Any]]:
    """Tasks of this loop other than the test's own (aiokv's: links, leases, pumps)."""
    return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]


async def round_trip(p: LLMDataDist, d: LLMDataDist) -> None:
    """The decoder pulls 80 scattered blocks of the prompt's cache, the prompt pushes 40
    back into others; every byte checked, then both caches released."""
    src = await p.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(1, 0))
    dst = await d.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(2, 0))
    fill_bytes(src, 1)
    fill_bytes(dst, 2)
    rng = np.random.default_rng(0)
    srcs = rng.permutation(BLOCKS)[:80].tolist()
    dsts = rng.permutation(BLOCKS)[:80].tolist()
    for _ in range(3):  # by request, then (nixl) under the lease asked for meanwhile
        await d.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, srcs, dsts)
        await same_rows(dst, dsts, src, srcs)
        fill_bytes(src, 3)
        await p.cache_manager.push_blocks(BlocksCacheKey(2, 0), src, srcs[:40], dsts[40:])
        await same_rows(dst, dsts[40:], src, srcs[:40])
    await d.cache_manager.deallocate_blocks_cache(dst)
    await p.cache_manager.deallocate_blocks_cache(src)
    assert p.cache_manager.statistics().caches == d.cache_manager.statistics().caches == 0


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
@pytest.mark.parametrize(
    ("prompt_inline", "decoder_inline"), [(True, True), (True, False), (False, True)]
)
async def test_bytes_arrive_and_nothing_is_left_after_finalize(
    transport: str, prompt_inline: bool, decoder_inline: bool
) -> None:
    if transport == "nixl":
        skip_unless_transport("nixl")
    threads_before = engine_threads()
    pc = make_config(transport, engine_thread=not prompt_inline)
    dc = make_config(transport, engine_thread=not decoder_inline)
    async with linked_pair(pc, dc) as (p, d):
        started = len(engine_threads()) - len(threads_before)
        assert started == (not prompt_inline) + (not decoder_inline)  # none for inline
        await round_trip(p, d)
        await d.check_link_status(1)  # raises unless the link is up
    assert engine_threads() == threads_before
    assert aiokv_tasks() == []
    assert not p.initialized and not d.initialized


async def test_an_inline_operation_yields_to_the_loop_and_a_cancelled_one_is_over() -> None:
    """A loop of operations that never wait (here: link checks) still lets the loop's
    other tasks run; a pull cancelled in flight has ended when its cancellation is seen,
    after which the link and both caches serve as before."""
    async with linked_pair(config()) as (p, d):
        async with loop_turns() as turns:
            for _ in range(50):
                await d.check_link_status(1)
            assert turns() >= 49

        big = CacheDesc(2, [1024, 16384], DataType.DT_UINT8)  # 32 MiB: many loop turns
        src = await p.cache_manager.allocate_blocks_cache(big, BlocksCacheKey(1, 0))
        dst = await d.cache_manager.allocate_blocks_cache(big)
        fill_bytes(src, 5)
        blocks = list(range(1024))
        outcomes = set()
        for delay in (0.0, 0.002, 0.01, 0.03):
            pull = asyncio.create_task(
                d.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, blocks, blocks)
            )
            await asyncio.sleep(delay)
            pull.cancel()
            try:
                await pull
                outcomes.add("done")
            except asyncio.CancelledError:
                outcomes.add("cancelled")
            assert d.cache_manager.statistics().caches == 1
        assert "cancelled" in outcomes
        await d.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, blocks, blocks)
        await same_rows(dst, blocks, src, blocks)
        await d.cache_manager.deallocate_blocks_cache(dst)
        await p.cache_manager.deallocate_blocks_cache(src)
    assert aiokv_tasks() == []


async def test_other_threads_reach_an_inline_engine_as_an_engine_thread() -> None:
    """A plain thread's blocking call and another thread's own event loop both run their
    operation on the inline engine's loop (which keeps running here)."""
    async with linked_pair(config()) as (_, d):
        assert d._engine is not None and d._engine.inline
        engine = d._engine

        async def status() -> str:
            assert engine.on_engine()  # run on the inline loop
            await d.check_link_status(1)
            return threading.current_thread().name

        me = threading.current_thread().name
        assert await asyncio.to_thread(engine.call, status) == me
        await asyncio.to_thread(asyncio.run, d.check_link_status(1))  # another loop
        with pytest.raises(LLMException) as ei:
            await asyncio.to_thread(asyncio.run, d.check_link_status(9))
        assert ei.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK
        with pytest.raises(RuntimeError, match="would deadlock"):
            engine.call(status)  # this thread runs the loop: a blocking wait never ends


def test_no_asyncio_loop_to_run_on_is_refused_and_nothing_starts() -> None:
    threads_before = threading.active_count()
    dd = blocking.LLMDataDist(LLMRole.PROMPT, 1)
    with pytest.raises(LLMException) as ei:
        dd.init(config())
    assert ei.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert "engine_thread=False" in str(ei.value) and "aiokv.sync" in str(ei.value)
    assert not dd.initialized and threading.active_count() == threads_before

    async def on_trio() -> str:
        async with LLMDataDist(LLMRole.PROMPT, 2) as trio_dd:
            try:
                await trio_dd.init(config())
            except LLMException as exc:
                return str(exc)
            return ""

    assert "engine_thread=False" in anyio.run(on_trio, backend="trio")
    dd.init(make_config("tcp", engine_thread=True))  # the same instance, threaded: fine
    dd.finalize()


async def test_a_blocked_loop_stalls_an_inline_peer_and_its_timeout_says_so() -> None:
    """The documented price: whatever blocks the inline loop blocks the peer service.
    A threaded decoder's pull from an inline prompt whose loop sleeps waits for it, and
    completes once the loop runs again (within ``sync_kv_timeout``)."""
    async with linked_pair(config(), make_config("tcp", engine_thread=True)) as (p, d):
        src = await p.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(1, 0))
        dst = await d.cache_manager.allocate_blocks_cache(DESC)
        fill_bytes(src, 7)
        assert d._engine is not None
        done = threading.Event()

        def pull() -> None:
            d._engine.call(d.cache_manager.pull_blocks, BlocksCacheKey(1, 0), dst, [3], [4])  # type: ignore[union-attr]
            done.set()

        worker = threading.Thread(target=pull)
        t0 = time.monotonic()
        worker.start()
        time.sleep(0.3)  # noqa: ASYNC251  (the point: the inline prompt's loop is blocked)
        assert not done.is_set()
        await asyncio.to_thread(worker.join, 10)
        assert done.is_set() and time.monotonic() - t0 >= 0.3
        await same_rows(dst, [4], src, [3])
        await d.cache_manager.deallocate_blocks_cache(dst)
        await p.cache_manager.deallocate_blocks_cache(src)
