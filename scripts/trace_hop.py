"""Where one 1-block remote pull spends its time, the engine hop included.

``python scripts/trace_hop.py`` (repository root): 400 pulls of one 4 KiB block from
the spawned prompt peer (the ``aiokv bench latency`` set-up), each timed at six points
by wrapping the engine's ``_Call`` and the client's ``transfer``; prints the median µs
of each stretch:

* ``checks``: the caller's argument checks and planning, up to the hand-over;
* ``wake_in``: the hand-over until the engine thread runs it (one thread wake-up);
* ``start_task``: the engine creating the task until the transfer starts;
* ``transfer``: the request/response on the link (both sides' work and the wire);
* ``task_end``: the transfer's end until the caller is notified;
* ``back``: the notification until ``pull_blocks`` returns on the caller's loop, in
  two: ``wake_back``, until the caller's loop runs its first callback after it (the
  second wake-up: the caller's thread gets the GIL only once the engine thread has
  done what followed the notification, e.g. the link's ``READ_DONE``), and ``resume``,
  the caller's task resuming, then the unpin.

The hop itself is ``wake_in + start_task + task_end + back`` less the unpin (a few µs).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import aiokv._engine as engine_mod
import aiokv._remote._client as client_mod
from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import DataType
from aiokv import LLMDataDist
from aiokv._bench._harness import PEER_ID
from aiokv._bench._harness import PromptPeer
from aiokv._bench._harness import run_remote

marks: dict[str, float] = {}


def _wrap() -> None:
    transfer = client_mod.RemoteClient.transfer

    async def traced(self: Any, *args: Any, **kwargs: Any) -> bool:
        marks["task"] = time.perf_counter()
        try:
            return await transfer(self, *args, **kwargs)
        finally:
            marks["transfer_end"] = time.perf_counter()

    client_mod.RemoteClient.transfer = traced  # type: ignore[method-assign]
    call_init, call_start, call_end = (
        engine_mod._Call.__init__,
        engine_mod._Call._start,
        engine_mod._Call._end,
    )

    def init(self: Any, *args: Any) -> None:
        marks["call"] = time.perf_counter()
        call_init(self, *args)

    def start(self: Any) -> None:
        marks["start"] = time.perf_counter()
        call_start(self)

    def end(self: Any, outcome: Any) -> None:
        marks["end"] = time.perf_counter()
        call_end(self, outcome)

    until_notified = engine_mod._until_notified

    async def traced_until(start: Any, *args: Any, **kwargs: Any) -> None:
        loop = asyncio.get_running_loop()

        def woken() -> None:  # on the caller's loop, queued just before its wake-up
            marks["woken"] = time.perf_counter()

        def traced_start(notify: Any) -> None:
            def traced_notify() -> None:
                loop.call_soon_threadsafe(woken)
                notify()

            start(traced_notify)

        await until_notified(traced_start, *args, **kwargs)

    engine_mod._until_notified = traced_until
    engine_mod._Call.__init__ = init  # type: ignore[method-assign, assignment]
    engine_mod._Call._start = start  # type: ignore[method-assign]
    engine_mod._Call._end = end  # type: ignore[method-assign]


async def _main(peer: PromptPeer, decoder: LLMDataDist) -> None:
    cm = decoder.cache_manager
    desc = CacheDesc(1, [4, 4096], DataType.DT_UINT8)
    await peer.cache(desc)
    dst = await cm.allocate_blocks_cache(desc)
    key = BlocksCacheKey(PEER_ID, 0)
    names = (
        "checks",
        "wake_in",
        "start_task",
        "transfer",
        "task_end",
        "back",
        "wake_back",
        "resume",
        "total",
    )
    rows: list[tuple[float, ...]] = []
    for r in range(420):
        t0 = time.perf_counter()
        await cm.pull_blocks(key, dst, [1], [2])
        t1 = time.perf_counter()
        if r >= 20:
            m = marks
            rows.append(
                (
                    m["call"] - t0,
                    m["start"] - m["call"],
                    m["task"] - m["start"],
                    m["transfer_end"] - m["task"],
                    m["end"] - m["transfer_end"],
                    t1 - m["end"],
                    m["woken"] - m["end"],
                    t1 - m["woken"],
                    t1 - t0,
                )
            )
    medians = {n: statistics.median(r[i] for r in rows) * 1e6 for i, n in enumerate(names)}
    print("  ".join(f"{n}={v:.0f}" for n, v in medians.items()), "(median µs)")


if __name__ == "__main__":
    _wrap()
    run_remote(_main)
