"""The writer of a TCP link: control frames first, then payload streams in turns.

A frame posted while the writer is parked leaves at once, in the call that posts it (as
asyncio's own transports write when nothing is queued): no writer wake-up on a lone
request's or reply's way. What is posted after that during the same loop iteration is
batched into one ``sendmsg`` (or, with payload moved by address, one ``writev``) by the
writer's next turn. It tells the link's protocol when replies it accounted leave
(reply backpressure).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Sequence
from typing import Final
from typing import Protocol

import numpy as np
import numpy.typing as npt

from .. import _wire as wire
from ._io import IOV_MAX
from ._io import RawSock
from ._io import advance_rows
from ._io import as_rows
from ._io import consumed
from ._io import privatize
from ._io import vectored
from ._io import wake
from ._io import writev
from ._ops import Bufs
from ._ops import RunCursor
from ._ops import Stream

__all__ = ["BLOCKED", "DONE", "MORE", "YIELD_BYTES", "Writer"]

_F = wire.FrameType
# A peer that keeps the socket full would let the reader (or a fast peer the writer) run
# without ever suspending; they yield to the loop after about this many bytes.
YIELD_BYTES: Final = 4 << 20
# Outcomes of Writer.pump.
DONE: Final = 0
BLOCKED: Final = 1
MORE: Final = 2
# A frame posted during a long loop iteration (a reader answering many queued requests,
# a task posting many requests) waits at most about this long for the writer's turn:
# it is sent at once when the last send at once is older (seconds).
FLUSH_S = 300e-6


class _Chunks(Protocol):
    chunk_bytes: int  # payload of one DATA frame at most


class _Backlog(Protocol):
    """The reply accounting of the link's protocol (:class:`LinkProtocol`)."""

    def queued(self, frame: bytes) -> None: ...

    def batch_taken(self) -> None: ...

    def batch_sent(self) -> None: ...

    def replies_drained(self) -> bool: ...


