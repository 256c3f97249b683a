"""The TCP link's protocol without a socket: frames in, actions out, frame by frame."""

from __future__ import annotations

import ast
from collections.abc import Awaitable
from collections.abc import Callable
from pathlib import Path
from typing import Any
from typing import cast

import pytest

from aiokv import LLMStatusCode as Code
from aiokv.transport import _wire as wire
from aiokv.transport._base import encode_reason
from aiokv.transport.tcp import _protocol
from aiokv.transport.tcp._ops import MyOp
from aiokv.transport.tcp._ops import PeerOp
from aiokv.transport.tcp._ops import State
from aiokv.transport.tcp._ops import Stream
from aiokv.transport.tcp._ops import cursor_of
from aiokv.transport.tcp._protocol import LinkProtocol

F = wire.FrameType


def test_the_protocol_module_does_no_io() -> None:
    """It imports neither an event loop nor sockets or TLS: it only keeps state."""
    tree = ast.parse(Path(_protocol.__file__).read_text())
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            imported.add(node.module.split(".")[0])
    assert imported  # it was read
    assert not imported & {"asyncio", "socket", "ssl", "anyio", "trio", "selectors"}


def test_the_link_layers_name_no_data_plane() -> None:
    """The TCP link, the wire format and the link contract know data planes only by
    their interface (tcp/_plane.py): no medium's name appears in them, so a new medium
    is one new plane, not an edit of the link."""
    root = Path(wire.__file__).parent
    files = [*sorted((root / "tcp").glob("*.py")), root / "_base.py", root / "_wire.py"]
    assert len(files) > 5
    named = [f.name for f in files if "nixl" in f.read_text().lower()]
    assert named == []


class FakeTask:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class FakeWaiter:
    def __init__(self) -> None:
        self.woken = 0

    def done(self) -> bool:
        return self.woken > 0

    def set_result(self, result: None, /) -> None:
        self.woken += 1


class Driver:
    """Records what the protocol asks of its link."""

    def __init__(self) -> None:
        self.posted: list[tuple[wire.Header, bytes]] = []
        self.broken: list[str] = []
        self.aborted: list[Stream] = []
        self.serving: list[tuple[PeerOp, bytes, int]] = []
        self.commits: list[PeerOp] = []
        self.plane: list[tuple[str, object]] = []

    def _post(self, frame: bytes) -> None:
        h = wire.decode_header(frame[: wire.HEADER_SIZE])
        self.posted.append((h, frame[wire.HEADER_SIZE :]))

    def _break(self, reason: str) -> None:
        self.broken.append(reason)

    def _abort_stream(self, stream: Stream) -> None:
        stream.aborted = True
        self.aborted.append(stream)

    def _start_serving(self, op: PeerOp, meta: bytes, size: int) -> None:
        op.task = cast(Any, FakeTask())
        self.serving.append((op, meta, size))

    def _start_commit(self, op: PeerOp, commit: Callable[[], Awaitable[Code]]) -> None:
        self.commits.append(op)

    def _on_plane_hello(self, meta: bytearray | None, cap: int) -> None:
        self.plane.append(("hello", cap))

    def _on_plane_grant(
        self, op: MyOp | None, status: Code, size: int, meta: bytearray | None
    ) -> None:
        self.plane.append(("grant", op))

    def sent(self) -> list[tuple[F, int, Code]]:
        """``(type, request id, status)`` of each frame posted, in order."""
        return [(h.type, h.req_id, Code(h.status)) for h, _ in self.posted]


def make(*, initiator: bool = True, peer_cap: int = 4, high: int = 1000, low: int = 100) -> Any:
    driver = Driver()
    proto = LinkProtocol(
        driver,
        initiator=initiator,
        max_meta_bytes=64,
        max_peer_requests=peer_cap,
        reply_backlog=(high, low),
    )
    return proto, driver


def feed(proto: LinkProtocol, kind: F, rid: int = 0, **fields: Any) -> None:
    frame = wire.encode_frame(kind, rid, **fields)
    proto.receive(
        wire.decode_header(frame[: wire.HEADER_SIZE]), bytearray(frame[wire.HEADER_SIZE :])
    )


