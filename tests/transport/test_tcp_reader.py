"""A TCP link's reader reads ahead: whatever way the peer's bytes arrive (all at once, or
cut anywhere: inside a header, a meta, a payload), every frame reaches the protocol
whole and in order, every payload byte lands where its request wants it, and the
frames that arrive together cost one read.

The reader runs alone on one end of a socket pair, over a recording protocol (what the
link's ``LinkProtocol`` is to it); the test writes raw frames into the other end.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import random
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import pytest
from _helpers import until

from aiokv.transport import _wire as wire
from aiokv.transport.tcp import _reader
from aiokv.transport.tcp._io import SockIO
from aiokv.transport.tcp._ops import Cursor
from aiokv.transport.tcp._ops import PeerOp
from aiokv.transport.tcp._ops import State
from aiokv.transport.tcp._reader import READ_AHEAD
from aiokv.transport.tcp._reader import Reader

F = wire.FrameType
SINK, UNKNOWN, SKIPPED = 8, 10, 12  # request ids: one receiving, one nobody wants


@dataclass
class _Protocol:
    """Records what the reader hands over; request ``SINK`` receives into ``views``."""

    views: list[memoryview]
    total: int
    frames: list[tuple[F, int, bytes]] = field(default_factory=list)
    filled_ids: list[int] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.op = PeerOp(SINK, is_read=False)
        self.op.state = State.RECEIVING
        self.op.cursor = Cursor(self.views, self.total)

    def skips_meta(self, h: wire.Header) -> bool:
        return h.req_id == SKIPPED

    def receive(self, h: wire.Header, meta: bytearray | None) -> None:
        self.frames.append((h.type, h.req_id, b"<skipped>" if meta is None else bytes(meta)))

    def sink(self, rid: int) -> PeerOp | None:
        return self.op if rid == SINK else None

    def filled(self, sink: PeerOp) -> None:
        self.filled_ids.append(sink.rid)

    def fail_sink(self, sink: PeerOp, why: str) -> None:
        self.failed.append(why)

    def reader_must_pause(self) -> bool:
        return False


class _Link:
    def __init__(self) -> None:
        self.broken: list[str] = []

    def _break(self, reason: str) -> None:
        self.broken.append(reason)


class _Writer:
    drained: asyncio.Future[None] | None = None


@dataclass
class _Read:
    reader: Reader
    protocol: _Protocol
    link: _Link
    peer: socket.socket
    recvs: list[int]


@contextlib.asynccontextmanager
async def _reading(views: list[memoryview], total: int) -> AsyncIterator[_Read]:
    """A reader on one end of a socket pair, what its reads (``recv_into``,
    ``recvmsg_into``) returned recorded (-1: ``EAGAIN``); the other end."""
    a, b = socket.socketpair()
    a.setblocking(False)
    recvs: list[int] = []

    def counted(read: Any) -> Any:
        def call(*args: Any) -> Any:
            try:
                got = read(*args)
            except BlockingIOError:
                recvs.append(-1)
                raise
            recvs.append(got if isinstance(got, int) else got[0])
            return got

        return call

    class _Counted:  # the socket calls of ``a``, its reads recorded
        def __getattr__(self, name: str) -> object:
            return getattr(a, name)

        recv_into = staticmethod(counted(a.recv_into))
        recvmsg_into = staticmethod(counted(a.recvmsg_into))

    io = SockIO(asyncio.get_running_loop(), _Counted())  # type: ignore[arg-type]
    protocol, link = _Protocol(views, total), _Link()
    reader = Reader(io, link, protocol, _Writer(), scratch=bytearray(1000), stall_s=5.0)
    task = asyncio.create_task(reader.run())
    try:
        yield _Read(reader, protocol, link, b, recvs)
    finally:
        b.close()
        async with asyncio.timeout(5):
            await task  # EOF ends it
        io.close()


def _stream(rng: random.Random) -> tuple[bytes, list[tuple[F, int, bytes]], bytes, list[int]]:
    """Frames of every shape the reader meets: the bytes, the frames the protocol must
    see, the payload request ``SINK`` must receive, and its views' lengths."""
    parts: list[bytes] = []
    frames: list[tuple[F, int, bytes]] = []
    payload = bytearray()

    def control(kind: F, rid: int, meta: bytes) -> None:
        parts.append(wire.encode_frame(kind, rid, meta=meta, size=len(meta)))
        frames.append((kind, rid, b"<skipped>" if rid == SKIPPED else meta))

    def data(rid: int, n: int) -> None:
        chunk = rng.randbytes(n)
        parts.append(wire.encode_header(F.DATA, rid, size=n) + chunk)
        if rid == SINK:
            payload.extend(chunk)

    control(F.PING, 1, b"")
    control(F.READ_REQ, 2, b"m" * 100)
    data(SINK, 10)  # read ahead with what is around it
    control(F.READ_REQ, 4, rng.randbytes(3 * READ_AHEAD))  # a meta larger than the read
    data(UNKNOWN, 3000)  # dropped
    data(SINK, READ_AHEAD + 5000)  # partly read ahead, the rest in place
    control(F.WRITE_REQ, SKIPPED, rng.randbytes(2 * READ_AHEAD))  # skipped unread
    control(F.READ_REQ, 6, b"after the skipped meta")
    data(SINK, 1)
    data(UNKNOWN, 2 * READ_AHEAD + 7)
    for i in range(40):  # small frames, many per read
        control(F.READ_REQ, 100 + 2 * i, rng.randbytes(rng.randrange(0, 60)))
    data(SINK, 4 * READ_AHEAD)
    control(F.PING, 3, b"")
    lens = [7, 1, 4096, len(payload) - 4104]  # the payload's views cut across frames
    return b"".join(parts), frames, bytes(payload), lens