class Writer:
    """What a link has to send, and the batch in flight.

    `iov[pos:]` is the unsent part of the batch in flight: a list of buffers, or (a
    batch with payload moved by address: see _next_batch) `(address, length)` rows over
    the memory of `_keep` and of the streams.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: RawSock,
        owner: _Chunks,
        backlog: _Backlog,
        first_frame: bytes | None,
    ) -> None:
        self._loop = loop
        self._sock = sock
        self._owner = owner
        self._backlog = backlog
        # `first_frame` (the accepting side's last handshake frame) leads every other
        self.ctrl: Bufs = [] if first_frame is None else [first_frame]
        self.streams: collections.deque[Stream] = collections.deque()
        self.iov: Bufs | npt.NDArray[np.uint64] = []
        self._keep: list[object] = []
        self.pos = 0
        # payload of LayoutViews moves by address (readv / writev): no object per run
        self._vec = vectored(sock)
        self._inflight: list[Stream] = []
        # streams whose last byte is in the batch, with the iov index just past that byte:
        # a stream is `sent` once the kernel took it, not when the whole batch is out (a
        # peer's WRITE_DONE / READ_DONE may arrive while the batch's tail still waits)
        self._finishing: collections.deque[tuple[int, Stream]] = collections.deque()
        self._batch_data = 0  # payload bytes in the batch
        self.drained: asyncio.Future[None] | None = None  # the paused reader waits here
        self._idle: asyncio.Future[None] | None = None
        # whether kick() may send at once: not again in a loop iteration that already did
        self._at_once = True
        self._sent_at = 0.0  # when kick() last sent at once (time.monotonic())

    def post(self, frame: bytes, *, soon: bool = False) -> None:
        """Queue an owned control frame; it is sent before any further payload.

        ``soon``: not at once (see :meth:`kick`) but on the writer's next turn, for a
        frame nobody waits on (an acknowledgement), so that its send is not paid on the
        way of the operation that posts it.
        """
        self.ctrl.append(frame)
        self._backlog.queued(frame)
        if soon:
            if self._idle is not None:
                wake(self._idle)
        else:
            self.kick()

    def between_frames(self) -> bool:
        """Whether no frame is half-sent."""
        return self.pos >= len(self.iov)

    def clear(self) -> None:
        """The link broke: send nothing more."""
        self.streams.clear()
        self.ctrl.clear()

    def add_stream(
        self, rid: int, views: Sequence[memoryview], total: int, *, lead: bytes | None = None
    ) -> Stream:
        """Queue a payload stream of ``total`` bytes from ``views`` as ``DATA`` of ``rid``;
        ``lead``: an owned control frame queued just before it (a ``READ_RESP``), so
        that both leave in one batch."""
        if lead is not None:
            self.ctrl.append(lead)
            self._backlog.queued(lead)
        stream = Stream(rid, views, total)
        self.streams.append(stream)
        self.kick()
        return stream

    def abort_stream(self, stream: Stream) -> None:
        """Withdraw a stream; afterwards its memory is never read again."""
        if stream.sent or stream.aborted:
            return
        stream.aborted = True
        with contextlib.suppress(ValueError):
            self.streams.remove(stream)
        if stream in self._inflight:
            # Frames must stay whole, so the batch in flight is finished from private
            # copies of whatever was not handed to the kernel yet.
            iov = self.iov
            if isinstance(iov, np.ndarray):
                self._keep.append(privatize(iov[self.pos :]))
                return
            for i in range(self.pos, len(iov)):
                if isinstance(iov[i], memoryview):
                    iov[i] = bytes(iov[i])

    def _next_batch(self) -> bool:
        """Fill `iov` with control frames plus up to ~one chunk from each stream in turn.

        Payload of a :class:`RunCursor` on a :func:`vectored` socket is taken as address
        rows; a batch with any becomes one array of rows (each buffer of the batch one
        row, kept alive by `_keep`), sent with ``writev``.
        """
        iov: list[bytes | memoryview | npt.NDArray[np.uint64]] = list(self.ctrl)
        self.ctrl = []
        self._backlog.batch_taken()
        inflight: list[Stream] = []
        finishing: list[tuple[int, Stream]] = []  # piece index just past a stream's end
        by_address = False
        budget = self._owner.chunk_bytes
        streams = self.streams
        while streams and budget > 0:
            s = streams.popleft()
            n = min(s.cursor.remaining, self._owner.chunk_bytes)
            iov.append(wire.encode_header(_F.DATA, s.rid, size=n))
            if self._vec and type(s.cursor) is RunCursor:
                iov.append(s.cursor.take_rows(n))
                by_address = True
            else:
                iov.extend(s.cursor.take(n))
            budget -= n
            inflight.append(s)
            if s.cursor.remaining:
                streams.append(s)
            else:
                finishing.append((len(iov), s))
        if by_address:
            self.iov, ends = as_rows(iov)
            self._keep = [p for p in iov if not isinstance(p, np.ndarray)]
            self._finishing.extend((ends[i - 1], s) for i, s in finishing)
        else:
            self.iov = iov  # type: ignore[assignment]  # no rows in it
            self._keep = []
            self._finishing.extend(finishing)
        self.pos, self._inflight = 0, inflight
        self._batch_data = self._owner.chunk_bytes - budget
        return bool(iov)

    def pump(self) -> int:
        """Send pending frames without waiting; returns ``DONE``, ``BLOCKED`` or ``MORE``.

        ``BLOCKED``: the socket is full. ``MORE``: work remains, but this call sent
        :data:`YIELD_BYTES` already and gives the loop a turn.

        Raises:
            OSError: the connection failed.
        """
        sock, sent = self._sock, 0
        while True:
            if self.pos >= len(self.iov):
                self._inflight = []
                self._backlog.batch_sent()
                if self.drained is not None and self._backlog.replies_drained():
                    wake(self.drained)
                if sent >= YIELD_BYTES:
                    return MORE
                if not self._next_batch():
                    return DONE
                sent += self._batch_data
            iov, pos = self.iov, self.pos
            if isinstance(iov, np.ndarray):
                try:
                    n = writev(sock, iov[pos : pos + IOV_MAX])
                except (BlockingIOError, InterruptedError):
                    return BLOCKED
                pos = advance_rows(iov, pos, n)
            else:
                try:
                    n = sock.sendmsg(iov[pos : pos + IOV_MAX])
                except (BlockingIOError, InterruptedError):
                    return BLOCKED
                pos = consumed(iov, pos, n)
            self.pos = pos
            finishing = self._finishing
            while finishing and finishing[0][0] <= pos:
                finishing.popleft()[1].sent = True

    def kick(self) -> None:
        """Send what is queued, now or on the writer's next turn.

        At once (``pump`` right here) when the writer is parked or woken but not yet
        run, so no batch is in flight, and nothing was sent so in this loop iteration
        yet, or the last send at once is :data:`FLUSH_S` old: a lone frame costs no
        writer wake-up, and a frame posted late in a long iteration (a reader answering
        many queued requests, 32 layers' requests posted in a row) does not wait for
        its end, so the peer starts on it meanwhile. Otherwise the parked writer is
        woken, and its next turn sends everything posted meanwhile in one ``sendmsg``
        (sending each of many concurrent frames at once measured much slower). What a
        send at once leaves (a full
        socket, :data:`YIELD_BYTES` sent) and a send that failed are the writer's: it
        is woken, retries, and breaks the link on an ``OSError``.
        """
        idle = self._idle
        if idle is None:
            return  # the writer is running: it will send it
        now = time.monotonic()
        if self._at_once or now - self._sent_at >= FLUSH_S:
            if self._at_once:
                self._at_once = False
                self._loop.call_soon(self._rearm)
            self._sent_at = now
            try:
                if self.pump() == DONE:
                    return
            except OSError:
                pass  # the writer's own pump meets it again and breaks the link
        if not idle.done():
            wake(idle)

    def _rearm(self) -> None:
        self._at_once = True

    async def until_work(self, loop: asyncio.AbstractEventLoop) -> None:
        """Park until :meth:`kick`."""
        self._idle = loop.create_future()
        await self._idle
        self._idle = None