def served(driver: Driver, proto: LinkProtocol, kind: F, state: State) -> tuple[PeerOp, list[bool]]:
    """The peer's request ``kind`` (id 1, 4 bytes) fed to ``proto`` and moved to ``state``
    (one being sent carries its 4-byte stream); returns it and the list of the outcomes it
    reports."""
    feed(proto, kind, 1, size=4)
    op = driver.serving[0][0]
    outcomes: list[bool] = []
    op.bind(outcomes.append)
    op.state = state
    if state is State.SENDING:
        op.stream = Stream(1, [memoryview(b"abcd")], 4)
    return op, outcomes


def mine(proto: LinkProtocol, *, is_read: bool, total: int = 10) -> MyOp:
    op = proto.start(lambda rid: MyOp(cast(Any, None), rid, is_read))
    op.total = total
    return op


# ------------------------------------------------------------------------- request ids


def test_each_side_numbers_its_requests_in_its_own_parity() -> None:
    a, _ = make(initiator=True)
    b, _ = make(initiator=False)
    assert [mine(a, is_read=True).rid for _ in range(3)] == [0, 2, 4]
    assert [mine(b, is_read=False).rid for _ in range(3)] == [1, 3, 5]
    assert sorted(a.mine) == [0, 2, 4]


def test_ending_our_request_forgets_it_and_cancels_it_at_the_peer() -> None:
    proto, driver = make()
    op = mine(proto, is_read=True)
    proto.end(op, cancel=True)
    assert op.rid not in proto.mine
    assert op.state is State.OVER and op.result is Code.LLM_FAILED
    assert driver.sent() == [(F.CANCEL, op.rid, Code.LLM_SUCCESS)]


# ---------------------------------------------------------------------- peer's requests


@pytest.mark.parametrize(
    ("kind", "is_read", "plane"),
    [
        (F.READ_REQ, True, False),
        (F.WRITE_REQ, False, False),
        (F.PLANE_READ_REQ, True, True),
        (F.PLANE_WRITE_REQ, False, True),
    ],
)
def test_a_peer_request_starts_serving(kind: F, is_read: bool, plane: bool) -> None:
    proto, driver = make(initiator=True)  # the peer's ids are odd
    feed(proto, kind, 7, meta=b"key", size=100)
    [(op, meta, size)] = driver.serving
    assert (op.rid, op.is_read, op.plane, meta, size) == (7, is_read, plane, b"key", 100)
    assert proto.theirs == {7: op}
    assert driver.posted == []


@pytest.mark.parametrize(
    ("kind", "reply"), [(F.READ_REQ, F.READ_RESP), (F.WRITE_REQ, F.WRITE_GRANT)]
)
def test_bad_peer_requests_are_refused_without_serving(kind: F, reply: F) -> None:
    proto, driver = make(initiator=True, peer_cap=2)
    feed(proto, kind, 2)  # our parity: not the peer's to use
    feed(proto, kind, 1)
    feed(proto, kind, 1)  # a repeat of a request being served
    feed(proto, kind, 3)
    feed(proto, kind, 5)  # over the cap of 2
    assert driver.sent() == [
        (reply, 2, Code.LLM_PARAM_INVALID),
        (reply, 1, Code.LLM_REPEAT_REQUEST),
        (reply, 5, Code.LLM_LINK_BUSY),
    ]
    assert sorted(proto.theirs) == [1, 3]
    assert all(meta == b"" for _, meta in driver.posted)  # no reason: O(1) refusals


def test_a_request_whose_meta_was_skipped_is_refused_with_a_reason() -> None:
    proto, driver = make()
    h = wire.decode_header(wire.encode_header(F.WRITE_REQ, 1, meta_len=65, size=8))
    assert proto.skips_meta(h)  # over max_meta_bytes=64
    proto.receive(h, None)
    [(reply, meta)] = driver.posted
    assert (reply.type, reply.req_id, Code(reply.status)) == (
        F.WRITE_GRANT,
        1,
        Code.LLM_PARAM_INVALID,
    )
    assert b"exceeds 64" in meta
    assert not driver.serving


