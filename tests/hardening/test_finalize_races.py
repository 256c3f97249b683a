"""Threads racing finalize and each other: copies submitted as the workers close, two
loops starting copy threads, a cache freed during copy_cache, init undone by finalize,
old blocking handles, finalize on the engine thread. Each race is forced at a known
point (a step held on an Event or a Barrier) and every wait is bounded."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import types
import warnings
from typing import Any

import pytest
from _helpers import not_listening

import aiokv._copy._scheduler as scheduler_mod
import aiokv._copy._workers as workers_mod
import aiokv._datadist as datadist_mod
import aiokv._manager._local as local_mod
import aiokv.sync as llm_datadist
from aiokv import CacheDesc
from aiokv import DataType
from aiokv import LLMDataDist
from aiokv import LLMException
from aiokv import LLMRole
from aiokv import LLMStatusCode

pytestmark = pytest.mark.timeout(60)

DESC = CacheDesc(2, [2, 1024], DataType.DT_UINT8)


def _in_thread(fn: Any, *args: Any) -> tuple[threading.Thread, list[Any]]:
    """Run ``fn(*args)`` on a thread of its own; its outcome (result or exception)
    goes in the list."""
    out: list[Any] = []

    def body() -> None:
        try:
            out.append(fn(*args))
        except BaseException as exc:
            out.append(exc)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t, out


def _copier_held_before_submit(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> tuple[threading.Event, threading.Event]:
    """Hold a copy job on thread ``name`` after ``CopyScheduler._check_open`` passed and
    before the job is queued (where the GIL may switch to the engine thread)."""
    reached, go = threading.Event(), threading.Event()
    real = scheduler_mod.is_accelerator

    def held(device: Any) -> bool:
        if threading.current_thread().name == name and not reached.is_set():
            reached.set()
            go.wait(10)
        return real(device)

    monkeypatch.setattr(scheduler_mod, "is_accelerator", held)
    return reached, go


def test_copy_racing_finalize_does_not_wait_forever(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/design.md: "Calls from other threads that reach the engine while it closes
    fail with LLMException(LLM_FAILED) or RuntimeError; none waits forever". A
    ``copy_cache`` from another thread's loop that passed the copy scheduler's check as
    ``finalize`` closed the copy workers: its job, queued after ``WorkerPool.aclose``
    queued its stop markers, took the idle count of a thread that had exited (so no
    thread was started) and sat in the queue for ever; ``copy_cache`` never returned."""
    dd = LLMDataDist(LLMRole.PROMPT, 421)
    asyncio.run(dd.init(not_listening(pool=1 << 20)))
    cm = dd.cache_manager
    a = asyncio.run(cm.allocate_cache(DESC))
    b = asyncio.run(cm.allocate_cache(DESC))
    reached, go = _copier_held_before_submit(monkeypatch, "copier-421")

    async def copy() -> str:
        try:
            await asyncio.wait_for(cm.copy_cache(b, a), 3)
        except TimeoutError:
            return "hung"
        except (LLMException, RuntimeError) as exc:
            return f"refused: {exc}"
        return "copied"

    outcome: list[str] = []
    copier = threading.Thread(
        target=lambda: outcome.append(asyncio.run(copy())), name="copier-421", daemon=True
    )
    copier.start()
    assert reached.wait(10)
    asyncio.run(dd.finalize())  # closes and joins the copy workers
    go.set()
    copier.join(15)
    assert not copier.is_alive()
    assert outcome != ["hung"], "copy_cache racing finalize waits forever"
    assert outcome[0].startswith("refused"), outcome


async def test_a_job_submitted_as_the_pool_closes_leaves_no_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """WorkerPool: "Threads ... exit after the jobs queued before aclose"; finalize leaves
    no thread of the instance. A job submitted from another thread (another loop) while
    ``aclose`` ran, with no thread idle, started a new non-daemon worker after ``aclose``
    had counted the threads to stop: it waits on the queue for ever."""
    pool = workers_mod.WorkerPool("review-close", 2)
    reached, go = threading.Event(), threading.Event()
    real = pool._submit

    def held(job: Any) -> None:
        reached.set()
        go.wait(10)
        real(job)

    monkeypatch.setattr(pool, "_submit", held)

    async def submit() -> str:
        try:
            return await asyncio.wait_for(pool.run(lambda: "ran"), 3)
        except RuntimeError as exc:
            return f"refused: {exc}"

    t, out = _in_thread(asyncio.run, submit())
    assert await asyncio.to_thread(reached.wait, 10)
    await pool.aclose()  # no thread yet: nothing to stop
    go.set()
    await asyncio.to_thread(t.join, 10)
    alive = [w.name for w in pool.threads if w.is_alive()]
    pool.stop_nowait()  # let a leaked worker go
    assert alive == [], f"worker started after aclose, never stopped: {alive} ({out})"
    assert out and str(out[0]).startswith("refused"), out


