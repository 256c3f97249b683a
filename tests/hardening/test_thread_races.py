"""Races between an instance's life (init, finalize) and calls from other threads,
found in review: each is forced (a step held on an Event or a Barrier), not left to
luck. aiokv.sync promises calls "safe from many threads at once"."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any

import pytest
from _helpers import free_port
from _helpers import not_listening

import aiokv._datadist as datadist_mod
import aiokv.sync as llm_datadist
from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import DataType
from aiokv import LLMConfig
from aiokv import LLMDataDist
from aiokv import LLMException
from aiokv import LLMRole
from aiokv import LLMStatusCode
from aiokv import TransferWithCacheKeyConfig
from aiokv.testing import cluster_info
from aiokv.testing import linked_pair
from aiokv.testing import make_config

pytestmark = pytest.mark.timeout(60)


def tcp_config() -> LLMConfig:
    return make_config("tcp", pool=1 << 20)


def engine_threads(cluster_id: int) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == f"aiokv-engine-{cluster_id}"]


# ------------------------------------------------ 1. two inits from two threads at once


def test_two_blocking_inits_at_once_start_one_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """``init``: "RuntimeError: an init or finalize of this instance is under way", and
    aiokv.sync: "Calls are safe from many threads at once". Two threads that pass the
    check before either took the engine both start one: the second overwrites
    ``_engine``, and the first engine (its thread, listener, pools) is never stopped."""
    dd = llm_datadist.LLMDataDist(LLMRole.PROMPT, 401)
    both_checked = threading.Barrier(2)
    real = LLMConfig._from_options_in.__func__  # type: ignore[attr-defined]

    def held(cls: type, op: str, options: Any) -> Any:
        if op == "init":
            both_checked.wait(5)  # both threads are past the "under way" check
        return real(cls, op, options)

    monkeypatch.setattr(LLMConfig, "_from_options_in", classmethod(held))
    errors: list[BaseException] = []

    def init() -> None:
        try:
            dd.init(tcp_config())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=init) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    monkeypatch.undo()
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError), f"init errors: {errors}"
    finalizing = threading.Thread(target=dd.finalize, daemon=True)
    finalizing.start()
    finalizing.join(10)  # (it hung: its teardown awaited the other engine's objects)
    assert not finalizing.is_alive(), "finalize hangs"
    time.sleep(0.2)
    left = engine_threads(401)
    assert left == [], f"engine thread leaked after finalize: {left}"


# ------------------------------------------------ 2. finalize during init


async def test_finalize_during_init_leaves_the_instance_usable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``finalize`` while ``init`` runs on the engine: the finalize undoes the init
    (which returns, or fails), and the instance can be initialized again (init's failure
    path set ``_engine = None`` before finalize's ``_ended`` ran, which then did
    nothing: every later ``init`` raised "a finalize of this LLMDataDist is under way",
    for ever)."""
    dd = LLMDataDist(LLMRole.PROMPT, 402)
    entered = threading.Event()
    real = LLMDataDist._make_pool

    async def held(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        await asyncio.sleep(0.5)  # init is under way on the engine
        return await real(*args, **kwargs)

    monkeypatch.setattr(LLMDataDist, "_make_pool", staticmethod(held))
    init = asyncio.create_task(dd.init(tcp_config()))
    assert await asyncio.to_thread(entered.wait, 10)
    await dd.finalize()
    with contextlib.suppress(LLMException):
        await init  # ended before the finalize undid it, or cut short by it
    assert not dd.initialized
    monkeypatch.setattr(LLMDataDist, "_make_pool", staticmethod(real))
    await dd.init(tcp_config())  # it raised "a finalize ... is under way", for ever
    assert dd.initialized
    await dd.finalize()


# ------------------------------------------------ 3. a blocking CacheTask past finalize


def test_blocking_cache_task_gives_its_results_after_finalize() -> None:
    """A finished layer-wise transfer's results stay readable (the async ``CacheTask``
    returns them after finalize: it has ended). The blocking face hops to the ended
    engine and raises ``LLMException(LLM_FAILED)`` instead."""

    class Ready:
        def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
            return True

    desc = CacheDesc(2, [4, 256], DataType.DT_UINT8)
    p = llm_datadist.LLMDataDist(LLMRole.PROMPT, 1)
    d = llm_datadist.LLMDataDist(LLMRole.DECODER, 2)
    p.init(tcp_config())
    d.init(tcp_config())
    try:
        code, _ = d.link_clusters([cluster_info(1, p.listen_address)], timeout=5000)
        assert code == LLMStatusCode.LLM_SUCCESS
        src = p.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(1, 0))
        d.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(2, 0))
        task = p.cache_manager.transfer_cache_async(
            src, Ready(), [TransferWithCacheKeyConfig(BlocksCacheKey(2, 0))], [0, 1], [0, 1]
        )
        assert task.synchronize() == LLMStatusCode.LLM_SUCCESS
    finally:
        d.finalize()
        p.finalize()
    assert task.done()
    assert asyncio.run(task._async.get_results()) == [LLMStatusCode.LLM_SUCCESS]  # async: ok
    assert task.get_results() == [LLMStatusCode.LLM_SUCCESS]  # the blocking face raised
    assert task.synchronize() == LLMStatusCode.LLM_SUCCESS


