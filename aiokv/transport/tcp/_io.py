"""Readiness waits and exact reads/writes on one non-blocking socket."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import itertools
import os
import socket
import sys
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import MutableSequence
from typing import TYPE_CHECKING
from typing import Any
from typing import ClassVar
from typing import Final
from typing import Protocol

import numpy as np
import numpy.typing as npt

from ..._layout import address_of

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer
    from _typeshed import WriteableBuffer

__all__ = [
    "IOV_MAX",
    "RawSock",
    "SockIO",
    "advance_rows",
    "as_rows",
    "consumed",
    "privatize",
    "readv",
    "vectored",
    "wake",
    "writev",
]

#: Most buffers one vectored send or receive takes.
IOV_MAX: Final = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)

# Waits for at least this many more bytes of a frame use SO_RCVLOWAT (see readable()).
_LOWAT_MIN: Final = 64 << 10


def _libc_calls() -> tuple[Callable[[int, int, int], int], Callable[[int, int, int], int]] | None:
    """libc's ``readv`` / ``writev`` (errno kept), where ``struct iovec`` is two
    pointer-sized words and the C library can be loaded; else None."""
    if not sys.platform.startswith(("linux", "darwin")) or ctypes.sizeof(ctypes.c_void_p) != 8:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        calls = libc.readv, libc.writev
    except (OSError, AttributeError):
        return None
    for fn in calls:
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
        fn.restype = ctypes.c_ssize_t
    return calls


_CALLS = _libc_calls()


def vectored(sock: object) -> bool:
    """Whether ``sock`` moves payload by address (:func:`readv` / :func:`writev`): a
    plain ``socket.socket`` where libc's calls are available (TLS never: its bytes go
    through OpenSSL)."""
    return _CALLS is not None and type(sock) is socket.socket


def _vcall(i: int, sock: RawSock, rows: npt.NDArray[np.uint64]) -> int:
    fd = sock.fileno()  # checked right before the call: a closed socket's fd may be reused
    if fd < 0:
        raise ConnectionResetError("socket closed")
    assert _CALLS is not None and rows.dtype == np.uint64 and rows.flags.c_contiguous
    n: int = _CALLS[i](fd, rows.ctypes.data, min(len(rows), IOV_MAX))
    if n >= 0:
        return n
    err = ctypes.get_errno()
    if err in (errno.EAGAIN, errno.EWOULDBLOCK):
        raise BlockingIOError(err, os.strerror(err))
    if err == errno.EINTR:
        raise InterruptedError(err, os.strerror(err))
    raise OSError(err, os.strerror(err))


def readv(sock: RawSock, rows: npt.NDArray[np.uint64]) -> int:
    """Receive into the memory of ``rows`` (``(address, length)``, ``uint64``, C order;
    the first :data:`IOV_MAX` of them) from a :func:`vectored` socket; bytes received
    (0: the peer closed). The caller guarantees the memory is writable and alive.

    Raises:
        BlockingIOError / InterruptedError: as ``recv_into`` on a non-blocking socket.
        OSError: the connection failed (``ConnectionResetError`` once closed locally).
    """
    return _vcall(0, sock, rows)


def writev(sock: RawSock, rows: npt.NDArray[np.uint64]) -> int:
    """Send from the memory of ``rows`` (as for :func:`readv`); bytes the kernel took.

    Raises:
        as :func:`readv`.
    """
    return _vcall(1, sock, rows)


def wake(fut: asyncio.Future[None]) -> None:
    """Resolve ``fut`` unless it is already done (a waiter may have been cancelled)."""
    if not fut.done():
        fut.set_result(None)


class RawSock(Protocol):
    """The socket calls a link makes: a ``socket.socket``, or TLS's stand-in for one."""

    def fileno(self) -> int: ...
    def send(self, data: ReadableBuffer, /) -> int: ...
    def sendmsg(self, buffers: Iterable[ReadableBuffer], /) -> int: ...
    def recv_into(self, buffer: WriteableBuffer, nbytes: int = ..., /) -> int: ...
    def recvmsg_into(
        self, buffers: Iterable[WriteableBuffer], /
    ) -> tuple[int, list[Any], int, Any]: ...
    def getsockopt(self, level: int, optname: int, /) -> int: ...
    def setsockopt(self, level: int, optname: int, value: int, /) -> None: ...
    def close(self) -> None: ...


