"""Raw baselines, and the transport-level grid (``aiokv bench raw``).

* :class:`RawStream` — the plain method every remote figure is compared with: blocking
  ``sendall`` from one buffer in a child process, blocking ``recv_into`` one buffer
  here, after a 9-byte request per round (a pull needs a request too). ``MSG_WAITALL``,
  chunked sends and non-blocking ``poll`` loops measured no faster on the development
  machine.
* :class:`RawBlocks` — the same stream between scattered blocks: blocking ``writev``
  from K blocks of a buffer in a child process, blocking ``readv`` into K blocks here,
  no protocol. What the kernel alone charges for moving scattered blocks rather than one
  contiguous buffer: the floor of any transfer of those blocks over a socket.
* :func:`run_raw_bench` — the ``tcp`` transport (through :mod:`aiokv.transport` only)
  serving one pool from a child process; this process pulls ``K`` scattered blocks of
  ``B`` bytes (``Link.read``) into, then pushes them (``Link.write``) from, ``K``
  scattered blocks of its own, interleaved with raw-stream rounds of the same bytes.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from .. import LLMStatusCode
from .._copy import host_empty
from ..transport import DirectCheck
from ..transport import Grant
from ..transport import Link
from ..transport import PeerInfo
from ..transport import get_transport
from ..transport.tcp._io import IOV_MAX
from ..transport.tcp._io import advance_rows
from ..transport.tcp._io import readv
from ..transport.tcp._io import writev
from ._harness import KIB
from ._harness import MIB
from ._harness import Peer
from ._harness import Report
from ._harness import gbps
from ._harness import interleave
from ._harness import median
from ._harness import run_loop
from ._harness import scattered
from ._harness import spawned
from ._progress import steps

__all__ = ["RawBlocks", "RawStream", "run_raw_bench"]

#: Default grid: block sizes x block counts, skipping transfers above 256 MiB.
BLOCK_SIZES = (16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB)
BLOCK_COUNTS = (64, 256, 1024, 4096)


def _filled(nbytes: int, byte: int) -> bytearray:
    """A buffer with every page touched: untouched pages would all map the zero page."""
    return bytearray(bytes([byte])) * nbytes


def _raw_sender(conn: Connection, port: int, max_bytes: int) -> None:
    """Child: connect, greet, then for every ``b"g" + 8-byte size`` send that many bytes."""
    payload = memoryview(_filled(max_bytes, 0xA5))
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.send("connected")
        request = bytearray(9)
        while sock.recv_into(request, len(request), socket.MSG_WAITALL) == len(request):
            sock.sendall(payload[: int.from_bytes(request[1:], "little")])


class RawStream:
    """A raw socket stream from a child process: the baseline of every remote figure.

    :meth:`receive` is one round: a 9-byte request, then ``nbytes`` received with
    blocking ``recv_into`` into one buffer. It blocks its thread (the loop's, when
    timed by :func:`~._harness.interleave`), on purpose. :meth:`stop` it (or start it
    with :func:`~._harness.spawned`) to stop the child.
    """

    def __init__(self, max_bytes: int) -> None:
        self._buf = memoryview(_filled(max_bytes, 0x5A))
        with socket.create_server(("127.0.0.1", 0)) as lsock:
            self._peer = Peer(_raw_sender, lsock.getsockname()[1], max_bytes)
            self._sock = lsock.accept()[0]
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def receive(self, nbytes: int) -> None:
        """Receive one round of ``nbytes`` (at most ``max_bytes``)."""
        self._sock.sendall(b"g" + nbytes.to_bytes(8, "little"))
        pos = 0
        while pos < nbytes:
            pos += self._sock.recv_into(self._buf[pos:nbytes])

    def stop(self) -> None:
        """Close the stream; the child sees EOF and exits."""
        self._sock.close()
        self._peer.stop()


def _pool_like(nbytes: int, byte: int) -> torch.Tensor:
    """``nbytes`` of ``byte`` in memory allocated as the caches' pools are (huge pages
    where the kernel grants them: they halved the kernel's cost per scattered 4 KiB
    block here), every page touched."""
    return host_empty(nbytes, torch.device("cpu")).fill_(byte)


def _rows(buf: torch.Tensor, blocks: npt.NDArray[np.int64], block: int) -> npt.NDArray[np.uint64]:
    """``(address, length)`` rows of ``blocks`` of ``block`` bytes in ``buf``, in order."""
    starts = np.uint64(buf.data_ptr()) + blocks.astype(np.uint64) * np.uint64(block)
    return np.ascontiguousarray(np.stack((starts, np.full_like(starts, block)), axis=1))


def _move_rows(call: Any, sock: socket.socket, rows: npt.NDArray[np.uint64]) -> None:
    """Every byte of ``rows`` through blocking ``readv`` / ``writev`` (``call``)."""
    rows, pos = rows.copy(), 0  # advance_rows moves partly done rows on
    while pos < len(rows):
        n = call(sock, rows[pos : pos + IOV_MAX])
        if not n:
            raise ConnectionResetError("raw blocks: connection closed")
        pos = advance_rows(rows, pos, n)


def _blocks_sender(conn: Connection, port: int, max_bytes: int) -> None:
    """Child: connect, greet; ``b"b"`` + block size + count + the block indices (8
    bytes each, little-endian) sets the blocks sent; ``b"g"`` + size sends them."""
    buf = _pool_like(2 * max_bytes, 0xA5)
    rows = np.empty((0, 2), dtype=np.uint64)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.send("connected")
        head = bytearray(17)
        while sock.recv_into(head, len(head), socket.MSG_WAITALL) == len(head):
            if head[:1] == b"g":
                _move_rows(writev, sock, rows)
                continue
            block, count = (int.from_bytes(head[i : i + 8], "little") for i in (1, 9))
            raw = bytearray(8 * count)
            sock.recv_into(raw, len(raw), socket.MSG_WAITALL)
            rows = _rows(buf, np.frombuffer(raw, dtype="<i8").astype(np.int64), block)


class RawBlocks:
    """:class:`RawStream` between scattered blocks: the kernel's floor for them.

    :meth:`blocks` sets which blocks move (the sender's ``srcs``, this side's ``dsts``,
    at most ``2 * max_bytes`` bytes in); :meth:`receive` is one round: a request, then
    every block received with blocking ``readv`` (no protocol, no Python per block).
    Both buffers are allocated as the caches' pools are (:func:`_pool_like`).

    Attributes:
        buf: this side's buffer (``0x5A`` until blocks of the sender's ``0xA5`` land).
    """

    def __init__(self, max_bytes: int) -> None:
        self.buf = _pool_like(2 * max_bytes, 0x5A)
        self._rows = np.empty((0, 2), dtype=np.uint64)
        with socket.create_server(("127.0.0.1", 0)) as lsock:
            self._peer = Peer(_blocks_sender, lsock.getsockname()[1], max_bytes)
            self._sock = lsock.accept()[0]
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def blocks(self, block: int, srcs: Sequence[int], dsts: Sequence[int]) -> None:
        """Move ``srcs`` of the sender's buffer into ``dsts`` of ours, ``block`` bytes each."""
        head = b"b" + block.to_bytes(8, "little") + len(srcs).to_bytes(8, "little")
        self._sock.sendall(head + np.asarray(srcs, dtype="<i8").tobytes())
        self._rows = _rows(self.buf, np.asarray(dsts, dtype=np.int64), block)

    def receive(self) -> None:
        """One round: every block of :meth:`blocks`."""
        self._sock.sendall(b"g" + bytes(16))
        _move_rows(readv, self._sock, self._rows)

    def stop(self) -> None:
        """Close the stream; the child sees EOF and exits."""
        self._sock.close()
        self._peer.stop()


