"""Races between init and finalize, and failed init / link / switch_role calls that
left things running or changed (found in review; each fails before its fix)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from typing import Any

import pytest
from _helpers import held_at
from _helpers import not_listening

import aiokv._datadist as datadist_mod
from aiokv import LLMDataDist
from aiokv import LLMException
from aiokv import LLMRole
from aiokv import LLMStatusCode


def _aiokv_threads(before: set[threading.Thread]) -> list[str]:
    return sorted(t.name for t in set(threading.enumerate()) - before if t.is_alive())


async def _until(cond: Any, seconds: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not cond():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


@pytest.fixture
def held_reservation(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """The pool reservation of ``init`` blocks (on its copy worker) until released."""
    return held_at(monkeypatch, datadist_mod, "pre_touch")


async def _finalize_during_init(
    dd: LLMDataDist, options: Any, gates: tuple[threading.Event, threading.Event]
) -> BaseException | None:
    """Start ``init``; once it reserves its pool, ``finalize``; let the reservation end.
    What ``init`` raised (None if it returned)."""
    entered, release = gates
    init = asyncio.create_task(dd.init(options))
    await _until(entered.is_set)
    engine = dd._engine
    assert engine is not None
    fin = asyncio.create_task(dd.finalize())
    # the finalize's teardown has started on the engine (before this fix it ended at
    # once, and the loop stopped, while the reservation still ran)
    await _until(lambda: engine._last is not None)
    await asyncio.sleep(0.1)
    release.set()
    await fin
    try:
        await init
    except BaseException as exc:
        return exc
    return None


async def test_finalize_during_init_leaves_nothing_running(
    held_reservation: tuple[threading.Event, threading.Event],
) -> None:
    """finalize() called while init() reserves its pool: once both returned, nothing of
    the instance may be left (no listener, no copy threads), and it must not claim to be
    initialized with a dead engine."""
    before = set(threading.enumerate())
    dd = LLMDataDist(LLMRole.MIX, 41)
    opts = not_listening(pool=1 << 20, listen_ip_info="127.0.0.1:0")
    await _finalize_during_init(dd, opts, held_reservation)
    leftover = {
        "initialized": dd.initialized,
        "threads": _aiokv_threads(before),
        "listening": dd.listen_address,
    }
    try:
        assert leftover == {"initialized": False, "threads": [], "listening": None}, leftover
    finally:
        if dd._scheduler is not None:  # clean up what the defect leaves behind
            dd._scheduler.stop_nowait()
        if dd._transport is not None:
            with contextlib.suppress(Exception):
                for srv in getattr(dd._transport, "_servers", {}).values():
                    srv.close()


async def test_init_failing_during_finalize_can_be_retried(
    held_reservation: tuple[threading.Event, threading.Event],
) -> None:
    """init() fails (its port is taken) while a finalize() runs: once both returned, a
    new init() must work (the instance must not stay 'being finalized' forever)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        dd = LLMDataDist(LLMRole.MIX, 42)
        opts = not_listening(pool=1 << 20, listen_ip_info=f"127.0.0.1:{port}")
        err = await _finalize_during_init(dd, opts, held_reservation)
    assert isinstance(err, LLMException), err
    assert not dd.initialized
    await dd.init(not_listening(pool=1 << 20))  # RuntimeError: "a finalize ... under way"
    assert dd.initialized
    await dd.finalize()


async def test_init_failing_at_transport_leaves_no_copy_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """init() that fails after the pools were reserved (the transport cannot be
    loaded: LLM_FEATURE_NOT_ENABLED) must leave no worker thread behind, as a failure
    to bind does."""

    def unavailable(name: str) -> Any:
        raise LLMException(
            f"get_transport: transport {name!r} is not available",
            status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
        )

    monkeypatch.setattr(datadist_mod, "get_transport", unavailable)
    before = set(threading.enumerate())
    dd = LLMDataDist(LLMRole.MIX, 43)
    with pytest.raises(LLMException) as ei:
        await dd.init(not_listening(pool=1 << 20))
    assert ei.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    del ei  # the traceback is not what keeps the thread: the scheduler was never closed
    await asyncio.sleep(0.2)
    assert _aiokv_threads(before) == []


async def test_switch_role_without_listen_option_stops_listening_despite_env(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs/links.md: switch_role without "llm.listenIpInfo" in switch_options stops
    listening (and, in legacy mode, switching to PROMPT without it is LLM_PARAM_INVALID).
    An AIOKV_LISTEN_IP_INFO default in the environment is not a switch option."""
    async with LLMDataDist(
        LLMRole.MIX, 44, not_listening(pool=1 << 20, listen_ip_info="127.0.0.1:0")
    ) as dd:
        assert dd.listen_address is not None
        monkeypatch.setenv("AIOKV_LISTEN_IP_INFO", "127.0.0.1:0")
        await dd.switch_role(LLMRole.DECODER)
        assert dd.listen_address is None  # a new listener was opened instead
    legacy = not_listening(pool=1 << 20, enable_cache_manager=False)
    async with LLMDataDist(LLMRole.DECODER, 45, legacy) as dd:
        with pytest.raises(LLMException) as ei:
            await dd.switch_role(LLMRole.PROMPT, {})
        assert ei.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


async def test_failed_link_leaves_no_listener() -> None:
    """A ``link`` that fails (``LLM_ALREADY_LINK``: this side linked the party already)
    changes nothing (SPEC §1.2): it must not leave behind the listener it opened at its
    rank-table entry's address."""
    import json

    from _helpers import free_port

    from aiokv.testing import cluster_info

    port = free_port()
    servers = [
        {"device": [{"rank_id": "0", "device_ip": "127.0.0.1", "device_port": str(port)}]},
        {"device": [{"rank_id": "1"}]},
    ]
    rank_table = json.dumps({"server_count": "2", "server_list": servers, "version": "1.2"})
    async with (
        LLMDataDist(LLMRole.PROMPT, 1, not_listening(pool=1 << 20)) as p,
        LLMDataDist(
            LLMRole.DECODER, 2, not_listening(pool=1 << 20, listen_ip_info="127.0.0.1:0")
        ) as d,
    ):
        code, _ = await p.link_clusters([cluster_info(2, d.listen_address)])
        assert code == LLMStatusCode.LLM_SUCCESS
        assert p.listen_address is None
        with pytest.raises(LLMException) as ei:
            await p.link("c", {1: 0, 2: 1}, rank_table)
        assert ei.value.status_code == LLMStatusCode.LLM_ALREADY_LINK
        assert p.listen_address is None  # the failed call opened a listener and kept it
