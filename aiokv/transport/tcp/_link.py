"""One TCP link: a connected socket, its reader task and its writer task.

See :mod:`aiokv.transport.tcp` for the design.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Coroutine
from collections.abc import Sequence
from functools import partial
from typing import Any
from typing import Final
from typing import Protocol
from typing import TypeVar
from typing import final

from ..._enums import LLMStatusCode
from ..._errors import LLMException
from .. import _wire as wire
from .._base import DIRECT_REFUSED
from .._base import Capability
from .._base import DeviceRuns
from .._base import DirectCheck
from .._base import Grant
from .._base import Link
from .._base import Payload
from .._base import PeerInfo
from .._base import RequestHandler
from .._base import check_grant
from .._base import check_probe_timeout
from .._base import check_request
from .._base import decode_reason
from .._base import failure_code
from .._base import flatten_views
from .._base import grant_reason
from .._base import handler_failed
from .._base import refusal
from ._io import SockIO
from ._ops import MyOp
from ._ops import PeerOp
from ._ops import State
from ._ops import Stream
from ._ops import cursor_of
from ._plane import DataPlane
from ._protocol import NOT_DIRECT
from ._protocol import LinkProtocol
from ._reader import Reader
from ._writer import BLOCKED
from ._writer import MORE
from ._writer import Writer

__all__ = ["LinkOwner", "TcpLink"]

_log = logging.getLogger("aiokv.transport.tcp")
_S = LLMStatusCode
_F = wire.FrameType
# Requests a peer may have outstanding on one link; more are answered LLM_LINK_BUSY (their
# meta skipped unread, so a refusal costs O(1)) so a hostile peer cannot pile up handler
# tasks and grants without bound. aiokv itself has one request per transfer in flight
# (a layer-wise task: one per layer and destination).
_MAX_PEER_REQUESTS: Final = 4096
# Reply backpressure (accounted by LinkProtocol): past _REPLY_BACKLOG_HIGH bytes of
# replies queued for the peer the reader stops reading from the peer until the writer
# has sent them down to _REPLY_BACKLOG_LOW; a peer that lets it stall for
# _REPLY_STALL_S loses the link.
_REPLY_BACKLOG_HIGH = 4 << 20
_REPLY_BACKLOG_LOW = 1 << 20
_REPLY_STALL_S = 30.0
# How long a cancelled or timed-out write waits for the peer's CANCEL_ACK: its remaining
# time, clamped to this range (seconds). Without the ack in time the link is dropped.
_CANCEL_ACK_WAIT: Final = (0.5, 5.0)
T = TypeVar("T")


class LinkOwner(Protocol):
    """What a link needs from the transport that made it (:class:`TcpTransport`): its
    settings and handler, its event loop and tasks, and to hear that the link is lost."""

    local_cluster_id: int
    handler: RequestHandler
    max_meta_bytes: int
    chunk_bytes: int
    _scratch: bytearray  # sink for data nobody wants

    def _loop_or_raise(self) -> asyncio.AbstractEventLoop: ...

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]: ...

    def _link_lost(self, link: TcpLink) -> None: ...


@final
class TcpLink(Link):
    """One connected socket with its reader and writer tasks; see the module docstring.

    Payload moves as ``DATA`` frames on the socket, or by its data ``plane`` where that
    plane offers to move it (see :mod:`._plane`).
    """

    def __init__(
        self,
        transport: LinkOwner,
        io: SockIO,
        peer: PeerInfo,
        *,
        initiator: bool,
        plane: DataPlane,
        first_frame: bytes | None = None,
    ) -> None:
        self.local_cluster_id = transport.local_cluster_id
        self.peer = peer
        self.initiator = initiator
        self._t = transport
        self._loop = transport._loop_or_raise()
        self._io = io
        self._sock = io.sock
        self._broken = False
        # the protocol's state (request ids, requests, reply backlog): see _protocol
        self._p = LinkProtocol(
            self,
            initiator=initiator,
            max_meta_bytes=transport.max_meta_bytes,
            max_peer_requests=_MAX_PEER_REQUESTS,
            reply_backlog=(_REPLY_BACKLOG_HIGH, _REPLY_BACKLOG_LOW),
        )
        self._mine = self._p.mine
        self._theirs = self._p.theirs
        self._w = Writer(self._loop, self._sock, transport, self._p, first_frame)
        self._r = Reader(
            io, self, self._p, self._w, scratch=transport._scratch, stall_s=_REPLY_STALL_S
        )
        self._tasks: set[asyncio.Task[None]] = set()
        self._reader = self._spawn(self._r.run(), "reader")
        self._writer = self._spawn(self._write_loop(), "writer")
        self._plane = plane
        plane.bind(self)

    def __repr__(self) -> str:
        state = "broken" if self._broken else "up"
        return (
            f"<TcpLink {self.local_cluster_id}->{self.peer.cluster_id} {self.peer.address} {state}>"
        )

    @property
    def broken(self) -> bool:
        return self._broken

    @property
    def heard(self) -> bool:
        """Whether the peer sent any frame since the handshake (see TcpTransport's caps)."""
        return self._r.heard

    def extra(self, capability: Capability[T]) -> T | None:
        return None if self._broken else self._plane.extra(capability)

    # ---------------------------------------------------------------- public operations

    async def read(self, meta: bytes, into: Payload, *, timeout: float) -> None:
        op, views, frame_meta = self._open("Link.read", meta, into, timeout, is_read=True)
        if not op.device:  # a plane request may be answered with DATA too
            op.cursor = cursor_of(views, op.total)
        acked = False
        try:
            kinds = (_F.READ_REQ, _F.PLANE_READ_REQ)
            steps = partial(self._reading, op)
            await self._exchange("Link.read", op, kinds, frame_meta, timeout, steps)
            # The ack lets the peer release what it granted (e.g. drop a pulled key);
            # nobody waits on it, so it leaves on the writer's next turn, not on our way.
            self._post(wire.encode_frame(_F.READ_DONE, op.rid), soon=True)
            acked = True
        finally:
            self._end(op, cancel=not acked)

    async def write(self, meta: bytes, src: Payload, *, timeout: float) -> None:
        op, views, frame_meta = self._open("Link.write", meta, src, timeout, is_read=False)
        deadline = self._loop.time() + timeout
        ok = False
        try:
            kinds = (_F.WRITE_REQ, _F.PLANE_WRITE_REQ)
            steps = partial(self._writing, op, views)
            await self._exchange("Link.write", op, kinds, frame_meta, timeout, steps)
            ok = True
        finally:
            data = op.stream is not None and op.remote is None  # DATA frames, not the plane
            if op.stream is not None:
                self._abort_stream(op.stream)
            self._end(op, cancel=not ok)
            if not ok and data and not op.peer_over:
                # DATA of it may be on the wire: return only once the peer confirmed
                # that none of it lands any more (see Link.write)
                await self._until_cancel_acked(op.rid, deadline)

    async def _exchange(
        self,
        name: str,
        op: MyOp,
        kinds: tuple[wire.FrameType, wire.FrameType],
        frame_meta: bytes,
        timeout: float,
        steps: Callable[[], Awaitable[None]],
    ) -> None:
        """Send ``op``'s request frame (``kinds``: without a plane plan, with one), run
        ``steps`` (our side of the exchange, up to the peer's last word) within
        ``timeout``, then raise unless the outcome is success."""
        kind = kinds[op.plan is not None]
        self._post(wire.encode_frame(kind, op.rid, meta=frame_meta, size=op.total))
        try:
            async with asyncio.timeout(timeout):
                await steps()
        except TimeoutError:
            self._timed_out(op, name, timeout)
        if op.outcome() is not _S.LLM_SUCCESS:
            raise self._refused(name, op)

    async def _reading(self, op: MyOp) -> None:
        if op.plan is not None:
            await op.until_granted_or_over()
            if op.remote is not None and op.result is None:
                await self._plane.move(op, op.plan)
                self._p.check(op)  # the granter's answer ends it
        await op.until_over()

    async def _writing(self, op: MyOp, views: Sequence[memoryview]) -> None:
        await op.until_granted_or_over()
        if op.state is State.SENDING and op.result is None and op.total:
            if op.remote is not None:
                await self._plane.move(op, op.plan)
                self._p.check(op)  # the granter's WRITE_DONE ends it
            elif op.device:  # a WRITE_GRANT: device memory cannot go as DATA
                op.finish(_S.LLM_FAILED, NOT_DIRECT)
            else:  # a WRITE_GRANT: the bytes go as DATA
                op.stream = self._w.add_stream(op.rid, views, op.total)
        await op.until_over()

    def _buffers(
        self, name: str, bufs: Payload, *, writable: bool
    ) -> tuple[Sequence[memoryview], int, Any | None]:
        """``(flat views, total, the plane's plan)`` of a request's buffers (no plan:
        the payload moves as DATA); device memory has no views and always a plan (else
        ``LLM_PARAM_INVALID``)."""
        if isinstance(bufs, DeviceRuns):
            plan = self._plane.offer_device(bufs)
            if plan is None:
                flatten_views(name, bufs, writable=writable)  # raises: not addressable
            return [], bufs.total, plan
        views, total = flatten_views(name, bufs, writable=writable)
        return views, total, self._plane.offer(views, total) if total else None

    async def aclose(self) -> None:
        if not self._broken and self._w.between_frames():
            # Best effort: tell the peer this is an orderly close. Only when no frame is
            # half-sent, and without waiting: a close must not hang on a stuck peer.
            with contextlib.suppress(OSError):
                self._sock.send(wire.encode_frame(_F.CLOSE))
        self._break("closed locally")
        await self._join()

    async def probe(self, timeout: float) -> bool:
        seconds = check_probe_timeout(timeout)
        if self._broken:
            return False
        pong: asyncio.Future[None] = self._loop.create_future()
        pid, ping = self._p.new_probe(pong)
        try:
            self._post(ping)
            # the reader ends when the link breaks: no need to wait out the timeout then
            await asyncio.wait({pong, self._reader}, timeout=seconds, return_when="FIRST_COMPLETED")
            return pong.done() and not self._broken
        finally:
            del self._p.probes[pid]
            pong.cancel()

    def _greet(self) -> None:
        """Send one PING right after linking (the connecting side): it tells the
        accepting side this link is in use, so its idle-link rule never closes it."""
        self._post(self._p.new_probe(None)[1])  # no waiter: its PONG is ignored

    # ----------------------------------------------------------------- op bookkeeping

    def _prepare(self, op: str, meta: bytes, timeout: float) -> bytes:
        check_request(op, meta, timeout, self._t.max_meta_bytes)
        if self._broken:
            raise LLMException(
                f"{op}: link to cluster {self.peer.cluster_id} is broken",
                status_code=_S.LLM_LINK_FAILED,
            )
        return meta

    def _open(
        self,
        name: str,
        meta: bytes,
        bufs: Payload,
        timeout: float,
        *,
        is_read: bool,
    ) -> tuple[MyOp, Sequence[memoryview], bytes]:
        """Check a ``read`` / ``write`` request and start its op (its total, plan and
        device set): ``(op, the flat views, the frame's meta)``; the caller ends it."""
        views, total, plan = self._buffers(name, bufs, writable=is_read)
        frame_meta = self._prepare(name, meta, timeout)
        op = self._p.start(lambda rid: MyOp(self._loop, rid, is_read))
        op.total = total
        op.device = isinstance(bufs, DeviceRuns)
        op.plan = plan
        return op, views, frame_meta

    def _timed_out(self, op: MyOp, name: str, seconds: float) -> None:
        """The deadline passed: raise ``LLM_TIMEOUT``, unless the answer landed just now."""
        op.finish(_S.LLM_TIMEOUT)  # no-op if it landed in the very iteration the deadline fired
        if op.result is _S.LLM_TIMEOUT:
            raise LLMException(
                f"{name}: no answer from cluster {self.peer.cluster_id} within {seconds:.3g} s",
                status_code=_S.LLM_TIMEOUT,
            ) from None

    async def _until_cancel_acked(self, rid: int, deadline: float) -> None:
        """Wait, shielded, for the peer's ``CANCEL_ACK`` of our write ``rid``.

        Bounded by the write's remaining time clamped to :data:`_CANCEL_ACK_WAIT`; not
        at all once the link is broken. A peer that does not answer in time loses the
        link. A cancellation that arrives meanwhile is re-raised afterwards.
        """
        if self._broken:
            return
        fut: asyncio.Future[None] = self._loop.create_future()
        self._p.cancelling[rid] = fut
        low, high = _CANCEL_ACK_WAIT
        wait = min(max(deadline - self._loop.time(), low), high)
        end = self._loop.time() + wait
        cancelled = False
        try:
            while not fut.done():
                left = end - self._loop.time()
                if left <= 0:
                    _log.warning("%r: no CANCEL_ACK for request %d in %.3g s", self, rid, wait)
                    self._break("peer did not acknowledge a cancelled write")
                    break
                try:
                    await asyncio.wait([fut], timeout=left)  # never cancels fut
                except asyncio.CancelledError:
                    cancelled = True  # cancelled again: keep waiting, re-raise below
        finally:
            self._p.cancelling.pop(rid, None)
        if cancelled:
            raise asyncio.CancelledError

    def _refused(self, name: str, op: MyOp) -> LLMException:
        """The error of our failed ``op``: a broken link, or the peer's code and reason."""
        status = op.outcome()
        if op.device and op.reason is NOT_DIRECT:
            return LLMException(
                f"{name}: cluster {self.peer.cluster_id} granted memory this link cannot "
                "reach by address",
                status_code=status,
                context=DIRECT_REFUSED,
            )
        if status is _S.LLM_LINK_FAILED:
            why = self._why_broken or "broken"
            if why == "closed locally":
                why = "closed on this side: unlink_clusters, unlink or finalize"
            return LLMException(
                f"{name}: link to cluster {self.peer.cluster_id} broke ({why}); link it "
                "again with link_clusters",
                status_code=status,
            )
        if op.ours:  # this side failed (e.g. its data plane), not the peer
            return LLMException(f"{name}: {op.reason}", status_code=status)
        return refusal(name, self.peer.cluster_id, status, op.reason)

    def _end(self, op: MyOp, *, cancel: bool) -> None:
        """Synchronous clean-up of our op: after this its buffers are never touched again."""
        self._p.end(op, cancel=cancel)

    # ---------------------------------------------------------------------- writer side

    def _abort_stream(self, stream: Stream) -> None:
        """Withdraw a stream; afterwards its memory is never read again."""
        self._w.abort_stream(stream)

    def _post(self, frame: bytes, *, soon: bool = False) -> None:
        """Queue an owned control frame; the writer sends it before any further payload
        (at once where it can; ``soon``: on its next turn, see :meth:`Writer.post`)."""
        if self._broken:
            return
        self._w.post(frame, soon=soon)

    async def _write_loop(self) -> None:
        try:
            while True:
                state = self._w.pump()
                if state == BLOCKED:
                    await self._io.writable()
                elif state == MORE:
                    await asyncio.sleep(0)
                else:
                    await self._w.until_work(self._loop)
        except OSError as exc:
            self._break(f"send failed: {exc}")
        except Exception as exc:  # a bug must not kill the loop silently
            _log.exception("writer of %r failed", self)
            self._break(f"writer failed: {exc!r}")

    # --------------------------------------------------- actions of the link protocol

    def _on_plane_hello(self, meta: bytearray | None, cap: int) -> None:
        """The peer's plane greeting: for our plane if it names it (else, or skipped
        unread: ignored, and no plane request of ours is ever granted by a plane)."""
        if meta is None or not meta or self._broken:
            return
        n = meta[0]
        if meta[1 : 1 + n] == self._plane.name.encode():
            self._plane.hello(bytes(meta[1 + n :]), cap)

    def _on_plane_grant(
        self, op: MyOp | None, status: LLMStatusCode, size: int, meta: bytearray | None
    ) -> None:
        """The peer's plane grant answering our plane request ``op`` (None: not ours)."""
        if op is None or op.state is not State.WAIT_REPLY:
            return  # late answer of a request we dropped
        if status is not _S.LLM_SUCCESS:
            op.finish(status, decode_reason(meta) if meta else "")
            return
        remote = None
        if op.plan is not None and meta is not None and size == op.total:
            remote = self._plane.accept(meta, size)
        if remote is None:  # the peer should have refused; never trust it
            op.finish(_S.LLM_PARAM_INVALID, "it granted a transfer it may not")
            return
        op.remote = remote
        op.cursor = None  # no DATA lands in our buffers now
        op.grant()
        if op.is_read:
            op.state = State.RECEIVING

    def _hello(self, payload: bytes) -> None:
        name = self._plane.name.encode()
        meta = bytes((len(name),)) + name + payload
        self._post(wire.encode_frame(_F.PLANE_HELLO, meta=meta, size=self._t.max_meta_bytes))

    def _start_serving(self, op: PeerOp, meta: bytes, size: int) -> None:
        """Answer the peer's request ``op``: right here (in the reader, no task) when the
        handler answers without waiting (:class:`ImmediateHandler`), else in a task
        that awaits the handler (``op.task``)."""
        direct = self._plane.direct(op) if op.plane else None
        grant = self._ask_now(op, meta, size, direct)
        if grant is not None:
            self._granted(op, size, direct, grant)
        else:
            op.task = self._spawn(self._serve(op, meta, size, direct), f"serve-{op.rid}")
            # its meta is held until the task ends (even one cancelled before it ran)
            self._p.deciding_meta += len(meta)
            op.task.add_done_callback(partial(self._decided, len(meta)))

    def _start_commit(self, op: PeerOp, commit: Callable[[], Awaitable[LLMStatusCode]]) -> None:
        self._spawn(self._committed(op, commit), f"commit-{op.rid}")

    async def _serve(self, op: PeerOp, meta: bytes, size: int, direct: DirectCheck | None) -> None:
        """Await the handler's answer, then answer the peer and start the transfer."""
        self._granted(op, size, direct, await self._ask(op, meta, size, direct))

    def _decided(self, meta_len: int, _: object) -> None:
        self._p.deciding_meta -= meta_len

    def _granted(self, op: PeerOp, size: int, direct: DirectCheck | None, grant: Any) -> None:
        """Answer the peer's request ``op`` with the handler's ``grant`` (checked here)
        and start the transfer."""
        status, views, total = check_grant(
            grant, _grant_name(op), writable=not op.is_read, device_ok=direct is not None
        )
        why = grant_reason(grant)
        if isinstance(grant, Grant):
            op.bind(grant.done)
            op.commit = None if op.is_read or grant.device is not None else grant.commit
        if self._theirs.get(op.rid) is not op or self._broken:
            op.finish(False)  # cancelled or link lost while the handler decided
            return
        if status is _S.LLM_SUCCESS and total != size:
            status, why = _S.LLM_PARAM_INVALID, f"the request is {size} bytes, not {total}"
        if status is not _S.LLM_SUCCESS:
            self._p.refuse(op, status, why)
            return
        assert isinstance(grant, Grant)  # check_grant fails anything else
        grant.bind_abort(lambda code: self._p.revoke(op, code))
        if op.state is not State.OVER:  # else revoked before it was even answered
            self._answer(op, grant, views, total)

    def _ask_now(
        self, op: PeerOp, meta: bytes, size: int, direct: DirectCheck | None
    ) -> Grant | None:
        """The handler's answer to ``op`` if it gives one without waiting (its
        ``grant_now``, where it has one; a failure: a refusal), else None."""
        now = getattr(self._t.handler, "grant_now", None)
        if now is None:
            return None
        try:
            grant: Grant | None = now(self.peer, meta, size, write=not op.is_read, direct=direct)
        except LLMException as exc:
            return Grant(exc.status_code, reason=str(exc))
        except Exception as exc:
            _log.exception("%r: handler grant_now failed", self)
            return handler_failed(exc)
        return grant

    async def _ask(self, op: PeerOp, meta: bytes, size: int, direct: DirectCheck | None) -> Any:
        """The handler's answer to the peer's request ``op`` (a failure: a refusal)."""
        handler = self._t.handler
        try:
            if direct is not None:  # only then: handlers without device memory may lack it
                if op.is_read:
                    return await handler.grant_read(self.peer, meta, direct=direct)
                return await handler.grant_write(self.peer, meta, size, direct=direct)
            if op.is_read:
                return await handler.grant_read(self.peer, meta)
            return await handler.grant_write(self.peer, meta, size)
        except LLMException as exc:
            return Grant(exc.status_code, reason=str(exc))
        except Exception as exc:
            _log.exception("%r: handler %s failed", self, _grant_name(op))
            return handler_failed(exc)

    def _answer(self, op: PeerOp, grant: Grant, views: Sequence[memoryview], total: int) -> None:
        """Answer the peer's request ``op`` that the handler granted, and start the
        transfer: by the data plane where it takes the grant, else as DATA frames."""
        if grant.device is not None:  # never as DATA: by address, or refused
            payload = self._plane.answer_device(op, grant.device)
            if payload is None:
                self._p.refuse(op, _S.LLM_FAILED, "device memory not reachable by address")
            else:
                self._grant_plane(op, payload, total)
            return
        if op.plane and total and (payload := self._plane.answer(op, views, total)) is not None:
            self._grant_plane(op, payload, total)
            return
        if op.is_read:
            op.state = State.SENDING  # held until the reader's READ_DONE or CANCEL
            resp = wire.encode_frame(_F.READ_RESP, op.rid, size=total)
            if total:  # the reply and its DATA leave in one batch
                op.stream = self._w.add_stream(op.rid, views, total, lead=resp)
            else:
                self._post(resp)
        else:
            op.state = State.RECEIVING
            op.cursor = cursor_of(views, total)
            self._post(wire.encode_frame(_F.WRITE_GRANT, op.rid))
            if not total:
                self._filled(op)

    def _grant_plane(self, op: PeerOp, payload: bytes, total: int) -> None:
        """Answer the peer's request ``op`` with its plane's grant ``payload``: the
        requester's plane moves the bytes (a read is held until READ_DONE or CANCEL, a
        write until the requester's PLANE_WRITE_CHECK, or CANCEL)."""
        op.state = State.SENDING if op.is_read else State.RECEIVING
        self._post(wire.encode_frame(_F.PLANE_GRANT, op.rid, meta=payload, size=total))

    def _filled(self, sink: MyOp | PeerOp) -> None:
        """Every byte of ``sink`` landed (see :meth:`LinkProtocol.filled`)."""
        self._p.filled(sink)

    async def _committed(self, op: PeerOp, commit: Callable[[], Awaitable[LLMStatusCode]]) -> None:
        status = _S.LLM_FAILED
        try:
            status = LLMStatusCode(await commit())
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            _log.exception("%r: the commit of request %d failed", self, op.rid)
            status = failure_code(exc)  # e.g. out of (device) memory
        finally:
            self._p.committed(op, status)

    # ------------------------------------------------------------------------ lifecycle

    def _spawn(self, coro: Coroutine[Any, Any, None], what: str) -> asyncio.Task[None]:
        task = self._t._spawn(coro, f"aiokv-tcp-{what}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _break(self, reason: str) -> None:
        """Mark broken, close the socket, fail everything pending. Idempotent, synchronous."""
        if self._broken:
            return
        self._why_broken = reason  # first: read from other threads once broken
        self._broken = True
        _log.debug("%r: %s", self, reason)
        self._io.close()
        self._w.clear()
        # first: the plane sees which of the grants it serves ended unheard (with the link)
        self._plane.closed()
        self._p.close()
        current = asyncio.current_task()
        for task in (self._reader, self._writer):
            if task is not current:
                task.cancel()
        self._t._link_lost(self)

    async def _join(self) -> None:
        """Wait until every task of this link has finished."""
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current]
        if tasks:
            await asyncio.wait(tasks)


def _grant_name(op: PeerOp) -> str:
    return "grant_read" if op.is_read else "grant_write"
