"""The TCP data path over :class:`~aiokv._layout.LayoutViews`: payload moved by address
(``readv`` / ``writev`` over numpy rows on a plain socket; a chunk's views at a time over
TLS), exact bytes, cancellation at every step, and no Python object per block.

Every async test runs on asyncio and on uvloop (see ``tests/conftest.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import json
import random
import socket
import time
import tracemalloc
from collections.abc import AsyncIterator
from collections.abc import Awaitable
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import numpy as np
import pytest
from _helpers import cancel_after
from _helpers import tls_tcp_transport

from aiokv._enums import LLMStatusCode as Code
from aiokv._layout import ByteLayout
from aiokv._layout import LayoutViews
from aiokv.transport import Grant
from aiokv.transport import Link
from aiokv.transport import PeerInfo
from aiokv.transport.tcp import TcpTransport
from aiokv.transport.tcp import _io as tcp_io
from aiokv.transport.tcp import _writer as tcp_writer
from aiokv.transport.tcp._ops import RunCursor
from aiokv.transport.tcp._ops import cursor_of

HOST = "127.0.0.1"
KIB, MIB = 1 << 10, 1 << 20


def _blocks(rng: random.Random, count: int, space: int) -> np.ndarray:
    """``count`` distinct block indices out of ``space``, shuffled, a few neighbours kept
    (so some runs merge)."""
    picked = rng.sample(range(space), count)
    return np.array(picked, dtype=np.int64)


def _gather(buf: bytes | bytearray, blocks: np.ndarray, block: int) -> bytes:
    return b"".join(bytes(buf[b * block : (b + 1) * block]) for b in blocks.tolist())


@dataclass
class RunsHandler:
    """Grants ``LayoutViews`` of ``region``: meta ``{"blocks": [...], "block": B}``;
    ``{"tag": t}`` records the grant's ``done``."""

    region: bytearray = field(default_factory=bytearray)
    done: dict[Any, asyncio.Future[bool]] = field(default_factory=dict)

    def _grant(self, raw: bytes) -> Grant:
        meta = json.loads(raw)
        layout = ByteLayout.of_blocks(np.array(meta["blocks"], dtype=np.int64), meta["block"])
        views = layout.views([memoryview(self.region)])
        assert isinstance(views, LayoutViews)
        fut = self.done.setdefault(
            meta.get("tag", object()), asyncio.get_running_loop().create_future()
        )

        def done(ok: bool) -> None:
            assert not fut.done(), "done called twice"
            fut.set_result(ok)

        return Grant(Code.LLM_SUCCESS, views, done)

    async def grant_read(self, peer: PeerInfo, meta: bytes) -> Grant:
        return self._grant(meta)

    async def grant_write(self, peer: PeerInfo, meta: bytes, nbytes: int) -> Grant:
        return self._grant(meta)


@dataclass
class Pair:
    a: TcpTransport
    b: TcpTransport
    hb: RunsHandler
    link: Link  # A's end


@contextlib.asynccontextmanager
async def make_pair(
    transport: type[TcpTransport] = TcpTransport, **kwargs: Any
) -> AsyncIterator[Pair]:
    hb = RunsHandler()
    a = transport(1, RunsHandler(), **kwargs)
    b = transport(2, hb, **kwargs)
    try:
        host, port = await b.listen(HOST, 0)
        link = await a.connect(host, port, timeout=5)
        yield Pair(a, b, hb, link)
    finally:
        await a.aclose()
        await b.aclose()


_TLS: dict[str, type[TcpTransport]] = {}


