"""Request state of a TCP link: our requests (:class:`MyOp`), the peer's
(:class:`PeerOp`), payload streams and the cursor that cuts them into chunks."""

from __future__ import annotations

import asyncio
import ctypes
import enum
import logging
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import Final

import numpy as np
import numpy.typing as npt

from ..._enums import LLMStatusCode
from ..._layout import LayoutViews
from .. import _wire as wire

__all__ = [
    "AnyCursor",
    "Bufs",
    "Cursor",
    "MyOp",
    "PeerOp",
    "RunCursor",
    "State",
    "Stream",
    "code_of",
    "cursor_of",
]

_log = logging.getLogger("aiokv.transport.tcp")
_S = LLMStatusCode
_F = wire.FrameType

Bufs = list[bytes | memoryview]


def code_of(value: int) -> LLMStatusCode:
    """A status received from a peer; unknown values become ``LLM_FAILED``."""
    try:
        return LLMStatusCode(value)
    except ValueError:
        return _S.LLM_FAILED


class Cursor:
    """A position in a list of flat views; hands out the views covering the next bytes."""

    __slots__ = ("_i", "_off", "_views", "remaining")

    def __init__(self, views: list[memoryview], total: int) -> None:
        self._views = views
        self._i = 0
        self._off = 0
        self.remaining = total

    def take(self, n: int) -> list[memoryview]:
        """Views covering the next ``n <= remaining`` bytes; advances past them."""
        out: list[memoryview] = []
        views, i, off = self._views, self._i, self._off
        self.remaining -= n
        while n:
            v = views[i]
            avail = len(v) - off
            if avail <= n:
                out.append(v[off:] if off else v)
                n -= avail
                i += 1
                off = 0
            else:
                out.append(v[off : off + n])
                off += n
                n = 0
        self._i, self._off = i, off
        return out


class RunCursor:
    """A position in the memory of a :class:`~aiokv._layout.LayoutViews`, as address
    rows: hands out the rows covering the next bytes (numpy, for ``readv`` /
    ``writev``: no Python object per run), or views of them (for a socket that needs
    buffers, e.g. TLS: a chunk's worth at a time, dropped after it).

    The views' owner keeps their memory alive and in place while the cursor is used;
    whether it may be written was checked when the views were accepted.
    """

    __slots__ = ("_ends", "_pos", "_rows", "remaining")

    def __init__(self, views: LayoutViews) -> None:
        self._rows = np.ascontiguousarray(views.runs(), dtype=np.uint64)
        # byte offset just past each row, as int64, made at the first partial take:
        # searching it for a Python int is O(log n) (a uint64 array is converted whole
        # first: O(n) per chunk)
        self._ends: npt.NDArray[np.int64] | None = None
        self._pos = 0  # bytes handed out
        self.remaining = views.total

    def take_rows(self, n: int) -> npt.NDArray[np.uint64]:
        """``(address, length)`` rows covering the next ``0 < n <= remaining`` bytes (a
        fresh array the caller may change); advances past them."""
        if not self._pos and n == self.remaining:  # all of it at once (a small payload)
            self._pos, self.remaining = n, 0
            return self._rows.copy()
        pos, end = self._pos, self._pos + n
        ends = self._ends
        if ends is None:
            ends = self._ends = np.cumsum(self._rows[:, 1], dtype=np.int64)
        i = int(np.searchsorted(ends, pos, side="right"))  # the row holding byte pos
        j = int(np.searchsorted(ends, end, side="left"))  # ... and byte end - 1
        rows = self._rows[i : j + 1].copy()
        skip = pos - (int(ends[i]) - int(rows[0, 1]))
        rows[0, 0] += np.uint64(skip)
        rows[0, 1] -= np.uint64(skip)
        rows[-1, 1] -= np.uint64(int(ends[j]) - end)
        self._pos = end
        self.remaining -= n
        return rows

    def take(self, n: int) -> list[memoryview]:
        """Views of the memory of the next ``0 < n <= remaining`` bytes; advances."""
        return [
            memoryview((ctypes.c_char * ln).from_address(addr)).cast("B")
            for addr, ln in self.take_rows(n).tolist()
        ]


AnyCursor = Cursor | RunCursor


#: A :class:`~aiokv._layout.LayoutViews` of more views than this moves by address; fewer
#: cost less as views. Address rows cost ~20 µs per payload whatever their count (numpy's
#: fixed costs); a view made from an address ~1.3 µs each: they tie at ~16
#: (``scripts/few_views.py``).
_FEW_VIEWS: Final = 16


def cursor_of(views: Sequence[memoryview], total: int) -> AnyCursor:
    """The cursor over flat ``views`` totalling ``total``: by address over a
    :class:`~aiokv._layout.LayoutViews` of more than :data:`_FEW_VIEWS` views (no Python
    object per run), else over the views themselves."""
    if type(views) is LayoutViews and len(views) > _FEW_VIEWS:
        return RunCursor(views)
    return Cursor(list(views), total)


