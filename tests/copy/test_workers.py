"""Worker pools: results and errors, thread reuse, cancellation, threads joined or stopped."""

from __future__ import annotations

import asyncio
import functools
import threading

import pytest
import torch
from _helpers import run_code
from copy_helpers import CPU
from copy_helpers import Gate

from aiokv._copy import CopyScheduler
from aiokv._copy import SchedulerConfig


async def test_call_returns_and_raises(sched: CopyScheduler) -> None:
    assert await sched.call(lambda: 41 + 1) == 42
    name = await sched.call(lambda: threading.current_thread().name)
    assert name.startswith("aiokv-swap-out-")
    err = KeyError("boom")

    def fail() -> None:
        raise err

    with pytest.raises(KeyError) as info:
        await sched.call(fail)
    assert info.value is err  # the original exception, not a wrapper
    assert await sched.call(lambda: "ok") == "ok"
    with pytest.raises(RuntimeError, match="StopIteration"):
        await sched.call(lambda: next(iter(())))


async def test_many_concurrent_calls_use_few_threads() -> None:
    s = CopyScheduler(CPU, SchedulerConfig(swap_out_threads=2))
    try:
        results = await asyncio.gather(*(s.call(functools.partial(pow, i, 2)) for i in range(300)))
        assert results == [i * i for i in range(300)]
        assert 1 <= len(s.threads) <= 2
    finally:
        await s.aclose()


async def test_cancel_while_running_waits_for_the_job_and_returns_what_it_did(
    sched1: CopyScheduler,
) -> None:
    gate = Gate()
    task = asyncio.ensure_future(sched1.call(gate))
    await gate.started.wait()
    task.cancel()
    for _ in range(20):  # let the loop deliver the cancellation, twice over
        await asyncio.sleep(0)
    task.cancel()  # a second cancel is shielded as well
    for _ in range(20):
        await asyncio.sleep(0)
    assert not task.done(), "returned while the worker was still running"
    gate.release.set()
    # the job ran to its end: its result, not a cancellation (raised or returned,
    # never both); the task had no later suspension to take the cancellation at
    assert await task == "done"
    assert gate.finished
    assert await sched1.call(lambda: 7) == 7  # the scheduler still works


async def test_a_completed_job_returns_and_the_cancellation_comes_at_the_next_await(
    sched1: CopyScheduler,
) -> None:
    gate = Gate()
    got: list[str] = []

    async def caller() -> None:
        got.append(await sched1.call(gate))
        await asyncio.sleep(3600)  # the pending cancellation ends this at once

    task = asyncio.ensure_future(caller())
    await gate.started.wait()
    task.cancel()
    for _ in range(20):
        await asyncio.sleep(0)
    gate.release.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)
    assert got == ["done"]


async def test_a_failed_job_under_cancellation_raises_the_cancellation(
    sched1: CopyScheduler,
) -> None:
    loop = asyncio.get_running_loop()
    started, release = asyncio.Event(), threading.Event()

    def fail() -> None:
        loop.call_soon_threadsafe(started.set)
        release.wait()
        raise KeyError("boom")

    task = asyncio.ensure_future(sched1.call(fail))
    await started.wait()
    task.cancel()
    for _ in range(20):
        await asyncio.sleep(0)
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_cancel_before_start_never_runs(sched1: CopyScheduler) -> None:
    gate = Gate()
    blocker = asyncio.ensure_future(sched1.call(gate))
    await gate.started.wait()  # the only worker is busy
    ran: list[bool] = []
    queued = asyncio.ensure_future(sched1.call(lambda: ran.append(True)))
    src, dst = torch.ones(8, 64), torch.zeros(8, 64)
    copy = asyncio.ensure_future(sched1.copy_blocks([src], [dst], [(0, 0), (5, 3)]))
    await asyncio.sleep(0)  # both are submitted and waiting in the queue
    queued.cancel()
    copy.cancel()
    with pytest.raises(asyncio.CancelledError):
        await queued
    with pytest.raises(asyncio.CancelledError):
        await copy
    gate.release.set()
    assert await blocker == "done"
    await sched1.call(lambda: None)  # FIFO on one thread: everything before it is over
    assert ran == []
    assert dst.eq(0).all()


async def test_aclose_joins_threads_and_rejects_calls() -> None:
    before = set(threading.enumerate())
    s = CopyScheduler(CPU, SchedulerConfig(swap_out_threads=3))
    gates = [Gate() for _ in range(3)]
    tasks = [asyncio.ensure_future(s.call(g)) for g in gates]
    for g in gates:
        await g.started.wait()
    assert {t.name for t in s.threads} == {f"aiokv-swap-out-{i}" for i in range(3)}
    assert all(not t.daemon for t in s.threads)
    queued = asyncio.ensure_future(s.call(lambda: "queued"))
    await asyncio.sleep(0)
    closing = asyncio.ensure_future(s.aclose())
    await asyncio.sleep(0)
    for g in gates:
        g.release.set()
    await closing
    assert [await t for t in tasks] == ["done"] * 3
    assert await queued == "queued"  # queued work finishes before the threads stop
    assert not any(t.is_alive() for t in s.threads)
    assert set(threading.enumerate()) == before
    assert s.closed
    with pytest.raises(RuntimeError, match="closed"):
        await s.call(lambda: None)
    with pytest.raises(RuntimeError, match="closed"):
        await s.copy_blocks([torch.zeros(1)], [torch.zeros(1)], [(0, 0)])
    with pytest.raises(RuntimeError, match="closed"):
        await s.copy_many([])
    await s.aclose()  # idempotent


async def test_threads_start_on_demand() -> None:
    s = CopyScheduler(CPU)
    assert s.threads == []
    await s.call(lambda: None)
    await s.call(lambda: None)
    assert len(s.threads) == 1  # an idle thread is reused
    await s.aclose()


def test_unclosed_scheduler_does_not_hang_exit() -> None:
    out = run_code(
        "import asyncio, torch\n"
        "from aiokv._copy import CopyScheduler\n"
        "s = CopyScheduler(torch.device('cpu'))\n"
        "print(asyncio.run(s.call(lambda: 'ran')))\n"
    )
    assert out.stdout.strip() == "ran"


async def test_dropped_scheduler_stops_its_threads() -> None:
    s = CopyScheduler(CPU)
    await s.call(lambda: None)
    threads = s.threads
    del s
    for t in threads:
        t.join(timeout=10)  # the finalizer told it to stop; join is the proof
        assert not t.is_alive()