def test_a_busy_link_skips_request_meta_but_reads_reasons() -> None:
    proto, _ = make(peer_cap=1)
    small = wire.decode_header(wire.encode_header(F.READ_REQ, 3, meta_len=5))
    assert not proto.skips_meta(small)
    feed(proto, F.READ_REQ, 1, meta=b"x")
    assert proto.skips_meta(small)  # the peer has its one request: refused unread
    reason = wire.decode_header(
        wire.encode_header(F.READ_RESP, 0, status=Code.LLM_FAILED, meta_len=5)
    )
    assert not proto.skips_meta(reason)


# ----------------------------------------------------------------- replies to ours


def test_a_read_grant_of_the_whole_size_starts_receiving() -> None:
    proto, driver = make()
    op = mine(proto, is_read=True, total=10)
    feed(proto, F.READ_RESP, op.rid, size=10)
    assert op.state is State.RECEIVING and op.result is None
    assert proto.sink(op.rid) is op
    assert driver.posted == [] and driver.broken == []


def test_read_replies_that_end_our_read() -> None:
    proto, _ = make()
    wrong, refused, empty = (mine(proto, is_read=True, total=t) for t in (10, 10, 0))
    feed(proto, F.READ_RESP, wrong.rid, size=9)
    feed(
        proto,
        F.READ_RESP,
        refused.rid,
        status=Code.LLM_KV_CACHE_NOT_EXIST,
        meta=encode_reason("no such key\n"),
    )
    feed(proto, F.READ_RESP, empty.rid, size=0)
    assert (wrong.result, wrong.reason) == (Code.LLM_PARAM_INVALID, "it granted 9 bytes, not 10")
    assert (refused.result, refused.reason) == (
        Code.LLM_KV_CACHE_NOT_EXIST,
        "no such key?",
    )  # sanitized
    assert empty.result is Code.LLM_SUCCESS


def test_a_revoked_grant_mid_read_fails_it() -> None:
    proto, _ = make()
    op = mine(proto, is_read=True)
    feed(proto, F.READ_RESP, op.rid, size=10)
    feed(proto, F.READ_RESP, op.rid, status=Code.LLM_FAILED, meta=b"revoked")
    assert (op.result, op.reason) == (Code.LLM_FAILED, "revoked")


def test_replies_for_unknown_requests_are_dropped() -> None:
    proto, driver = make()
    op = mine(proto, is_read=True)
    feed(proto, F.READ_RESP, 40, size=10)  # never ours
    feed(proto, F.WRITE_GRANT, 40)
    feed(proto, F.WRITE_DONE, 40)
    feed(proto, F.READ_RESP, 1, size=10)  # the peer's parity: never a reply to us
    feed(proto, F.WRITE_GRANT, op.rid)  # a write's reply to our read
    feed(proto, F.CANCEL_ACK, 40)
    feed(proto, F.PONG, 40)
    assert op.state is State.WAIT_REPLY and op.result is None
    assert driver.posted == [] and driver.broken == []


def test_a_write_grant_then_its_confirmation() -> None:
    proto, _ = make()
    op = mine(proto, is_read=False, total=4)
    feed(proto, F.WRITE_GRANT, op.rid)
    assert op.granted and op.state is State.SENDING
    op.stream = Stream(op.rid, [memoryview(b"abcd")], 4)
    op.stream.sent = True
    feed(proto, F.WRITE_DONE, op.rid)
    assert op.peer_over and op.result is Code.LLM_SUCCESS


def test_a_write_confirmed_before_it_was_sent_fails() -> None:
    proto, _ = make()
    op = mine(proto, is_read=False, total=4)
    feed(proto, F.WRITE_GRANT, op.rid)
    op.stream = Stream(op.rid, [memoryview(b"abcd")], 4)  # not yet sent
    feed(proto, F.WRITE_DONE, op.rid)
    assert (op.result, op.reason) == (Code.LLM_FAILED, "it confirmed bytes not yet sent")


def test_a_refused_write() -> None:
    proto, _ = make()
    op = mine(proto, is_read=False)
    feed(proto, F.WRITE_GRANT, op.rid, status=Code.LLM_OUT_OF_MEMORY, meta=b"full")
    assert (op.result, op.reason, op.granted) == (Code.LLM_OUT_OF_MEMORY, "full", False)


# ------------------------------------------------------------------------ cancel / ack


