"""The TCP transport's trust boundary: what a peer that has not authenticated, or one that
stalls, can make a listener allocate or log, and what a peer of another version is told.

Everything binds 127.0.0.1 port 0 and stops what it starts; throwaway certificates are
made with the ``openssl`` command.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import socket
import tracemalloc
from pathlib import Path

import pytest
from _helpers import raises
from _helpers import raw_link
from _helpers import recv_frame
from _helpers import until

from aiokv import LLMStatusCode
from aiokv._bench._pki import Pki
from aiokv._bench._pki import make_pki
from aiokv.transport import Grant
from aiokv.transport import PeerInfo
from aiokv.transport import TlsContexts
from aiokv.transport import _wire as wire
from aiokv.transport import load_tls
from aiokv.transport.tcp import TcpTransport
from aiokv.transport.tcp._protocol import DECIDING_META_CAPS
from aiokv.transport.tcp._tls_io import TlsSockIO

if shutil.which("openssl") is None:  # pragma: no cover - present wherever aiokv is tested
    pytest.skip("the openssl command makes the test certificates", allow_module_level=True)

HOST = "127.0.0.1"
_F = wire.FrameType


class Refuse:
    """A handler that is never asked: no peer in these tests gets a link."""

    async def grant_read(self, peer: PeerInfo, meta: bytes) -> Grant:
        raise AssertionError("no request expected")

    async def grant_write(self, peer: PeerInfo, meta: bytes, nbytes: int) -> Grant:
        raise AssertionError("no request expected")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(Path(tmp_path_factory.mktemp("pki")) / "main")


def tls_of(pki: Pki, name: str) -> TlsContexts:
    files = pki.leaves[name]
    tls = load_tls(files.cert_file, files.key_file, files.ca_file, False)
    assert tls is not None
    return tls


async def test_an_unauthenticated_tls_connection_allocates_no_send_buffer(pki: Pki) -> None:
    """docs/security.md: whoever reaches a listening port cannot make it "allocate more
    than a capped handshake" (4 KiB of meta; OpenSSL's own handshake buffers aside). A
    TLS listener wrapped each incoming socket with a 256 KiB send-gather buffer before
    the peer had proved anything: 64 MiB for the 256 connections that may be
    unauthenticated at once, from peers that send one byte each."""
    n = 16
    server = TcpTransport(2, Refuse(), tls=tls_of(pki, "b"))
    socks: list[socket.socket] = []
    tracemalloc.start()
    try:
        port = (await server.listen(HOST, 0))[1]
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(n):
            s = socket.create_connection((HOST, port), timeout=5)
            s.sendall(b"\x16\x03\x01")  # the head of a TLS record, then silence
            socks.append(s)

        def wrapped() -> int:  # incoming sockets whose TLS handshake has begun
            return sum(
                isinstance(io, TlsSockIO) and io._tls is not None for io in server._handshaking
            )

        await until(lambda: wrapped() == n, 10)
        per_connection = (tracemalloc.get_traced_memory()[0] - before) / n
        assert per_connection < 64 << 10, f"{per_connection / 1024:.0f} KiB per connection"
    finally:
        tracemalloc.stop()
        for s in socks:
            s.close()
        await server.aclose()


async def test_a_plain_listener_says_when_the_peer_speaks_tls(
    pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    """A TLS participant dialling a listener without TLS: the connecting side's error
    says TLS failed, and the listener's record must say why as well ("the peer speaks
    TLS"), as a TLS listener's does for a plain peer; it logged only
    ``bad magic b'\\x16\\x03\\x01\\x00'``, which names neither TLS nor the fix."""
    caplog.set_level(logging.INFO, logger="aiokv.transport.tcp")
    plain = TcpTransport(2, Refuse())
    client = TcpTransport(1, Refuse(), tls=tls_of(pki, "a"))
    try:
        address = await plain.listen(HOST, 0)
        exc = await raises(LLMStatusCode.LLM_LINK_FAILED, client.connect(*address, timeout=5))
        assert "TLS failed" in str(exc)

        def said() -> bool:
            return any(
                "handshake with" in r.getMessage() and "the peer speaks TLS" in r.getMessage()
                for r in caplog.records
            )

        await until(said, 10)
        assert plain.links() == [] and client.links() == []
    finally:
        await client.aclose()
        await plain.aclose()


async def test_a_peer_of_another_wire_version_is_told_which_version_listens() -> None:
    """docs/nixl.md: "a peer of another version is refused at the handshake". The
    listener closed the connection without a word, so a participant of another aiokv
    version read only the connection closing: its ``link_clusters`` said "connection
    closed by peer", never that the versions differ. Now it is answered with an
    ``ERROR`` frame of the listener's version, which any version's header check
    reports ("unsupported protocol version 8"), with the reason as meta."""
    server = TcpTransport(2, Refuse())
    try:
        port = (await server.listen(HOST, 0))[1]
        loop = asyncio.get_running_loop()
        with socket.create_connection((HOST, port), timeout=5) as s:
            s.setblocking(False)
            hello = bytearray(
                wire.encode_frame(wire.FrameType.HELLO, meta=b'{"cluster_id":1,"nonce":"00"}')
            )
            hello[4] = wire.VERSION + 1  # a participant of a later wire version
            await loop.sock_sendall(s, bytes(hello))
            answer = b""
            with contextlib.suppress(ConnectionResetError):  # closed with our meta unread
                async with asyncio.timeout(5):
                    while chunk := await loop.sock_recv(s, 4096):  # up to the close
                        answer += chunk
        assert len(answer) >= wire.HEADER_SIZE, answer
        magic, version, kind, status, meta_len, _, size = wire.HEADER.unpack(
            answer[: wire.HEADER_SIZE]
        )
        assert (magic, version, kind) == (wire.MAGIC, wire.VERSION, wire.FrameType.ERROR)
        assert status == LLMStatusCode.LLM_LINK_FAILED and size == 0
        assert len(answer) == wire.HEADER_SIZE + meta_len  # one frame, then the close
        reason = wire.decode_meta(answer[wire.HEADER_SIZE :])["reason"]
        assert f"version {wire.VERSION}" in reason
        assert server.links() == []
    finally:
        await server.aclose()


class Metas:
    """Records the meta of every read request and refuses it (nothing to serve)."""

    def __init__(self) -> None:
        self.metas: list[bytes] = []

    async def grant_read(self, peer: PeerInfo, meta: bytes) -> Grant:
        self.metas.append(meta)
        return Grant(LLMStatusCode.LLM_NOT_YET_LINK)

    async def grant_write(self, peer: PeerInfo, meta: bytes, nbytes: int) -> Grant:
        return Grant(LLMStatusCode.LLM_NOT_YET_LINK)


async def test_an_announced_meta_costs_no_memory_until_its_bytes_come() -> None:
    """docs/security.md: a peer that completes the handshake (anyone, without
    ``link_secret`` or TLS) holds "a descriptor and two small tasks"; the brief of the
    wire: no allocation proportional to a remote length before it is checked *and*
    backed by bytes. The reader allocated the whole announced meta (up to
    ``max_meta_bytes``, 1 MiB by default) as soon as a 30-byte request header came, and
    held it while the peer sent nothing more, with no deadline: 64 such links per
    address (512 in all) pinned 64 MiB (512 MiB) for 30 bytes each. Now a meta grows
    with the bytes that arrived; one that arrives whole still reaches the handler."""
    handler = Metas()
    server = TcpTransport(2, handler)
    loop = asyncio.get_running_loop()
    socks: list[socket.socket] = []
    n = 8
    tracemalloc.start()
    try:
        port = (await server.listen(HOST, 0))[1]
        for _ in range(n):
            socks.append(await loop.run_in_executor(None, raw_link, port))
        await until(lambda: len(server.links()) == n, 10)
        links = server.links()
        before = tracemalloc.get_traced_memory()[0]
        for s in socks:  # a request announcing 1 MiB of meta, then silence
            s.sendall(wire.encode_header(_F.READ_REQ, 0, meta_len=1 << 20, size=1))
        await until(lambda: all(link.heard for link in links), 10)  # type: ignore[attr-defined]
        await asyncio.sleep(0.2)  # the readers are parked in the meta by now
        per_link = (tracemalloc.get_traced_memory()[0] - before) / n
        assert per_link < 128 << 10, f"{per_link / 1024:.0f} KiB per link"
        # the meta the first peer announced, sent at last (in pieces), arrives intact
        meta = bytes(range(256)) * 4096
        for i in range(0, len(meta), 10_000):
            socks[0].sendall(meta[i : i + 10_000])
        await until(lambda: len(handler.metas) == 1, 10)
        assert handler.metas[0] == meta
        assert not links[0].broken
    finally:
        tracemalloc.stop()
        for s in socks:
            s.close()
        await server.aclose()


def test_the_docs_give_the_header_its_size() -> None:
    """docs/security.md and docs/design.md state what one header can make a side
    allocate before authentication, "one 32-byte header"; the header is
    ``wire.HEADER_SIZE`` (30) bytes, as the wire module's docstring says."""
    root = Path(__file__).resolve().parents[2] / "docs"
    for page in ("security.md", "design.md"):
        text = " ".join((root / page).read_text().split())
        assert f"one {wire.HEADER_SIZE}-byte header cannot" in text, page


