"""The protocol of a TCP link, without I/O: frames in, actions out.

:class:`LinkProtocol` owns a link's request state: the ids of our requests, our
requests (:class:`MyOp`) and the peer's (:class:`PeerOp`) by id, the cap on the
peer's outstanding requests, the cost of the replies queued for the peer (reply
backpressure), our cancelled writes awaiting ``CANCEL_ACK`` and our probes awaiting
``PONG``. :meth:`LinkProtocol.receive` takes one decoded control frame and hands it
to the one handler of its type (:attr:`LinkProtocol.handlers`); what the frame calls
for beyond the state kept here, the protocol asks of its :class:`LinkDriver` (the
:class:`~aiokv.transport.tcp._link.TcpLink`): post a frame, break the link, withdraw
a payload stream, start serving a request or committing a write, or hand a plane frame
to the link (for its data plane, ``_plane.py``). The driver owns the socket, its reader
and writer tasks and the streams.

This module does no I/O and imports neither ``asyncio`` nor ``socket`` (a test
checks), so it is tested frame by frame without either.
"""

from __future__ import annotations

from collections.abc import Awaitable
from collections.abc import Callable
from typing import Final
from typing import Protocol

from ..._enums import LLMStatusCode
from .. import _wire as wire
from .._base import decode_reason
from .._base import encode_reason
from ._ops import MyOp
from ._ops import PeerOp
from ._ops import State
from ._ops import Stream
from ._ops import code_of

__all__ = ["NOT_DIRECT", "LinkDriver", "LinkProtocol", "Waiter"]

_S = LLMStatusCode
_F = wire.FrameType

#: the reason of our own op that a grant this link cannot move by address ended
NOT_DIRECT: Final = "granted memory not reachable by address"
# Reply backpressure: frames this side posts in answer to the peer (grants, refusals,
# confirmations) cost their length plus this much heap while queued; our own requests
# do not count, so two busy peers cannot stop each other.
_REPLY_TYPES: Final = frozenset(
    {_F.READ_RESP, _F.WRITE_GRANT, _F.WRITE_DONE, _F.CANCEL_ACK, _F.PONG, _F.ERROR, _F.PLANE_GRANT}
)
_REPLY_OVERHEAD: Final = 64
_REQUEST_TYPES: Final = (_F.READ_REQ, _F.WRITE_REQ, _F.PLANE_READ_REQ, _F.PLANE_WRITE_REQ)
# Replies whose meta is a refusal's reason (capped by the wire at REASON_CAP): always read.
_REASON_TYPES: Final = frozenset({_F.READ_RESP, _F.WRITE_GRANT, _F.WRITE_DONE})

Handler = Callable[[wire.Header, "bytearray | None"], None]
Commit = Callable[[], Awaitable[LLMStatusCode]]


class Waiter(Protocol):
    """A one-shot waiter the protocol resolves (an ``asyncio.Future[None]``)."""

    def done(self) -> bool: ...

    def set_result(self, result: None, /) -> None: ...


class LinkDriver(Protocol):
    """The actions a :class:`LinkProtocol` asks of the link that drives it."""

    def _post(self, frame: bytes) -> None:
        """Send ``frame`` (queued behind the frames posted before it)."""

    def _break(self, reason: str) -> None:
        """Close the link; it calls :meth:`LinkProtocol.close`."""

    def _abort_stream(self, stream: Stream) -> None:
        """Withdraw ``stream``: its memory is never read again."""

    def _start_serving(self, op: PeerOp, meta: bytes, size: int) -> None:
        """Ask the handler about the peer's new request ``op`` (sets ``op.task``)."""

    def _start_commit(self, op: PeerOp, commit: Commit) -> None:
        """Run the peer's landed write's ``commit``, then :meth:`~LinkProtocol.committed`."""

    def _on_plane_hello(self, meta: bytearray | None, cap: int) -> None:
        """The peer's ``PLANE_HELLO``: its meta (None: skipped unread) and meta cap."""

    def _on_plane_grant(
        self, op: MyOp | None, status: LLMStatusCode, size: int, meta: bytearray | None
    ) -> None:
        """A ``PLANE_GRANT`` answering our request ``op`` (None: not one of ours)."""