def test_a_peer_cancel_stops_serving_and_is_acknowledged() -> None:
    proto, driver = make()
    feed(proto, F.READ_REQ, 1)
    op = driver.serving[0][0]
    feed(proto, F.CANCEL, 1)
    assert cast(FakeTask, op.task).cancelled  # the handler was still deciding
    assert op.state is State.OVER and 1 not in proto.theirs
    feed(proto, F.CANCEL, 3)  # unknown (already over): acknowledged all the same
    feed(proto, F.CANCEL, 2)  # ours: not the peer's to cancel
    assert driver.sent() == [
        (F.CANCEL_ACK, 1, Code.LLM_SUCCESS),
        (F.CANCEL_ACK, 3, Code.LLM_SUCCESS),
    ]


def test_a_cancel_mid_send_withdraws_the_stream() -> None:
    proto, driver = make()
    op, outcomes = served(driver, proto, F.READ_REQ, State.SENDING)
    feed(proto, F.CANCEL, 1)
    assert driver.aborted == [op.stream] and outcomes == [False]


def test_read_done_releases_a_sent_grant() -> None:
    proto, driver = make()
    op, outcomes = served(driver, proto, F.READ_REQ, State.SENDING)
    op.stream.sent = True
    feed(proto, F.READ_DONE, 1)
    assert outcomes == [True] and proto.theirs == {}
    assert driver.posted == []  # READ_DONE is not answered


def plane_read(proto: LinkProtocol) -> MyOp:
    """Our plane read (4 bytes), granted by the peer's plane, its bytes moving."""
    op = mine(proto, is_read=True, total=4)
    op.remote, op.state = object(), State.RECEIVING
    return op


def read_whole(op: MyOp) -> None:
    """``op``'s plane read every byte (as a plane marks it)."""
    op.stream = Stream(op.rid, [], 0)
    op.stream.sent = True


def test_a_plane_read_ends_only_when_the_granter_confirms_it() -> None:
    proto, driver = make()
    op = plane_read(proto)
    proto.check(op)  # not read whole yet: nothing to ask
    read_whole(op)
    proto.check(op)
    assert driver.sent() == [(F.PLANE_READ_CHECK, op.rid, Code.LLM_SUCCESS)]
    assert op.result is None
    feed(proto, F.READ_RESP, op.rid)
    assert op.result is Code.LLM_SUCCESS


def test_a_plane_read_revoked_before_the_confirmation_fails() -> None:
    proto, _ = make()
    op = plane_read(proto)
    read_whole(op)
    proto.check(op)
    feed(proto, F.READ_RESP, op.rid, status=Code.LLM_TIMEOUT, meta=b"revoked")
    feed(proto, F.READ_RESP, op.rid)  # too late: the first word stands
    assert (op.result, op.reason) == (Code.LLM_TIMEOUT, "revoked")


def test_a_plane_read_confirmed_before_it_was_done_fails() -> None:
    proto, _ = make()
    op = plane_read(proto)
    feed(proto, F.READ_RESP, op.rid)
    assert (op.result, op.reason) == (Code.LLM_FAILED, "it confirmed a read not yet done")


def test_the_granter_confirms_a_plane_read_only_while_it_serves_it() -> None:
    proto, driver = make()
    feed(proto, F.PLANE_READ_REQ, 1, size=4)
    feed(proto, F.PLANE_READ_REQ, 3, size=4)
    plane_op, revoked = (op for op, _, _ in driver.serving)
    outcomes: list[bool] = []
    plane_op.bind(outcomes.append)
    plane_op.state = revoked.state = State.SENDING  # granted by the plane (no stream)
    proto.revoke(revoked, Code.LLM_TIMEOUT)
    feed(proto, F.PLANE_READ_CHECK, 1)
    feed(proto, F.PLANE_READ_CHECK, 3)  # revoked: its READ_RESP already went out
    feed(proto, F.PLANE_READ_CHECK, 5)  # never granted
    assert driver.sent() == [
        (F.READ_RESP, 3, Code.LLM_TIMEOUT),
        (F.READ_RESP, 1, Code.LLM_SUCCESS),
    ]
    assert outcomes == [] and 1 in proto.theirs  # held until READ_DONE
    feed(proto, F.READ_DONE, 1)
    assert outcomes == [True] and proto.theirs == {}


