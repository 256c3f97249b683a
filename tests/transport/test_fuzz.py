"""Fuzz the TCP transport: hostile bytes never crash it or write outside a grant.

A live server guards a writable region with guard bytes on both sides and serves a
read-only region of known content. Hundreds of raw connections throw thousands of
random and mutated frames at it: garbage, absurd lengths, ids and types, truncated
frames, oversized or broken meta, data for unknown requests, payloads larger or smaller
than granted, forged handshakes. Afterwards the server still serves correct reads, the
guard bytes and the read-only region are unchanged, every grant was released exactly
once, and nothing was logged as a transport bug.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import secrets
import struct
import time
from collections.abc import Callable
from typing import Any

import pytest
from _helpers import logged_errors
from fuzzing import fuzz_seed

from aiokv._enums import LLMStatusCode as Code
from aiokv.transport import Grant
from aiokv.transport import Link
from aiokv.transport import PeerInfo
from aiokv.transport import _wire as wire
from aiokv.transport._wire import FrameType as F
from aiokv.transport.tcp import TcpTransport
from aiokv.transport.tcp._handshake import mac

HOST = "127.0.0.1"
SECRET = b"fuzz-secret"
REGION = 64 << 10
GUARD = 4 << 10
META_CAP = 4096
SERVER_ID, FUZZER_ID = 7, 99
BUDGET_S = 8.0  # per event loop; the whole file stays well under 20 s


class GuardedHandler:
    """Grants spans of a read-only region (reads) or a guarded writable region (writes).

    meta: ``{"spans": [[offset, length], ...]}``; checked like a cache layer would.
    """

    def __init__(self, rng: random.Random) -> None:
        self.ro_known = rng.randbytes(REGION)
        self.ro = bytearray(self.ro_known)
        self.rw = bytearray(rng.randbytes(GUARD + REGION + GUARD))
        self.guards = (bytes(self.rw[:GUARD]), bytes(self.rw[-GUARD:]))
        self.open_grants = 0
        self.granted = 0

    def _grant(self, buf: memoryview, meta: bytes) -> Grant:
        try:
            req = json.loads(meta)
        except (ValueError, RecursionError):  # RecursionError: b"[" * 3000
            return Grant(Code.LLM_PARAM_INVALID)
        spans = req.get("spans") if isinstance(req, dict) else None
        if not isinstance(spans, list) or len(spans) > 2000:
            return Grant(Code.LLM_PARAM_INVALID)
        views = []
        for s in spans:
            if (
                not isinstance(s, list)
                or len(s) != 2
                or not all(type(x) is int for x in s)
                or s[0] < 0
                or s[1] <= 0
                or s[0] + s[1] > REGION
            ):
                return Grant(Code.LLM_PARAM_INVALID)
            views.append(buf[s[0] : s[0] + s[1]])
        self.open_grants += 1
        self.granted += 1
        released = False

        def done(ok: bool) -> None:
            nonlocal released
            assert not released, "done called twice"
            released = True
            self.open_grants -= 1

        return Grant(Code.LLM_SUCCESS, views, done)

    async def grant_read(self, peer: PeerInfo, meta: bytes) -> Grant:
        return self._grant(memoryview(self.ro), meta)

    async def grant_write(self, peer: PeerInfo, meta: bytes, nbytes: int) -> Grant:
        return self._grant(memoryview(self.rw)[GUARD : GUARD + REGION], meta)


def raw(
    ftype: int,
    rid: int = 0,
    *,
    status: int = 0,
    meta: bytes = b"",
    size: int = 0,
    meta_len: int | None = None,
    version: int = wire.VERSION,
    magic: bytes = wire.MAGIC,
) -> bytes:
    """A frame with any field values, valid or not."""
    return (
        struct.pack(
            "<4sBBIIQQ",
            magic,
            version,
            ftype,
            status,
            len(meta) if meta_len is None else meta_len,
            rid,
            size,
        )
        + meta
    )


def js(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def spans(rng: random.Random) -> list[list[int]]:
    out = []
    for _ in range(rng.randint(1, 6)):
        off = rng.randrange(REGION)
        out.append([off, rng.randint(1, REGION - off)])
    return out


def hostile_meta(rng: random.Random) -> bytes:
    return rng.choice(
        [
            b"{",
            b"[]",
            b"null",
            b'"x"',
            b"\xff\xfe\xfd",
            b"[" * 3000,
            js({"spans": "all"}),
            js({"spans": [[-1, 10]]}),
            js({"spans": [[0, REGION + 1]]}),
            js({"spans": [[REGION - 1, 2**63]]}),
            js({"spans": [[0, 0]]}),
            js({"spans": [[1.5, 2]]}),
            js({"pad": "x" * (META_CAP + 10)}),
            rng.randbytes(rng.randint(1, 64)),
        ]
    )


class Fuzzer:
    """One raw connection speaking (and mangling) the protocol from the connecting side."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.rid = 0
        self.reader: asyncio.StreamReader
        self.writer: asyncio.StreamWriter

    def next_id(self) -> int:
        self.rid += 2
        return self.rid

    async def open(self, port: int) -> None:
        self.reader, self.writer = await asyncio.open_connection(HOST, port)

    async def recv_frame(self) -> tuple[wire.Header, bytes]:
        h = wire.decode_header(await self.reader.readexactly(wire.HEADER_SIZE))
        meta = await self.reader.readexactly(h.meta_len)
        if h.type is F.DATA:
            await self.reader.readexactly(h.size)
        return h, meta

    async def handshake(self, *, forge: bool = False) -> None:
        nonce_c = secrets.token_bytes(32)
        hello = {"cluster_id": FUZZER_ID, "nonce": nonce_c.hex()}
        self.writer.write(wire.encode_frame(F.HELLO, meta=js(hello)))
        _, meta = await self.recv_frame()
        server = wire.decode_meta(meta)
        nonce_s = bytes.fromhex(server["nonce"])
        proof: Any = mac(SECRET, b"client", nonce_c, nonce_s, FUZZER_ID, SERVER_ID)
        if forge:
            proof = self.rng.choice([None, "00" * 32, proof[:-1] + "0", 12, "zz", proof.upper()])
        self.writer.write(wire.encode_frame(F.AUTH, meta=js({"mac": proof})))
        h, _ = await self.recv_frame()
        if h.type is not F.AUTH:
            raise ConnectionError("refused")

    async def write_granted(self) -> None:
        """A real WRITE_REQ, then DATA of a wrong (or right) size once it is granted."""
        rid = self.next_id()
        sp = spans(self.rng)
        total = sum(n for _, n in sp)
        self.writer.write(raw(F.WRITE_REQ, rid, meta=js({"spans": sp}), size=total))
        async with asyncio.timeout(2):
            while True:
                h, _ = await self.recv_frame()
                if h.type is F.WRITE_GRANT and h.req_id == rid:
                    break
        if h.status != Code.LLM_SUCCESS:
            return
        for _ in range(self.rng.randint(1, 4)):
            n = self.rng.choice([0, 1, total // 2, total, total + 1, total * 2, 5000])
            n = min(n, wire.MAX_CHUNK)
            self.writer.write(raw(F.DATA, rid, size=n) + self.rng.randbytes(n))

    def random_frames(self) -> list[bytes]:
        rng = self.rng
        out: list[bytes] = []
        for _ in range(rng.randint(1, 25)):
            k = rng.randrange(16)
            if k == 0:
                out.append(rng.randbytes(rng.randint(1, 200)))
            elif k == 1:  # valid framing, arbitrary fields
                t = rng.choice(list(F))
                size = rng.choice([0, 1, 100, wire.MAX_CHUNK, 2**64 - 1])
                meta = rng.randbytes(rng.randint(0, 40)) if t in (F.READ_REQ, F.WRITE_REQ) else b""
                payload = rng.randbytes(min(size, 300)) if t is F.DATA else b""
                out.append(
                    raw(t, rng.getrandbits(64), status=rng.getrandbits(32), meta=meta, size=size)
                    + payload
                )
            elif k == 2:  # one header byte mutated
                frame = bytearray(raw(F.READ_REQ, self.next_id(), meta=js({"spans": spans(rng)})))
                frame[rng.randrange(wire.HEADER_SIZE)] = rng.randrange(256)
                out.append(bytes(frame))
            elif k == 3:
                sp = spans(rng)
                total = sum(n for _, n in sp) + rng.choice([0, 0, -1, 1])
                out.append(raw(F.READ_REQ, self.next_id(), meta=js({"spans": sp}), size=total))
            elif k == 4:
                t = rng.choice([F.READ_REQ, F.WRITE_REQ])
                out.append(
                    raw(t, self.next_id(), meta=hostile_meta(rng), size=rng.randrange(REGION))
                )
            elif k == 5:  # a request id of the wrong parity, or repeated
                rid = rng.choice([1, 3, self.rid, self.rid])
                out.append(raw(F.READ_REQ, rid, meta=js({"spans": spans(rng)}), size=10))
            elif k == 6:  # data for requests nobody made
                n = rng.randint(0, 2000)
                out.append(raw(F.DATA, rng.getrandbits(64), size=n) + rng.randbytes(n))
            elif k == 7:  # a write, and data racing its grant
                rid = self.next_id()
                sp = spans(rng)
                total = sum(n for _, n in sp)
                out.append(raw(F.WRITE_REQ, rid, meta=js({"spans": sp}), size=total))
                n = min(total + rng.choice([-1, 0, 1]), 70000)
                out.append(raw(F.DATA, rid, size=max(n, 0)) + rng.randbytes(max(n, 0)))
            elif k == 8:
                t = rng.choice([F.CANCEL, F.READ_DONE, F.WRITE_DONE, F.READ_RESP, F.WRITE_GRANT])
                out.append(
                    raw(t, rng.choice([self.rid, rng.getrandbits(64), 0]), size=rng.getrandbits(20))
                )
            elif k == 9:  # absurd lengths
                out.append(raw(F.DATA, self.rid, size=wire.MAX_CHUNK + rng.randint(1, 2**40)))
            elif k == 10:
                out.append(
                    raw(F.READ_REQ, self.next_id(), meta_len=rng.choice([2**32 - 1, META_CAP + 1]))
                )
            elif k == 11:  # handshake frames after the handshake
                out.append(raw(rng.choice([F.HELLO, F.AUTH]), meta=js({"cluster_id": 1})))
            elif k == 12:  # bad version or magic
                out.append(
                    rng.choice([raw(F.DATA, version=9), raw(F.DATA, magic=b"GET "), raw(0xEE)])
                )
            elif k == 13:  # truncated: a frame cut short, then the end of the connection
                whole = raw(F.WRITE_REQ, self.next_id(), meta=js({"spans": spans(rng)}), size=99)
                out.append(whole[: rng.randrange(len(whole))])
                break
            elif k == 14:
                out.append(raw(F.ERROR if rng.random() < 0.5 else F.CLOSE))
            else:
                out.append(raw(F.CANCEL, rng.choice([self.rid, max(self.rid - 2, 0)])))
        return out

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            if self.rng.random() < 0.5:
                self.writer.transport.abort()
            else:
                self.writer.close()
                await self.writer.wait_closed()


async def fuzz_one(port: int, rng: random.Random) -> int:
    """One connection's worth of abuse; returns the number of frames thrown."""
    fz = Fuzzer(rng)
    await fz.open(port)
    sent = 0
    try:
        mode = rng.randrange(10)
        if mode == 0:  # garbage instead of a handshake
            fz.writer.write(rng.randbytes(rng.randint(1, 500)))
            sent += 1
        elif mode == 1:  # a handshake with broken or forged fields
            bad = rng.choice(
                [
                    raw(F.HELLO, meta=js({"cluster_id": -1, "nonce": "00" * 32})),
                    raw(F.HELLO, meta=js({"cluster_id": 1, "nonce": "xyz"})),
                    raw(F.HELLO, meta=b"{"),
                    raw(F.HELLO, meta_len=wire.HANDSHAKE_META_CAP + 1),
                    raw(F.AUTH, meta=js({"mac": None})),
                    raw(F.READ_REQ, 2, meta=js({"spans": [[0, 10]]}), size=10),
                ]
            )
            fz.writer.write(bad)
            sent += 1
        elif mode == 2:
            with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
                await fz.handshake(forge=True)
            sent += 2
            fz.writer.write(raw(F.READ_REQ, 2, meta=js({"spans": [[0, 10]]}), size=10))
        else:
            await fz.handshake()
            sent += 2
            if rng.random() < 0.3:
                await fz.write_granted()
                sent += 2
            frames = fz.random_frames()
            fz.writer.write(b"".join(frames))
            sent += len(frames)
        with contextlib.suppress(ConnectionError):
            await fz.writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError, TimeoutError, wire.WireError):
        pass  # the server hung up on us: exactly what it should do with most of this
    finally:
        await fz.close()
    return sent


@pytest.fixture
def transport_errors(caplog: pytest.LogCaptureFixture) -> Callable[[], list[str]]:
    """The ERROR messages logged by ``aiokv.transport`` so far in the test."""
    return logged_errors(caplog, "aiokv.transport")


async def test_hostile_frames_never_break_the_server(
    transport_errors: Callable[[], list[str]],
) -> None:
    seed = fuzz_seed()
    rng = random.Random(seed)
    handler = GuardedHandler(rng)
    open_links = 0
    settled = asyncio.Event()

    def on_link(link: Link) -> None:
        nonlocal open_links
        open_links += 1
        settled.clear()

    def on_lost(link: Link) -> None:
        nonlocal open_links
        open_links -= 1
        if open_links == 0:
            settled.set()

    server = TcpTransport(
        SERVER_ID,
        handler,
        secret=SECRET,
        max_meta_bytes=META_CAP,
        handshake_timeout=2,
        on_link=on_link,
        on_link_lost=on_lost,
    )
    client = TcpTransport(FUZZER_ID, GuardedHandler(rng), secret=SECRET)
    try:
        port = (await server.listen(HOST, 0))[1]
        frames = connections = 0
        deadline = time.monotonic() + BUDGET_S
        while time.monotonic() < deadline and frames < 6000:
            counts = await asyncio.gather(
                *(fuzz_one(port, random.Random(rng.getrandbits(64))) for _ in range(8))
            )
            frames += sum(counts)
            connections += len(counts)
        assert frames >= 1000, f"only {frames} frames in {BUDGET_S} s (seed {seed})"

        # Every hostile link is gone, and with it every grant it held.
        if open_links:
            await asyncio.wait_for(settled.wait(), 10)
        assert handler.open_grants == 0, f"grants never released (seed {seed})"
        assert handler.granted > 0, "the fuzzer never got a request through"

        # The server still serves exactly what it holds...
        link = await client.connect(HOST, port, timeout=5)
        got = bytearray(REGION)
        await link.read(js({"spans": [[0, REGION]]}), [memoryview(got)], timeout=5)
        assert got == handler.ro_known, f"read-only region changed (seed {seed})"
        fresh = bytes(random.Random(seed).randbytes(REGION))
        await link.write(js({"spans": [[0, REGION]]}), [memoryview(fresh)], timeout=5)
        assert handler.rw[GUARD : GUARD + REGION] == fresh
        # ...and nothing ever landed outside a grant.
        assert (bytes(handler.rw[:GUARD]), bytes(handler.rw[-GUARD:])) == handler.guards, (
            f"guard bytes overwritten (seed {seed})"
        )
        assert handler.ro == handler.ro_known
        assert transport_errors() == [], f"transport bug logged (seed {seed})"
    finally:
        await client.aclose()
        await server.aclose()
