"""The reader of a TCP link: frame headers and meta in, ``DATA`` straight into buffers.

It reads one frame at a time, hands control frames to the link's protocol, receives
``DATA`` into the buffers of the request it is for (``recvmsg_into``, or with payload
moved by address ``readv``), drops what nobody wants, and pauses while the protocol
says too many replies are queued for the peer (reply backpressure).

It reads ahead: one ``recv_into`` takes up to :data:`READ_AHEAD` bytes, so the frames
of a small exchange (a header, its meta, the next header, a small payload) cost one
system call together rather than one each; what of a ``DATA`` payload was read ahead is
copied into the request's buffers, the rest received into them directly, by a read
whose last buffer is the read-ahead buffer (what follows the chunk). After a read
that left a plain socket empty (fewer bytes than asked), the next read first waits for
readiness instead of trying and meeting ``EAGAIN``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Final
from typing import Protocol

import numpy as np
import numpy.typing as npt

from ..._layout import address_of
from .. import _wire as wire
from ._io import IOV_MAX
from ._io import RawSock
from ._io import SockIO
from ._io import advance_rows
from ._io import consumed
from ._io import readv
from ._io import vectored
from ._ops import MyOp
from ._ops import PeerOp
from ._ops import RunCursor
from ._ops import State
from ._writer import YIELD_BYTES

__all__ = ["Reader"]

_log = logging.getLogger("aiokv.transport.tcp")
_F = wire.FrameType
# What handling one frame counts for against YIELD_BYTES (after which the reader yields
# to the loop): a flood of small frames (each may start a request) also lets the loop
# run every 64 frames.
_FRAME_COST: Final = YIELD_BYTES // 64
#: Bytes one read takes ahead of what the frame in hand needs; also the most of a
#: ``DATA`` payload ever copied (the rest is received in place).
READ_AHEAD: Final = 16 << 10


class _Into(Protocol):
    """The buffers the rest of one DATA chunk is received into."""

    def read(self, sock: RawSock) -> tuple[int, bool]:
        """One read into the buffers not yet filled; returns the bytes read and whether
        the read's last buffer was the read-ahead buffer (the read could finish the
        chunk and read ahead behind it). Raises as ``recv_into``."""
        ...

    def advance(self, k: int) -> None:
        """Past ``k`` more bytes received (fewer than were left)."""
        ...


class _Views:
    """A chunk's buffers as views, read with ``recvmsg_into``."""

    __slots__ = ("_ahead", "_iov", "_pos")

    def __init__(self, iov: list[memoryview], ahead: memoryview) -> None:
        self._iov, self._ahead, self._pos = iov, ahead, 0

    def read(self, sock: RawSock) -> tuple[int, bool]:
        bufs = self._iov[self._pos : self._pos + IOV_MAX - 1]
        last = self._pos + len(bufs) == len(self._iov)  # this read can finish the chunk...
        if last:
            bufs.append(self._ahead)  # ... and read ahead behind it
        return sock.recvmsg_into(bufs)[0], last

    def advance(self, k: int) -> None:
        self._pos = consumed(self._iov, self._pos, k)


class _Rows:
    """A chunk's memory as ``(address, length)`` rows, read with ``readv``."""

    __slots__ = ("_ahead", "_pos", "_rows")

    def __init__(self, rows: npt.NDArray[np.uint64], ahead: npt.NDArray[np.uint64]) -> None:
        self._rows, self._ahead, self._pos = rows, ahead, 0

    def read(self, sock: RawSock) -> tuple[int, bool]:
        part = self._rows[self._pos : self._pos + IOV_MAX - 1]
        last = self._pos + len(part) == len(self._rows)  # as in _Views.read
        if last:
            part = np.concatenate((part, self._ahead))
        return readv(sock, part), last

    def advance(self, k: int) -> None:
        self._pos = advance_rows(self._rows, self._pos, k)


class _Frames(Protocol):
    """What the reader asks of the link's protocol (:class:`LinkProtocol`)."""

    def skips_meta(self, h: wire.Header) -> bool: ...

    def receive(self, h: wire.Header, meta: bytearray | None) -> None: ...

    def sink(self, rid: int) -> MyOp | PeerOp | None: ...

    def filled(self, sink: MyOp | PeerOp) -> None: ...

    def fail_sink(self, sink: MyOp | PeerOp, why: str) -> None: ...

    def reader_must_pause(self) -> bool: ...


class _Drain(Protocol):
    """The link's writer: it wakes ``drained`` once the queued replies are sent."""

    drained: asyncio.Future[None] | None