class SockIO:
    """Readiness waits for one non-blocking socket; safe against fd reuse after close."""

    __slots__ = (
        "_error",
        "_errors_end_watch",
        "_loop",
        "_lowat",
        "_rfut",
        "_watching",
        "_wfut",
        "fd",
        "sock",
    )

    #: Whether a read that returns fewer bytes than asked left nothing to read (a plain
    #: socket: it returns what the kernel holds; TLS: one record at a time).
    SHORT_READ_EMPTIES: ClassVar[bool] = True

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: RawSock) -> None:
        self._loop = loop
        self.sock = sock
        self.fd = sock.fileno()
        self._rfut: asyncio.Future[None] | None = None
        self._wfut: asyncio.Future[None] | None = None
        self._watching = False  # the loop watches fd for reading (see readable())
        self._lowat = 1
        # uvloop ends a descriptor's watch on a socket error (libuv reports the poll
        # failed; uvloop calls the callbacks once more, then closes the poll handle),
        # where asyncio's selector loop keeps it: see _on_readable
        self._errors_end_watch = not isinstance(loop, asyncio.selector_events.BaseSelectorEventLoop)
        self._error = 0  # that socket error, raised by the next wait

    @property
    def closed(self) -> bool:
        return self.sock.fileno() < 0

    async def start(self) -> None:
        """Whatever must run before the link's handshake: nothing on a plain socket
        (the TLS variant runs its own handshake)."""

    async def readable(self, want: int = 1) -> None:
        """Wait until ``want`` bytes can be read (fewer if the socket buffer is small).

        Waking only once the bytes a frame still needs have arrived (``SO_RCVLOWAT``),
        rather than at the first byte, saves most wake-ups of a big transfer: measured
        +25% throughput with half to a third of the context switches. Reads stay non-blocking and
        return what is there; EOF, errors and close still wake at once. A wake-up may be
        stale (readiness seen before the last read took the bytes): callers read
        non-blocking and wait again on ``EAGAIN``, as every reader here does.
        """
        if self.closed:
            raise ConnectionResetError("socket closed")
        if self._error:
            raise OSError(self._error, os.strerror(self._error))
        lowat = 1
        if want > _LOWAT_MIN:
            # Well below the buffer size, so the kernel can always reach it.
            cap = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // 4
            lowat = max(1, min(want, cap))
        if lowat != self._lowat:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
            self._lowat = lowat
        fut = self._rfut = self._loop.create_future()
        if not self._watching:
            self._loop.add_reader(self.fd, self._on_readable)
            self._watching = True
        try:
            await fut
        finally:
            if self._rfut is fut:
                self._rfut = None

    def _on_readable(self) -> None:
        """The loop saw fd readable: wake the waiter. The fd stays watched after a wait,
        so a reader that reads a reply and waits again costs no ``add_reader`` /
        ``remove_reader`` (two ``epoll_ctl`` calls) per wait; with no waiter (its bytes
        are read later, or the reader paused) it is unwatched here, since readiness is
        level-triggered and would call again every loop iteration.

        Under uvloop a socket error (``SO_ERROR`` set, e.g. ``EPIPE`` after the peer
        reset a half-closed connection) ends the watch: this call is the last. The error
        is taken (``SO_ERROR`` reads and clears it) and raised by the next
        :meth:`readable`; the fd is unwatched here, so the state stays the loop's. Else
        a reader whose read after this wake-up found nothing would wait forever on a
        watch that no longer exists (a link that never learns its peer is gone)."""
        fut = self._rfut
        if fut is None or (self._errors_end_watch and self._take_error()):
            self._watching = False
            self._loop.remove_reader(self.fd)
        if fut is not None:
            wake(fut)

    def _take_error(self) -> bool:
        """Whether the socket has a pending error (kept in ``_error``); reads it, which
        clears it in the kernel."""
        try:
            err = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        except OSError as exc:
            err = exc.errno or errno.EBADF
        if err:
            self._error = err
        return bool(err)

    async def writable(self) -> None:
        """Wait until the socket is writable (or closed under us)."""
        if self.closed:
            raise ConnectionResetError("socket closed")
        fut = self._wfut = self._loop.create_future()
        self._loop.add_writer(self.fd, wake, fut)
        try:
            await fut
        finally:
            if self._wfut is fut:
                self._wfut = None
                self._loop.remove_writer(self.fd)

    async def recv_exact(self, view: memoryview) -> None:
        """Fill ``view`` completely.

        Raises:
            ConnectionResetError: the peer closed the connection.
        """
        pos, n, sock = 0, len(view), self.sock
        while pos < n:
            try:
                k = sock.recv_into(view[pos:])
            except (BlockingIOError, InterruptedError):
                await self.readable(n - pos)
                continue
            if not k:
                raise ConnectionResetError("connection closed by peer")
            pos += k

    async def send_all(self, data: bytes) -> None:
        """Send ``data`` completely (handshake only; links send through their writer)."""
        view = memoryview(data)
        while view:
            try:
                k = self.sock.send(view)
            except (BlockingIOError, InterruptedError):
                await self.writable()
                continue
            view = view[k:]

    def close(self) -> None:
        """Unregister from the loop, wake any waiter (its next syscall fails), close."""
        if self._watching:
            self._watching = False
            self._loop.remove_reader(self.fd)
        if self._wfut is not None:
            self._loop.remove_writer(self.fd)
        for fut in (self._rfut, self._wfut):
            if fut is not None:
                wake(fut)
        self._rfut = self._wfut = None
        self.sock.close()