class Stream:
    """A payload queued on the writer: DATA frames of request ``rid`` from ``cursor``."""

    __slots__ = ("aborted", "cursor", "rid", "sent")

    def __init__(self, rid: int, views: Sequence[memoryview], total: int) -> None:
        self.rid = rid
        self.cursor = cursor_of(views, total)
        self.sent = False  # every byte handed to the kernel
        self.aborted = False  # withdrawn; its memory is no longer read


class State(enum.Enum):
    WAIT_REPLY = enum.auto()  # ours: READ_REQ / WRITE_REQ posted
    GRANTING = enum.auto()  # theirs: the handler is deciding
    RECEIVING = enum.auto()  # payload flows into our buffers
    SENDING = enum.auto()  # payload flows from our buffers
    OVER = enum.auto()  # finished, failed or cancelled: buffers are off limits


class MyOp:
    """A request this side started (``read`` or ``write``).

    Outcomes are plain fields, set by the reader or by a link failure; the caller waits
    on a throw-away future, because a future awaited directly would be cancelled along
    with the caller and lose the outcome that the clean-up still needs.
    """

    __slots__ = (
        "_loop",
        "_wake",
        "cursor",
        "device",
        "granted",
        "is_read",
        "ours",
        "peer_over",
        "plan",
        "reason",
        "remote",
        "result",
        "rid",
        "state",
        "stream",
        "total",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop, rid: int, is_read: bool) -> None:
        self._loop = loop
        self._wake: asyncio.Future[None] | None = None
        self.rid = rid
        self.is_read = is_read
        self.state = State.WAIT_REPLY
        self.cursor: AnyCursor | None = None
        self.stream: Stream | None = None
        self.total = 0
        self.device = False  # its buffers are device memory (DeviceRuns): never DATA
        self.granted = False  # a write's WRITE_GRANT said yes
        self.peer_over = False  # a write's WRITE_DONE came: the peer writes no more of it
        self.result: LLMStatusCode | None = None  # final outcome
        self.reason = ""  # the peer's reason for a refusal (sanitized), with the outcome
        self.ours = False  # the failure is this side's (``reason`` says what), not the peer's
        self.plan: Any | None = None  # the data plane's plan: sent as a plane request
        self.remote: Any | None = None  # the plane's grant (DataPlane.accept) of it

    def grant(self) -> None:
        self.granted = True
        self.state = State.SENDING
        self._notify()

    def finish(self, status: LLMStatusCode, reason: str = "", *, ours: bool = False) -> None:
        """Record the outcome (the first one wins; ``reason``: the peer's, sanitized, or
        with ``ours`` what failed on this side) and stop all I/O on our buffers."""
        self.state = State.OVER
        if self.result is None:
            self.result = status
            self.reason = reason
            self.ours = ours
        self._notify()

    def outcome(self) -> LLMStatusCode:
        return _S.LLM_FAILED if self.result is None else self.result

    def _notify(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def until_granted_or_over(self) -> None:
        while not self.granted and self.result is None:
            self._wake = self._loop.create_future()
            await self._wake

    async def until_over(self) -> None:
        while self.result is None:
            self._wake = self._loop.create_future()
            await self._wake


class PeerOp:
    """A request the peer started, which this side serves."""

    __slots__ = (
        "_done",
        "after_commit",
        "commit",
        "committing",
        "cursor",
        "is_read",
        "plane",
        "rid",
        "state",
        "stream",
        "task",
    )

    def __init__(self, rid: int, is_read: bool) -> None:
        self.rid = rid
        self.is_read = is_read
        self.state = State.GRANTING
        self.task: asyncio.Task[None] | None = None
        self.cursor: AnyCursor | None = None
        self.stream: Stream | None = None
        self._done: Callable[[bool], None] | None = None
        self.commit: Callable[[], Awaitable[LLMStatusCode]] | None = None  # Grant.commit
        self.committing = False  # the commit runs: its bytes are still landing
        # the answer to a cancellation or revocation that came during the commit: sent
        # once the commit ended, so nothing of the write lands after it
        self.after_commit: bytes | None = None
        self.plane = False  # a plane request (PLANE_READ_REQ / PLANE_WRITE_REQ)

    def bind(self, done: Callable[[bool], None] | None) -> None:
        self._done = done

    def finish(self, ok: bool) -> None:
        """End the op; the grant's ``done`` runs here, exactly once."""
        self.state = State.OVER
        done, self._done = self._done, None
        if done is not None:
            try:
                done(ok)
            except Exception:
                _log.exception("Grant.done callback failed")
