"""The TCP link under a busy peer (its requests at the cap) and a read revoked as its
last chunk leaves: our own requests never fail for the peer's, a skipped request is
refused busy, a revoked read never reports wrong bytes."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

from _helpers import raw_link
from _helpers import recv_frame
from _helpers import until
from fake_handler import FakeHandler
from memmove_plane import MemmoveTransport
from spans import js

from aiokv._enums import LLMStatusCode as Code
from aiokv._errors import LLMException
from aiokv.transport import Grant
from aiokv.transport import Link
from aiokv.transport import PeerInfo
from aiokv.transport import _wire as wire
from aiokv.transport._wire import FrameType
from aiokv.transport.tcp import TcpTransport
from aiokv.transport.tcp import _link

HOST = "127.0.0.1"


@contextlib.asynccontextmanager
async def linked(a: TcpTransport, b: TcpTransport) -> AsyncIterator[tuple[Link, Link]]:
    """``a`` connected to ``b``: (a's end, b's end)."""
    accepted: asyncio.Future[Link] = asyncio.get_running_loop().create_future()

    def on_link(link: Link) -> None:
        if not accepted.done():
            accepted.set_result(link)

    b.on_link = on_link
    try:
        host, port = await b.listen(HOST, 0)
        link_a = await a.connect(host, port, timeout=5)
        link_b = await asyncio.wait_for(accepted, 5)
        yield link_a, link_b
    finally:
        await a.aclose()
        await b.aclose()


async def test_a_plane_grant_is_read_while_the_peer_has_its_most_requests() -> None:
    """Our own requests do not count against the cap on the peer's: a PLANE_GRANT
    answering our plane read must not have its meta skipped (and the read fail) only
    because the peer has as many requests outstanding with us as it may have."""
    ha, hb = FakeHandler(), FakeHandler()
    a, b = MemmoveTransport(1, ha), MemmoveTransport(2, hb)
    async with linked(a, b) as (link_a, link_b):
        assert isinstance(link_a, _link.TcpLink)
        link_a._p.max_peer_requests = 2  # A's cap on B's requests
        hung = [
            asyncio.create_task(link_b.read(js({"hang": True}), [], timeout=10)) for _ in range(2)
        ]
        try:
            while ha.grants < 2:
                await asyncio.wait_for(ha.hanging.wait(), 5)
                ha.hanging.clear()
            assert len(link_a._p.theirs) == 2
            size = 4096
            hb.regions["r"] = bytearray(range(256)) * (size // 256)
            mine = bytearray(size)
            await link_a.read(js({"spans": [[0, size]], "tag": "t"}), [memoryview(mine)], timeout=5)
            assert mine == hb.regions["r"]
            assert a.moved == 1  # it moved by the plane
        finally:
            for task in hung:
                task.cancel()
            await asyncio.gather(*hung, return_exceptions=True)


class _GateHandler:
    """Requests wait until ``gate`` opens, then are refused (``LLM_FAILED``)."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.asked = 0

    async def _wait(self) -> Any:
        self.asked += 1
        await self.gate.wait()
        return Grant(Code.LLM_FAILED, reason="gated")

    async def grant_read(self, peer: PeerInfo, meta: bytes) -> Any:
        return await self._wait()

    async def grant_write(self, peer: PeerInfo, meta: bytes, nbytes: int) -> Any:
        return await self._wait()