class _PoolHandler:
    """Grants blocks of one big pool; meta ``{"block_bytes": B, "blocks": [index, ...]}``."""

    def __init__(self, pool: bytearray) -> None:
        self._pool = memoryview(pool)

    def _views(self, raw: bytes) -> Grant:
        meta = json.loads(raw)
        size, blocks = meta.get("block_bytes"), meta.get("blocks")
        if not isinstance(size, int) or size <= 0 or not isinstance(blocks, list):
            return Grant(LLMStatusCode.LLM_PARAM_INVALID)
        count = len(self._pool) // size
        if not all(isinstance(i, int) and 0 <= i < count for i in blocks):
            return Grant(LLMStatusCode.LLM_PARAM_INVALID)
        return Grant(
            LLMStatusCode.LLM_SUCCESS, [self._pool[i * size : (i + 1) * size] for i in blocks]
        )

    async def grant_read(
        self, peer: PeerInfo, meta: bytes, *, direct: DirectCheck | None = None
    ) -> Grant:
        return self._views(meta)  # host memory only: ``direct`` is never passed

    async def grant_write(
        self, peer: PeerInfo, meta: bytes, nbytes: int, *, direct: DirectCheck | None = None
    ) -> Grant:
        return self._views(meta)


def _link_server(conn: Connection, pool_bytes: int, use_uvloop: bool) -> None:
    """Child: serve one link over a pool, greet with the port, exit when the link closes."""

    async def serve() -> None:
        lost = asyncio.Event()
        handler = _PoolHandler(_filled(pool_bytes, 0xA5))
        tcp = get_transport("tcp")
        async with tcp(1, handler, on_link_lost=lambda _link: lost.set()) as transport:
            conn.send((await transport.listen("127.0.0.1", 0))[1])
            await lost.wait()

    run_loop(serve, use_uvloop=use_uvloop)


