"""The TCP transport over loopback, with a fake cache layer serving plain bytearrays.

Every async test runs on asyncio and on uvloop (see ``tests/conftest.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import mmap
import random
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
from _helpers import cancel_after
from _helpers import fake_peer
from _helpers import fake_peer_hello
from _helpers import serving_once
from fake_handler import FakeHandler
from spans import KIB
from spans import ManyOps
from spans import Scatter
from spans import assert_reads
from spans import gather_spans
from spans import js
from spans import layout
from spans import outside_spans
from spans import run_many_ops
from spans import views_of

from aiokv._enums import LLMStatusCode as Code
from aiokv._errors import LLMException
from aiokv.transport import Grant
from aiokv.transport import Link
from aiokv.transport import PeerInfo
from aiokv.transport import Transport
from aiokv.transport import _wire as wire
from aiokv.transport import get_transport
from aiokv.transport import transport_names
from aiokv.transport._wire import FrameType
from aiokv.transport.tcp import TcpTransport
from aiokv.transport.tcp import _link

HOST = "127.0.0.1"
MIB = 1 << 20


# ------------------------------------------------------------------------------ fakes


@dataclass
class Pair:
    a: TcpTransport
    b: TcpTransport
    ha: FakeHandler
    hb: FakeHandler
    link_a: Link  # A's end (A connected)
    link_b: Link  # B's end (B accepted)
    lost_a: list[Link]
    lost_b: list[Link]


@contextlib.asynccontextmanager
async def make_pair(
    *,
    secret_a: bytes | None = None,
    secret_b: bytes | None = None,
    **kwargs: Any,
) -> AsyncIterator[Pair]:
    ha, hb = FakeHandler(), FakeHandler()
    lost_a: list[Link] = []
    lost_b: list[Link] = []
    accepted: asyncio.Future[Link] = asyncio.get_running_loop().create_future()

    def on_link(link: Link) -> None:
        if not accepted.done():
            accepted.set_result(link)

    a = TcpTransport(1, ha, secret=secret_a, on_link_lost=lost_a.append, **kwargs)
    b = TcpTransport(2, hb, secret=secret_b, on_link=on_link, on_link_lost=lost_b.append, **kwargs)
    try:
        host, port = await b.listen(HOST, 0)
        link_a = await a.connect(host, port, timeout=5)
        link_b = await asyncio.wait_for(accepted, 5)
        yield Pair(a, b, ha, hb, link_a, link_b, lost_a, lost_b)
    finally:
        await a.aclose()
        await b.aclose()


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    # A small chunk size makes multi-chunk transfers cheap to test.
    async with make_pair(chunk_bytes=64 * KIB) as p:
        yield p


# -------------------------------------------------------------------- data integrity


async def test_link_ends_know_each_other(pair: Pair) -> None:
    assert pair.link_a.peer.cluster_id == 2
    assert pair.link_a.local_cluster_id == 1
    assert pair.link_b.peer.cluster_id == 1
    assert pair.link_b.local_cluster_id == 2
    assert pair.link_a.peer.address[0] == HOST
    assert pair.a.links() == [pair.link_a]
    assert pair.b.links() == [pair.link_b]
    assert not pair.link_a.broken
    assert not pair.link_b.broken


@pytest.mark.parametrize("chunk_bytes", [64 * KIB, wire.MAX_CHUNK])
async def test_read_many_scatter_buffers_exact(chunk_bytes: int, scatter: Scatter) -> None:
    src, src_spans, dst_spans = scatter.src, scatter.src_spans, scatter.dst_spans
    assert sum(n for _, n in src_spans) > wire.MAX_CHUNK
    dst = bytearray(b"\x77") * scatter.dst_len
    async with make_pair(chunk_bytes=chunk_bytes) as p:
        p.hb.regions["r"] = src
        await p.link_a.read(
            js({"region": "r", "spans": src_spans, "tag": "t"}),
            views_of(dst, dst_spans),
            timeout=10,
        )
        assert gather_spans(dst, dst_spans) == gather_spans(src, src_spans)
        assert set(outside_spans(dst, dst_spans)) == {0x77}  # nothing landed in the gaps
        assert await p.hb.done("t") is True


async def test_write_many_scatter_buffers_exact(pair: Pair) -> None:
    rng = random.Random(2)
    dst_spans, dst_len = layout(rng, 1300, 4 * KIB)
    total = sum(n for _, n in dst_spans)
    src_spans = [[3, total]]
    src = bytearray(rng.randbytes(total + 6))
    dst = bytearray(rng.randbytes(dst_len))
    dst_before = bytes(dst)
    pair.hb.regions["w"] = dst
    await pair.link_a.write(
        js({"region": "w", "spans": dst_spans, "tag": "w"}), views_of(src, src_spans), timeout=10
    )
    # write() returns only once the peer confirmed: its done has already run.
    assert pair.hb.calls["w"] == [True]
    assert gather_spans(dst, dst_spans) == gather_spans(src, src_spans)
    assert outside_spans(dst, dst_spans) == outside_spans(dst_before, dst_spans)


async def test_both_directions_on_one_link(pair: Pair) -> None:
    rng = random.Random(3)
    pair.ha.regions["x"] = bytearray(rng.randbytes(300 * KIB))
    pair.hb.regions["y"] = bytearray(rng.randbytes(300 * KIB))
    spans = [[0, 100 * KIB], [200 * KIB, 100 * KIB]]
    got_a = bytearray(200 * KIB)
    got_b = bytearray(200 * KIB)
    push_a = bytearray(rng.randbytes(200 * KIB))
    push_b = bytearray(rng.randbytes(200 * KIB))
    await asyncio.gather(
        pair.link_a.read(js({"region": "y", "spans": spans}), [memoryview(got_a)], timeout=10),
        pair.link_b.read(js({"region": "x", "spans": spans}), [memoryview(got_b)], timeout=10),
    )
    assert got_a == gather_spans(pair.hb.regions["y"], spans)
    assert got_b == gather_spans(pair.ha.regions["x"], spans)
    await asyncio.gather(
        pair.link_a.write(js({"region": "y", "spans": spans}), [memoryview(push_a)], timeout=10),
        pair.link_b.write(js({"region": "x", "spans": spans}), [memoryview(push_b)], timeout=10),
    )
    assert gather_spans(pair.hb.regions["y"], spans) == push_a
    assert gather_spans(pair.ha.regions["x"], spans) == push_b


async def test_200_concurrent_ops_do_not_mix(pair: Pair, many_ops: ManyOps) -> None:
    """200 reads and writes on one link of 64 KiB chunks, all in flight at once."""
    await run_many_ops(
        pair.link_a, pair.link_b, pair.ha.regions, pair.hb.regions, many_ops, op_timeout=20
    )


async def test_zero_byte_transfers(pair: Pair) -> None:
    pair.hb.regions["r"] = bytearray(10)
    await pair.link_a.read(js({"region": "r", "spans": [], "tag": "r0"}), [], timeout=5)
    await pair.link_a.write(js({"region": "r", "spans": [], "tag": "w0"}), [], timeout=5)
    assert await pair.hb.done("r0") is True
    assert pair.hb.calls["w0"] == [True]


async def test_views_of_any_format_are_bytes(pair: Pair) -> None:
    pair.hb.regions["r"] = bytearray(range(16))
    words = memoryview(bytearray(16)).cast("I")  # 4 x uint32: 16 bytes
    await pair.link_a.read(js({"region": "r", "spans": [[0, 16]]}), [words], timeout=5)
    assert words.tobytes() == bytes(range(16))


# --------------------------------------------------------------------- error codes


@pytest.mark.parametrize(
    ("meta", "code"),
    [
        ({"refuse": Code.LLM_KV_CACHE_NOT_EXIST}, Code.LLM_KV_CACHE_NOT_EXIST),
        ({"refuse": Code.LLM_FEATURE_NOT_ENABLED}, Code.LLM_FEATURE_NOT_ENABLED),
        ({"raise": Code.LLM_OUT_OF_MEMORY}, Code.LLM_OUT_OF_MEMORY),
        ({"crash": True}, Code.LLM_FAILED),
    ],
)
async def test_refusal_codes_propagate(pair: Pair, meta: dict[str, Any], code: Code) -> None:
    buf = bytearray(8)
    for op in (pair.link_a.read, pair.link_a.write):
        with pytest.raises(LLMException) as info:
            await op(js(meta), [memoryview(buf)], timeout=5)
        assert info.value.status_code == code
    assert not pair.link_a.broken


async def test_size_mismatch_is_param_invalid(pair: Pair) -> None:
    pair.hb.regions["r"] = bytearray(b"x" * 100)
    meta = {"region": "r", "spans": [[0, 50]], "tag": "read"}
    with pytest.raises(LLMException) as info:
        await pair.link_a.read(js(meta), [memoryview(bytearray(49))], timeout=5)
    assert info.value.status_code == Code.LLM_PARAM_INVALID
    assert await pair.hb.done("read") is False
    meta = {"region": "r", "spans": [[0, 50]], "tag": "write"}
    with pytest.raises(LLMException) as info:
        await pair.link_a.write(js(meta), [memoryview(bytearray(51))], timeout=5)
    assert info.value.status_code == Code.LLM_PARAM_INVALID
    assert pair.hb.calls["write"] == [False]
    assert pair.hb.regions["r"] == b"x" * 100  # nothing was sent into a refused request
    got = bytearray(50)
    await pair.link_a.read(js({"region": "r", "spans": [[0, 50]]}), [memoryview(got)], timeout=5)
    assert got == b"x" * 50


async def test_bad_arguments(pair: Pair) -> None:
    buf = [memoryview(bytearray(4))]
    with pytest.raises(TypeError):
        await pair.link_a.read([], buf, timeout=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        await pair.link_a.read(js({}), [object()], timeout=1)  # type: ignore[list-item]
    with pytest.raises(TypeError):
        await pair.link_a.read(js({}), memoryview(bytearray(4)), timeout=1)
    with pytest.raises(ValueError, match="timeout"):
        await pair.link_a.read(js({}), buf, timeout=0)
    with pytest.raises(LLMException) as info:
        await pair.link_a.read(js({}), [memoryview(b"readonly")], timeout=1)
    assert info.value.status_code == Code.LLM_PARAM_INVALID
    with pytest.raises(TypeError, match="meta must be bytes"):
        await pair.link_a.read({"region": "r"}, buf, timeout=1)  # type: ignore[arg-type]
    with pytest.raises(LLMException) as info:
        await pair.link_a.read(b"x" * (pair.a.max_meta_bytes + 1), buf, timeout=1)
    assert info.value.status_code == Code.LLM_PARAM_INVALID
    assert pair.hb.grants == 0  # none of these reached the peer


async def test_peer_request_flood_is_capped(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(pair.link_b, _link.TcpLink)
    monkeypatch.setattr(pair.link_b._p, "max_peer_requests", 2)  # B's cap on A's requests
    hung = [
        asyncio.create_task(pair.link_a.read(js({"hang": True}), [], timeout=10)) for _ in range(2)
    ]
    while pair.hb.grants < 2:
        await pair.hb.hanging.wait()
        pair.hb.hanging.clear()
    with pytest.raises(LLMException) as info:
        await pair.link_a.read(js({"hang": True}), [], timeout=10)
    assert info.value.status_code == Code.LLM_LINK_BUSY
    for task in hung:
        task.cancel()
    await asyncio.gather(*hung, return_exceptions=True)


async def test_meta_caps() -> None:
    async with make_pair(max_meta_bytes=1000) as p:
        with pytest.raises(LLMException) as info:  # over our own cap: never sent
            await p.link_a.read(js({"pad": "x" * 2000}), [], timeout=5)
        assert info.value.status_code == Code.LLM_PARAM_INVALID
    # Over the peer's cap only: the peer skips it and answers.
    ha = FakeHandler()
    small = TcpTransport(2, ha, max_meta_bytes=100)
    big = TcpTransport(1, FakeHandler())
    try:
        port = (await small.listen(HOST, 0))[1]
        link = await big.connect(HOST, port, timeout=5)
        with pytest.raises(LLMException) as info:
            await link.write(js({"pad": "x" * 5000}), [memoryview(bytearray(10))], timeout=5)
        assert info.value.status_code == Code.LLM_PARAM_INVALID
        assert ha.grants == 0
        assert not link.broken
    finally:
        await big.aclose()
        await small.aclose()


# --------------------------------------------------------------- time and cancellation


async def test_handler_that_never_answers_times_out(pair: Pair) -> None:
    t0 = time.monotonic()
    with pytest.raises(LLMException) as info:
        await pair.link_a.read(js({"hang": True}), [memoryview(bytearray(4))], timeout=0.2)
    assert info.value.status_code == Code.LLM_TIMEOUT
    assert time.monotonic() - t0 < 2
    # The CANCEL reached the peer, which stopped waiting on its handler.
    await asyncio.wait_for(pair.hb.hung_cancelled.wait(), 5)
    with pytest.raises(LLMException) as info:
        await pair.link_a.write(js({"hang": True}), [memoryview(bytearray(4))], timeout=0.1)
    assert info.value.status_code == Code.LLM_TIMEOUT
    assert not pair.link_a.broken
    await assert_reads(pair.link_a, pair.hb.regions, b"ok")


async def test_a_peer_that_never_acknowledges_a_cancelled_write_loses_the_link(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A write cut short mid-stream returns only once the peer confirmed that none of it
    lands any more (``CANCEL_ACK``); a peer that never confirms loses the link, after a
    bounded wait (``_CANCEL_ACK_WAIT``), instead of holding the writer forever."""
    size = 256 * MIB  # ~100 ms of loopback: the deadline falls mid-stream
    async with make_pair(chunk_bytes=1 * MIB) as p:
        # (anonymous mappings: zeroing a 256 MiB bytearray holds the GIL, and so blocks
        # the loop, for up to a second on a loaded machine, even from another thread)
        p.hb.regions["r"] = mmap.mmap(-1, size)  # type: ignore[assignment]
        p.link_b._p.handlers[FrameType.CANCEL] = lambda h, meta: None  # type: ignore[attr-defined]
        mine = memoryview(mmap.mmap(-1, size))
        meta = js({"region": "r", "spans": [[0, size]]})
        took = 0.0
        for _ in range(5):  # a deadline that fell before the grant breaks nothing: again
            t0 = time.monotonic()
            with pytest.raises(LLMException) as info:
                await asyncio.wait_for(p.link_a.write(meta, [mine], timeout=0.03), 15)
            took = time.monotonic() - t0
            assert info.value.status_code in (Code.LLM_TIMEOUT, Code.LLM_LINK_FAILED)
            if p.link_a.broken:
                break
        assert p.link_a.broken and p.lost_a == [p.link_a]
        assert _link._CANCEL_ACK_WAIT[0] <= took < _link._CANCEL_ACK_WAIT[1] + 2
        assert "no CANCEL_ACK for request" in caplog.text