def _views(lens: list[int]) -> tuple[list[bytearray], list[memoryview]]:
    bufs = [bytearray(n) for n in lens]
    return bufs, [memoryview(b) for b in bufs]


@pytest.mark.parametrize("cuts", [0, 1, 37, 400])
async def test_frames_arrive_whole_and_in_order_however_the_bytes_are_cut(cuts: int) -> None:
    """The stream sent at once, or cut at ``cuts`` random places (inside headers, meta
    and payloads; the reader reading each piece before the next comes): the protocol
    gets every control frame with its meta (a skipped one without), request ``SINK``'s
    views get its payload exactly and it is filled once, other data is dropped, and
    the link never breaks."""
    rng = random.Random(cuts)
    raw, frames, payload, lens = _stream(rng)
    bufs, views = _views(lens)
    async with _reading(views, len(payload)) as r:
        at = sorted(rng.sample(range(1, len(raw)), cuts))
        for lo, hi in zip([0, *at], [*at, len(raw)], strict=True):
            r.peer.sendall(raw[lo:hi])
            if cuts:
                await asyncio.sleep(0.001)  # the reader takes this piece alone
        await until(lambda: len(r.protocol.frames) == len(frames))
        assert r.protocol.frames == frames
        assert b"".join(bufs) == payload
        assert r.protocol.filled_ids == [SINK]
        assert r.protocol.failed == [] and r.link.broken == []
        assert r.reader.heard


async def test_frames_that_arrive_together_cost_one_read() -> None:
    """Forty small requests and a small payload sent in one go are read with one
    ``recv_into``."""
    rng = random.Random(5)
    parts = [
        wire.encode_frame(F.READ_REQ, 2 * i, meta=rng.randbytes(50), size=50) for i in range(40)
    ]
    chunk = rng.randbytes(4096)
    parts.append(wire.encode_header(F.DATA, SINK, size=4096) + chunk)
    bufs, views = _views([4096])
    async with _reading(views, 4096) as r:
        await asyncio.sleep(0.01)  # parked, waiting for readiness
        before = len(r.recvs)
        raw = b"".join(parts)
        r.peer.sendall(raw)
        await until(lambda: r.protocol.filled_ids == [SINK])
        await asyncio.sleep(0.01)
        assert len(r.protocol.frames) == 40 and bytes(bufs[0]) == chunk
        # one read took it all (a stale readiness wake-up may add an EAGAIN: -1)
        assert [k for k in r.recvs[before:] if k != -1] == [len(raw)]