def plane_write(proto: LinkProtocol) -> MyOp:
    """Our plane write (4 bytes), granted by the peer's plane, its bytes moving."""
    op = mine(proto, is_read=False, total=4)
    op.remote, op.state = object(), State.SENDING
    return op


def test_a_plane_write_asks_once_written_and_ends_by_the_granters_word() -> None:
    proto, driver = make()
    op = plane_write(proto)
    proto.check(op)  # not written whole yet: nothing to say
    feed(proto, F.WRITE_DONE, op.rid)  # "landed" before we said so: a broken peer
    assert (op.result, op.reason) == (Code.LLM_FAILED, "it confirmed bytes not yet sent")
    op = plane_write(proto)
    read_whole(op)  # written whole (as a plane marks it)
    proto.check(op)
    assert driver.sent() == [(F.PLANE_WRITE_CHECK, op.rid, Code.LLM_SUCCESS)]
    assert op.result is None
    feed(proto, F.WRITE_DONE, op.rid)
    assert op.result is Code.LLM_SUCCESS
    proto.check(op)  # over: nothing more to say
    assert len(driver.posted) == 1


def test_a_plane_write_revoked_before_its_check_fails() -> None:
    proto, driver = make()
    op = plane_write(proto)
    feed(proto, F.WRITE_DONE, op.rid, status=Code.LLM_TIMEOUT, meta=b"revoked")
    read_whole(op)
    proto.check(op)  # failed already: no check
    assert driver.posted == [] and (op.result, op.reason) == (Code.LLM_TIMEOUT, "revoked")


def test_the_granter_takes_a_plane_write_as_landed_only_while_it_serves_it() -> None:
    proto, driver = make(peer_cap=8)
    for rid in (1, 3, 5, 13):
        feed(proto, F.PLANE_WRITE_REQ, rid, size=4)
    feed(proto, F.WRITE_REQ, 7, size=4)
    feed(proto, F.PLANE_READ_REQ, 9, size=4)
    plain, committed, revoked, as_data, data, read = (op for op, _, _ in driver.serving)

    async def commit() -> Code:
        return Code.LLM_SUCCESS

    committed.commit = commit
    for op in (plain, committed, revoked, as_data, data):
        op.state = State.RECEIVING  # granted (the last two by WRITE_GRANT: DATA)
    as_data.cursor = data.cursor = cursor_of([memoryview(bytearray(4))], 4)
    read.state = State.SENDING
    proto.revoke(revoked, Code.LLM_TIMEOUT)
    for rid in (1, 3, 5, 13, 7, 9, 11):  # 11: never granted
        feed(proto, F.PLANE_WRITE_CHECK, rid)
    feed(proto, F.PLANE_WRITE_CHECK, 1)  # a second word changes nothing
    assert driver.sent() == [
        (F.WRITE_DONE, 5, Code.LLM_TIMEOUT),  # the revocation, before any check
        (F.WRITE_DONE, 1, Code.LLM_SUCCESS),
    ]
    assert driver.commits == [committed]  # confirmed once committed
    # a write granted as DATA lands by its bytes, a read by READ_DONE
    assert sorted(proto.theirs) == [3, 7, 9, 13]


def test_a_data_read_is_not_confirmed() -> None:
    """Over DATA the granter sends the bytes itself: no check, no extra frame."""
    proto, driver = make()
    op, outcomes = served(driver, proto, F.PLANE_READ_REQ, State.SENDING)
    feed(proto, F.PLANE_READ_CHECK, 1)
    assert driver.posted == [] and outcomes == [] and proto.theirs == {1: op}
    ours = mine(proto, is_read=True, total=4)
    feed(proto, F.READ_RESP, ours.rid, size=4)
    feed(proto, F.READ_RESP, ours.rid)  # a stray second grant changes nothing
    assert ours.result is None and ours.state is State.RECEIVING


def test_cancel_ack_wakes_the_cancelled_write() -> None:
    proto, _ = make()
    waiter = FakeWaiter()
    proto.cancelling[4] = waiter
    feed(proto, F.CANCEL_ACK, 4)
    feed(proto, F.CANCEL_ACK, 4)  # a second one: nobody waits any more
    assert waiter.woken == 1 and proto.cancelling == {}