@pytest.mark.parametrize(
    ("chunk", "sockbuf"),
    [(16 * KIB, None), (1 * MIB, 32 * KIB)],
    ids=["small-chunks", "chunks-over-socket-buffer"],
)
@pytest.mark.parametrize("op", ["read", "write"])
async def test_cancel_at_every_step_leaves_link_usable(
    op: str, chunk: int, sockbuf: int | None
) -> None:
    """Cancel one transfer after 0, 1, 2, ... loop steps: before, during and after it.

    With chunks larger than the socket buffers, cancellation lands mid-chunk: the reader
    must switch to scratch space, the writer finish the frame from a private copy.
    """
    rng = random.Random(5)
    size = 2 * MIB
    async with make_pair(chunk_bytes=chunk, sock_buf_bytes=sockbuf) as p:
        p.hb.regions["r"] = bytearray(rng.randbytes(size))
        for steps in range(0, 60, 4):
            tag = f"{op}{steps}"
            mine = bytearray(rng.randbytes(size))
            meta = js({"region": "r", "spans": [[0, size]], "tag": tag})
            method = p.link_a.read if op == "read" else p.link_a.write
            task = await cancel_after(method(meta, [memoryview(mine)], timeout=20), steps)
            snapshot = bytes(mine)
            if tag in p.hb.first:  # the grant happened: the peer learns how it ended
                ok = await p.hb.ended_as(tag, op, task)
                assert p.hb.calls[tag] == [ok]  # done runs once
            # The link still works, and the cancelled op's buffer is never touched again
            # (late chunks of it are drained into scratch space while this runs).
            check = bytearray(size)
            await p.link_a.read(
                js({"region": "r", "spans": [[0, size]]}), [memoryview(check)], timeout=20
            )
            assert check == p.hb.regions["r"]
            assert bytes(mine) == snapshot
            if op == "write":
                p.hb.regions["r"][:] = check  # a cancelled push may have half-landed
        assert not p.link_a.broken
        assert not p.link_b.broken
        assert p.a.links() == [p.link_a]


