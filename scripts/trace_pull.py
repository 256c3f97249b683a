"""Where a pull of many blocks spends its time, on both sides of the link.

``PYTHONPATH=. python scripts/trace_pull.py [--arrays] [BLOCK_KIB] [COUNTS] [PAUSE_MS]``
(repository root, Linux): pulls of ``COUNT`` scattered blocks of ``BLOCK_KIB`` KiB
(default 4, counts ``1,256,1024,4096,16384``; every other block of twice as many,
shuffled, as ``aiokv bench transfer`` moves them) from the spawned prompt peer, 60 per
count (the first 10 not counted), back to back or ``PAUSE_MS`` apart; the block lists
are lists of ``int``, or int64 numpy arrays with ``--arrays``. Functions of both
processes are wrapped to take ``time.perf_counter_ns`` marks (``CLOCK_MONOTONIC``: one
clock for both on Linux); the peer's marks reach this process through a file that a
thread of the peer writes every 0.2 s. Prints, per count, the median µs of each
stretch of a pull:

* ``checks``: the caller's argument checks and planning, up to the hand-over;
* ``hop_in``: the hand-over until the engine runs ``RemoteClient.move``;
* ``prepare``: the engine's route, layout and request, until ``TcpLink.read``;
* ``to_peer``: the request's send, the wire and the peer's wake-up, until the peer's
  reader starts serving it;
* ``grant``: the peer's handler (``PeerService.grant_now``): decode, look-up, rows, pin;
* ``to_data``: the peer's answer and first send, the wire and this side's wake-up,
  until the first ``DATA`` header is read here;
* ``data``: from the first ``DATA`` header to the last byte received (the copy);
* ``tail``: the last byte until ``TcpLink.read`` returns (``READ_DONE``, completion);
* ``hop_back``: the engine's end of the move until the caller's ``_move`` returns;
* ``total``: the whole ``pull_blocks``, beside ``raw_blocks``: the same blocks moved by
  a raw blocking ``readv`` stream (``aiokv bench transfer``'s floor), timed in the same
  rounds, each right before the pull.

The wrappers cost ~1 µs per mark; read the stretches as shares of the total.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np

from aiokv import BlocksCacheKey
from aiokv import LLMDataDist
from aiokv._bench import transfer
from aiokv._bench._harness import PEER_ID
from aiokv._bench._harness import PromptPeer
from aiokv._bench._harness import run_remote
from aiokv._bench._harness import scattered
from aiokv._bench._harness import spawned
from aiokv._bench.raw import RawBlocks
from aiokv._manager._remote import RemoteTransfers
from aiokv._remote._client import RemoteClient
from aiokv.transport.tcp._link import TcpLink
from aiokv.transport.tcp._reader import Reader

KIB = 1 << 10
ROUNDS, WARMUP = 60, 10
PEER_FILE = f"/tmp/aiokv-trace-pull-{os.getppid() if __name__ == '__mp_main__' else os.getpid()}"
STRETCHES = (
    "checks",
    "hop_in",
    "prepare",
    "to_peer",
    "grant",
    "to_data",
    "data",
    "tail",
    "hop_back",
    "total",
    "raw_blocks",
)

#: this process's marks of the current pull (first entry, last exit of each function)
marks: dict[str, int] = {}


def _wrap_async(cls: type, name: str, tag: str) -> None:
    orig = getattr(cls, name)

    async def wrapped(*args: Any, **kwargs: Any) -> Any:
        marks.setdefault(tag + ">", time.perf_counter_ns())
        try:
            return await orig(*args, **kwargs)
        finally:
            marks[tag + "<"] = time.perf_counter_ns()

    setattr(cls, name, wrapped)


def _wrap_sync(cls: type, name: str, tag: str, *, first: bool = False) -> None:
    orig = getattr(cls, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if first:  # a new request: its marks only
            marks.clear()
        marks.setdefault(tag + ">", time.perf_counter_ns())
        try:
            return orig(*args, **kwargs)
        finally:
            marks[tag + "<"] = time.perf_counter_ns()

    setattr(cls, name, wrapped)


def _peer_marks() -> None:
    """In the peer: mark each request served; a thread writes them out every 0.2 s."""
    lines: list[str] = []
    answer = TcpLink._answer

    def answered(self: TcpLink, *args: Any) -> None:
        answer(self, *args)
        if "srv>" in marks and "grant<" in marks:  # served in the reader (grant_now)
            lines.append(f"{marks['srv>']} {marks['grant<']} {time.perf_counter_ns()}\n")

    def flush() -> None:
        while True:
            time.sleep(0.2)
            if lines:
                done = lines[:]
                del lines[: len(done)]
                with open(PEER_FILE, "a") as f:
                    f.writelines(done)

    _wrap_sync(TcpLink, "_start_serving", "srv", first=True)
    _wrap_sync(TcpLink, "_ask_now", "grant")
    TcpLink._answer = answered  # type: ignore[method-assign, assignment]
    threading.Thread(target=flush, daemon=True).start()


def _stretches(
    m: dict[str, int], t0: int, t9: int, peer: tuple[int, int], raw_ns: int
) -> tuple[float, ...]:
    """One pull's stretches in µs, from this side's marks ``m`` and the peer's."""
    srv, grant = peer
    ns = (
        m["move>"] - t0,
        m["engine>"] - m["move>"],
        m["read>"] - m["engine>"],
        srv - m["read>"],
        grant - srv,
        m["data>"] - grant,
        m["data<"] - m["data>"],
        m["read<"] - m["data<"],
        m["move<"] - m["engine<"],
        t9 - t0,
        raw_ns,
    )
    return tuple(v / 1000 for v in ns)