# --------------------------------------------------------------------------- revocation


def test_revoking_a_grant_tells_the_peer_once() -> None:
    proto, driver = make()
    op, outcomes = served(driver, proto, F.WRITE_REQ, State.RECEIVING)
    proto.revoke(op, Code.LLM_FAILED)
    proto.revoke(op, Code.LLM_FAILED)
    [(h, meta)] = driver.posted
    assert (h.type, h.req_id, Code(h.status)) == (F.WRITE_DONE, 1, Code.LLM_FAILED)
    assert meta == b"the grant was revoked (LLM_FAILED)"
    assert outcomes == [False] and proto.theirs == {} and proto.sink(1) is None


def test_a_revoked_read_withdraws_its_stream() -> None:
    proto, driver = make()
    op, outcomes = served(driver, proto, F.READ_REQ, State.SENDING)
    proto.revoke(op, Code.LLM_KV_CACHE_NOT_EXIST)
    assert driver.aborted == [op.stream] and outcomes == [False]
    assert driver.sent() == [(F.READ_RESP, 1, Code.LLM_KV_CACHE_NOT_EXIST)]


# ----------------------------------------------------------- landing, commit, bad data


def test_a_filled_peer_write_is_confirmed_or_committed_first() -> None:
    proto, driver = make()
    feed(proto, F.WRITE_REQ, 1, size=4)
    feed(proto, F.WRITE_REQ, 3, size=4)
    plain, committed = (op for op, _, _ in driver.serving)

    async def commit() -> Code:
        return Code.LLM_SUCCESS

    committed.commit = commit
    proto.filled(plain)
    proto.filled(committed)
    assert driver.sent() == [(F.WRITE_DONE, 1, Code.LLM_SUCCESS)]
    assert driver.commits == [committed] and committed.commit is None
    proto.committed(committed, Code.LLM_FAILED)  # the commit failed
    assert driver.sent()[-1] == (F.WRITE_DONE, 3, Code.LLM_FAILED)
    assert proto.theirs == {}


@pytest.mark.parametrize("end", ["cancel", "revoke", "overrun", "filled again"])
def test_a_write_ended_during_its_commit_is_answered_once_the_commit_ended(end: str) -> None:
    """The commit moves the write's bytes into place: the peer's CANCEL (or our
    revocation, or more DATA than granted) during it ends the grant at once, but its
    answer (CANCEL_ACK, or the failed WRITE_DONE), which tells the peer nothing more
    lands, waits for the commit; the write told landed again (a peer's repeated word)
    is not confirmed before its commit's code."""
    proto, driver = make()
    op, outcomes = served(driver, proto, F.WRITE_REQ, State.RECEIVING)

    async def commit() -> Code:
        return Code.LLM_SUCCESS

    op.commit = commit
    proto.filled(op)
    assert driver.commits == [op] and op.committing
    if end == "filled again":
        proto.filled(op)
        assert driver.commits == [op] and driver.sent() == [] and outcomes == []
        proto.committed(op, Code.LLM_FAILED)  # the commit's code is the write's
        assert driver.sent() == [(F.WRITE_DONE, 1, Code.LLM_FAILED)] and outcomes == [False]
        return
    if end == "cancel":
        feed(proto, F.CANCEL, 1)
        answer = (F.CANCEL_ACK, 1, Code.LLM_SUCCESS)
    elif end == "revoke":
        proto.revoke(op, Code.LLM_KV_CACHE_NOT_EXIST)
        answer = (F.WRITE_DONE, 1, Code.LLM_KV_CACHE_NOT_EXIST)
    else:
        proto.fail_sink(op, "sent more bytes than granted")
        answer = (F.WRITE_DONE, 1, Code.LLM_PARAM_INVALID)
    assert outcomes == [False] and proto.theirs == {}  # the grant ended now...
    assert driver.sent() == []  # ... but the peer is not told while bytes still land
    proto.committed(op, Code.LLM_SUCCESS)
    assert driver.sent() == [answer] and not op.committing