def consumed(
    iov: MutableSequence[memoryview] | MutableSequence[bytes | memoryview], pos: int, n: int
) -> int:
    """Past ``n`` bytes moved from ``iov[pos:]`` (by ``recvmsg_into`` or ``sendmsg``): the
    first buffer not fully moved, cut down (to a view) to what of it was not."""
    while n:
        m = len(iov[pos])
        if n >= m:
            n -= m
            pos += 1
        else:
            iov[pos] = memoryview(iov[pos])[n:]
            n = 0
    return pos


# ------------------------------------------------------------------ address rows (writev)


def as_rows(
    pieces: list[bytes | memoryview | npt.NDArray[np.uint64]],
) -> tuple[npt.NDArray[np.uint64], list[int]]:
    """One ``(address, length)`` row array over ``pieces`` in order (a buffer: one row;
    an array: its rows), and the row index just past each piece."""
    parts: list[npt.NDArray[np.uint64]] = []
    ends: list[int] = []
    pending: list[tuple[int, int]] = []  # consecutive buffers, one array for them all
    for p in pieces:
        if isinstance(p, np.ndarray):
            if pending:
                parts.append(np.array(pending, dtype=np.uint64))
                pending = []
            parts.append(p)
        else:
            pending.append((_addr(p), len(p)))
        ends.append(len(p) if isinstance(p, np.ndarray) else 1)
    if pending:
        parts.append(np.array(pending, dtype=np.uint64))
    return np.ascontiguousarray(np.concatenate(parts)), list(itertools.accumulate(ends))


def _addr(buf: bytes | memoryview) -> int:
    """The address of a flat byte buffer of a batch (frames: bytes; views: flat ``'B'``)."""
    if isinstance(buf, bytes):
        addr = ctypes.cast(ctypes.c_char_p(buf), ctypes.c_void_p).value  # its own bytes
        assert addr is not None
        return addr
    return address_of(buf)


def advance_rows(rows: npt.NDArray[np.uint64], pos: int, n: int) -> int:
    """Past ``n`` bytes moved from ``rows[pos:]``: the first row not fully moved (its
    start and length moved on by what of it was)."""
    if not n:
        return pos
    # uint64 throughout: a cast in the cumsum costs twice the sum, and a Python int key
    # would make numpy convert every end for the search
    ends = rows[pos : pos + IOV_MAX, 1].cumsum()
    k = int(ends.searchsorted(np.uint64(n), side="right"))  # rows moved whole
    if k < len(ends):
        part = n - (int(ends[k - 1]) if k else 0)
        if part:
            rows[pos + k, 0] += np.uint64(part)
            rows[pos + k, 1] -= np.uint64(part)
    return pos + k


def privatize(rows: npt.NDArray[np.uint64]) -> bytearray:
    """Copy the memory of ``rows`` into a fresh buffer and point the rows at the copy
    (a withdrawn stream's memory is read no more); returns the copy, to be kept alive."""
    lens = rows[:, 1].copy()
    copy = bytearray(int(lens.sum()))
    if not len(copy):
        return copy
    base = ctypes.addressof(ctypes.c_char.from_buffer(copy))
    offs = np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.uint64)
    for (addr, ln), off in zip(rows.tolist(), offs.tolist(), strict=True):
        ctypes.memmove(base + off, addr, ln)
    rows[:, 0] = np.uint64(base) + offs
    return copy