def _reply_frame(kind: wire.FrameType, rid: int, status: LLMStatusCode, reason: str) -> bytes:
    """A reply frame; a refusal carries ``reason`` (capped) for the requester."""
    meta = encode_reason(reason) if status is not _S.LLM_SUCCESS else b""
    return wire.encode_frame(kind, rid, status=status, meta=meta)


def _wake(waiter: Waiter) -> None:
    if not waiter.done():
        waiter.set_result(None)


#: The metas of a peer's requests that its link holds while their handler decides (a
#: grant waiting for staging room, say) stay below this many ``max_meta_bytes`` (16 MiB
#: by default); requests beyond are answered ``LLM_LINK_BUSY`` with their meta skipped
#: unread. aiokv's own requests carry a few KiB of meta (256 KiB for 16,384 blocks).
DECIDING_META_CAPS: Final = 16


class LinkProtocol:
    """The request state of one link and one small handler per control frame type."""

    def __init__(
        self,
        driver: LinkDriver,
        *,
        initiator: bool,
        max_meta_bytes: int,
        max_peer_requests: int,
        reply_backlog: tuple[int, int],
    ) -> None:
        self._out = driver
        self.max_meta_bytes = max_meta_bytes
        # requests a peer may have outstanding; more are answered LLM_LINK_BUSY
        self.max_peer_requests = max_peer_requests
        # the metas of the peer's requests whose handler is still deciding (held in
        # memory meanwhile; the driver counts them): past the cap, LLM_LINK_BUSY too
        self.deciding_meta = 0
        self.max_deciding_meta = DECIDING_META_CAPS * max_meta_bytes
        # past `high` queued reply bytes the reader pauses until they are down to `low`
        self.backlog_high, self.backlog_low = reply_backlog
        # The connecting side numbers its requests 0, 2, 4, ...; the accepting side 1, 3, 5.
        self.next_id = 0 if initiator else 1
        self.peer_parity = 1 if initiator else 0
        self.mine: dict[int, MyOp] = {}
        self.theirs: dict[int, PeerOp] = {}
        self.cancelling: dict[int, Waiter] = {}  # our cancelled writes awaiting CANCEL_ACK
        self.probes: dict[int, Waiter] = {}  # our PINGs awaiting their PONG
        self.next_probe = 0
        self.queued_replies = 0  # cost of the replies posted, not yet in a batch
        self.batch_replies = 0  # ... and in the batch in flight
        self.handlers: dict[wire.FrameType, Handler] = {
            _F.READ_RESP: self._on_read_resp,
            _F.WRITE_GRANT: self._on_write_grant,
            _F.WRITE_DONE: self._on_write_done,
            _F.READ_DONE: self._on_read_done,
            _F.PLANE_READ_CHECK: self._on_read_check,
            _F.PLANE_WRITE_CHECK: self._on_write_check,
            _F.CANCEL: self._on_cancel,
            _F.CANCEL_ACK: self._on_cancel_ack,
            _F.ERROR: self._on_error,
            _F.CLOSE: self._on_close,
            _F.PING: self._on_ping,
            _F.PONG: self._on_pong,
            _F.PLANE_HELLO: self._on_plane_hello,
            _F.PLANE_GRANT: self._on_plane_grant,
        }
        self.handlers.update(dict.fromkeys(_REQUEST_TYPES, self._on_request))

    # ------------------------------------------------------------------ our requests

    def start(self, op_of: Callable[[int], MyOp]) -> MyOp:
        """Register our new request, made by ``op_of(request id)``."""
        rid = self.next_id
        self.next_id += 2
        op = self.mine[rid] = op_of(rid)
        return op

    def end(self, op: MyOp, *, cancel: bool) -> None:
        """Forget our ``op`` (failed unless already over); ``cancel``: tell the peer."""
        self.mine.pop(op.rid, None)
        op.finish(_S.LLM_FAILED)  # no-op if already finished; makes the reader drop its data
        if cancel:
            self._out._post(wire.encode_frame(_F.CANCEL, op.rid))

    def check(self, op: MyOp) -> None:
        """Our plane request ``op`` moved: if its plane moved every byte (``op.stream``
        sent), ask the granter to confirm while it still serves the grant: a read's
        ``PLANE_READ_CHECK`` (answered ``READ_RESP``: a one-sided read that ran while
        the granter revoked and reused the memory may hold torn bytes, and the
        revocation, read first, fails it), a write's ``PLANE_WRITE_CHECK`` (answered
        ``WRITE_DONE`` once the write is committed: the granter learns that the bytes
        landed from this frame alone)."""
        if op.result is None and op.stream is not None and op.stream.sent:
            kind = _F.PLANE_READ_CHECK if op.is_read else _F.PLANE_WRITE_CHECK
            self._out._post(wire.encode_frame(kind, op.rid))

    def new_probe(self, waiter: Waiter | None) -> tuple[int, bytes]:
        """The id and PING frame of a new probe; ``waiter`` (if any, until the prober
        drops it from :attr:`probes`) is woken by its PONG."""
        pid = self.next_probe
        self.next_probe += 1
        if waiter is not None:
            self.probes[pid] = waiter
        return pid, wire.encode_frame(_F.PING, pid)

    # ------------------------------------------------------------ frames and replies

    def skips_meta(self, h: wire.Header) -> bool:
        """Whether the frame's meta is skipped unread: a request's (or plane frame's)
        over our cap, or a request's while the peer has the most requests it may have (a
        refusal is O(1)). The busy rule is for requests only: the answers to our own
        requests (a ``PLANE_GRANT``) and plane greetings are read however busy the peer
        keeps us, so that its requests never fail ours."""
        return h.type not in _REASON_TYPES and (
            h.meta_len > self.max_meta_bytes
            or (h.meta_len > 0 and h.type in _REQUEST_TYPES and self._busy(h.meta_len))
        )

    def _busy(self, meta_len: int) -> bool:
        """Whether a request with ``meta_len`` bytes of meta is answered ``LLM_LINK_BUSY``:
        the peer has the most requests it may have, or the metas held for its requests
        being decided would pass :attr:`max_deciding_meta` (a meta over the cap is
        refused as such, not as busy)."""
        return len(self.theirs) >= self.max_peer_requests or (
            meta_len <= self.max_meta_bytes
            and self.deciding_meta + meta_len > self.max_deciding_meta
        )

    def receive(self, h: wire.Header, meta: bytearray | None) -> None:
        """Handle one control frame (``meta``: None when skipped unread).

        Raises:
            wire.WireError: a frame that has no place after the handshake.
        """
        self.handlers.get(h.type, _unexpected)(h, meta)

    def sink(self, rid: int) -> MyOp | PeerOp | None:
        """The request a DATA frame of ``rid`` lands in, if any."""
        return self.mine.get(rid) if rid % 2 != self.peer_parity else self.theirs.get(rid)

    def reply(
        self, kind: wire.FrameType, rid: int, status: LLMStatusCode, reason: str = ""
    ) -> None:
        """Post a reply frame; a refusal carries ``reason`` (capped) for the requester."""
        self._out._post(_reply_frame(kind, rid, status, reason))

    def refuse(self, op: PeerOp, status: LLMStatusCode, why: str) -> None:
        """End the peer's request ``op`` and answer it ``status`` (``why``: the reason)."""
        self.theirs.pop(op.rid, None)
        op.finish(False)
        self.reply(_F.READ_RESP if op.is_read else _F.WRITE_GRANT, op.rid, status, why)

    # ------------------------------------------------------------- reply backpressure

    def queued(self, frame: bytes) -> None:
        """Account ``frame``, just posted: a reply costs its length and overhead."""
        if frame[5] in _REPLY_TYPES:  # the header's type byte
            self.queued_replies += len(frame) + _REPLY_OVERHEAD

    def batch_taken(self) -> None:
        """The writer took the posted frames into its batch."""
        self.batch_replies, self.queued_replies = self.queued_replies, 0

    def batch_sent(self) -> None:
        self.batch_replies = 0

    def reader_must_pause(self) -> bool:
        return self.queued_replies + self.batch_replies > self.backlog_high

    def replies_drained(self) -> bool:
        return self.queued_replies <= self.backlog_low

    # ------------------------------------------------------------ the peer's requests

    def _on_request(self, h: wire.Header, meta: bytearray | None) -> None:
        rid = h.req_id
        # Refusals a conforming peer never causes (or a flood does) carry no reason: a
        # small request must not be answered with a bigger reply.
        why = ""
        if rid % 2 != self.peer_parity:
            status = _S.LLM_PARAM_INVALID
        elif rid in self.theirs:
            status = _S.LLM_REPEAT_REQUEST
        elif self._busy(h.meta_len):
            status = _S.LLM_LINK_BUSY
        elif meta is None and h.meta_len <= self.max_meta_bytes:
            # skipped because the peer was at its cap when the header came (a slot
            # freed while the meta was skipped): busy, not malformed
            status = _S.LLM_LINK_BUSY
        elif meta is None:  # meta over our cap, already skipped
            status = _S.LLM_PARAM_INVALID
            why = f"request meta of {h.meta_len} bytes exceeds {self.max_meta_bytes}"
        else:
            is_read = h.type is _F.READ_REQ or h.type is _F.PLANE_READ_REQ
            op = self.theirs[rid] = PeerOp(rid, is_read)
            op.plane = h.type is _F.PLANE_READ_REQ or h.type is _F.PLANE_WRITE_REQ
            self._out._start_serving(op, bytes(meta), h.size)
            return
        is_read = h.type is _F.READ_REQ or h.type is _F.PLANE_READ_REQ
        self.reply(_F.READ_RESP if is_read else _F.WRITE_GRANT, rid, status, why)

    def _theirs_of(self, rid: int) -> PeerOp | None:
        return self.theirs.get(rid) if rid % 2 == self.peer_parity else None

    def _on_read_done(self, h: wire.Header, meta: bytearray | None) -> None:
        op = self._theirs_of(h.req_id)
        if op is not None and op.is_read:
            self.peer_ended(op, acked=True)

    def _on_read_check(self, h: wire.Header, meta: bytearray | None) -> None:
        """The peer's plane read every byte of the grant: confirm it while we still serve
        it (a revoked one was answered when it was revoked; the grant is released by the
        READ_DONE that follows, or a CANCEL)."""
        op = self._theirs_of(h.req_id)
        if op is not None and op.plane and op.state is State.SENDING and op.stream is None:
            self.reply(_F.READ_RESP, op.rid, _S.LLM_SUCCESS)

    def _on_write_check(self, h: wire.Header, meta: bytearray | None) -> None:
        """The peer's plane wrote every byte of the grant (its transfer completed): the
        write landed, while we still serve it by the plane (a revoked one was answered
        when it was revoked; one granted as ``DATA`` has a cursor and lands by its
        bytes); confirmed by ``WRITE_DONE`` after its commit (:meth:`filled`)."""
        op = self._theirs_of(h.req_id)
        if (
            op is not None
            and op.plane
            and not op.is_read
            and op.state is State.RECEIVING
            and op.cursor is None
        ):
            self.filled(op)

    def _on_cancel(self, h: wire.Header, meta: bytearray | None) -> None:
        rid = h.req_id
        if rid % 2 != self.peer_parity:
            return
        op = self.theirs.get(rid)
        # every earlier DATA frame of it has been read: nothing more lands (once a
        # commit that runs ended)
        ack = wire.encode_frame(_F.CANCEL_ACK, rid)
        if op is None:
            self._out._post(ack)
            return
        self.peer_ended(op, acked=False)
        self._answer(op, ack)

    def peer_ended(self, op: PeerOp, *, acked: bool) -> None:
        """The peer acknowledged (READ_DONE) or cancelled one of its requests."""
        self.theirs.pop(op.rid, None)
        if op.task is not None and op.state is State.GRANTING:
            op.task.cancel()
        if op.stream is not None:
            acked = acked and op.stream.sent
            self._out._abort_stream(op.stream)
        op.finish(acked and op.state is State.SENDING)

    def revoke(self, op: PeerOp, status: LLMStatusCode) -> None:
        """Our handler revoked a grant being served (``Grant.abort``): stop all I/O on its
        buffers now, release it, and tell the peer its request failed with ``status``."""
        if self.theirs.get(op.rid) is not op or op.state is State.OVER:
            return
        del self.theirs[op.rid]
        if op.stream is not None:
            self._out._abort_stream(op.stream)  # unsent bytes of the batch in flight: copies
        op.finish(False)  # a write's DATA still on its way is discarded (no sink)
        kind = _F.READ_RESP if op.is_read else _F.WRITE_DONE
        self._answer(
            op, _reply_frame(kind, op.rid, status, f"the grant was revoked ({status.name})")
        )

    def filled(self, sink: MyOp | PeerOp) -> None:
        """Every byte of ``sink`` landed: our read is over; the peer's write is confirmed
        (WRITE_DONE), after the grant's commit."""
        if isinstance(sink, MyOp):
            sink.finish(_S.LLM_SUCCESS)
            return
        if sink.committing:  # told again (a peer's repeated word) while its commit runs
            return
        commit, sink.commit = sink.commit, None
        if commit is None:
            self.landed(sink, _S.LLM_SUCCESS)
        else:
            sink.committing = True
            self._out._start_commit(sink, commit)

    def _answer(self, op: PeerOp, frame: bytes) -> None:
        """Post ``frame``, the answer that ends the peer's request ``op``: once its
        commit ended, if one runs (nothing of a write lands after the peer has it)."""
        if op.committing:
            op.after_commit = frame
        else:
            self._out._post(frame)

    def committed(self, op: PeerOp, status: LLMStatusCode) -> None:
        """The commit of the peer's write ``op`` ended with ``status``: confirm the write
        (:meth:`landed`), or send the answer that a cancellation or revocation during the
        commit left waiting (no byte of the write lands after the peer has it)."""
        op.committing = False
        late, op.after_commit = op.after_commit, None
        if late is not None:
            self._out._post(late)
        elif self.theirs.get(op.rid) is op and op.state is not State.OVER:
            self.landed(op, status)  # else the link broke

    def landed(self, op: PeerOp, status: LLMStatusCode) -> None:
        """The peer's write ``op`` is over with ``status`` (after its commit)."""
        self.theirs.pop(op.rid, None)
        op.finish(status is _S.LLM_SUCCESS)
        self._out._post(wire.encode_frame(_F.WRITE_DONE, op.rid, status=status))

    def fail_sink(self, sink: MyOp | PeerOp, why: str) -> None:
        """The peer sent DATA it may not (``why``): the request fails."""
        if isinstance(sink, MyOp):
            sink.finish(_S.LLM_PARAM_INVALID, f"the peer {why}")
        else:
            self.theirs.pop(sink.rid, None)
            sink.finish(False)
            self._answer(
                sink, _reply_frame(_F.WRITE_DONE, sink.rid, _S.LLM_PARAM_INVALID, f"you {why}")
            )

    # ------------------------------------------------------------ answers to ours

    def _mine_of(self, h: wire.Header, meta: bytearray | None) -> tuple[MyOp | None, str]:
        """Our op a reply answers (None: not ours, or over), and its refusal reason."""
        rid = h.req_id
        op = self.mine.get(rid) if rid % 2 != self.peer_parity else None
        why = decode_reason(meta) if op is not None and meta and h.status else ""
        return op, why

    def _on_read_resp(self, h: wire.Header, meta: bytearray | None) -> None:
        op, why = self._mine_of(h, meta)
        if op is None or not op.is_read:
            return
        status = code_of(h.status)
        if op.state is State.RECEIVING and status is not _S.LLM_SUCCESS:
            op.finish(status, why)  # the granter revoked its grant mid-transfer
        elif op.state is State.RECEIVING and op.remote is not None:
            _confirm_read(op)
        elif op.state is State.WAIT_REPLY:
            _answer_read(op, status, h.size, why)

    def _on_write_grant(self, h: wire.Header, meta: bytearray | None) -> None:
        op, why = self._mine_of(h, meta)
        if op is None or op.is_read or op.state is not State.WAIT_REPLY:
            return
        status = code_of(h.status)
        if status is _S.LLM_SUCCESS:
            op.grant()
        else:
            op.finish(status, why)

    def _on_write_done(self, h: wire.Header, meta: bytearray | None) -> None:
        op, why = self._mine_of(h, meta)
        if op is None or op.is_read or op.state is State.OVER:
            return
        status = code_of(h.status)
        op.peer_over = True
        complete = op.state is State.SENDING and (
            op.total == 0 or (op.stream is not None and op.stream.sent)
        )
        if status is _S.LLM_SUCCESS and not complete:
            status = _S.LLM_FAILED  # "landed" before we even sent it: a broken peer
            why = "it confirmed bytes not yet sent"
        op.finish(status, why)

    def _on_cancel_ack(self, h: wire.Header, meta: bytearray | None) -> None:
        waiter = self.cancelling.pop(h.req_id, None)
        if waiter is not None:
            _wake(waiter)

    # ------------------------------------------------------------ link-level frames

    def _on_close(self, h: wire.Header, meta: bytearray | None) -> None:
        self._out._break("closed by peer")

    def _on_error(self, h: wire.Header, meta: bytearray | None) -> None:
        """The peer closes the link with an error: its reason (``{"reason": str}``,
        untrusted text, sanitized) names why the link broke."""
        self._out._break(f"closed by peer with an error: {_error_reason(meta) or 'no reason'}")

    def _on_ping(self, h: wire.Header, meta: bytearray | None) -> None:
        self._out._post(wire.encode_frame(_F.PONG, h.req_id))

    def _on_pong(self, h: wire.Header, meta: bytearray | None) -> None:
        pong = self.probes.get(h.req_id)
        if pong is not None:
            _wake(pong)

    def _on_plane_hello(self, h: wire.Header, meta: bytearray | None) -> None:
        self._out._on_plane_hello(meta, h.size)

    def _on_plane_grant(self, h: wire.Header, meta: bytearray | None) -> None:
        rid = h.req_id
        op = self.mine.get(rid) if rid % 2 != self.peer_parity else None
        self._out._on_plane_grant(op, code_of(h.status), h.size, meta)

    def close(self) -> None:
        """The link broke: fail our requests, end the peer's, wake every waiter."""
        mine, theirs = list(self.mine.values()), list(self.theirs.values())
        self.mine.clear()
        self.theirs.clear()
        for waiter in self.cancelling.values():
            _wake(waiter)
        self.cancelling.clear()
        for op in mine:
            op.finish(_S.LLM_LINK_FAILED)
        for peer_op in theirs:
            if peer_op.task is not None and peer_op.state is State.GRANTING:
                peer_op.task.cancel()
            peer_op.finish(False)