def test_too_much_data_fails_the_request() -> None:
    proto, driver = make()
    op = mine(proto, is_read=True)
    proto.fail_sink(op, "sent more bytes than granted")
    assert (op.result, op.reason) == (
        Code.LLM_PARAM_INVALID,
        "the peer sent more bytes than granted",
    )
    feed(proto, F.WRITE_REQ, 1, size=4)
    peer = driver.serving[0][0]
    proto.fail_sink(peer, "sent more bytes than granted")
    [(h, meta)] = driver.posted
    assert (h.type, Code(h.status), meta) == (
        F.WRITE_DONE,
        Code.LLM_PARAM_INVALID,
        b"you sent more bytes than granted",
    )


# ------------------------------------------------------------------ reply backpressure


def test_replies_are_accounted_until_sent() -> None:
    proto, _ = make(high=300, low=100)
    proto.queued(wire.encode_frame(F.READ_REQ, 4))  # our own requests do not count
    assert proto.queued_replies == 0
    refusal = wire.encode_frame(F.READ_RESP, 1, status=Code.LLM_FAILED, meta=b"why")
    proto.queued(refusal)
    assert proto.queued_replies == len(refusal) + 64
    assert not proto.reader_must_pause() and proto.replies_drained()
    for rid in range(3):
        proto.queued(wire.encode_frame(F.PONG, rid))
    assert proto.queued_replies == len(refusal) + 3 * wire.HEADER_SIZE + 4 * 64 > 300
    assert proto.reader_must_pause() and not proto.replies_drained()
    proto.batch_taken()  # the writer took them: unsent, they still count
    assert proto.queued_replies == 0 and proto.reader_must_pause()
    assert proto.replies_drained()  # nothing more queued behind the batch
    proto.batch_sent()
    assert not proto.reader_must_pause()


# ------------------------------------------------------------------- link-level frames


def test_ping_is_answered_and_pong_wakes_its_probe() -> None:
    proto, driver = make()
    feed(proto, F.PING, 9)
    assert driver.sent() == [(F.PONG, 9, Code.LLM_SUCCESS)]
    waiter = FakeWaiter()
    pid, ping = proto.new_probe(waiter)
    greeting = proto.new_probe(None)[0]  # no waiter: its PONG is ignored
    assert wire.decode_header(ping).type is F.PING and greeting == pid + 1
    feed(proto, F.PONG, greeting)
    feed(proto, F.PONG, pid)
    assert waiter.woken == 1


@pytest.mark.parametrize(
    ("kind", "meta", "why"),
    [
        (F.CLOSE, b"", "closed by peer"),
        (F.ERROR, b"", "closed by peer with an error: no reason"),
        (F.ERROR, b"not json", "closed by peer with an error: no reason"),
        (F.ERROR, b'{"reason": 5}', "closed by peer with an error: no reason"),
        (F.ERROR, b'{"reason": "going\\naway"}', "closed by peer with an error: going?away"),
    ],
)
def test_close_and_error_break_the_link(kind: F, meta: bytes, why: str) -> None:
    """An ERROR frame's reason (sanitized) says why the link broke."""
    proto, driver = make()
    feed(proto, kind, meta=meta)
    assert driver.broken == [why]


def test_handshake_frames_after_the_handshake_are_violations() -> None:
    proto, _ = make()
    with pytest.raises(wire.WireError, match="unexpected HELLO"):
        feed(proto, F.HELLO, meta=b"{}")


def test_plane_frames_go_to_the_link() -> None:
    proto, driver = make()
    op = mine(proto, is_read=True)
    feed(proto, F.PLANE_HELLO, meta=b"md", size=512)
    feed(proto, F.PLANE_GRANT, op.rid, status=Code.LLM_FAILED)
    feed(proto, F.PLANE_GRANT, 1, status=Code.LLM_FAILED)  # the peer's parity: no op
    assert driver.plane == [("hello", 512), ("grant", op), ("grant", None)]


def test_close_fails_everything_pending() -> None:
    proto, driver = make()
    ours = mine(proto, is_read=False)
    feed(proto, F.READ_REQ, 1)
    theirs = driver.serving[0][0]
    waiter = FakeWaiter()
    proto.cancelling[6] = waiter
    proto.close()
    assert ours.result is Code.LLM_LINK_FAILED
    assert cast(FakeTask, theirs.task).cancelled and theirs.state is State.OVER
    assert waiter.woken == 1
    assert proto.mine == proto.theirs == proto.cancelling == {}
