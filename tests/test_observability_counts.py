"""Statistics as a user reads them: a layer-wise transfer is one operation per destination,
failed inline copies are exported, queue depth counts only jobs that will run, and a host
allocation failure is ``LLM_OUT_OF_MEMORY``."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest

from aiokv import BlocksCacheKey
from aiokv import Cache
from aiokv import CacheDesc
from aiokv import DataType
from aiokv import LLMDataDist
from aiokv import LLMException
from aiokv import LLMRole
from aiokv import LLMStatusCode
from aiokv import Placement
from aiokv import TransferWithCacheKeyConfig
from aiokv._remote import Move
from aiokv.testing import linked_pair
from aiokv.testing import make_config

CODE = LLMStatusCode
pytestmark = pytest.mark.timeout(60)


@contextlib.asynccontextmanager
async def host_cache(host_pool: int, desc: CacheDesc) -> AsyncIterator[tuple[LLMDataDist, Cache]]:
    """A decoder with a host pool of ``host_pool`` bytes (no listener) and a blocks cache
    of ``desc`` in it; finalized on exit."""
    d = LLMDataDist(LLMRole.DECODER, 2)
    await d.init(make_config(pool=None, host_pool=host_pool, listen_ip_info=None))
    try:
        yield d, await d.cache_manager.allocate_blocks_cache(desc)
    finally:
        await d.finalize()


# 2 layers (4 tensors) of 8 blocks of 256 bytes, host memory
LAYERED = CacheDesc(4, [8, 256], DataType.DT_UINT8, Placement.HOST)


async def test_a_layer_wise_transfer_counts_as_one_operation_per_destination() -> None:
    """docs/observability.md: ``LinkStats.requests`` counts "this side's pulls and pushes
    to it, layer-wise transfers included: each one operation, however many requests it
    is cut into". A layer-wise transfer whose layers were released one at a time (the
    model computing the next one) was counted once per request: a dashboard's ops and
    latency depended on the synchronizer's timing, and a destination that then failed
    (its synchronizer said False for layer 1) showed as one SUCCESSFUL operation with
    layer 0's bytes and no failure, while the caller's result was LLM_PARAM_INVALID."""
    async with linked_pair(make_config(pool=None, host_pool=4 << 20, sync_kv_timeout=3000)) as (
        p,
        d,
    ):
        src = await p.cache_manager.allocate_blocks_cache(LAYERED)
        await d.cache_manager.allocate_blocks_cache(LAYERED, BlocksCacheKey(2, 0))
        client = p.cache_manager._client
        real = client.move
        moves: list[range] = []
        first_sent = threading.Event()

        async def move(m: Move) -> None:  # counts the requests; layer 0's lands first
            moves.append(m.job.tensors)
            await real(m)
            first_sent.set()

        client.move = move  # type: ignore[method-assign]

        class Paced:
            """Releases layer 1 only once layer 0 has been sent alone; ``answer`` for it."""

            def __init__(self, answer: bool) -> None:
                self.answer = answer

            def synchronize_layer(self, layer_index: int, timeout_in_millis: Any) -> bool:
                if layer_index == 1:
                    assert first_sent.wait(10)
                    return self.answer
                return True

        cfg = TransferWithCacheKeyConfig(BlocksCacheKey(2, 0), range(0, 2), range(0, 2))
        whole = 4 * 2 * 256  # 4 tensors x 2 blocks

        task = p.cache_manager.transfer_cache_async(src, Paced(True), [cfg], [0, 1], [0, 1])
        assert await task.get_results() == [CODE.LLM_SUCCESS]
        assert len(moves) == 2  # two requests: the layers went one by one
        s = p.statistics().links[2].requests
        assert (s.ops, s.bytes, dict(s.failures), s.in_flight) == (1, whole, {}, 0)
        assert s.latency.count == 1

        first_sent.clear()
        moves.clear()
        task = p.cache_manager.transfer_cache_async(src, Paced(False), [cfg], [0, 1], [0, 1])
        assert await task.get_results() == [CODE.LLM_PARAM_INVALID]
        assert len(moves) == 1  # layer 0 went; layer 1 failed the destination
        s = p.statistics().links[2].requests
        assert (s.ops, s.bytes, s.in_flight) == (2, whole, 0)
        assert dict(s.failures) == {"LLM_PARAM_INVALID": 1}

        class Odd:  # raises an LLMException with a code llm_datadist does not name
            def synchronize_layer(self, layer_index: int, timeout_in_millis: Any) -> bool:
                raise LLMException("odd", status_code=12345)  # type: ignore[arg-type]

        task = p.cache_manager.transfer_cache_async(src, Odd(), [cfg], [0, 1], [0, 1])
        assert await task.get_results() == [12345]
        s = p.statistics().links[2].requests
        assert (s.ops, s.in_flight) == (3, 0)  # counted (as LLM_FAILED), not lost
        assert dict(s.failures) == {"LLM_PARAM_INVALID": 1, "LLM_FAILED": 1}


async def test_a_failed_inline_copy_is_exported_to_prometheus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``statistics().copies.inline.failures`` counts a failed small host copy (the
    common ``swap_blocks`` / ``copy_blocks`` of a block or two, done inline), but the
    Prometheus exporter had no series for it: ``aiokv_copy_failures_total`` covers the
    worker jobs only, so an alert on copy failures never saw these, while
    ``aiokv_copy_inline_total`` counted them among the inline copies as if done."""
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry
    from prometheus_client.openmetrics.exposition import generate_latest
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    import aiokv._manager._local as local
    from aiokv.metrics import Collector

    def fail(*_: object) -> None:
        raise MemoryError

    async with host_cache(1 << 20, CacheDesc(1, [8, 256], DataType.DT_UINT8, Placement.HOST)) as (
        d,
        cache,
    ):
        monkeypatch.setattr(local, "copy_rows", fail)
        with pytest.raises(LLMException) as ei:
            await d.cache_manager.copy_blocks(cache, {0: [1]})
        assert ei.value.status_code == CODE.LLM_OUT_OF_MEMORY
        inline = d.statistics().copies.inline
        assert dict(inline.failures) == {"LLM_OUT_OF_MEMORY": 1}
        registry = CollectorRegistry(auto_describe=False)
        registry.register(Collector(d))
        text = generate_latest(registry).decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    series = ("aiokv_copy_inline_failures_total", (("cluster", "2"), ("code", "LLM_OUT_OF_MEMORY")))
    assert samples.get(series) == 1.0