class _Link(Protocol):
    """The link the reader reads for: it breaks when reading ends."""

    def _break(self, reason: str) -> None: ...


class Reader:
    """Reads a link's socket until it breaks (:meth:`run`, the link's reader task)."""

    def __init__(
        self,
        io: SockIO,
        link: _Link,
        protocol: _Frames,
        writer: _Drain,
        *,
        scratch: bytearray,
        stall_s: float,
    ) -> None:
        self._io = io
        self._sock = io.sock
        self._link = link
        self._p = protocol
        self._w = writer
        self._scratch = scratch  # sink for data nobody wants
        self._stall_s = stall_s  # how long the peer may leave our replies unread
        #: whether the peer sent any frame since the handshake
        self.heard = False
        # payload of LayoutViews moves by address (readv / writev): no object per run
        self._vec = vectored(self._sock)
        # bytes read ahead: self._buf[self._lo : self._hi]
        self._buf = bytearray(READ_AHEAD)
        self._ahead = memoryview(self._buf)
        self._lo = self._hi = 0
        # the read-ahead buffer as an address row, appended to a chunk's last readv
        self._ahead_row = np.array([[address_of(self._ahead), READ_AHEAD]], dtype=np.uint64)
        # wait for readiness before the next read: the last one met EAGAIN, or read
        # fewer bytes than asked from a socket that such a read leaves empty
        self._dry = False
        self._short_empties = io.SHORT_READ_EMPTIES

    async def run(self) -> None:
        """Read frames until the link breaks, then break it with the reason (EOF, an
        ``OSError``, a protocol violation, the peer leaving our replies unread for
        ``stall_s``, or a bug); never raises."""
        size = wire.HEADER_SIZE
        ahead = self._ahead
        unyielded = 0
        try:
            while True:
                if self._hi - self._lo < size:
                    await self._fill(size)
                lo = self._lo
                self._lo = lo + size
                h = wire.decode_header(ahead[lo : lo + size])
                self.heard = True
                if h.type is _F.DATA:
                    await self._on_data(h.req_id, h.size)
                    unyielded += h.size + _FRAME_COST
                else:
                    await self._on_control(h)
                    unyielded += h.meta_len + _FRAME_COST
                if unyielded >= YIELD_BYTES:
                    unyielded = 0
                    await asyncio.sleep(0)
                if self._p.reader_must_pause():
                    await self._until_replies_drain()
        except TimeoutError:  # an OSError too: first
            _log.warning("%r: the peer does not read our replies; dropping the link", self._link)
            self._link._break("peer does not read")
        except (OSError, EOFError) as exc:
            self._link._break(f"connection lost: {exc}")
        except wire.WireError as exc:
            _log.warning("%r: protocol violation: %s", self._link, exc)
            self._link._break(f"protocol violation: {exc}")
        except Exception as exc:
            _log.exception("reader of %r failed", self._link)
            self._link._break(f"reader failed: {exc!r}")

    async def _on_control(self, h: wire.Header) -> None:
        """Read a control frame's meta and hand the frame to the protocol; the meta of a
        request it refuses unread (see :meth:`LinkProtocol.skips_meta`) is skipped."""
        meta: bytearray | None = None
        if self._p.skips_meta(h):
            await self._discard(h.meta_len)
        elif h.meta_len:
            meta = await self._meta(h.meta_len)
        else:
            meta = bytearray()
        self._p.receive(h, meta)

    async def _fill(self, n: int) -> None:
        """Read until at least ``n <= READ_AHEAD`` bytes are read ahead.

        Raises:
            ConnectionResetError: the peer closed the connection.
            OSError: the connection failed.
        """
        ahead, have = self._ahead, self._hi - self._lo
        if self._lo + n > READ_AHEAD or not have:  # keep the room at the end
            ahead[:have] = ahead[self._lo : self._hi]
            self._lo, self._hi = 0, have
        while self._hi - self._lo < n:
            if self._dry:
                await self._io.readable(n - (self._hi - self._lo))
            try:
                k = self._sock.recv_into(ahead[self._hi :])
            except (BlockingIOError, InterruptedError):
                self._dry = True
                continue
            if not k:
                raise ConnectionResetError("connection closed by peer")
            self._hi += k
            self._dry = self._short_empties and self._hi < READ_AHEAD

    async def _meta(self, n: int) -> bytearray:
        """The next ``n`` bytes (a frame's meta), as a buffer of their own."""
        if n <= READ_AHEAD:
            if self._hi - self._lo < n:
                await self._fill(n)
            lo = self._lo
            self._lo = lo + n
            return bytearray(self._ahead[lo : lo + n])
        # Memory grows with the bytes that came, never with the length the header
        # announced: a peer that announces a big meta and stalls holds about what it
        # sent (each piece is at most what arrived before it), not the cap.
        meta = bytearray(self._ahead[self._lo : self._hi])  # fewer than n: n > READ_AHEAD
        self._lo = self._hi
        while len(meta) < n:
            part = bytearray(min(n - len(meta), max(len(meta), READ_AHEAD)))
            await self._io.recv_exact(memoryview(part))
            meta += part
        return meta

    def _copy_ahead(self, iov: list[memoryview]) -> None:
        """Fill ``iov`` (no more than is read ahead) from the bytes read ahead."""
        ahead, lo = self._ahead, self._lo
        for v in iov:
            n = len(v)
            v[:] = ahead[lo : lo + n]
            lo += n
        self._lo = lo

    async def _until_replies_drain(self) -> None:
        """Backpressure: read nothing more until our replies to the peer are sent.

        Raises:
            TimeoutError: the peer read too little of them for ``stall_s``.
        """
        self._w.drained = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(self._stall_s):
                await self._w.drained
        finally:
            self._w.drained = None

    async def _discard(self, n: int) -> None:
        """Read ``n`` bytes and drop them."""
        ahead = min(n, self._hi - self._lo)
        self._lo += ahead
        n -= ahead
        scratch, sock = self._scratch, self._sock
        while n:
            if self._dry:
                await self._io.readable(min(n, len(scratch)))
            try:
                k = sock.recv_into(scratch, min(n, len(scratch)))
            except (BlockingIOError, InterruptedError):
                self._dry = True
                continue
            self._dry = False
            if not k:
                raise ConnectionResetError("connection closed by peer")
            n -= k

    async def _on_data(self, rid: int, size: int) -> None:
        sink = self._p.sink(rid)
        if sink is None or sink.state is not State.RECEIVING or sink.cursor is None:
            await self._discard(size)  # late data of a finished or cancelled request
            return
        if size > sink.cursor.remaining:
            # More than granted/requested: never written anywhere, the request fails.
            self._fail_sink(sink, "sent more bytes than granted")
            await self._discard(size)
            return
        ahead = min(size, self._hi - self._lo)
        if ahead:
            self._copy_ahead(sink.cursor.take(ahead))
            size -= ahead
            if not size:
                if not sink.cursor.remaining:
                    self._p.filled(sink)
                return
        if self._vec and type(sink.cursor) is RunCursor:
            into: _Into = _Rows(sink.cursor.take_rows(size), self._ahead_row)
        else:
            into = _Views(sink.cursor.take(size), self._ahead)
        await self._recv_chunk(sink, into, size)

    async def _recv_chunk(self, sink: MyOp | PeerOp, into: _Into, size: int) -> None:
        """Receive the ``size`` bytes left of one DATA chunk into ``into``; the rest of
        the chunk is dropped once ``sink`` stops receiving (cancelled mid-chunk)."""
        assert sink.cursor is not None
        sock, left = self._sock, size
        while left:
            if self._dry:
                await self._io.readable(left)
            # checked after any wait and right before the read, with no await between
            if sink.state is not State.RECEIVING:
                # Cancelled mid-chunk: its owner has returned, so the rest is dropped.
                await self._discard(left)
                return
            try:
                k, last = into.read(sock)
            except (BlockingIOError, InterruptedError):
                self._dry = True
                continue
            if not k:
                raise ConnectionResetError("connection closed by peer")
            k = self._behind(k, left, last)
            left -= k
            if left:
                into.advance(k)
        if not sink.cursor.remaining:
            self._p.filled(sink)

    def _behind(self, k: int, left: int, last: bool) -> int:
        """After a read of ``k`` bytes into a chunk's last ``left`` bytes and, when
        ``last``, the read-ahead buffer behind them (empty before: the chunk took all that
        was read ahead): keep what went past the chunk as read ahead, note whether the
        socket is now empty; returns the bytes that went into the chunk."""
        past = k - left
        if past > 0:
            self._lo, self._hi = 0, past
        # only a read that asked past the chunk's end knows whether it emptied the socket
        self._dry = last and self._short_empties and past < READ_AHEAD
        return min(k, left)

    def _fail_sink(self, sink: MyOp | PeerOp, why: str) -> None:
        _log.warning("%r: request %d failed: peer %s", self._link, sink.rid, why)
        self._p.fail_sink(sink, why)
