"""The Mooncake contenders of ``aiokv bench transfer --peers``.

Mooncake Transfer Engine (``pip install mooncake-transfer-engine-non-cuda``) over its TCP
transport, in two spawned processes on loopback, with no metadata server (P2P
handshake: the initiator reaches the target by ``127.0.0.1:<rpc port>``):

* a target: one registered buffer of random bytes;
* an initiator: one registered zeroed buffer; per grid row, it READs the same scattered
  blocks aiokv pulls (one request per block: local in destination order, remote in
  source order), checked byte for byte before any timing, then in each round one
  ``batch_transfer_sync_read`` and one ``batch_transfer_sync_write`` of the whole row,
  each timed in the initiator (:class:`~._harness.Elapsed`), so Mooncake pays for no
  pipe.

Mooncake's TCP transport refuses more than 1,024 queued requests per peer by default;
:data:`ENV` raises that bound to its maximum, so a row's batch (up to 4,096 requests
here) goes in one call. Buffers are host memory allocated as aiokv's pools are.
"""

from __future__ import annotations

import contextlib
import importlib
import time
from collections.abc import AsyncIterator
from collections.abc import Callable
from functools import partial
from multiprocessing.connection import Connection
from typing import Any
from typing import Final

from ._harness import Elapsed
from ._harness import Peer
from ._harness import Report
from ._harness import apply_env
from ._harness import gbps
from ._harness import spawned_all
from .nixl import SETTINGS
from .nixl import _buffer
from .nixl import _raw_digest
from .nixl import _rows

__all__ = ["ENV", "INSTALL", "MooncakeContenders", "Peers", "missing", "mooncake_contenders"]

#: How to install Mooncake here (its wheel links these Debian libraries).
INSTALL: Final = (
    "apt-get install libibverbs1 libnl-3-200 libnl-route-3-200, then "
    "pip install mooncake-transfer-engine-non-cuda"
)

#: Each Mooncake process's environment, set before its engine is made: per-peer queue
#: bounds at their maximum (a row's batch in one call), and its log at warnings and up
#: (its INFO lines would mix with the progress bars on stderr).
ENV: Final[dict[str, str | None]] = {
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535",
    "MC_LOG_LEVEL": "WARNING",
}

#: The target's host in the P2P handshake (its session is ``HOST:<rpc port>``).
HOST: Final = "127.0.0.1"


def missing() -> str | None:
    """Why Mooncake Transfer Engine cannot run here, naming the fix; ``None`` if it can."""
    try:
        importlib.import_module("mooncake.engine")
    except ImportError as exc:
        return f"--peers: Mooncake Transfer Engine does not import ({exc}): {INSTALL}"
    return None