async def test_a_request_skipped_while_busy_is_refused_busy_not_as_oversized() -> None:
    """A request whose meta was skipped because the peer had the most requests it may
    have is ``LLM_LINK_BUSY`` (retry later), even when a slot freed while its meta was
    being skipped: never ``LLM_PARAM_INVALID`` claiming its (small) meta exceeds the cap."""
    handler = _GateHandler()
    accepted: asyncio.Future[Link] = asyncio.get_running_loop().create_future()
    server = TcpTransport(
        2, handler, on_link=lambda link: accepted.done() or accepted.set_result(link)
    )
    s: socket.socket | None = None
    try:
        port = (await server.listen(HOST, 0))[1]
        s = await asyncio.to_thread(raw_link, port)
        link = await asyncio.wait_for(accepted, 5)
        assert isinstance(link, _link.TcpLink)
        link._p.max_peer_requests = 1
        skipped = asyncio.Event()
        real = link._p.skips_meta

        def spy(h: wire.Header) -> bool:
            out = real(h)
            if out:
                skipped.set()
            return out

        link._p.skips_meta = spy  # type: ignore[method-assign]
        s.sendall(wire.encode_frame(FrameType.READ_REQ, 0, meta=b"first"))
        await until(lambda: handler.asked == 1)
        meta = b"m" * 100  # far below the cap (1 MiB)
        frame = wire.encode_frame(FrameType.READ_REQ, 2, meta=meta)
        s.sendall(frame[: wire.HEADER_SIZE + 10])  # the rest of its meta comes later
        await asyncio.wait_for(skipped.wait(), 5)  # busy: its meta is being skipped
        handler.gate.set()  # the first request is refused: a slot is free again
        await until(lambda: not link._p.theirs)
        s.sendall(frame[wire.HEADER_SIZE + 10 :])
        replies = {}
        for _ in range(2):
            h = await asyncio.to_thread(recv_frame, s)
            replies[h.req_id] = h
        assert replies[0].status == Code.LLM_FAILED
        assert replies[2].type is FrameType.READ_RESP
        assert replies[2].status == Code.LLM_LINK_BUSY, Code(replies[2].status).name
    finally:
        if s is not None:
            s.close()
        await server.aclose()


class _RevokingHandler:
    """Grants a read of its whole buffer and revokes the grant on the next loop step,
    while the payload's (one) chunk is on its way."""

    def __init__(self, size: int) -> None:
        self.buf = bytearray(b"\x5a") * size
        self.done: list[bool] = []

    async def grant_read(self, peer: PeerInfo, meta: bytes) -> Any:
        grant = Grant(Code.LLM_SUCCESS, [memoryview(self.buf)], self.done.append)
        asyncio.get_running_loop().call_soon(self._revoke, grant)
        return grant

    def _revoke(self, grant: Grant) -> None:
        grant.abort(Code.LLM_KV_CACHE_NOT_EXIST)
        self.buf[:] = bytes(len(self.buf))  # off limits now: a reader must never see this

    async def grant_write(self, peer: PeerInfo, meta: bytes, nbytes: int) -> Any:
        return Grant(Code.LLM_FAILED)


async def test_a_read_revoked_as_its_last_chunk_leaves_fails_or_has_every_byte() -> None:
    """``Grant.abort`` while the read's last DATA chunk is in the batch on its way: the
    tail is sent from a private copy (frames stay whole), so the reader may complete
    before the failing ``READ_RESP`` (docs/contract.md, "Grants"): it then holds every
    byte as it was when revoked; otherwise it fails with the revoking code. Either way
    the granter's ``done`` says not read (a ``CacheKey`` stays bound), and the buffer is
    not read after the abort (changed right after it, the reader never sees it)."""
    size = 1 << 20  # one DATA chunk, far more than the small socket buffers hold
    handler = _RevokingHandler(size)
    a = TcpTransport(1, FakeHandler(), sock_buf_bytes=64 << 10)
    b = TcpTransport(2, handler, sock_buf_bytes=64 << 10)
    try:
        port = (await b.listen(HOST, 0))[1]
        link = await a.connect(HOST, port, timeout=5)
        mine = bytearray(size)
        code = Code.LLM_SUCCESS
        try:
            await link.read(b"x", [memoryview(mine)], timeout=5)
        except LLMException as exc:
            code = Code(exc.status_code)
        if code is Code.LLM_SUCCESS:
            assert mine == bytearray(b"\x5a") * size
        else:
            assert code is Code.LLM_KV_CACHE_NOT_EXIST
        await until(lambda: bool(handler.done))
        assert handler.done == [False]
    finally:
        await a.aclose()
        await b.aclose()