def test_two_loops_never_start_more_copy_threads_than_configured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``swap_out_threads`` bounds the swap-out pool ("Threads start on demand" up to
    ``size``). Two asyncio loops on two threads sharing one LLMDataDist submit at once
    while no thread is idle: both see fewer than ``size`` threads, and both start one."""
    dd = LLMDataDist(LLMRole.PROMPT, 423)
    asyncio.run(dd.init(not_listening(pool=1 << 20, swap_out_threads=2)))
    cm = dd.cache_manager
    scheduler = dd._scheduler
    assert scheduler is not None
    caches = [asyncio.run(cm.allocate_cache(DESC)) for _ in range(4)]
    busy, done = threading.Event(), threading.Event()

    def occupy() -> None:  # the thread init started (its pool reservation) is busy
        busy.set()
        done.wait(10)

    blocker, _ = _in_thread(asyncio.run, scheduler.call(occupy))
    assert busy.wait(10)
    both = threading.Barrier(2, timeout=2)
    real = threading.Thread

    def thread(*args: Any, **kwargs: Any) -> threading.Thread:
        with contextlib.suppress(threading.BrokenBarrierError):
            both.wait()  # both submitters are past the "start a thread?" check
        return real(*args, **kwargs)

    shim = types.ModuleType("threading")
    shim.__dict__.update(vars(threading))
    shim.Thread = thread  # type: ignore[attr-defined]
    monkeypatch.setattr(workers_mod, "threading", shim)
    try:
        runs = [_in_thread(asyncio.run, cm.copy_cache(caches[i + 1], caches[i])) for i in (0, 2)]
        for t, _ in runs:
            t.join(15)
        assert [out for _, out in runs] == [[None], [None]]
        started = [t.name for t in scheduler._swap_out.threads]
    finally:
        monkeypatch.undo()
        done.set()
        blocker.join(10)
        asyncio.run(dd.finalize())
    assert len(started) <= 2, f"swap_out_threads=2 but {started} started"


def test_copy_cache_of_a_cache_freed_meanwhile_is_not_exist(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """contract.md: a cache released meanwhile is ``LLM_KV_CACHE_NOT_EXIST`` (pin:
    "another thread dropped its last reference after it was looked up"). copy_cache
    built its tensor views before it pinned: a source freed by another thread between
    the look-up and the pin had no tensors, and ``zip(strict=True)`` raised a bare
    ``ValueError`` ("zip() argument 2 is shorter")."""
    dd = LLMDataDist(LLMRole.PROMPT, 424)
    asyncio.run(dd.init(not_listening(pool=1 << 20)))
    cm = dd.cache_manager
    src = asyncio.run(cm.allocate_cache(DESC))
    dst = asyncio.run(cm.allocate_cache(DESC))
    real = local_mod.check_index
    freed: list[Any] = []

    def check_index(*args: Any) -> int:
        if not freed:  # after the look-ups: another thread frees the source now
            t, out = _in_thread(asyncio.run, cm.deallocate_cache(src))
            t.join(10)
            freed.append(out)
        return real(*args)

    monkeypatch.setattr(local_mod, "check_index", check_index)
    try:
        with pytest.raises(LLMException) as caught:
            asyncio.run(cm.copy_cache(dst, src))
        assert caught.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
        assert freed == [[None]] and src.tensors == []
    finally:
        monkeypatch.undo()
        asyncio.run(dd.finalize())


def test_blocking_manager_used_after_finalize_raises_runtime_error() -> None:
    """contract.md: "After finalize() every CacheManager / KvCacheManager call raises
    RuntimeError" (the async manager does). The blocking face hopped to the ended
    engine and raised LLMException(LLM_FAILED) "finalized while this ran", though it
    was finalized before the call."""
    dd = llm_datadist.LLMDataDist(LLMRole.PROMPT, 425)
    dd.init(not_listening(pool=1 << 20))
    cm = dd.cache_manager
    dd.finalize()
    with pytest.raises(RuntimeError) as caught:
        cm.allocate_cache(DESC)
    # the async manager's error: not an LLMException (an operation that failed), and
    # not "finalized while this ran"
    assert type(caught.value) is RuntimeError, repr(caught.value)
    assert "allocate_cache: the LLMDataDist was finalized" in str(caught.value)


def test_async_finalize_on_the_engine_thread_starts_nothing() -> None:
    """``finalize`` on the engine thread raises RuntimeError ("called on the engine
    thread", as the blocking one). It began the teardown first: the instance was being
    finalized although the call said it refused."""
    dd = llm_datadist.LLMDataDist(LLMRole.PROMPT, 426)
    dd.init(not_listening(pool=1 << 20))
    engine = dd._async._engine
    assert engine is not None
    try:
        with pytest.raises(RuntimeError, match="engine thread"):
            engine.call(dd._async.finalize)
        assert not dd._async._closing, "finalize refused, yet the teardown began"
        dd.cache_manager.allocate_cache(DESC)  # still usable
    finally:
        dd.finalize()
    assert not dd.initialized


def test_init_racing_finalize_leaves_no_live_instance(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_started`` checked only ``self._engine is engine``: a finalize (on another thread)
    begun once the build ended but before ``_started`` let init return normally for an
    instance being finalized, and ``_ended`` running in the middle of ``_started`` left
    a finalized instance in ``_live`` with ``_finalized`` False: its next init warned of
    a twin (itself), and its errors said "not initialized"."""
    dd = llm_datadist.LLMDataDist(LLMRole.PROMPT, 427)
    reached, go = threading.Event(), threading.Event()
    real = datadist_mod._warn_twins

    def held(d: Any) -> None:
        reached.set()
        go.wait(10)
        real(d)

    monkeypatch.setattr(datadist_mod, "_warn_twins", held)
    init, out = _in_thread(dd.init, not_listening(pool=1 << 20))
    assert reached.wait(10)
    fin, fin_out = _in_thread(dd.finalize)
    deadline = time.monotonic() + 10
    while not dd._async._closing and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dd._async._closing
    fin.join(2)  # the teardown is short: let it end in the middle of init's _started
    go.set()
    init.join(10)
    fin.join(10)
    monkeypatch.undo()
    assert fin_out == [None]
    assert out == [None]  # init had completed (its check passed) before finalize began
    assert not dd.initialized
    assert dd._async not in datadist_mod._live, "a finalized instance stays in _live"
    with pytest.raises(RuntimeError, match="was finalized"):
        dd.cache_manager  # noqa: B018
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        dd.init(not_listening(pool=1 << 20))  # no twin: it is the only one
    dd.finalize()


def test_init_that_a_finalize_undid_does_not_return_normally(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``init`` (``_started``): "LLMException LLM_FAILED, a finalize that began while
    init ran has undone it". A finalize begun (on another thread) after the build and
    before ``_started`` let the blocking init return normally, the instance already
    refusing every operation as "being finalized" and then finalized."""
    from aiokv._engine import Engine

    dd = llm_datadist.LLMDataDist(LLMRole.PROMPT, 428)
    built, go = threading.Event(), threading.Event()
    real = Engine.call

    def call(self: Engine, fn: Any, *args: Any, **kwargs: Any) -> Any:
        result = real(self, fn, *args, **kwargs)
        if getattr(fn, "__name__", "") == "_build":
            built.set()
            go.wait(10)  # init's thread, between the build and _started
        return result

    monkeypatch.setattr(Engine, "call", call)
    init, out = _in_thread(dd.init, not_listening(pool=1 << 20))
    assert built.wait(10)
    monkeypatch.undo()
    fin, fin_out = _in_thread(dd.finalize)
    deadline = time.monotonic() + 10
    while not dd._async._closing and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dd._async._closing
    go.set()
    init.join(10)
    fin.join(10)
    assert fin_out == [None]
    assert not dd.initialized
    assert len(out) == 1 and isinstance(out[0], LLMException), f"init returned {out}"
    assert out[0].status_code == LLMStatusCode.LLM_FAILED
    dd.init(not_listening(pool=1 << 20))  # and it can be started again
    dd.finalize()
