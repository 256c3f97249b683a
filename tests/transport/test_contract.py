"""The transport contract (``aiokv/transport/_base.py``), run over every registered transport.

One suite, parametrised over :func:`aiokv.transport.transport_names`: a new backend is
covered by adding it to the registry. ``tcp+tls`` runs it once more over TCP with TLS
(throwaway certificates made by the ``openssl`` command); ``tcp+now`` over TCP with
handlers that answer what needs no waiting from ``grant_now`` (served in the link's
reader, no task per request). Only the public interface is
used, with default constructor arguments, binding 127.0.0.1 with port 0. A fake cache
layer serves named bytearrays and records every ``Grant.done`` call. Every async test
runs on asyncio and on uvloop (``tests/conftest.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import math
import random
import time
import typing
from collections.abc import AsyncIterator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from _helpers import cancel_after
from _helpers import raises
from _helpers import tls_tcp_transport
from _helpers import until
from fake_handler import FakeHandler
from spans import KIB
from spans import ManyOps
from spans import Scatter
from spans import assert_reads
from spans import gather_spans
from spans import js
from spans import outside_spans
from spans import run_many_ops
from spans import views_of

from aiokv import LLMConfig
from aiokv._enums import LLMStatusCode as Code
from aiokv._errors import LLMException
from aiokv.transport import Link
from aiokv.transport import Transport
from aiokv.transport import get_transport
from aiokv.transport import transport_names

HOST = "127.0.0.1"
MIB = 1 << 20


# ---------------------------------------------------------------------------- fixtures


# name -> class, for the names that are not registered transports
_VARIANTS: dict[str, type[Transport]] = {}


def transport_class(name: str) -> type[Transport]:
    return _VARIANTS.get(name) or get_transport(name)


def _nixl_or_skip(name: str) -> None:
    """Skip a NIXL variant (with the reason) where NIXL is not installed."""
    try:
        get_transport("nixl")
    except LLMException as exc:
        pytest.skip(f"{name}: {exc}")
    if name == "nixl+reg" and name not in _VARIANTS:
        from nixl_reg import registering_nixl

        _VARIANTS[name] = registering_nixl()


@pytest.fixture(params=[*transport_names(), "tcp+tls", "nixl+reg", "tcp+memmove", "tcp+now"])
def name(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    if str(request.param).startswith("nixl"):
        _nixl_or_skip(request.param)
    if request.param == "tcp+now":  # handlers answering from grant_now: served in the reader
        _VARIANTS[request.param] = get_transport("tcp")
    if request.param == "tcp+memmove":
        from memmove_plane import MemmoveTransport

        _VARIANTS[request.param] = MemmoveTransport
    if request.param == "tcp+tls" and request.param not in _VARIANTS:
        _VARIANTS[request.param] = tls_tcp_transport(tmp_path_factory.mktemp("pki"))
    return str(request.param)


@dataclass
class Pair:
    a: Transport  # connects
    b: Transport  # listens
    ha: FakeHandler
    hb: FakeHandler
    link_a: Link
    link_b: Link
    address: tuple[str, int]  # where B listens
    linked_a: list[Link]
    linked_b: list[Link]
    lost_a: list[Link]
    lost_b: list[Link]
    name: str = ""  # the transport variant


@contextlib.asynccontextmanager
async def make_pair(
    name: str,
    *,
    secret_a: bytes | None = None,
    secret_b: bytes | None = None,
    meta_a: int = 1 << 20,
    meta_b: int = 1 << 20,
) -> AsyncIterator[Pair]:
    cls = transport_class(name)
    now = name == "tcp+now"
    ha, hb = FakeHandler(now=now), FakeHandler(now=now)
    linked_a: list[Link] = []
    linked_b: list[Link] = []
    lost_a: list[Link] = []
    lost_b: list[Link] = []
    a = cls(1, ha, secret=secret_a, max_meta_bytes=meta_a)
    a.on_link, a.on_link_lost = linked_a.append, lost_a.append
    b = cls(2, hb, secret=secret_b, max_meta_bytes=meta_b)
    b.on_link, b.on_link_lost = linked_b.append, lost_b.append
    try:
        address = await b.listen(HOST, 0)
        link_a = await a.connect(*address, timeout=5)
        await until(lambda: bool(linked_b))
        pair = Pair(
            a, b, ha, hb, link_a, linked_b[0], address, linked_a, linked_b, lost_a, lost_b, name
        )
        yield pair
    finally:
        await a.aclose()
        await b.aclose()


@pytest.fixture
async def pair(name: str) -> AsyncIterator[Pair]:
    async with make_pair(name) as p:
        yield p


# ------------------------------------------------------------------- links and registry


def test_registered(name: str) -> None:
    assert issubclass(transport_class(name), Transport)  # registered names import


def test_config_names_every_transport() -> None:
    annotation = LLMConfig.model_fields["transfer_backend"].annotation
    assert set(typing.get_args(annotation)) == set(transport_names())


async def test_link_ends_know_each_other(pair: Pair) -> None:
    assert pair.address[0] == HOST and pair.address[1] > 0
    assert (pair.link_a.local_cluster_id, pair.link_a.peer.cluster_id) == (1, 2)
    assert (pair.link_b.local_cluster_id, pair.link_b.peer.cluster_id) == (2, 1)
    assert pair.link_a.peer.address == pair.address
    assert pair.linked_a == [pair.link_a] and pair.linked_b == [pair.link_b]
    assert pair.a.links() == [pair.link_a] and pair.b.links() == [pair.link_b]
    assert not pair.link_a.broken and not pair.link_b.broken
    # the handler learns who asks
    pair.hb.regions["r"] = bytearray(4)
    await pair.link_a.read(js({"spans": [[0, 4]]}), [memoryview(bytearray(4))], timeout=5)
    assert [p.cluster_id for p in pair.hb.peers] == [1]


async def test_listen_on_a_taken_address_fails(pair: Pair) -> None:
    third = type(pair.b)(3, FakeHandler())
    try:
        await raises(Code.LLM_LINK_FAILED, third.listen(*pair.address))
        fresh = await third.listen(HOST, 0)
        assert fresh != pair.address
    finally:
        await third.aclose()


async def test_connect_to_nobody_is_refused(name: str) -> None:
    cls = transport_class(name)
    gone = cls(2, FakeHandler())
    address = await gone.listen(HOST, 0)
    await gone.aclose()  # nothing listens there now
    client = cls(1, FakeHandler())
    try:
        t0 = time.monotonic()
        await raises(Code.LLM_LINK_FAILED, client.connect(*address, timeout=5))
        assert time.monotonic() - t0 < 2
        assert client.links() == []
    finally:
        await client.aclose()


async def test_connect_without_time_left_times_out(pair: Pair) -> None:
    client = type(pair.a)(3, FakeHandler())
    try:
        for seconds in (0, -1):
            await raises(Code.LLM_TIMEOUT, client.connect(*pair.address, timeout=seconds))
        assert client.links() == []
        link = await client.connect(*pair.address, timeout=5)  # then it links
        assert link.peer.cluster_id == 2 and client.links() == [link]
    finally:
        await client.aclose()


async def test_same_secret_links(name: str) -> None:
    async with make_pair(name, secret_a=b"s3cret", secret_b=b"s3cret") as p:
        await assert_reads(p.link_a, p.hb.regions, b"secret data")


@pytest.mark.parametrize(
    ("client_secret", "server_secret"),
    [(b"wrong", b"right"), (None, b"right"), (b"right", None), (b"", b"x")],
    ids=["wrong-secret", "client-lacks-secret", "server-lacks-secret", "empty-secret"],
)
async def test_secret_mismatch_is_refused(
    name: str, client_secret: bytes | None, server_secret: bytes | None
) -> None:
    cls = transport_class(name)
    accepted: list[Link] = []
    server = cls(2, FakeHandler(), secret=server_secret, on_link=accepted.append)
    client = cls(1, FakeHandler(), secret=client_secret)
    try:
        address = await server.listen(HOST, 0)
        await raises(Code.LLM_LINK_FAILED, client.connect(*address, timeout=5))
        assert client.links() == []
        await asyncio.sleep(0.05)  # the server never adopts the peer; give it a moment
        assert accepted == [] and server.links() == []
    finally:
        await client.aclose()
        await server.aclose()


# ---------------------------------------------------------------------- data integrity


async def test_read_scatter_gather_exact(pair: Pair, scatter: Scatter) -> None:
    src, src_spans, dst_spans = scatter.src, scatter.src_spans, scatter.dst_spans
    dst = bytearray(b"\x77") * scatter.dst_len
    pair.hb.regions["r"] = src
    before = bytes(src)
    meta = js({"spans": src_spans, "tag": "t"})
    await pair.link_a.read(meta, views_of(dst, dst_spans), timeout=20)
    assert gather_spans(dst, dst_spans) == gather_spans(src, src_spans)
    assert set(outside_spans(dst, dst_spans)) == {0x77}  # nothing landed in the gaps
    assert src == before  # a read never writes the granted buffers
    assert await pair.hb.done("t") is True
    assert pair.hb.calls["t"] == [True]


async def test_write_scatter_gather_exact(pair: Pair, scatter: Scatter) -> None:
    # the scatter fixture the other way round: the granted side is the destination
    src = bytearray(b"\x55") * scatter.dst_len
    src[:] = random.Random(2).randbytes(scatter.dst_len)
    src_before = bytes(src)
    dst = bytearray(scatter.src)
    dst_before = bytes(dst)
    pair.hb.regions["w"] = dst
    meta = js({"region": "w", "spans": scatter.src_spans, "tag": "w"})
    await pair.link_a.write(meta, views_of(src, scatter.dst_spans), timeout=20)
    # write() returns only once every byte landed: done(True) has run already
    assert pair.hb.calls["w"] == [True]
    assert gather_spans(dst, scatter.src_spans) == gather_spans(src, scatter.dst_spans)
    assert outside_spans(dst, scatter.src_spans) == outside_spans(dst_before, scatter.src_spans)
    assert src == src_before  # a write never writes its source


async def test_both_directions_on_one_link(pair: Pair) -> None:
    rng = random.Random(3)
    pair.ha.regions["r"] = bytearray(rng.randbytes(300 * KIB))
    pair.hb.regions["r"] = bytearray(rng.randbytes(300 * KIB))
    spans = [[0, 100 * KIB], [200 * KIB, 100 * KIB]]
    got_a, got_b = bytearray(200 * KIB), bytearray(200 * KIB)
    await asyncio.gather(
        pair.link_a.read(js({"spans": spans}), [memoryview(got_a)], timeout=10),
        pair.link_b.read(js({"spans": spans}), [memoryview(got_b)], timeout=10),
    )
    assert got_a == gather_spans(pair.hb.regions["r"], spans)
    assert got_b == gather_spans(pair.ha.regions["r"], spans)
    push_a, push_b = bytearray(rng.randbytes(200 * KIB)), bytearray(rng.randbytes(200 * KIB))
    await asyncio.gather(
        pair.link_a.write(js({"spans": spans}), [memoryview(push_a)], timeout=10),
        pair.link_b.write(js({"spans": spans}), [memoryview(push_b)], timeout=10),
    )
    assert gather_spans(pair.hb.regions["r"], spans) == push_a
    assert gather_spans(pair.ha.regions["r"], spans) == push_b


async def test_zero_bytes_and_any_format(pair: Pair) -> None:
    pair.hb.regions["r"] = bytearray(range(16))
    await pair.link_a.read(js({"spans": [], "tag": "r0"}), [], timeout=5)
    await pair.link_a.write(js({"spans": [], "tag": "w0"}), [], timeout=5)
    assert await pair.hb.done("r0") is True
    assert pair.hb.calls["w0"] == [True]
    words = memoryview(bytearray(16)).cast("I")  # 4 x uint32: 16 bytes
    await pair.link_a.read(js({"spans": [[0, 16]]}), [words], timeout=5)
    assert words.tobytes() == bytes(range(16))


@pytest.mark.parametrize("op", ["read", "write"])
async def test_big_transfer_lets_the_loop_run(pair: Pair, op: str) -> None:
    """64 MiB in one request: the loop keeps turning while the bytes move."""
    size = 64 * MIB
    pair.hb.regions["r"], mine = await asyncio.to_thread(
        lambda: (bytearray(size), bytearray(size))  # off the loop: it is timed for blocking
    )
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        for _ in range(1_000_000):  # bounded; cancelled once the transfer is over
            ticks += 1
            await asyncio.sleep(0)

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    try:
        method = pair.link_a.read if op == "read" else pair.link_a.write
        await method(js({"spans": [[0, size]]}), [memoryview(mine)], timeout=20)
        during = ticks
    finally:
        tick.cancel()
    assert during >= 8


async def test_200_concurrent_ops_do_not_mix(pair: Pair, many_ops: ManyOps) -> None:
    """200 reads (A from B) and writes (B into A) on one link, all in flight at once."""
    await run_many_ops(
        pair.link_a, pair.link_b, pair.ha.regions, pair.hb.regions, many_ops, op_timeout=30
    )
    for i in range(len(many_ops.sizes)):
        if i % 2:
            assert await pair.hb.done(i) is True
        else:
            assert pair.ha.calls[i] == [True]


# ------------------------------------------------------------------------ error codes


@pytest.mark.parametrize("op", ["read", "write"])
@pytest.mark.parametrize(
    ("meta", "code"),
    [
        ({"refuse": Code.LLM_KV_CACHE_NOT_EXIST}, Code.LLM_KV_CACHE_NOT_EXIST),
        ({"refuse": Code.LLM_FEATURE_NOT_ENABLED, "tag": "t"}, Code.LLM_FEATURE_NOT_ENABLED),
        ({"refuse": Code.LLM_PARAM_INVALID, "tag": "t"}, Code.LLM_PARAM_INVALID),
        ({"raise": Code.LLM_OUT_OF_MEMORY}, Code.LLM_OUT_OF_MEMORY),
        ({"raise": Code.LLM_KV_CACHE_NOT_EXIST}, Code.LLM_KV_CACHE_NOT_EXIST),
        ({"crash": True}, Code.LLM_FAILED),
        ({"bad": "not-a-grant"}, Code.LLM_FAILED),
        ({"bad": "unknown-status"}, Code.LLM_FAILED),
        ({"bad": "not-a-buffer"}, Code.LLM_FAILED),
    ],
    ids=[
        "refuse",
        "refuse-with-done",
        "refuse-param-invalid",
        "raise",
        "raise-not-exist",
        "foreign-error",
        "not-a-grant",
        "unknown-status",
        "not-a-buffer",
    ],
)
async def test_refusals_propagate(pair: Pair, op: str, meta: dict[str, Any], code: Code) -> None:
    buf = bytearray(b"\x11" * 8)
    method = pair.link_a.read if op == "read" else pair.link_a.write
    await raises(code, method(js(meta), [memoryview(buf)], timeout=5))
    assert buf == b"\x11" * 8
    if "tag" in meta:  # a refusing grant's done still runs, once, with False
        assert await pair.hb.done("t") is False
    assert not pair.link_a.broken
    await assert_reads(pair.link_a, pair.hb.regions, b"ok")  # the link still serves
    assert pair.hb.calls.get("t", [False]) == [False]


async def test_read_only_grant_for_a_write_is_refused(pair: Pair) -> None:
    meta = js({"bad": "read-only"})
    await raises(Code.LLM_FAILED, pair.link_a.write(meta, [memoryview(bytearray(9))], timeout=5))
    got = bytearray(9)  # a read may be served from read-only memory
    await pair.link_a.read(meta, [memoryview(got)], timeout=5)
    assert got == b"read-only"


async def test_size_mismatch_is_param_invalid(pair: Pair) -> None:
    pair.hb.regions["r"] = bytearray(b"x" * 100)
    mine = bytearray(b"\x22" * 49)
    meta = js({"spans": [[0, 50]], "tag": "read"})
    await raises(Code.LLM_PARAM_INVALID, pair.link_a.read(meta, [memoryview(mine)], timeout=5))
    assert await pair.hb.done("read") is False
    assert mine == b"\x22" * 49  # nothing received into a refused request
    meta = js({"spans": [[0, 50]], "tag": "write"})
    push = [memoryview(bytearray(b"y" * 51))]
    await raises(Code.LLM_PARAM_INVALID, pair.link_a.write(meta, push, timeout=5))
    assert await pair.hb.done("write") is False
    assert pair.hb.regions["r"] == b"x" * 100  # nothing sent into a refused request
    assert pair.hb.calls == {"read": [False], "write": [False]}
    got = bytearray(50)
    await pair.link_a.read(js({"spans": [[0, 50]]}), [memoryview(got)], timeout=5)
    assert got == b"x" * 50


@pytest.mark.parametrize("op", ["read", "write"])
async def test_bad_arguments_never_reach_the_peer(pair: Pair, op: str) -> None:
    method = pair.link_a.read if op == "read" else pair.link_a.write
    buf = [memoryview(bytearray(4))]
    for bad_meta in ([], {"region": "r"}, "text", bytearray(b"{}"), None):
        with pytest.raises(TypeError, match="meta must be bytes"):
            await method(bad_meta, buf, timeout=1)  # type: ignore[arg-type]
    for bad_bufs in ([object()], memoryview(bytearray(4)), bytearray(4), None, 7):
        with pytest.raises(TypeError):
            await method(js({}), bad_bufs, timeout=1)  # type: ignore[arg-type]
    for bad_timeout in (0, -1, math.nan, -math.inf):
        with pytest.raises(ValueError, match="timeout"):
            await method(js({}), buf, timeout=bad_timeout)
    for bad_type in ("1", None, True):
        with pytest.raises(TypeError, match="timeout"):
            await method(js({}), buf, timeout=bad_type)  # type: ignore[arg-type]
    strided = memoryview(bytearray(8))[::2]
    await raises(Code.LLM_PARAM_INVALID, method(js({}), [strided], timeout=1))
    if op == "read":  # bytes must be written into a read's buffers
        await raises(Code.LLM_PARAM_INVALID, method(js({}), [memoryview(b"ro")], timeout=1))
    over = b"x" * (pair.a.max_meta_bytes + 1)
    await raises(Code.LLM_PARAM_INVALID, method(over, buf, timeout=1))
    assert pair.hb.grants == 0  # none of these reached the peer
    assert not pair.link_a.broken


@pytest.mark.parametrize("op", ["read", "write"])
async def test_meta_caps(name: str, op: str) -> None:
    async with make_pair(name, meta_a=1000, meta_b=100) as p:
        method = p.link_a.read if op == "read" else p.link_a.write
        buf = [memoryview(bytearray(10))]
        p.hb.regions["r"] = bytearray(10)
        # under both caps: served
        await method(js({"spans": [[0, 10]], "pad": "x" * 40}), buf, timeout=5)
        assert p.hb.grants == 1
        # over the peer's cap only: refused, the peer's handler never sees it
        await raises(Code.LLM_PARAM_INVALID, method(js({"pad": "x" * 500}), buf, timeout=5))
        # over our own cap: never sent
        await raises(Code.LLM_PARAM_INVALID, method(js({"pad": "x" * 2000}), buf, timeout=5))
        assert p.hb.grants == 1
        assert not p.link_a.broken
        # a cap of exactly max_meta_bytes is allowed
        meta = js({"spans": [[0, 10]], "pad": ""})
        meta = js({"spans": [[0, 10]], "pad": "x" * (100 - len(meta))})
        assert len(meta) == 100
        await method(meta, buf, timeout=5)
        assert p.hb.grants == 2


# ------------------------------------------------------------- time and cancellation


@pytest.mark.parametrize("op", ["read", "write"])
async def test_timeout_while_the_peer_decides(pair: Pair, op: str) -> None:
    method = pair.link_a.read if op == "read" else pair.link_a.write
    t0 = time.monotonic()
    await raises(
        Code.LLM_TIMEOUT, method(js({"hang": True}), [memoryview(bytearray(4))], timeout=0.2)
    )
    assert 0.15 < time.monotonic() - t0 < 2
    await asyncio.wait_for(pair.hb.hung_cancelled.wait(), 5)  # the peer stopped waiting too
    assert not pair.link_a.broken
    await assert_reads(pair.link_a, pair.hb.regions, b"ok")


@pytest.mark.parametrize("op", ["read", "write"])
async def test_late_grant_is_released(pair: Pair, op: str) -> None:
    """A handler that ignores cancellation and grants after the requester gave up: its
    grant is released with done(False), once, and its buffers never touched."""
    method = pair.link_a.read if op == "read" else pair.link_a.write
    region = pair.hb.regions["r"] = bytearray(b"\x33" * 64)
    mine = bytearray(b"\x44" * 64)
    meta = js({"stubborn": 0.3, "spans": [[0, 64]], "tag": "late"})
    await raises(Code.LLM_TIMEOUT, method(meta, [memoryview(mine)], timeout=0.1))
    assert await pair.hb.done("late") is False
    await asyncio.sleep(0.05)
    assert pair.hb.calls["late"] == [False]
    assert region == b"\x33" * 64 and mine == b"\x44" * 64
    assert not pair.link_a.broken


@pytest.mark.parametrize("op", ["read", "write"])
async def test_timeout_during_data_movement(pair: Pair, op: str) -> None:
    """Deadlines that may land before, during or after the bytes move: either outcome is
    whole (done once, True iff it returned), and a failed op's buffer is left alone."""
    size = 16 * MIB
    region = pair.hb.regions["r"] = bytearray(random.Random(6).randbytes(size))
    method = pair.link_a.read if op == "read" else pair.link_a.write
    outcomes = set()
    for i, seconds in enumerate([0.0005, 0.001, 0.002, 0.004, 0.008, 0.03, 10]):
        mine = bytearray(b"\x66") * size
        tag = f"t{i}"
        try:
            await method(
                js({"spans": [[0, size]], "tag": tag}), [memoryview(mine)], timeout=seconds
            )
            code = Code.LLM_SUCCESS
        except LLMException as exc:
            code = exc.status_code
        assert code in (Code.LLM_SUCCESS, Code.LLM_TIMEOUT)
        ok = code == Code.LLM_SUCCESS
        outcomes.add(code)
        snapshot = bytes(mine)
        if tag in pair.hb.calls or ok:  # the peer granted: it learns how the op ended
            landed = await pair.hb.done(tag)
            # a pull counts as done exactly when read() returned; a push may land just
            # before the deadline cuts off its confirmation
            assert landed is ok if op == "read" else (landed or not ok)
        if op == "read" and ok:
            assert mine == region
        check = bytearray(size)  # a round trip: late bytes would have landed by now
        await pair.link_a.read(js({"spans": [[0, size]]}), [memoryview(check)], timeout=20)
        assert bytes(mine) == snapshot
        assert len(pair.hb.calls.get(tag, [ok])) == 1
        if op == "write":
            if ok:
                assert check == b"\x66" * size
            region[:] = b"\0" * size  # a timed-out push may have half-landed
    assert Code.LLM_SUCCESS in outcomes
    assert not pair.link_a.broken