async def test_a_payload_larger_than_the_read_ahead_and_what_follows_cost_two_reads() -> None:
    """A 64 KiB payload and forty small requests behind it, sent in one go: the first
    read takes 16 KiB, the second the rest of the payload in place and the requests
    behind it (read ahead); then the reader waits, with no read meeting ``EAGAIN``."""
    rng = random.Random(6)
    size = 4 * READ_AHEAD
    chunk = rng.randbytes(size)
    parts = [wire.encode_header(F.DATA, SINK, size=size) + chunk]
    parts += [
        wire.encode_frame(F.READ_REQ, 2 * i, meta=rng.randbytes(50), size=50) for i in range(40)
    ]
    bufs, views = _views([size])
    async with _reading(views, size) as r:
        await asyncio.sleep(0.01)  # parked, waiting for readiness
        before = len(r.recvs)
        raw = b"".join(parts)
        r.peer.sendall(raw)
        await until(lambda: len(r.protocol.frames) == 40)
        await asyncio.sleep(0.01)
        assert bytes(bufs[0]) == chunk and r.protocol.filled_ids == [SINK]
        reads = [k for k in r.recvs[before:] if k != -1]  # -1: a stale wake-up's EAGAIN
        assert reads == [READ_AHEAD, len(raw) - READ_AHEAD]


async def test_a_broken_header_read_ahead_breaks_the_link() -> None:
    """A bad header that arrives behind good frames in one read still breaks the link
    (a protocol violation), after the good frames were handed over."""
    _, views = _views([1])
    async with _reading(views, 1) as r:
        good = wire.encode_frame(F.PING, 1)
        r.peer.sendall(good + b"XXXX" + good[4:])
        await until(lambda: r.link.broken)
        assert [f[0] for f in r.protocol.frames] == [F.PING]
        assert "protocol violation" in r.link.broken[0]


async def test_the_peer_closing_mid_frame_breaks_the_link() -> None:
    """EOF inside a header read ahead ends the reader with ``connection lost``."""
    _, views = _views([1])
    async with _reading(views, 1) as r:
        r.peer.sendall(wire.encode_frame(F.PING, 1)[:10])
        await asyncio.sleep(0.01)
        r.peer.shutdown(socket.SHUT_WR)
        await until(lambda: r.link.broken)
        assert r.protocol.frames == [] and "connection lost" in r.link.broken[0]


def test_read_ahead_is_small() -> None:
    """What one read takes, and so the most of a payload ever copied, stays small."""
    assert 4096 < _reader.READ_AHEAD <= 64 << 10


@pytest.mark.parametrize("first", [100, READ_AHEAD + 100])
async def test_nothing_lands_once_a_request_stops_receiving_mid_chunk(first: int) -> None:
    """A request that stops receiving (cancelled: its owner returned) while the reader
    waits for the rest of its chunk gets no byte more; the rest of the chunk is dropped
    and the frames after it are read as usual."""
    size = 4 * READ_AHEAD
    bufs, views = _views([size])
    chunk = random.Random(1).randbytes(size)
    async with _reading(views, size) as r:
        r.peer.sendall(wire.encode_header(F.DATA, SINK, size=size) + chunk[:first])
        await until(lambda: bytes(bufs[0][:first]) == chunk[:first])
        r.protocol.op.state = State.OVER
        r.peer.sendall(chunk[first:] + wire.encode_frame(F.PING, 1))
        await until(lambda: len(r.protocol.frames) == 1)
        assert bytes(bufs[0][first:]) == bytes(size - first)
        assert r.protocol.filled_ids == [] and r.link.broken == []


async def test_a_socket_error_is_never_waited_past() -> None:
    """uvloop ends a descriptor's watch when the socket reports an error (it calls the
    callback once more, then closes its poll handle); a reader that woke, read nothing
    and waits again must get the error, not wait forever on a watch that is gone (seen
    as a link that never broke after its peer vanished: the hostile-frames fuzz, seed
    999, under uvloop). asyncio's loop keeps the watch: each wait returns at once."""
    loop = asyncio.get_running_loop()
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sock = socket.socket()
    sock.setblocking(False)
    assert sock.connect_ex(("127.0.0.1", port)) in (errno.EINPROGRESS, errno.ECONNREFUSED)
    io = SockIO(loop, sock)
    raised: OSError | None = None
    try:
        for _ in range(3):
            try:
                await asyncio.wait_for(io.readable(), 5)
            except TimeoutError:
                raise AssertionError("waited past a socket error") from None
            except OSError as exc:  # uvloop: the wait after the one the error woke
                raised = exc
                break
        err = raised.errno if raised else sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        assert err == errno.ECONNREFUSED
    finally:
        io.close()