# ------------------------------------------------ 4. link_failure vs linked_clusters


class _HeldFiling(dict):  # type: ignore[type-arg]
    """A dict whose ``d[key] = link`` of ``key`` then waits for the test: the engine
    thread held just after the link is filed (the GIL may switch there)."""

    def __init__(self, data: dict[int, Any], key: int) -> None:
        super().__init__(data)
        self.key = key
        self.reached = threading.Event()
        self.go = threading.Event()

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        if key == self.key and not self.reached.is_set():
            self.reached.set()
            self.go.wait(10)


async def test_link_failure_is_none_once_the_cluster_is_listed_as_linked() -> None:
    """``link_failure``: "None if ... a link to that cluster came up since" (the mirror
    of the race where it said None while the cluster was no longer listed).
    ``LinkTable._file`` filed the link before it dropped the old failure: from another
    thread ``linked_clusters()`` listed the cluster while ``link_failure()`` still
    reported the failed attempt."""
    cfg = not_listening(pool=4 << 20, sync_kv_timeout=3000)
    async with linked_pair(
        not_listening(pool=4 << 20, listen_ip_info="127.0.0.1:0"), cfg, link=False
    ) as (p, d):
        wrong = cluster_info(1, ("127.0.0.1", free_port()))
        assert (await d.link_clusters([wrong], timeout=300))[0] == LLMStatusCode.LLM_LINK_FAILED
        assert d.link_failure(1) is not None
        assert d._engine is not None
        held = _HeldFiling(d._links._links, 1)

        def swap() -> None:
            d._links._links = held

        await d._engine.run_sync(swap)
        linking = asyncio.create_task(d.link_clusters([cluster_info(1, p.listen_address)]))
        try:
            assert await asyncio.to_thread(held.reached.wait, 10)
            # the engine thread has just filed the link (LinkTable._file)
            listed, failure = d.linked_clusters(), d.link_failure(1)
        finally:
            held.go.set()
        assert (await linking)[0] == LLMStatusCode.LLM_SUCCESS
        assert listed == [1]
        assert failure is None, f"linked_clusters() == [1] but link_failure(1) == {failure!r}"


# ------------------------------------------------ 5. Ctrl-C as a blocking init completes


def test_blocking_init_interrupted_as_it_completes_can_be_finalized() -> None:
    """``Engine.call``: interrupted after the operation completed, "its effects stand"
    (a note says so). For ``init`` the failure path then forgets and stops the engine
    while the build's state stays: ``initialized`` is True for ever, ``finalize`` does
    nothing, and the copy threads and the listening socket are leaked."""
    import signal
    import socket

    dd = llm_datadist.LLMDataDist(LLMRole.PROMPT, 405)
    main = threading.main_thread().ident
    assert main == threading.get_ident()
    inbox = dd._async._inbox
    real_open = inbox.open

    def open_then_interrupt() -> None:  # the build's last step
        real_open()
        signal.pthread_kill(main, signal.SIGINT)  # Ctrl-C as init ends ...
        time.sleep(0.3)  # ... taken by the caller before the build returns

    def on_sigint(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGINT, on_sigint)
    inbox.open = open_then_interrupt  # type: ignore[method-assign]
    try:
        with pytest.raises(KeyboardInterrupt) as caught:
            dd.init(tcp_config())
    finally:
        inbox.open = real_open  # type: ignore[method-assign]
        signal.signal(signal.SIGINT, old)
    assert "had completed; its effects stand" in str(caught.value.__notes__)
    address = dd.listen_address
    assert address is not None and dd.initialized
    dd.finalize()
    assert not dd.initialized, "finalize did nothing"
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(address, timeout=1).close()


# ------------------------------------------------ 6. initialized before init is done


async def test_initialized_only_once_every_part_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_build`` sets ``_manager`` (what ``initialized`` reads) first, then the link
    table, config, transport and linker. While it runs on the engine thread the
    caller's loop runs other tasks: one that sees ``initialized`` True and calls an
    operation gets an ``AssertionError`` (``_linker_on``) instead of a
    ``RuntimeError`` (not initialized) or the operation."""
    dd = LLMDataDist(LLMRole.PROMPT, 406)
    reached, go = threading.Event(), threading.Event()
    real = datadist_mod.Linker

    def held(*args: Any) -> Any:
        reached.set()
        go.wait(10)  # the engine thread, between two assignments of _build
        return real(*args)

    monkeypatch.setattr(datadist_mod, "Linker", held)
    init = asyncio.create_task(dd.init(tcp_config()))
    try:
        assert await asyncio.to_thread(reached.wait, 10)
        seen = dd.initialized
        try:
            await dd.check_link_status(5)
        except AssertionError as exc:
            pytest.fail(f"initialized={seen}, check_link_status raised AssertionError {exc}")
        except RuntimeError:
            pass  # not initialized yet (or LLM_NOT_YET_LINK): both fine
    finally:
        go.set()
        await init
        await dd.finalize()
