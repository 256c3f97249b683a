"""A TCP link's short ways: a lone frame leaves in the call that posts it, and a request
the handler answers without waiting is served in the link's reader.

Both keep the order of what a link sends, its batching and its backpressure; the
contract suite runs over handlers that answer at once too (``tcp+now``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from test_tcp import HOST

from aiokv._enums import LLMStatusCode as Code
from aiokv._errors import LLMException
from aiokv.transport import Grant
from aiokv.transport import Link
from aiokv.transport import PeerInfo
from aiokv.transport.tcp import TcpTransport
from aiokv.transport.tcp._io import SockIO
from aiokv.transport.tcp._writer import BLOCKED
from aiokv.transport.tcp._writer import MORE
from aiokv.transport.tcp._writer import Writer


class _Owner:
    chunk_bytes = 1 << 16


class _Backlog:
    """No reply accounting (what the writer tells the link's protocol)."""

    def queued(self, frame: bytes) -> None: ...

    def batch_taken(self) -> None: ...

    def batch_sent(self) -> None: ...

    def replies_drained(self) -> bool:
        return True


@contextlib.asynccontextmanager
async def _writer(sndbuf: int = 0) -> AsyncIterator[tuple[Writer, socket.socket]]:
    """A writer on one end of a socket pair, driven as a link drives it; the other end."""
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    if sndbuf:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    loop = asyncio.get_running_loop()
    io = SockIO(loop, a)
    w = Writer(loop, a, _Owner(), _Backlog(), None)

    async def drive() -> None:
        while True:
            state = w.pump()
            if state == BLOCKED:
                await io.writable()
            elif state == MORE:
                await asyncio.sleep(0)
            else:
                await w.until_work(loop)

    task = asyncio.create_task(drive())
    try:
        await asyncio.sleep(0)  # the writer sent nothing and parked
        yield w, b
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        io.close()
        b.close()


def _pending(sock: socket.socket) -> bytes:
    try:
        return sock.recv(1 << 20)
    except BlockingIOError:
        return b""


async def test_a_lone_frame_leaves_at_once_then_frames_are_batched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a pause of a slow machine between the posts must not flush
    monkeypatch.setattr("aiokv.transport.tcp._writer.FLUSH_S", 60.0, raising=False)
    async with _writer() as (w, peer):
        w.post(b"one")
        assert _pending(peer) == b"one"  # no loop turn: sent by post itself
        w.post(b"two")
        w.post(b"three")
        assert _pending(peer) == b""  # the same loop iteration: left to the writer...
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert _pending(peer) == b"twothree"  # ... which sends them together, in order
        await asyncio.sleep(0)
        w.post(b"four")  # a later iteration: at once again
        assert _pending(peer) == b"four"


async def test_a_frame_posted_late_in_a_long_loop_iteration_leaves_without_waiting_for_its_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reader answering many queued requests (or a task posting many) runs for long
    without yielding: its frames must reach the peer while it goes on, so the peer
    starts on them meanwhile, not all at the iteration's end."""
    monkeypatch.setattr("aiokv.transport.tcp._writer.FLUSH_S", 0.01, raising=False)
    async with _writer() as (w, peer):
        w.post(b"one")
        w.post(b"two")  # the same instant: batched for the writer's turn
        assert _pending(peer) == b"one"
        time.sleep(0.02)  # noqa: ASYNC251  (the point: this loop iteration goes on, busy)
        w.post(b"three")  # sent at once, with what waited
        assert _pending(peer) == b"twothree"
        w.post(b"four")
        assert _pending(peer) == b""  # batched again
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert _pending(peer) == b"four"


async def test_an_acknowledgement_waits_for_the_writers_turn() -> None:
    async with _writer() as (w, peer):
        w.post(b"ack", soon=True)
        assert _pending(peer) == b""
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert _pending(peer) == b"ack"


async def test_a_reply_and_its_data_leave_in_one_batch() -> None:
    async with _writer() as (w, peer):
        payload = bytes(range(256)) * 4
        stream = w.add_stream(7, [memoryview(payload)], len(payload), lead=b"REPLY")
        got = _pending(peer)
        assert got.startswith(b"REPLY")  # the reply first, then the DATA frame, at once
        assert got.endswith(payload)
        assert stream.sent


async def test_a_full_socket_keeps_order_and_backpressure() -> None:
    async with _writer(sndbuf=4096) as (w, peer):
        big = bytes(range(251)) * 4000  # ~1 MB: far more than the socket buffer takes
        w.post(big)  # at once, but only part of it fits: the writer waits for room
        w_sent = len(big) - sum(len(p) for p in w.iov[w.pos :])  # type: ignore[arg-type]
        assert 0 < w_sent < len(big)
        await asyncio.sleep(0)
        w.post(b"after")  # the batch in flight goes first, whole
        got = bytearray()
        while len(got) < len(big) + 5:
            got += _pending(peer)
            await asyncio.sleep(0.001)
        assert bytes(got) == big + b"after"


# ------------------------------------------------------------------ serving at once


class _NowHandler:
    """Answers reads of ``region`` from ``grant_now``; ``{"wait": true}``: not at once
    (awaited ``grant_read``)."""

    def __init__(self) -> None:
        self.region = bytearray(range(256)) * 2048
        self.now = 0
        self.awaited = 0

    def grant_now(
        self, peer: PeerInfo, meta: bytes, nbytes: int, *, write: bool, direct: object
    ) -> Grant | None:
        m = json.loads(meta)
        if m.get("wait"):
            return None
        if "raise" in m:
            raise LLMException("refused at once", status_code=Code(m["raise"]))
        self.now += 1
        return Grant(Code.LLM_SUCCESS, [memoryview(self.region)[: m["n"]]])

    async def grant_read(self, peer: PeerInfo, meta: bytes) -> Any:
        self.awaited += 1
        await asyncio.sleep(0)
        return Grant(Code.LLM_SUCCESS, [memoryview(self.region)[: json.loads(meta)["n"]]])

    async def grant_write(self, peer: PeerInfo, meta: bytes, nbytes: int) -> Any:
        return Grant(Code.LLM_FEATURE_NOT_ENABLED)


@contextlib.asynccontextmanager
async def _linked(handler: Any) -> AsyncIterator[Link]:
    """A link to a transport serving with ``handler``."""
    a = TcpTransport(1, _NowHandler())
    b = TcpTransport(2, handler)
    try:
        host, port = await b.listen(HOST, 0)
        yield await a.connect(host, port, timeout=5)
    finally:
        await a.aclose()
        await b.aclose()


async def test_a_request_answered_at_once_is_served_without_awaiting_the_handler() -> None:
    handler = _NowHandler()
    async with _linked(handler) as link:
        for n in (1, 4096, 500_000):
            buf = bytearray(n)
            await link.read(json.dumps({"n": n}).encode(), [memoryview(buf)], timeout=5)
            assert buf == handler.region[:n]
        assert (handler.now, handler.awaited) == (3, 0)
        buf = bytearray(10)  # not at once: awaited, as any handler's answer
        await link.read(json.dumps({"n": 10, "wait": True}).encode(), [memoryview(buf)], timeout=5)
        assert buf == handler.region[:10]
        assert handler.awaited == 1


async def test_a_refusal_at_once_reaches_the_requester() -> None:
    async with _linked(_NowHandler()) as link:
        meta = json.dumps({"n": 1, "raise": int(Code.LLM_KV_CACHE_NOT_EXIST)}).encode()
        with pytest.raises(LLMException) as got:
            await link.read(meta, [memoryview(bytearray(1))], timeout=5)
        assert got.value.status_code is Code.LLM_KV_CACHE_NOT_EXIST
        buf = bytearray(8)  # the link is still good
        await link.read(json.dumps({"n": 8}).encode(), [memoryview(buf)], timeout=5)


# ------------------------------------------------------------------ reader readiness


async def _read_one(io: SockIO, sock: socket.socket) -> bytes:
    """One byte, as a link's reader reads: non-blocking, waiting again on ``EAGAIN``
    (a wake-up may be stale); in this task (``wait_for`` would read in another)."""
    async with asyncio.timeout(5):
        while True:
            with contextlib.suppress(BlockingIOError):
                return sock.recv(1)
            await io.readable()


async def test_a_socket_stays_watched_between_waits_and_is_dropped_when_nobody_waits() -> None:
    a, b = socket.socketpair()
    a.setblocking(False)
    io = SockIO(asyncio.get_running_loop(), a)
    try:
        for byte in (b"1", b"2"):  # wait, read, wait again: no add/remove_reader per wait
            asyncio.get_running_loop().call_later(0.01, b.send, byte)
            assert await _read_one(io, a) == byte and io._watching
        b.send(b"3")  # nobody waits: level-triggered readiness must not keep calling
        for _ in range(100):
            if not io._watching:
                break
            await asyncio.sleep(0.001)
        assert not io._watching
        assert await _read_one(io, a) == b"3"  # watched again for the next wait
        waiter = asyncio.create_task(io.readable())
        await asyncio.sleep(0.01)
        io.close()  # unwatched before the close (no fd reuse), the waiter woken
        await asyncio.wait_for(waiter, 5)
        assert not io._watching
    finally:
        io.close()
        b.close()