async def test_queue_depth_does_not_count_jobs_cancelled_while_queued() -> None:
    """``CopyStats.queue_depth`` / ``aiokv_copy_queue_depth``: "jobs waiting for a
    thread now". Jobs cancelled while queued behind a long copy never run (counted
    ``CANCELLED`` and no longer in flight), yet stayed counted as waiting until a thread
    got round to skipping them: the gauge said 3 jobs waited while ``in_flight``
    ("running or queued") said 1."""
    import asyncio

    import torch

    from aiokv._copy import CopyScheduler
    from aiokv._copy import SchedulerConfig

    sched = CopyScheduler(torch.device("cpu"), SchedulerConfig(swap_out_threads=1))
    gate, started = threading.Event(), threading.Event()

    def slow() -> None:
        started.set()
        assert gate.wait(30)

    try:
        first = asyncio.create_task(sched.call(slow))
        assert await asyncio.to_thread(started.wait, 30)
        queued = [asyncio.create_task(sched.call(lambda: None)) for _ in range(3)]
        for _ in range(1000):  # each submitted (queued behind the slow one)
            if sched.statistics().jobs.in_flight == 4:
                break
            await asyncio.sleep(0.01)
        assert sched.statistics().queue_depth == 3
        for t in queued:
            t.cancel()
        await asyncio.gather(*queued, return_exceptions=True)
        s = sched.statistics()
        assert dict(s.jobs.failures) == {"CANCELLED": 3} and s.jobs.in_flight == 1
        assert s.queue_depth == 0
    finally:
        gate.set()
        await first
        await sched.aclose()


async def test_torch_host_allocation_failure_in_a_copy_is_llm_out_of_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SPEC 1.2: torch's errors reach the caller "mapped to LLMException with a fitting
    code". torch's host allocator reports out of memory as a plain ``RuntimeError``
    ("DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes"), not
    ``MemoryError``; a local copy whose job could not allocate host memory (a staging
    buffer, the snapshot of an overlapping copy) raised ``LLM_FAILED`` and was counted
    so in ``statistics()``, where a ``MemoryError`` gives ``LLM_OUT_OF_MEMORY``."""
    import torch

    import aiokv._copy._scheduler as scheduler

    def allocating(*_: object) -> None:  # what a copy job does when memory is short
        torch.empty(1 << 62, dtype=torch.uint8)  # the real torch error: more than exists

    desc = CacheDesc(2, [64, 4096], DataType.DT_UINT8, Placement.HOST)
    async with host_cache(4 << 20, desc) as (d, cache):
        monkeypatch.setattr(scheduler, "copy_blocks_job", allocating)
        with pytest.raises(LLMException) as ei:  # 32 x 2 blocks of 4 KiB: a worker job
            await d.cache_manager.copy_blocks(cache, {0: list(range(1, 33))})
        assert ei.value.status_code == CODE.LLM_OUT_OF_MEMORY
        assert "you tried to allocate" in str(ei.value)  # how much, for a person
        assert dict(d.statistics().copies.jobs.failures) == {"LLM_OUT_OF_MEMORY": 1}