async def test_timeout_mid_transfer_keeps_link(pair: Pair) -> None:
    size = 8 * MIB
    pair.hb.regions["r"] = bytearray(random.Random(6).randbytes(size))
    mine = bytearray(size)
    with contextlib.suppress(LLMException):  # may or may not finish in 1 ms
        await pair.link_a.read(
            js({"region": "r", "spans": [[0, size]]}), [memoryview(mine)], timeout=0.001
        )
    snapshot = bytes(mine)
    got = bytearray(size)
    await pair.link_a.read(js({"region": "r", "spans": [[0, size]]}), [memoryview(got)], timeout=20)
    assert got == pair.hb.regions["r"]
    assert bytes(mine) == snapshot


# ---------------------------------------------------------------- broken links, close


async def test_peer_close_fails_pending_ops_promptly(pair: Pair) -> None:
    task = asyncio.create_task(pair.link_a.read(js({"hang": True}), [], timeout=30))
    await pair.hb.hanging.wait()
    t0 = time.monotonic()
    await pair.link_b.aclose()
    with pytest.raises(LLMException) as info:
        await task
    assert info.value.status_code == Code.LLM_LINK_FAILED
    assert time.monotonic() - t0 < 2
    assert pair.link_a.broken
    assert pair.link_b.broken
    assert pair.a.links() == []
    assert pair.b.links() == []
    assert pair.lost_a == [pair.link_a]
    assert pair.lost_b == [pair.link_b]
    with pytest.raises(LLMException) as info:
        await pair.link_a.read(js({}), [], timeout=1)
    assert info.value.status_code == Code.LLM_LINK_FAILED
    assert pair.hb.hung_cancelled.is_set()