def main(block: int, counts: list[int], pause_s: float, arrays: bool) -> None:
    async def bench(peer: PromptPeer, decoder: LLMDataDist) -> None:
        cm = decoder.cache_manager
        key = BlocksCacheKey(PEER_ID, 0)
        async with spawned(lambda: RawBlocks(block * max(counts))) as raw:
            for count in counts:
                srcs, dsts = scattered(count, seed=count), scattered(count, seed=count + 1)
                dst = await transfer._checked_pull((cm, peer), block, srcs, dsts, "")
                given: tuple[Any, Any] = (srcs, dsts)
                if arrays:
                    given = (np.array(srcs, dtype=np.int64), np.array(dsts, dtype=np.int64))
                await asyncio.to_thread(raw.blocks, block, srcs, dsts)
                spans: list[tuple[int, int, dict[str, int], int]] = []
                for _ in range(ROUNDS):
                    r0 = time.perf_counter_ns()
                    raw.receive()
                    r1 = time.perf_counter_ns()
                    marks.clear()
                    t0 = time.perf_counter_ns()
                    await cm.pull_blocks(key, dst, *given)
                    spans.append((t0, time.perf_counter_ns(), dict(marks), r1 - r0))
                    if pause_s:
                        await asyncio.sleep(pause_s)
                await cm.deallocate_blocks_cache(dst)
                await asyncio.sleep(0.5)  # the peer's thread writes its last marks
                served = _read_peer()
                rows = []
                for t0, t9, m, raw_ns in spans[WARMUP:]:
                    peer_marks = next((p for p in served if t0 <= p[0] <= t9), None)
                    if peer_marks is None:
                        continue
                    rows.append(_stretches(m, t0, t9, peer_marks[:2], raw_ns))
                med = [statistics.median(r[i] for r in rows) for i in range(len(STRETCHES))]
                kind = ", arrays" if arrays else ""
                print(
                    f"{block // KIB} KiB x {count} ({len(rows)} pulls{kind}): "
                    + "  ".join(f"{n} {v:.0f}" for n, v in zip(STRETCHES, med, strict=True))
                    + "  (median µs)",
                    flush=True,
                )

    run_remote(bench)


def _read_peer() -> list[tuple[int, int, int]]:
    try:
        with open(PEER_FILE) as f:
            return [(int(a), int(b), int(c)) for a, b, c in (line.split() for line in f)]
    except FileNotFoundError:
        return []


def _wrap_requester() -> None:
    _wrap_async(RemoteTransfers, "_move", "move")
    _wrap_async(RemoteClient, "move", "engine")
    _wrap_async(TcpLink, "read", "read")
    _wrap_async(Reader, "_on_data", "data")


if __name__ == "__mp_main__":  # the spawned peer runs this module under that name
    _peer_marks()

if __name__ == "__main__":
    _wrap_requester()
    args = [a for a in sys.argv[1:] if a != "--arrays"]
    try:
        main(
            int(args[0]) * KIB if args else 4 * KIB,
            [int(c) for c in args[1].split(",")] if len(args) > 1 else [1, 256, 1024, 4096, 16384],
            float(args[2]) / 1000 if len(args) > 2 else 0.0,
            "--arrays" in sys.argv,
        )
    finally:
        if os.path.exists(PEER_FILE):
            os.remove(PEER_FILE)