def default_configs(max_total: int) -> list[tuple[int, int]]:
    """The ``(B, K)`` grid of :data:`BLOCK_SIZES` x :data:`BLOCK_COUNTS` up to ``max_total``."""
    return [(b, k) for b in BLOCK_SIZES for k in BLOCK_COUNTS if b * k <= max_total]


def _fmt_bytes(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"


async def _grid(
    report: Report, configs: list[tuple[int, int]], repeat: int | None, use_uvloop: bool
) -> None:
    rows = report.table(
        "link",
        "Link.read / Link.write of K scattered blocks vs a raw socket stream (GB/s, median)",
    )
    max_total = max(b * k for b, k in configs)
    pool_bytes = 2 * max_total  # scattered() picks among 2 K blocks
    pool = memoryview(_filled(pool_bytes, 0x5A))
    tcp = get_transport("tcp")
    async with (
        spawned(lambda: RawStream(max_total)) as raw,
        spawned(lambda: Peer(_link_server, pool_bytes, use_uvloop)) as server,
        tcp(2, _PoolHandler(bytearray())) as transport,
    ):
        link = await transport.connect("127.0.0.1", server.hello, timeout=60)
        with steps("link", len(configs)) as part:
            for size, count in configs:
                with part.step(f"link {_fmt_bytes(size)} x {count}"):
                    rows.append(await _link_row(raw, link, pool, size, count, repeat))
        await link.aclose()


async def _link_row(
    raw: RawStream, link: Link, pool: memoryview, size: int, count: int, repeat: int | None
) -> dict[str, Any]:
    """One ``(B, K)`` of the grid: check that a read delivers, then time the rounds."""
    remote = scattered(count, seed=size + count)
    local = scattered(count, seed=size + count + 1)
    views = [pool[i * size : (i + 1) * size] for i in local]
    meta = json.dumps({"block_bytes": size, "blocks": remote}).encode()
    for v in views:  # prove that the bytes really move
        v[:] = bytes(size)
    await link.read(meta, views, timeout=60)
    if any(v != bytes([0xA5]) * size for v in views):
        raise AssertionError("Link.read delivered wrong bytes")
    nbytes = size * count
    rounds = repeat or max(3, min(200, (1 << 30) // nbytes))
    times = await interleave(
        {
            "raw": lambda: raw.receive(nbytes),
            "read": lambda: link.read(meta, views, timeout=60),
            "write": lambda: link.write(meta, views, timeout=60),
        },
        rounds,
    )
    t = {k: median(v) for k, v in times.items()}
    return {
        "block": _fmt_bytes(size),
        "blocks": count,
        "total": _fmt_bytes(nbytes),
        "raw_gbps": gbps(nbytes, t["raw"]),
        "read_gbps": gbps(nbytes, t["read"]),
        "read_ratio": t["raw"] / t["read"],
        "write_gbps": gbps(nbytes, t["write"]),
        "write_ratio": t["raw"] / t["write"],
    }


def run_raw_bench(
    *, quick: bool = False, repeat: int | None = None, use_uvloop: bool = True
) -> Report:
    """The transport-level grid: raw stream vs ``Link.read`` / ``Link.write``, one run.

    Args:
        quick: transfers up to 16 MiB only (else up to 256 MiB).
        repeat: rounds per figure (default: ~1 GiB per figure, 3 to 200 rounds).
        use_uvloop: run both ends on uvloop.
    """
    configs = default_configs(16 * MIB if quick else 256 * MIB)
    loop = "uvloop" if use_uvloop else "asyncio"
    report = Report("raw", {"loop": loop, "ratio": "t_raw / t_link (>1: link faster)"})
    run_loop(lambda: _grid(report, configs, repeat, use_uvloop), use_uvloop=use_uvloop)
    return report