async def test_peer_dies_mid_transfer() -> None:
    """A peer sends half a payload and vanishes: LLM_LINK_FAILED at once, link broken."""
    finished = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await fake_peer_hello(reader, writer)
        h = wire.decode_header(await reader.readexactly(wire.HEADER_SIZE))
        await reader.readexactly(h.meta_len)
        writer.write(wire.encode_frame(FrameType.READ_RESP, h.req_id, size=h.size))
        writer.write(wire.encode_frame(FrameType.DATA, h.req_id, size=h.size))
        writer.write(b"\xab" * (h.size // 2))
        await writer.drain()
        writer.transport.abort()
        finished.set()

    async with fake_peer(serve) as port:
        client = TcpTransport(1, FakeHandler())
        try:
            link = await client.connect(HOST, port, timeout=5)
            assert link.peer.cluster_id == 9
            t0 = time.monotonic()
            with pytest.raises(LLMException) as info:
                await link.read(js({}), [memoryview(bytearray(64 * KIB))], timeout=30)
            assert info.value.status_code == Code.LLM_LINK_FAILED
            assert time.monotonic() - t0 < 2
            assert link.broken
            assert client.links() == []
            await finished.wait()
        finally:
            await client.aclose()


@pytest.mark.parametrize("stall", [False, True], ids=["trickle", "stall"])
async def test_slow_peer_mid_chunk(stall: bool) -> None:
    """A chunk arriving in dribs completes; one that stops half-way times out, no hang."""
    size = 1 * MIB
    payload = random.Random(7).randbytes(size)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await fake_peer_hello(reader, writer)
        h = wire.decode_header(await reader.readexactly(wire.HEADER_SIZE))
        await reader.readexactly(h.meta_len)
        writer.write(wire.encode_frame(FrameType.READ_RESP, h.req_id, size=size))
        writer.write(wire.encode_frame(FrameType.DATA, h.req_id, size=size))
        for off in range(0, size // 2 if stall else size, 32 * KIB):
            writer.write(payload[off : off + 32 * KIB])
            await writer.drain()
            await asyncio.sleep(0.001)
        await reader.read()  # keep the connection open until the client leaves

    async with fake_peer(serve) as port:
        client = TcpTransport(1, FakeHandler())
        try:
            link = await client.connect(HOST, port, timeout=5)
            got = bytearray(size)
            if stall:
                with pytest.raises(LLMException) as info:
                    await link.read(js({}), [memoryview(got)], timeout=0.5)
                assert info.value.status_code == Code.LLM_TIMEOUT
            else:
                await link.read(js({}), [memoryview(got)], timeout=10)
                assert got == payload
        finally:
            await client.aclose()


def _misbehave_read(kind: str, rid: int, size: int) -> bytes:
    if kind == "wrong-size":
        return wire.encode_frame(FrameType.READ_RESP, rid, size=size + 1)
    if kind == "unknown-status":
        return wire.encode_frame(FrameType.READ_RESP, rid, status=12345)
    # "too-much-data": the grant matches, then one byte more than that arrives
    return (
        wire.encode_frame(FrameType.READ_RESP, rid, size=size)
        + wire.encode_frame(FrameType.DATA, rid, size=size + 1)
        + b"\xee" * (size + 1)
    )


@pytest.mark.parametrize(
    ("kind", "code"),
    [
        ("wrong-size", Code.LLM_PARAM_INVALID),
        ("unknown-status", Code.LLM_FAILED),
        ("too-much-data", Code.LLM_PARAM_INVALID),
        ("early-write-done", Code.LLM_FAILED),
    ],
)
async def test_misbehaving_peer_cannot_fool_the_requester(kind: str, code: Code) -> None:
    """Replies that contradict the request fail it; nothing lands in our buffers."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await fake_peer_hello(reader, writer)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                h = wire.decode_header(await reader.readexactly(wire.HEADER_SIZE))
                await reader.readexactly(h.meta_len + (h.size if h.type is FrameType.DATA else 0))
                if h.type is FrameType.READ_REQ:
                    writer.write(_misbehave_read(kind, h.req_id, h.size))
                elif h.type is FrameType.WRITE_REQ:  # "landed" before a byte was sent
                    writer.write(wire.encode_frame(FrameType.WRITE_GRANT, h.req_id))
                    writer.write(wire.encode_frame(FrameType.WRITE_DONE, h.req_id))

    async with fake_peer(serve) as port:
        client = TcpTransport(1, FakeHandler())
        try:
            link = await client.connect(HOST, port, timeout=5)
            buf = bytearray(b"\0" * 100)
            op = link.write if kind == "early-write-done" else link.read
            with pytest.raises(LLMException) as info:
                await op(b"", [memoryview(buf)], timeout=5)
            assert info.value.status_code == code
            assert buf == b"\0" * 100
            assert not link.broken
        finally:
            await client.aclose()


@pytest.mark.parametrize(
    "grant",
    [
        "not a grant",
        Grant(0xDEAD),  # type: ignore[arg-type]
        Grant(Code.LLM_SUCCESS, [object()]),  # type: ignore[list-item]
        Grant(Code.LLM_SUCCESS, [memoryview(b"read-only")]),  # a write grant must be writable
    ],
    ids=["not-a-grant", "unknown-status", "not-a-buffer", "read-only"],
)
async def test_broken_grants_are_refused(grant: Any) -> None:
    class Bad:
        async def grant_read(self, peer: PeerInfo, meta: dict[str, Any]) -> Any:
            return grant

        async def grant_write(self, peer: PeerInfo, meta: dict[str, Any], nbytes: int) -> Any:
            return grant

    server = TcpTransport(2, Bad())
    client = TcpTransport(1, FakeHandler())
    try:
        link = await client.connect(HOST, (await server.listen(HOST, 0))[1], timeout=5)
        with pytest.raises(LLMException) as info:
            await link.write(js({}), [memoryview(bytearray(9))], timeout=5)
        assert info.value.status_code == Code.LLM_FAILED
        assert not link.broken
    finally:
        await client.aclose()
        await server.aclose()


async def test_oversized_chunk_breaks_the_link() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await fake_peer_hello(reader, writer)
        h = wire.decode_header(await reader.readexactly(wire.HEADER_SIZE))
        writer.write(
            wire.HEADER.pack(wire.MAGIC, wire.VERSION, FrameType.DATA, 0, 0, 0, h.req_id, 2**40)
        )
        with contextlib.suppress(Exception):
            await reader.read()

    async with fake_peer(serve) as port:
        lost: list[Link] = []
        client = TcpTransport(1, FakeHandler(), on_link_lost=lost.append)
        try:
            link = await client.connect(HOST, port, timeout=5)
            with pytest.raises(LLMException) as info:
                await link.read(js({}), [memoryview(bytearray(10))], timeout=5)
            assert info.value.status_code == Code.LLM_LINK_FAILED
            assert link.broken
            assert lost == [link]
        finally:
            await client.aclose()


async def test_a_plane_grant_to_a_plain_request_fails_only_that_request() -> None:
    """A link whose plane offered nothing (plain TCP) never moves a plane grant: the
    request fails LLM_PARAM_INVALID, nothing lands, the link stays up."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await fake_peer_hello(reader, writer)
        h = wire.decode_header(await reader.readexactly(wire.HEADER_SIZE))
        await reader.readexactly(h.meta_len)
        # a greeting of some plane, then its grant of our plain READ_REQ
        writer.write(wire.encode_frame(FrameType.PLANE_HELLO, meta=b"\x04rdma", size=64))
        grant = bytes(8 + 8 + 16)
        writer.write(wire.encode_frame(FrameType.PLANE_GRANT, h.req_id, meta=grant, size=10))
        with contextlib.suppress(Exception):
            await reader.read()

    async with fake_peer(serve) as port:
        client = TcpTransport(1, FakeHandler())
        try:
            link = await client.connect(HOST, port, timeout=5)
            into = bytearray(b"x" * 10)
            with pytest.raises(LLMException) as info:
                await link.read(js({}), [memoryview(into)], timeout=5)
            assert info.value.status_code == Code.LLM_PARAM_INVALID
            assert into == b"x" * 10
            assert not link.broken
        finally:
            await client.aclose()


async def test_aclose_fails_pending_and_leaves_nothing_behind() -> None:
    before = asyncio.all_tasks()
    async with make_pair() as p:
        pending = asyncio.create_task(p.link_a.read(js({"hang": True}), [], timeout=30))
        incoming = asyncio.create_task(p.link_b.write(js({"hang": True}), [], timeout=30))
        await p.hb.hanging.wait()
        await p.ha.hanging.wait()
        sockets = [link._sock for link in (p.link_a, p.link_b)]  # type: ignore[attr-defined]
        await p.a.aclose()
        for task in (pending, incoming):
            with pytest.raises(LLMException) as info:
                await task
            assert info.value.status_code == Code.LLM_LINK_FAILED
        await p.b.aclose()
        assert p.a.links() == []
        assert p.b.links() == []
        assert all(s.fileno() == -1 for s in sockets)
        with pytest.raises(LLMException) as info:
            await p.a.connect(HOST, 1, timeout=1)
        assert info.value.status_code == Code.LLM_LINK_FAILED
    assert asyncio.all_tasks() == before


# ------------------------------------------------------------------ connect and auth


async def test_auth_with_the_same_secret() -> None:
    async with make_pair(secret_a=b"s3cret", secret_b=b"s3cret") as p:
        await assert_reads(p.link_a, p.hb.regions, b"secret data")


@pytest.mark.parametrize(
    ("client_secret", "server_secret"),
    [(b"wrong", b"right"), (None, b"right"), (b"right", None)],
    ids=["wrong-secret", "client-lacks-secret", "server-lacks-secret"],
)
async def test_auth_failures(client_secret: bytes | None, server_secret: bytes | None) -> None:
    accepted: list[Link] = []
    server = TcpTransport(2, FakeHandler(), secret=server_secret, on_link=accepted.append)
    client = TcpTransport(1, FakeHandler(), secret=client_secret)
    try:
        port = (await server.listen(HOST, 0))[1]
        with pytest.raises(LLMException) as info:
            await client.connect(HOST, port, timeout=5)
        assert info.value.status_code == Code.LLM_LINK_FAILED
        assert client.links() == []
        # The server never adopts an unauthenticated peer; give it a moment to decide.
        await asyncio.sleep(0.05)
        assert accepted == []
        assert server.links() == []
    finally:
        await client.aclose()
        await server.aclose()


async def test_connect_refused_and_silent_server() -> None:
    client = TcpTransport(1, FakeHandler())
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        free_port = probe.getsockname()[1]
    silent = socket.create_server((HOST, 0))  # accepts at kernel level, never answers
    try:
        with pytest.raises(LLMException) as info:
            await client.connect(HOST, free_port, timeout=5)
        assert info.value.status_code == Code.LLM_LINK_FAILED
        t0 = time.monotonic()
        with pytest.raises(LLMException) as info:
            await client.connect(HOST, silent.getsockname()[1], timeout=0.2)
        assert info.value.status_code == Code.LLM_TIMEOUT
        assert time.monotonic() - t0 < 2
    finally:
        silent.close()
        await client.aclose()


async def test_server_drops_silent_handshakes() -> None:
    server = TcpTransport(2, FakeHandler(), handshake_timeout=0.1)
    try:
        port = (await server.listen(HOST, 0))[1]
        reader, writer = await asyncio.open_connection(HOST, port)
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed on us
        writer.close()
        await writer.wait_closed()
    finally:
        await server.aclose()


async def test_version_mismatch_is_refused() -> None:
    server = TcpTransport(2, FakeHandler())
    try:
        port = (await server.listen(HOST, 0))[1]
        reader, writer = await asyncio.open_connection(HOST, port)
        hdr = bytearray(wire.encode_frame(FrameType.HELLO))
        hdr[4] = wire.VERSION + 1
        writer.write(bytes(hdr))
        # one ERROR frame of this side's version (its reason as meta), then the close
        answer = await asyncio.wait_for(reader.read(), 5)
        h = wire.decode_header(answer[: wire.HEADER_SIZE])
        assert h.type is FrameType.ERROR and len(answer) == wire.HEADER_SIZE + h.meta_len
        writer.close()
        await writer.wait_closed()
        assert server.links() == []
    finally:
        await server.aclose()


# --------------------------------------------------------------------------- registry


def test_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    assert get_transport("tcp") is TcpTransport
    assert issubclass(TcpTransport, Transport)
    assert "tcp" in transport_names()
    with pytest.raises(LLMException) as info:
        get_transport("carrier-pigeon")
    assert info.value.status_code == Code.LLM_PARAM_INVALID
    with pytest.raises(TypeError):
        get_transport(None)  # type: ignore[arg-type]
    # a backend whose module is missing: never a raw ImportError
    from aiokv import transport

    monkeypatch.setitem(transport._REGISTRY, "pigeon", "aiokv.transport._pigeon:PigeonTransport")
    with pytest.raises(LLMException) as info:
        get_transport("pigeon")
    assert info.value.status_code == Code.LLM_FEATURE_NOT_ENABLED


def test_constructor_checks() -> None:
    with pytest.raises(TypeError):
        TcpTransport("1", FakeHandler())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="out of range"):
        TcpTransport(-1, FakeHandler())
    with pytest.raises(ValueError, match="chunk_bytes"):
        TcpTransport(1, FakeHandler(), chunk_bytes=wire.MAX_CHUNK + 1)
    with pytest.raises(TypeError):
        TcpTransport(1, FakeHandler(), secret="text")  # type: ignore[arg-type]


# --------------------------------------------------------------- pre-auth hardening (#9)


def _frame_header(kind: FrameType, meta_len: int) -> bytes:
    return wire.HEADER.pack(wire.MAGIC, wire.VERSION, kind, 0, meta_len, 0, 0)


@pytest.mark.parametrize("secret", [None, b"s3cret"])
async def test_a_huge_first_frame_is_refused_before_any_allocation(secret: bytes | None) -> None:
    """A 30-byte header announcing a 512 MiB request meta as the first frame: the
    listener closes the connection without allocating it (issue #9, item 2)."""
    import tracemalloc

    server = TcpTransport(2, FakeHandler(), secret=secret)
    try:
        port = (await server.listen(HOST, 0))[1]
        tracemalloc.start()
        try:
            for kind in (FrameType.READ_REQ, FrameType.WRITE_REQ):
                reader, writer = await asyncio.open_connection(HOST, port)
                writer.write(_frame_header(kind, 512 << 20))
                assert await asyncio.wait_for(reader.read(), 5) == b""  # closed on us
                writer.close()
                await writer.wait_closed()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 16 << 20
        assert server.links() == []
    finally:
        await server.aclose()


async def test_a_hostile_server_cannot_make_the_client_allocate() -> None:
    """The connecting side checks the server's first frame the same way."""
    import tracemalloc

    client = TcpTransport(1, FakeHandler())
    loop = asyncio.get_running_loop()

    async def serve(conn: socket.socket) -> None:
        await loop.sock_sendall(conn, _frame_header(FrameType.READ_REQ, 512 << 20))
        await asyncio.sleep(2)

    async with serving_once(serve) as port:
        tracemalloc.start()
        try:
            with pytest.raises(LLMException) as info:
                await client.connect(HOST, port, timeout=5)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            await client.aclose()
    assert info.value.status_code == Code.LLM_LINK_FAILED
    assert peak < 16 << 20


async def test_a_malformed_mac_is_refused_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    """A lone surrogate as the MAC (valid JSON): refused with LLM_LINK_FAILED on the
    connecting side, and refused quietly by the listener (issue #9, item 12)."""
    bad = json.dumps({"cluster_id": 2, "nonce": "00" * 16, "mac": "\ud800"}).encode()
    # a listener answering HELLO with that MAC
    loop = asyncio.get_running_loop()

    async def serve(conn: socket.socket) -> None:
        await loop.sock_sendall(conn, _frame_header(FrameType.HELLO, len(bad)) + bad)
        await asyncio.sleep(2)

    client = TcpTransport(1, FakeHandler(), secret=b"s3cret")
    async with serving_once(serve) as port:
        try:
            with pytest.raises(LLMException) as info:
                await client.connect(HOST, port, timeout=5)
            assert info.value.status_code == Code.LLM_LINK_FAILED
        finally:
            await client.aclose()
    # a client sending that MAC in its AUTH frame
    server = TcpTransport(2, FakeHandler(), secret=b"s3cret")
    try:
        port = (await server.listen(HOST, 0))[1]
        reader, writer = await asyncio.open_connection(HOST, port)
        hello = json.dumps({"cluster_id": 1, "nonce": "00" * 16}).encode()
        writer.write(_frame_header(FrameType.HELLO, len(hello)) + hello)
        auth = json.dumps({"mac": "\ud800"}).encode()
        writer.write(_frame_header(FrameType.AUTH, len(auth)) + auth)
        with contextlib.suppress(ConnectionResetError):  # refused: EOF or a reset
            await asyncio.wait_for(reader.read(), 5)
        writer.close()
        with contextlib.suppress(ConnectionResetError):
            await writer.wait_closed()
        assert server.links() == []
    finally:
        await server.aclose()
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