@pytest.mark.parametrize("op", ["read", "write"])
async def test_cancel_while_the_peer_decides(pair: Pair, op: str) -> None:
    method = pair.link_a.read if op == "read" else pair.link_a.write
    task = asyncio.create_task(method(js({"hang": True}), [memoryview(bytearray(4))], timeout=30))
    await asyncio.wait_for(pair.hb.hanging.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(pair.hb.hung_cancelled.wait(), 5)
    # a stubborn handler grants anyway: released at once, never used
    pair.hb.hanging.clear()
    pair.hb.regions["r"] = bytearray(b"\x33" * 4)
    mine = bytearray(b"\x44" * 4)
    meta = js({"stubborn": 0.1, "spans": [[0, 4]], "tag": "late"})
    task = asyncio.create_task(method(meta, [memoryview(mine)], timeout=30))
    await asyncio.wait_for(pair.hb.hanging.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await pair.hb.done("late") is False
    assert pair.hb.calls["late"] == [False]
    assert pair.hb.regions["r"] == b"\x33" * 4 and mine == b"\x44" * 4
    assert not pair.link_a.broken and not pair.link_b.broken


@pytest.mark.parametrize("op", ["read", "write"])
async def test_cancel_at_every_step_of_a_transfer(pair: Pair, op: str) -> None:
    """Cancel a 12 MiB transfer after 0, 1, 2, ... loop steps: before the request, while
    the peer grants, while the bytes move, after. Each time the grant (if any) ends once,
    with True exactly when a read returned; the buffer is never touched afterwards; the
    link stays usable."""
    rng = random.Random(5)
    size = 12 * MIB
    region = pair.hb.regions["r"] = bytearray(rng.randbytes(size))
    method = pair.link_a.read if op == "read" else pair.link_a.write
    seen = {"cancelled": 0, "released": 0, "completed": 0}
    for steps in [0, 1, 2, 3, 4, 5, 6, 8, 10, 13, 16, 24, 32, 64]:
        tag = f"{op}{steps}"
        mine = bytearray(rng.randbytes(size))
        meta = js({"spans": [[0, size]], "tag": tag})
        task = await cancel_after(method(meta, [memoryview(mine)], timeout=20), steps)
        snapshot = bytes(mine)
        seen["cancelled" if task.cancelled() else "completed"] += 1
        if tag in pair.hb.calls:  # the peer granted: it learns how the op ended
            ok = await pair.hb.ended_as(tag, op, task)
            seen["released"] += not ok
        check = bytearray(size)
        await pair.link_a.read(js({"spans": [[0, size]]}), [memoryview(check)], timeout=20)
        assert check == region
        assert bytes(mine) == snapshot  # never touched after the op ended
        assert all(len(calls) <= 1 for calls in pair.hb.calls.values())
        assert len(pair.hb.calls.get(tag, [None])) == 1
        if op == "write":
            region[:] = check  # a cancelled push may have half-landed
    assert seen["cancelled"] and seen["released"]  # some landed mid-way
    assert not pair.link_a.broken and not pair.link_b.broken
    assert pair.a.links() == [pair.link_a]


# ----------------------------------------------------------------- broken links, close


@pytest.mark.parametrize("closer", ["peer-link", "own-link", "peer-transport"])
async def test_closing_fails_pending_ops(pair: Pair, closer: str) -> None:
    pending = [
        asyncio.create_task(pair.link_a.read(js({"hang": True}), [], timeout=30)),
        asyncio.create_task(pair.link_a.write(js({"hang": True}), [], timeout=30)),
    ]
    await until(lambda: pair.hb.grants == 2)  # both requests reached the handler
    t0 = time.monotonic()
    if closer == "peer-link":
        await pair.link_b.aclose()
    elif closer == "own-link":
        await pair.link_a.aclose()
    else:
        await pair.b.aclose()
    for task in pending:
        await raises(Code.LLM_LINK_FAILED, task)
    assert time.monotonic() - t0 < 2
    await until(lambda: pair.link_a.broken and pair.link_b.broken)
    assert pair.lost_a == [pair.link_a] and pair.lost_b == [pair.link_b]  # once per side
    assert pair.a.links() == [] and pair.b.links() == []
    # each end says why, for a person: the closing end its own close, the other its peer's
    closing, other = (
        (pair.link_a, pair.link_b) if closer == "own-link" else (pair.link_b, pair.link_a)
    )
    assert closing.why_broken in ("closed locally", "transport closed")
    assert "closed by peer" in other.why_broken
    await asyncio.wait_for(pair.hb.hung_cancelled.wait(), 5)
    for link in (pair.link_a, pair.link_b):
        await raises(Code.LLM_LINK_FAILED, link.read(js({}), [], timeout=1))
        await raises(Code.LLM_LINK_FAILED, link.write(js({}), [], timeout=1))
        await link.aclose()  # idempotent
    assert pair.lost_a == [pair.link_a] and pair.lost_b == [pair.link_b]


@pytest.mark.parametrize("steps", [0, 2, 5])
@pytest.mark.parametrize("op", ["read", "write"])
async def test_peer_loss_mid_transfer(pair: Pair, op: str, steps: int) -> None:
    """The peer closes its end ``steps`` loop steps after granting a big transfer: the op
    fails with LLM_LINK_FAILED (unless it just finished), the grant ends once, with False
    if the op failed; the buffer is never touched afterwards."""
    size = 32 * MIB
    region, mine = await asyncio.to_thread(  # off the loop: it is timed for blocking
        lambda: (bytearray(b"\xab") * size, bytearray(b"\xcd") * size)
    )
    pair.hb.regions["r"] = region
    method = pair.link_a.read if op == "read" else pair.link_a.write
    granted = asyncio.Event()
    base = pair.hb._done

    def done_spy(tag: Any) -> Callable[[bool], None]:
        granted.set()
        return base(tag)

    pair.hb._done = done_spy  # type: ignore[method-assign]
    meta = js({"spans": [[0, size]], "tag": "t"})
    task = asyncio.create_task(method(meta, [memoryview(mine)], timeout=20))
    await asyncio.wait_for(granted.wait(), 5)
    for _ in range(steps):
        await asyncio.sleep(0)
    await pair.link_b.aclose()
    with contextlib.suppress(LLMException):
        await task
    failed = task.exception()
    if failed is None:  # it finished first: the grant saw it land
        assert steps and await pair.hb.done("t") is True
    else:
        assert isinstance(failed, LLMException) and failed.status_code == Code.LLM_LINK_FAILED
        if op == "read":  # for a push, the last bytes may land as the confirmation is lost
            assert await pair.hb.done("t") is False
    snapshot = await asyncio.to_thread(lambda: (bytes(mine), bytes(region)))
    await asyncio.sleep(0.05)
    after = await asyncio.to_thread(lambda: (bytes(mine), bytes(region)))
    assert after == snapshot  # nothing moves after the op ended
    assert len(pair.hb.calls["t"]) == 1
    await until(lambda: pair.link_a.broken)
    assert pair.lost_a == [pair.link_a]


async def test_aclose_leaves_nothing_running(name: str) -> None:
    async with make_pair(name) as p:
        pending = asyncio.create_task(p.link_a.read(js({"hang": True}), [], timeout=30))
        incoming = asyncio.create_task(p.link_b.write(js({"hang": True}), [], timeout=30))
        await asyncio.wait_for(p.hb.hanging.wait(), 5)
        await asyncio.wait_for(p.ha.hanging.wait(), 5)
        await p.a.aclose()
        assert p.ha.hung_cancelled.is_set()  # A's handler task ended before aclose returned
        for task in (pending, incoming):
            await raises(Code.LLM_LINK_FAILED, task)
        await p.b.aclose()
        assert asyncio.all_tasks() == {asyncio.current_task()}  # nothing left running
        assert p.a.links() == [] and p.b.links() == []
        assert p.lost_a == [p.link_a] and p.lost_b == [p.link_b]
        await raises(Code.LLM_LINK_FAILED, p.a.connect(*p.address, timeout=1))
        await raises(Code.LLM_LINK_FAILED, p.a.listen(HOST, 0))
        await p.a.aclose()  # idempotent
    assert asyncio.all_tasks() == {asyncio.current_task()}
    again = transport_class(name)(3, FakeHandler())  # the address is free again
    try:
        assert await again.listen(*p.address) == p.address
    finally:
        await again.aclose()


# ---------------------------------------------------------------------- liveness probes


async def test_probe_answers_while_alive_and_fails_once_broken(pair: Pair) -> None:
    grants = pair.hb.grants
    assert await pair.link_a.probe(5) and await pair.link_b.probe(5)
    results = await asyncio.gather(*(pair.link_a.probe(5) for _ in range(20)))
    assert results == [True] * 20  # several at once, each answered
    # a probe is neither a request nor a payload: the handler never hears of it
    assert pair.hb.grants == grants and not pair.link_a.broken
    # it works alongside a request the peer has not answered yet
    hung = asyncio.create_task(pair.link_a.read(js({"hang": True}), [], timeout=30))
    await until(lambda: pair.hb.grants == grants + 1)
    assert await pair.link_a.probe(5)
    hung.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await hung
    for bad, exc in [(0, ValueError), (-1, ValueError), (float("inf"), ValueError)]:
        with pytest.raises(exc):
            await pair.link_a.probe(bad)
    for wrong in [None, "1", True]:
        with pytest.raises(TypeError):
            await pair.link_a.probe(wrong)  # type: ignore[arg-type]
    await pair.link_b.aclose()
    t0 = time.monotonic()
    assert not await pair.link_a.probe(5)  # broken now or as it waits: no 5 s wait
    assert not await pair.link_b.probe(5)
    assert time.monotonic() - t0 < 2


# ------------------------------------------------------------------ revoking a grant


@pytest.mark.parametrize("is_read", [True, False], ids=["read", "write"])
async def test_grant_revoked_before_it_is_answered(pair: Pair, is_read: bool) -> None:
    pair.hb.regions["r"] = region = bytearray(1024)
    meta = js({"spans": [[0, 1024]], "tag": "t", "abort_first": Code.LLM_KV_CACHE_NOT_EXIST})
    buf = memoryview(bytearray(b"\x07" * 1024))
    op = pair.link_a.read if is_read else pair.link_a.write
    await raises(Code.LLM_KV_CACHE_NOT_EXIST, op(meta, [buf], timeout=5))
    assert await pair.hb.done("t") is False
    assert pair.hb.calls["t"] == [False] and region == bytearray(1024)
    await pair.link_a.read(js({"spans": [[0, 4]]}), [buf[:4]], timeout=5)  # link still usable


def _fill(buf: bytearray, byte: int) -> None:
    """memset: a ctypes call, which lets go of the GIL (a Python-level fill of 64 MiB holds
    it, and the event loop with it, for up to a second on a loaded machine)."""
    ctypes.memset((ctypes.c_char * len(buf)).from_buffer(buf), byte, len(buf))


@pytest.mark.parametrize("is_read", [True, False], ids=["read", "write"])
async def test_grant_revoked_mid_transfer(pair: Pair, is_read: bool) -> None:
    """``Grant.abort`` while the bytes move: the requester fails with the code, ``done``
    runs once with False before abort returns, and the granted memory is never touched
    again (a marker written right after abort survives)."""
    n = 64 * MIB
    # off the loop: bytearray(n) zeroes its 64 MiB (a memset that has taken 0.5 s under
    # CI load), and this test is timed for blocking; byte 0 tells when bytes move
    region, mine = await asyncio.to_thread(lambda: (bytearray(n), bytearray(n)))
    pair.hb.regions["r"] = region
    (region if is_read else mine)[0] = 1
    meta = js({"spans": [[0, n]], "tag": "t"})
    op = pair.link_a.read if is_read else pair.link_a.write
    task = asyncio.create_task(op(meta, [memoryview(mine)], timeout=30))
    # abort as the first bytes move
    for _ in range(200_000):
        if (mine[0] if is_read else region[0]) or task.done():
            break
        await asyncio.sleep(0)
    assert not task.done(), "the transfer ended before it could be revoked"
    pair.hb.granted["t"].abort(Code.LLM_TIMEOUT)
    assert pair.hb.calls["t"] == [False]  # synchronously, before abort returned
    if pair.name == "nixl+reg" and not is_read:
        # a one-sided NIXL WRITE the peer already posted cannot be stopped from here: it
        # stops when the pusher hears of the revocation (docs/security.md, NIXL); from
        # then on, nothing lands
        await raises(Code.LLM_TIMEOUT, task)
    await asyncio.to_thread(_fill, region, 0x5A)  # the memory is the owner's again
    await raises(Code.LLM_TIMEOUT, task)
    pair.hb.granted["t"].abort(Code.LLM_FAILED)  # idempotent
    await asyncio.sleep(0.05)
    assert pair.hb.calls["t"] == [False]
    landed = await asyncio.to_thread(region.count, 0x5A)  # 64 MiB: off the loop too
    assert landed == n, "bytes landed after the grant was revoked"
    small = bytearray(4)
    await pair.link_a.read(js({"spans": [[0, 4]]}), [memoryview(small)], timeout=5)
    assert small == b"\x5a" * 4  # the link stays usable


async def test_grant_abort_after_done_is_a_no_op(pair: Pair) -> None:
    pair.hb.regions["r"] = bytearray(b"abcd")
    got = bytearray(4)
    await pair.link_a.read(js({"spans": [[0, 4]], "tag": "t"}), [memoryview(got)], timeout=5)
    assert await pair.hb.done("t") is True
    pair.hb.granted["t"].abort(Code.LLM_FAILED)
    assert pair.hb.calls["t"] == [True] and got == b"abcd"