def _answer_read(op: MyOp, status: LLMStatusCode, size: int, why: str) -> None:
    """The peer's READ_RESP to our read ``op``, which awaited it."""
    if status is not _S.LLM_SUCCESS:
        op.finish(status, why)
    elif size != op.total:  # the peer should have refused; never trust it
        op.finish(_S.LLM_PARAM_INVALID, f"it granted {size} bytes, not {op.total}")
    elif size == 0:
        op.finish(_S.LLM_SUCCESS)
    elif op.device:  # DATA cannot land in device memory: we cancel it
        op.finish(_S.LLM_FAILED, NOT_DIRECT)
    else:
        op.state = State.RECEIVING


def _confirm_read(op: MyOp) -> None:
    """The peer confirmed our plane read ``op`` (its grant was live at our check)."""
    if op.stream is not None and op.stream.sent:
        op.finish(_S.LLM_SUCCESS)
    else:  # a broken peer: never trust it
        op.finish(_S.LLM_FAILED, "it confirmed a read not yet done")


def _error_reason(meta: bytearray | None) -> str:
    """The reason an ``ERROR`` frame's meta gives (sanitized), ``""`` if none."""
    try:
        reason = wire.decode_meta(meta).get("reason") if meta else None
    except wire.MetaError:
        return ""
    return decode_reason(reason) if isinstance(reason, str) else ""


def _unexpected(h: wire.Header, meta: bytearray | None) -> None:
    """HELLO / AUTH (or DATA, which never reaches the handlers) after the handshake."""
    raise wire.WireError(f"unexpected {h.type.name} frame")
