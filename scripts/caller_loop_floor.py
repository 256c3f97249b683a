"""The floor of a one-block request/response with no thread hop: the same exchange as
``aiokv bench latency``'s raw baseline, awaited on the caller's own event loop.

``PYTHONPATH=. python scripts/caller_loop_floor.py [ROUNDS]`` (repository root): one
spawned ``RawStream`` sender (the bench's), one socket; per round a 9-byte request and a
4 KiB answer, first with blocking ``sendall`` / ``recv_into``, then with
``loop.sock_sendall`` / ``loop.sock_recv_into`` on a non-blocking socket, alternating;
once on asyncio's loop and once on uvloop's. Prints the median µs of each and their
ratio: what goal 1 of issue #24 (a one-block pull ≤ 2× the raw socket) would cost if a
link's I/O ran on the caller's loop and the protocol itself cost nothing.
"""

from __future__ import annotations

import asyncio
import socket
import statistics
import sys
import time
from collections.abc import Callable

import uvloop

from aiokv._bench.raw import RawStream

BLOCK = 4096


def main(rounds: int) -> None:
    raw = RawStream(BLOCK)
    sock: socket.socket = raw._sock
    view = memoryview(bytearray(BLOCK))
    request = b"g" + BLOCK.to_bytes(8, "little")

    def blocking() -> float:
        t = time.perf_counter()
        sock.sendall(request)
        pos = 0
        while pos < BLOCK:
            pos += sock.recv_into(view[pos:])
        return time.perf_counter() - t

    async def awaited(loop: asyncio.AbstractEventLoop) -> float:
        t = time.perf_counter()
        await loop.sock_sendall(sock, request)
        pos = 0
        while pos < BLOCK:
            pos += await loop.sock_recv_into(sock, view[pos:])
        return time.perf_counter() - t

    async def alternate() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        raw_s: list[float] = []
        loop_s: list[float] = []
        for _ in range(rounds):
            sock.setblocking(True)
            raw_s.append(blocking())
            sock.setblocking(False)
            loop_s.append(await awaited(loop))
        sock.setblocking(True)
        return statistics.median(raw_s) * 1e6, statistics.median(loop_s) * 1e6

    loops: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
        "asyncio": asyncio.new_event_loop,
        "uvloop": uvloop.new_event_loop,
    }
    try:
        for name, factory in loops.items():
            with asyncio.Runner(loop_factory=factory) as runner:
                b, a = runner.run(alternate())
            print(f"{name}: raw socket {b:.0f} µs, on the caller's loop {a:.0f} µs, ×{a / b:.2f}")
    finally:
        raw.stop()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2000)