class Stalling:
    """Decides every request only once ``go`` is set (a grant waiting for staging room,
    say), then refuses it; counts the requests it was asked."""

    def __init__(self) -> None:
        self.asked = 0
        self.go = asyncio.Event()

    async def grant_read(self, peer: PeerInfo, meta: bytes) -> Grant:
        self.asked += 1
        await self.go.wait()
        return Grant(LLMStatusCode.LLM_NOT_YET_LINK)

    async def grant_write(self, peer: PeerInfo, meta: bytes, nbytes: int) -> Grant:
        return await self.grant_read(peer, meta)


async def test_the_metas_held_for_requests_being_decided_are_capped() -> None:
    """docs/security.md: a linked peer "can load this side within per-link bounds". A
    request's meta (up to ``max_meta_bytes``, 1 MiB) is held while its handler decides,
    and a link took up to 4,096 such requests: 4 GiB held per link for requests the
    handler had not answered yet. Past ``DECIDING_META_CAPS`` metas' worth (16 MiB)
    the requests are answered ``LLM_LINK_BUSY`` with their meta skipped unread; the room
    comes back as the handler decides."""
    handler = Stalling()
    server = TcpTransport(2, handler)
    loop = asyncio.get_running_loop()
    n, cap = DECIDING_META_CAPS + 8, DECIDING_META_CAPS
    meta = bytes(1 << 20)  # the most a request may carry by default
    try:
        port = (await server.listen(HOST, 0))[1]
        s = await loop.run_in_executor(None, raw_link, port)
        await until(lambda: len(server.links()) == 1, 10)
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]

        def send(first: int, count: int) -> None:
            for rid in range(first, first + 2 * count, 2):
                s.sendall(wire.encode_frame(_F.READ_REQ, rid, meta=meta, size=1))

        await loop.run_in_executor(None, send, 0, n)
        busy = [await loop.run_in_executor(None, recv_frame, s) for _ in range(n - cap)]
        assert [h.status for h in busy] == [LLMStatusCode.LLM_LINK_BUSY] * (n - cap)
        assert handler.asked == cap
        held = tracemalloc.get_traced_memory()[0] - before
        assert held < (cap + 4) << 20, f"{held >> 20} MiB held"
        handler.go.set()  # decided: refused, and their room given back
        answers = [await loop.run_in_executor(None, recv_frame, s) for _ in range(cap)]
        assert {h.status for h in answers} == {LLMStatusCode.LLM_NOT_YET_LINK}
        await loop.run_in_executor(None, send, 2 * n, 1)
        assert (await loop.run_in_executor(None, recv_frame, s)).req_id == 2 * n
        assert handler.asked == cap + 1
        s.close()
    finally:
        tracemalloc.stop()
        await server.aclose()