@pytest.fixture(params=["tcp", "tls"])
def transport(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    if request.param == "tcp":
        return TcpTransport
    if "tls" not in _TLS:
        _TLS["tls"] = tls_tcp_transport(tmp_path_factory.mktemp("pki"))
    return _TLS["tls"]


def _meta(blocks: np.ndarray, block: int, **extra: Any) -> bytes:
    return json.dumps({"blocks": blocks.tolist(), "block": block, **extra}).encode()


# ----------------------------------------------------------------------- exact bytes


@pytest.mark.parametrize("count", [8, 600])
@pytest.mark.parametrize("chunk", [4 * KIB + 7, 64 * KIB, 4 * MIB])
@pytest.mark.parametrize("op", ["read", "write"])
async def test_layout_views_move_exact_bytes(
    transport: Any, op: str, chunk: int, count: int
) -> None:
    """Scattered blocks on both ends (different orders, some runs merged), chunks that
    cut runs anywhere: every byte lands where it belongs, nothing else is touched. (A
    few views move as views, many by address: both paths.)"""
    rng = random.Random(chunk)
    block, space = 1 * KIB + 24, 1000
    async with make_pair(transport, chunk_bytes=chunk) as p:
        p.hb.region = bytearray(rng.randbytes(space * block))
        mine = bytearray(rng.randbytes(space * block))
        before_peer, before_mine = bytes(p.hb.region), bytes(mine)
        theirs_b = _blocks(rng, count, space)
        # a run of neighbours (merged into one run), then scattered blocks
        near = min(50, count // 2)
        mine_b = np.array([*range(10, 10 + near), *rng.sample(range(60, space), count - near)])
        assert isinstance(
            cursor_of(ByteLayout.of_blocks(mine_b, block).views([memoryview(mine)]), 0), RunCursor
        ) is (count > 32)
        views = ByteLayout.of_blocks(mine_b, block).views([memoryview(mine)])
        assert isinstance(views, LayoutViews)
        # plain TCP moves by address wherever libc's calls load; TLS never does
        by_address = tcp_io._CALLS is not None and transport is TcpTransport
        assert p.link._r._vec is by_address  # type: ignore[attr-defined]
        if op == "read":
            await p.link.read(_meta(theirs_b, block, tag=1), views, timeout=20)
            assert _gather(mine, mine_b, block) == _gather(before_peer, theirs_b, block)
            expect = bytearray(before_mine)
            for d, s in zip(mine_b.tolist(), theirs_b.tolist(), strict=True):
                expect[d * block : (d + 1) * block] = before_peer[s * block : (s + 1) * block]
            assert mine == expect
            assert p.hb.region == before_peer
        else:
            await p.link.write(_meta(theirs_b, block, tag=1), views, timeout=20)
            expect = bytearray(before_peer)
            for d, s in zip(theirs_b.tolist(), mine_b.tolist(), strict=True):
                expect[d * block : (d + 1) * block] = before_mine[s * block : (s + 1) * block]
            assert p.hb.region == expect
            assert mine == before_mine
        assert await asyncio.wait_for(p.hb.done[1], 5) is True


def test_run_cursor_hands_out_the_bytes_in_order() -> None:
    """Takes of any sizes cover the views' memory exactly once, in wire order."""
    rng = random.Random(3)
    buf = bytearray(rng.randbytes(64 * 100))
    blocks = np.array([5, 6, 7, 1, 40, 41, 2, 97], dtype=np.int64)
    views = ByteLayout.of_blocks(blocks, 64).views([memoryview(buf), memoryview(buf)[64:]])
    assert isinstance(views, LayoutViews)
    want = b"".join(bytes(v) for v in views)
    for trial in range(20):
        cur = RunCursor(views)
        got = b""
        while cur.remaining:
            n = min(cur.remaining, rng.randint(1, 200))
            if trial % 2:
                got += b"".join(bytes(v) for v in cur.take(n))
            else:
                rows = cur.take_rows(n)
                assert rows.dtype == np.uint64 and bool(rows[:, 1].all())
                assert int(rows[:, 1].sum()) == n
                got += b"".join(ctypes.string_at(a, k) for a, k in rows.tolist())
        assert got == want


def _seconds_per_take(rows: int) -> float:
    """Best time of one ``take_rows`` of 64 rows from a cursor over ``rows`` separate
    runs of 64 bytes (the first 200 takes; best of 5 cursors)."""
    buf = bytearray(2 * rows * 64)
    blocks = np.arange(0, 2 * rows, 2, dtype=np.int64)
    views = ByteLayout.of_blocks(blocks, 64).views([memoryview(buf)])
    best = float("inf")
    for _ in range(5):
        cur, takes = RunCursor(views), 0
        t0 = time.perf_counter()
        while cur.remaining and takes < 200:
            cur.take_rows(min(cur.remaining, 64 * 64))
            takes += 1
        best = min(best, (time.perf_counter() - t0) / takes)
    return best


def test_a_chunk_costs_the_same_whatever_the_block_count() -> None:
    """Taking a chunk's rows costs no more from a 131,072-run cursor than from a
    1,024-run one (a search of the whole list converted for each chunk measured 25x)."""
    small, large = _seconds_per_take(1024), _seconds_per_take(1 << 17)
    assert large < 5 * small, f"{large * 1e6:.1f} us vs {small * 1e6:.1f} us per chunk"


def test_plain_sockets_move_by_address() -> None:
    """The fast path is the one in use on this platform's plain sockets (never TLS)."""
    with socket.socket() as s:
        assert tcp_io.vectored(s) is (tcp_io._CALLS is not None)
    assert not tcp_io.vectored(object())


# ---------------------------------------------------------------------- cancellation


@pytest.mark.parametrize(
    ("chunk", "sockbuf"), [(16 * KIB, None), (1 * MIB, 32 * KIB)], ids=["small", "mid-chunk"]
)
@pytest.mark.parametrize("op", ["read", "write"])
async def test_cancel_at_every_step(
    transport: Any, op: str, chunk: int, sockbuf: int | None
) -> None:
    """Cancel a LayoutViews transfer after 0, 1, 2, ... loop steps: the caller's memory
    is never touched after the cancellation returns, the peer's grant learns how it
    ended (a pull is done exactly when it returned), the link stays usable."""
    rng = random.Random(11)
    block, count = 4 * KIB, 512
    async with make_pair(transport, chunk_bytes=chunk, sock_buf_bytes=sockbuf) as p:
        p.hb.region = bytearray(rng.randbytes(2 * count * block))
        theirs_b = np.array(rng.sample(range(2 * count), count), dtype=np.int64)
        for steps in range(0, 48, 3):
            tag = f"{op}{steps}"
            mine = bytearray(rng.randbytes(2 * count * block))
            mine_b = np.array(rng.sample(range(2 * count), count), dtype=np.int64)
            views = ByteLayout.of_blocks(mine_b, block).views([memoryview(mine)])
            method = p.link.read if op == "read" else p.link.write
            meta = _meta(theirs_b, block, tag=tag)
            task = await cancel_after(method(meta, views, timeout=20), steps)
            snapshot = bytes(mine)
            if tag in p.hb.done:
                ok = await asyncio.wait_for(p.hb.done[tag], 5)
                if op == "read":
                    assert ok is (not task.cancelled())
                else:
                    assert ok or task.cancelled()
            check = bytearray(2 * count * block)
            check_views = ByteLayout.of_blocks(theirs_b, block).views([memoryview(check)])
            region = bytes(p.hb.region)
            await p.link.read(_meta(theirs_b, block), check_views, timeout=20)
            assert _gather(check, theirs_b, block) == _gather(region, theirs_b, block)
            for _ in range(20):  # late DATA of the cancelled op is drained meanwhile
                await asyncio.sleep(0)
            assert bytes(mine) == snapshot
        assert not p.link.broken


def test_privatize_and_advance_rows() -> None:
    """The writer's row bookkeeping: a partial send moves the first unsent row on; a
    withdrawn batch is finished from a private copy (the source may change at once)."""
    src = bytearray(random.Random(2).randbytes(300))
    base = ctypes.addressof(ctypes.c_char.from_buffer(src))
    rows = np.array([[base, 100], [base + 150, 50], [base + 250, 50]], dtype=np.uint64)
    assert tcp_io.advance_rows(rows, 0, 0) == 0
    assert tcp_io.advance_rows(rows, 0, 30) == 0
    assert rows[0].tolist() == [base + 30, 70]
    assert tcp_io.advance_rows(rows, 0, 70 + 10) == 1
    assert rows[1].tolist() == [base + 160, 40]
    want = bytes(src[160:200] + src[250:300])
    copy = tcp_io.privatize(rows[1:])
    src[:] = bytes(300)  # the owner reuses its memory
    assert b"".join(ctypes.string_at(a, n) for a, n in rows[1:].tolist()) == want
    assert bytes(copy) == want
    assert tcp_io.advance_rows(rows, 1, 90) == 3


async def test_a_stream_withdrawn_mid_frame_is_finished_from_a_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pulls cancelled while the peer's chunk is half-sent: the peer's writer goes on
    from a private copy (its grant was released: that memory is not read again), the
    frame stays whole and the link keeps working, byte-exact."""
    rng = random.Random(12)
    block, count = 64 * KIB, 64
    privatized: list[int] = []
    real = tcp_io.privatize

    def spy(rows: np.ndarray) -> bytearray:
        privatized.append(len(rows))
        return real(rows)

    monkeypatch.setattr(tcp_writer, "privatize", spy)
    async with make_pair(chunk_bytes=4 * MIB, sock_buf_bytes=32 * KIB) as p:
        p.hb.region = bytearray(rng.randbytes(2 * count * block))
        blocks = np.array(rng.sample(range(2 * count), count), dtype=np.int64)
        for attempt in range(40):
            mine = bytearray(2 * count * block)
            views = ByteLayout.of_blocks(blocks, block).views([memoryview(mine)])
            task = asyncio.create_task(p.link.read(_meta(blocks, block), views, timeout=20))
            for _ in range(3 + attempt % 7):
                await asyncio.sleep(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            got = bytearray(2 * count * block)
            gv = ByteLayout.of_blocks(blocks, block).views([memoryview(got)])
            await p.link.read(_meta(blocks, block), gv, timeout=20)
            assert _gather(got, blocks, block) == _gather(p.hb.region, blocks, block)
            if privatized:
                break
        assert privatized, "no cancellation landed mid-frame"
        assert not p.link.broken


# ------------------------------------------------------------------ no per-block objects


@contextlib.asynccontextmanager
async def _scattered_pulls(
    count: int, block: int, seed: int
) -> AsyncIterator[tuple[Callable[[], Awaitable[None]], bytes]]:
    """A linked pair (4 MiB chunks) and a function pulling ``count`` blocks of ``block``
    bytes, every other block of the peer's region in random order, into as scattered
    blocks of a local buffer (new views each pull); yields it with the pull's meta."""
    rng = random.Random(seed)
    async with make_pair(chunk_bytes=4 * MIB) as p:
        p.hb.region = bytearray(2 * count * block)
        mine = bytearray(2 * count * block)
        theirs_b = np.array(rng.sample(range(0, 2 * count, 2), count), dtype=np.int64)
        mine_b = np.array(rng.sample(range(0, 2 * count, 2), count), dtype=np.int64)
        meta = _meta(theirs_b, block)

        async def pull() -> None:
            views = ByteLayout.of_blocks(mine_b, block).views([memoryview(mine)])
            await p.link.read(meta, views, timeout=60)

        yield pull, meta


async def _peak_bytes_per_block(count: int, block: int) -> float:
    """Peak traced Python heap over one pull of ``count`` scattered blocks, both ends in
    this process, per block."""
    async with _scattered_pulls(count, block, seed=count) as (pull, meta):
        await pull()  # warm
        gc.collect()
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            await pull()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        return (peak - base - len(meta)) / count


@pytest.mark.skipif(tcp_io._CALLS is None, reason="no readv/writev here: views are used")
async def test_a_pull_makes_no_python_object_per_block() -> None:
    """Both ends of a 16,384-block pull together peak at well under one memoryview
    (~190 bytes with its list slot) per block per side: only numpy rows and the block
    list's temporaries (~140 bytes for both sides; a view per block and side: ~720)."""
    per_block = await _peak_bytes_per_block(16384, 512)
    assert per_block < 300, f"{per_block:.0f} bytes of Python heap per block"


@pytest.mark.skipif(tcp_io._CALLS is None, reason="no readv/writev here: views are used")
async def test_no_full_collection_during_pulls() -> None:
    """Twenty consecutive 4,096-block pulls trigger no full (generation 2) collection."""
    full: list[int] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            full.append(1)

    async with _scattered_pulls(4096, 1 * KIB, seed=1) as (pull, _):
        await pull()
        gc.collect()
        gc.callbacks.append(on_gc)
        try:
            for _ in range(20):
                await pull()
        finally:
            gc.callbacks.remove(on_gc)
    assert not full, f"{len(full)} full collections in 20 pulls"
