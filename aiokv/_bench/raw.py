"""Loopback TCP throughput: a raw-socket baseline next to ``Link.read`` / ``Link.write``.

Both measurements move the same bytes between two processes on this machine, in the
same run, so their ratio is meaningful even where absolute figures vary run to run:

* :func:`raw_stream_gbps` — the plain method: blocking ``sendall`` from one buffer in
  a child process, blocking ``recv_into`` one buffer here, after a 9-byte request per
  round (a pull needs a request too). ``MSG_WAITALL``, chunked sends and non-blocking
  ``poll`` loops measured no faster on the development machine.
* :func:`link_gbps` — a :class:`~aiokv.transport._tcp.TcpTransport` server in a child
  process granting ``K`` scattered blocks of ``B`` bytes; this process pulls them
  (``Link.read``) into, then pushes them (``Link.write``) from, ``K`` scattered blocks
  of its own, the block indices travelling in the request meta as a cache layer's would.

Children are started with the ``spawn`` method: ``fork`` after torch was imported hangs.

Run ``python -m aiokv._bench.raw [--quick] [--loop asyncio|uvloop]`` to print
a table of GB/s and ratios against the raw stream.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import random
import socket
import statistics
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from .._enums import LLMStatusCode
from ..transport._base import Grant, PeerInfo

__all__ = ["Row", "compare", "link_gbps", "main", "raw_stream_gbps"]

_KIB = 1 << 10
_MIB = 1 << 20
#: Default grid: block sizes x block counts, skipping transfers above 256 MiB.
BLOCK_SIZES = (16 * _KIB, 64 * _KIB, 256 * _KIB, 1 * _MIB)
BLOCK_COUNTS = (64, 256, 1024, 4096)
MAX_TOTAL = 256 * _MIB


def _repeats(nbytes: int, repeat: int | None) -> int:
    """Enough rounds to move ~1 GiB per figure, between 3 and 200."""
    return repeat if repeat is not None else max(3, min(200, (1 << 30) // nbytes))


# --------------------------------------------------------------------------- children


def _filled(nbytes: int, byte: int) -> bytearray:
    """A buffer with every page touched: untouched pages would all map the zero page."""
    return bytearray(bytes([byte])) * nbytes


def _raw_sender(port: int, max_bytes: int) -> None:
    """Child: for every request ``b"g" + 8-byte size`` send that many bytes; stop on EOF."""
    payload = memoryview(_filled(max_bytes, 0xA5))
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        request = bytearray(9)
        while sock.recv_into(request, len(request), socket.MSG_WAITALL) == len(request):
            sock.sendall(payload[: int.from_bytes(request[1:], "little")])


class _PoolHandler:
    """Grants blocks of one big pool; meta ``{"block_bytes": B, "blocks": [index, ...]}``."""

    def __init__(self, pool: bytearray) -> None:
        self._pool = memoryview(pool)

    def _views(self, meta: dict[str, Any]) -> Grant:
        size, blocks = meta.get("block_bytes"), meta.get("blocks")
        if not isinstance(size, int) or size <= 0 or not isinstance(blocks, list):
            return Grant(LLMStatusCode.LLM_PARAM_INVALID)
        count = len(self._pool) // size
        if not all(isinstance(i, int) and 0 <= i < count for i in blocks):
            return Grant(LLMStatusCode.LLM_PARAM_INVALID)
        return Grant(
            LLMStatusCode.LLM_SUCCESS, [self._pool[i * size : (i + 1) * size] for i in blocks]
        )

    async def grant_read(self, peer: PeerInfo, meta: dict[str, Any]) -> Grant:
        return self._views(meta)

    async def grant_write(self, peer: PeerInfo, meta: dict[str, Any], nbytes: int) -> Grant:
        return self._views(meta)


def _run(main: Callable[[], Coroutine[Any, Any, None]], use_uvloop: bool) -> None:
    if use_uvloop:
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())


def _link_server(conn: Connection, pool_bytes: int, use_uvloop: bool) -> None:
    """Child: serve one link over a pool, report the port on ``conn``, exit when it closes."""
    from ..transport._tcp import TcpTransport

    async def serve() -> None:
        lost = asyncio.Event()
        handler = _PoolHandler(_filled(pool_bytes, 0xA5))
        async with TcpTransport(1, handler, on_link_lost=lambda _link: lost.set()) as transport:
            conn.send((await transport.listen("127.0.0.1", 0))[1])
            await lost.wait()

    _run(serve, use_uvloop)


# ------------------------------------------------------------------------ measurement


def _measure(
    configs: Sequence[tuple[int, int]],
    *,
    raw: bool,
    link: bool,
    repeat: int | None,
    use_uvloop: bool,
    seed: int = 0,
) -> dict[tuple[int, int], dict[str, float]]:
    """GB/s per ``(B, K)``: ``"raw"``, ``"read"``, ``"write"``, as asked.

    The raw round, the read round and the write round of one configuration alternate,
    so slow drifts of a shared machine hit all three alike; each figure is the median.
    Raw rounds block the event loop on purpose: nothing else runs meanwhile.
    """
    from ..transport._tcp import TcpTransport

    max_total = max(b * k for b, k in configs)
    pool_bytes = 2 * max_total
    ctx = mp.get_context("spawn")
    procs: list[Any] = []
    rng = random.Random(seed)
    out: dict[tuple[int, int], dict[str, float]] = {}
    with contextlib.ExitStack() as stack:
        raw_conn: socket.socket | None = None
        if raw:
            lsock = stack.enter_context(socket.create_server(("127.0.0.1", 0)))
            procs.append(ctx.Process(target=_raw_sender, args=(lsock.getsockname()[1], max_total)))
            procs[-1].start()
            raw_conn = stack.enter_context(lsock.accept()[0])
            raw_conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        parent, child = ctx.Pipe()
        if link:
            procs.append(ctx.Process(target=_link_server, args=(child, pool_bytes, use_uvloop)))
            procs[-1].start()
        pool = memoryview(_filled(pool_bytes, 0x5A))

        def raw_round(size: int) -> float:
            assert raw_conn is not None
            t0 = time.perf_counter()
            raw_conn.sendall(b"g" + size.to_bytes(8, "little"))
            pos = 0
            while pos < size:
                pos += raw_conn.recv_into(pool[pos:size])
            return time.perf_counter() - t0

        async def client() -> None:
            async with TcpTransport(2, _PoolHandler(bytearray())) as transport:
                lnk = None
                if link:
                    if not parent.poll(120):
                        raise RuntimeError("the link server process did not start")
                    lnk = await transport.connect("127.0.0.1", parent.recv(), timeout=60)
                for size, count in configs:
                    remote = rng.sample(range(pool_bytes // size), count)
                    local = rng.sample(range(pool_bytes // size), count)
                    views = [pool[i * size : (i + 1) * size] for i in local]
                    meta = {"block_bytes": size, "blocks": remote}
                    if lnk is not None:  # prove that the bytes really move
                        for v in views:
                            v[:] = bytes(size)
                        await lnk.read(meta, views, timeout=60)
                        expect = bytes([0xA5]) * size
                        if any(v != expect for v in views):
                            raise AssertionError("Link.read delivered wrong bytes")
                    rounds: dict[str, list[float]] = {}
                    for _ in range(_repeats(size * count, repeat) + 1):
                        if raw:
                            rounds.setdefault("raw", []).append(raw_round(size * count))
                        if lnk is not None:
                            for name, op in (("read", lnk.read), ("write", lnk.write)):
                                t0 = time.perf_counter()
                                await op(meta, views, timeout=60)
                                rounds.setdefault(name, []).append(time.perf_counter() - t0)
                    # Round 0 warms up caches and page tables; it is not counted.
                    out[size, count] = {
                        k: size * count / statistics.median(v[1:]) / 1e9 for k, v in rounds.items()
                    }

        try:
            _run(client, use_uvloop)
        finally:
            if raw_conn is not None:
                raw_conn.close()
            for proc in procs:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
    return out


def raw_stream_gbps(nbytes: int, *, repeat: int | None = None) -> float:
    """GB/s of a blocking raw-socket stream of ``nbytes`` from a child process.

    Each round sends a 9-byte request and receives the whole payload with ``recv_into``
    into one buffer; the figure is the median round.
    """
    return _measure([(nbytes, 1)], raw=True, link=False, repeat=repeat, use_uvloop=False)[
        nbytes, 1
    ]["raw"]


def link_gbps(
    block_bytes: int, blocks: int, *, repeat: int | None = None, use_uvloop: bool = True
) -> tuple[float, float]:
    """GB/s of ``Link.read`` and of ``Link.write`` of ``blocks`` scattered blocks.

    The server runs in a child process; block indices on both ends are random and travel
    in the request meta. Returns ``(read GB/s, write GB/s)``, medians of the rounds.
    """
    got = _measure(
        [(block_bytes, blocks)], raw=False, link=True, repeat=repeat, use_uvloop=use_uvloop
    )[block_bytes, blocks]
    return got["read"], got["write"]


# -------------------------------------------------------------------------- comparison


@dataclass(frozen=True, slots=True)
class Row:
    """One configuration of :func:`compare`: throughputs in GB/s, ratios vs raw."""

    block_bytes: int
    blocks: int
    raw_gbps: float
    read_gbps: float
    write_gbps: float

    @property
    def nbytes(self) -> int:
        return self.block_bytes * self.blocks

    @property
    def read_ratio(self) -> float:
        return self.read_gbps / self.raw_gbps

    @property
    def write_ratio(self) -> float:
        return self.write_gbps / self.raw_gbps


def default_configs(max_total: int = MAX_TOTAL) -> list[tuple[int, int]]:
    """The ``(B, K)`` grid of :data:`BLOCK_SIZES` x :data:`BLOCK_COUNTS` up to ``max_total``."""
    return [(b, k) for b in BLOCK_SIZES for k in BLOCK_COUNTS if b * k <= max_total]


def compare(
    configs: Sequence[tuple[int, int]] | None = None,
    *,
    repeat: int | None = None,
    use_uvloop: bool = True,
) -> list[Row]:
    """Measure the raw stream and the link on every ``(B, K)``, interleaved, in one run."""
    configs = list(configs) if configs is not None else default_configs()
    got = _measure(configs, raw=True, link=True, repeat=repeat, use_uvloop=use_uvloop)
    return [Row(b, k, got[b, k]["raw"], got[b, k]["read"], got[b, k]["write"]) for b, k in configs]


def _fmt_bytes(n: int) -> str:
    return f"{n // _MIB} MiB" if n >= _MIB else f"{n // _KIB} KiB"


def main(argv: Sequence[str] | None = None) -> None:
    """Print raw vs ``Link.read`` / ``Link.write`` GB/s and ratios for the default grid."""
    parser = argparse.ArgumentParser(prog="python -m aiokv._bench.raw")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    parser.add_argument("--quick", action="store_true", help="transfers up to 16 MiB only")
    parser.add_argument("--repeat", type=int, default=None, help="rounds per figure")
    args = parser.parse_args(argv)
    configs = default_configs(16 * _MIB if args.quick else MAX_TOTAL)
    rows = compare(configs, repeat=args.repeat, use_uvloop=args.loop == "uvloop")
    print(f"loopback TCP, event loop: {args.loop}; GB/s, median of rounds; ratio = link / raw")
    heads = ("block", "blocks", "total", "raw", "read", "ratio", "write", "ratio")
    print(" ".join(f"{h:>{8 if i < 3 else 6}}" for i, h in enumerate(heads)))
    for r in rows:
        print(
            f"{_fmt_bytes(r.block_bytes):>8} {r.blocks:>6} {_fmt_bytes(r.nbytes):>8} "
            f"{r.raw_gbps:6.2f} {r.read_gbps:6.2f} {r.read_ratio:6.2f} "
            f"{r.write_gbps:6.2f} {r.write_ratio:6.2f}"
        )


if __name__ == "__main__":
    main()