def _engine() -> Any:
    """A Mooncake engine over TCP, P2P handshake (environment: :data:`ENV`)."""
    apply_env(ENV)
    engine = importlib.import_module("mooncake.engine").TransferEngine()
    if engine.initialize(HOST, "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("Mooncake Transfer Engine did not initialize over TCP")
    return engine


def _registered(engine: Any, nbytes: int, fill: int | None) -> Any:
    """A host buffer of ``nbytes`` (random bytes, or ``fill``) registered with ``engine``."""
    buf = _buffer(nbytes, fill, "DRAM")
    if engine.register_memory(buf.data_ptr(), nbytes) != 0:
        raise RuntimeError(f"Mooncake did not register a buffer of {nbytes} bytes")
    return buf


def _target(conn: Connection, nbytes: int) -> None:
    """Child: a registered random buffer; answers ``digest`` until ``stop``."""
    engine = _engine()
    buf = _registered(engine, nbytes, None)
    conn.send((f"{HOST}:{engine.get_rpc_port()}", buf.data_ptr()))
    while True:
        name, *args = conn.recv()
        if name == "stop":
            return
        conn.send(_raw_digest(buf, *args))


class _Initiator:
    """The initiator's engine and buffer, the target's session and buffer, one row."""

    def __init__(self, nbytes: int, target: tuple[str, int]) -> None:
        self.engine = _engine()
        self.buf = _registered(self.engine, nbytes, 0)
        self.session, self.peer_base = target
        self.local: list[int] = []
        self.remote: list[int] = []
        self.lengths: list[int] = []

    def row(self, block: int, srcs: list[int], dsts: list[int]) -> str:
        """A new row's requests; zero ``dsts``, READ once, return their digest."""
        base = int(self.buf.data_ptr())
        self.local = [base + d * block for d in dsts]
        self.remote = [self.peer_base + s * block for s in srcs]
        self.lengths = [block] * len(srcs)
        rows, index = _rows(self.buf, block, dsts)
        rows.index_fill_(0, index, 0)
        self.move("read")
        return _raw_digest(self.buf, block, dsts)

    def move(self, kind: str) -> float:
        """One batch of the row's requests, ``read`` or ``write``; seconds it took."""
        call = getattr(self.engine, f"batch_transfer_sync_{kind}")
        t0 = time.perf_counter()
        code = call(self.session, self.local, self.remote, self.lengths)
        t = time.perf_counter() - t0
        if code != 0:
            raise RuntimeError(f"Mooncake batch {kind} of {len(self.lengths)} failed: {code}")
        return t


def _initiator(conn: Connection, nbytes: int, target: tuple[str, int]) -> None:
    """Child: answers ``row``, ``read`` and ``write`` (seconds) until ``stop``."""
    me = _Initiator(nbytes, target)
    conn.send("ready")
    while True:
        name, *args = conn.recv()
        if name == "stop":
            return
        conn.send(me.row(*args) if name == "row" else me.move(name))


class _Pair:
    """A Mooncake target and initiator over ``nbytes`` buffers (two spawned processes)."""

    def __init__(self, nbytes: int) -> None:
        self.target = Peer(_target, nbytes)
        try:
            self.initiator = Peer(_initiator, nbytes, self.target.hello)
        except BaseException:
            self.target.stop()
            raise

    def stop(self) -> None:
        self.initiator.stop()
        self.target.stop()


class Peers:
    """The other engines in the throughput rounds: none (``--peers`` not given). Per
    grid row: :meth:`row` readies and checks them, :meth:`contenders` are timed,
    :meth:`add` takes the row's median times; :meth:`summarize` ends the grid."""

    async def row(self, block: int, srcs: list[int], dsts: list[int]) -> None:
        """Ready (and check) one row: none here."""

    def contenders(self) -> dict[str, Callable[[], Any]]:
        """What the rounds time: none here."""
        return {}

    def add(self, t: dict[str, float], block: int, count: int) -> None:
        """One row's median times, by contender name: nothing to add here."""

    def summarize(self) -> None:
        """After the last row: nothing here."""


class MooncakeContenders(Peers):
    """Mooncake's READ and WRITE in the throughput rounds, and their two tables.

    :meth:`row` readies (and checks) one grid row, :meth:`contenders` times it,
    :meth:`add` turns a row's median times into table rows (its tables made at the
    first, after aiokv's own), :meth:`summarize` adds the ratios' range to the report.
    """

    def __init__(self, pair: _Pair, report: Report) -> None:
        self._pair = pair
        self._report = report
        self._speeds: list[dict[str, Any]] = []
        self._ratios: list[dict[str, Any]] = []

    def _tables(self) -> None:
        report = self._report
        self._speeds = report.table(
            "peers",
            "the same bytes, same rounds, GB/s: raw socket; aiokv tcp pull/push; Mooncake "
            "Transfer Engine over TCP, one batch READ/WRITE (one request per block)",
        )
        self._ratios = report.table(
            "peers_ratios",
            "aiokv / Mooncake TE tcp (t_mooncake / t_aiokv; read: pull, write: push), "
            "aiokv tcp and, with --backend nixl, aiokv-nixl per UCX setting; "
            "*_us: per-block cost over the raw stream, (t - t_raw) / K, in µs (mc: Mooncake)",
        )

    async def row(self, block: int, srcs: list[int], dsts: list[int]) -> None:
        """New requests for the row; its READ into zeroed blocks checked byte for byte.

        Raises:
            AssertionError: Mooncake delivered wrong bytes.
        """
        got = await self._pair.initiator.request("row", block, srcs, dsts)
        if got != await self._pair.target.request("digest", block, srcs):
            raise AssertionError("Mooncake TE (tcp) READ delivered wrong bytes")

    def contenders(self) -> dict[str, Callable[[], Any]]:
        """``mooncake_read`` and ``mooncake_write``."""
        return {f"mooncake_{k}": partial(self._move, k) for k in ("read", "write")}

    async def _move(self, kind: str) -> Elapsed:
        return Elapsed(await self._pair.initiator.request(kind))

    def add(self, t: dict[str, float], block: int, count: int) -> None:
        """The rows of one ``(B, K)`` from its median times (``raw``, ``pull``, ``push``,
        ``mooncake_read``, ``mooncake_write``; with NIXL's, aiokv-nixl's per UCX
        setting too: ``shm_pull`` ...)."""
        if not self._ratios:
            self._tables()
        nbytes, head = block * count, {"block_kib": block // 1024, "count": count}
        paths = ("raw", "pull", "push", "mooncake_read", "mooncake_write")
        self._speeds.append({**head, **{f"{p}_gbps": gbps(nbytes, t[p]) for p in paths}})
        us = {
            f"{p.replace('mooncake', 'mc')}_us": (t[p] - t["raw"]) / count * 1e6 for p in paths[1:]
        }
        ratios = {
            **head,
            "pull_vs_read": t["mooncake_read"] / t["pull"],
            "push_vs_write": t["mooncake_write"] / t["push"],
        }
        for u in (u for u in SETTINGS if f"{u}_pull" in t):
            ratios[f"{u}_pull_vs_read"] = t["mooncake_read"] / t[f"{u}_pull"]
            ratios[f"{u}_push_vs_write"] = t["mooncake_write"] / t[f"{u}_push"]
        self._ratios.append({**ratios, **us, "verified": True})

    def summarize(self) -> None:
        """The range of every ratio over the grid."""
        if not self._ratios:
            return
        keys = [k for k in self._ratios[0] if "_vs_" in k]
        values = {
            f"{k}_{f.__name__}": f(r[k] for r in self._ratios) for k in keys for f in (min, max)
        }
        ranges = ", ".join(f"{k} {{{k}_min:.2f}}-{{{k}_max:.2f}}" for k in keys)
        self._report.summary(
            "peers_summary",
            f"aiokv / Mooncake TE tcp (t_mooncake / t_aiokv), over the grid: {ranges} "
            "(above 1: aiokv faster)",
            **values,
        )


@contextlib.asynccontextmanager
async def mooncake_contenders(report: Report, nbytes: int) -> AsyncIterator[MooncakeContenders]:
    """Mooncake's two processes over ``nbytes`` buffers, started, and stopped afterwards;
    their tables go into ``report``."""
    async with spawned_all([partial(_Pair, nbytes)]) as (pair,):
        yield MooncakeContenders(pair, report)
