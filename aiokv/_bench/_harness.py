"""What every benchmark shares: the loop runner, timing, interleaved rounds, a spawned
peer process (and the prompt peer the remote benchmarks link to), scattered block
lists, and a report printed as rich tables or as JSON.

A benchmark builds a :class:`Report` and returns it; the ``aiokv bench`` command decides
whether it is printed as tables (:meth:`Report.render`) or as one JSON object
(:meth:`Report.as_dict`). Timings are medians or bests of rounds in which every
contender runs once in turn (:func:`interleave`), so that the slow drifts of a shared
machine hit all contenders alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from collections.abc import AsyncIterator
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Coroutine
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from multiprocessing.connection import Connection
from typing import Any
from typing import Literal
from typing import Protocol
from typing import TypeVar

import torch
from rich.console import Console
from rich.table import Table

from .. import BlocksCacheKey
from .. import Cache
from .. import CacheDesc
from .. import LLMClusterInfo
from .. import LLMConfig
from .. import LLMDataDist
from .. import LLMRole
from .. import LLMStatusCode
from ._interrupt import sigint_blocked
from ._pki import TlsFiles
from ._progress import steps

__all__ = [
    "KIB",
    "MIB",
    "PEER_ID",
    "POOL_BYTES",
    "Backend",
    "Elapsed",
    "Peer",
    "PromptPeer",
    "Report",
    "apply_env",
    "digest",
    "gbps",
    "interleave",
    "linked",
    "median",
    "random_fill",
    "run_loop",
    "run_remote",
    "scattered",
    "serve_requests",
    "spawned",
    "spawned_all",
    "time_call",
]

KIB, MIB = 1 << 10, 1 << 20
T = TypeVar("T")
#: The transports the remote benchmarks link participants with.
Backend = Literal["tcp", "nixl"]


def run_loop(main: Callable[[], Coroutine[Any, Any, T]], *, use_uvloop: bool | None = None) -> T:
    """Run ``main()`` to completion on a new event loop and return its result.

    Args:
        main: makes the coroutine to run.
        use_uvloop: ``True``: uvloop (``ImportError`` if missing); ``False``: asyncio;
            ``None``: uvloop where it is installed, asyncio otherwise.
    """
    if use_uvloop is not False:
        try:
            import uvloop
        except ImportError:
            if use_uvloop:
                raise
        else:
            return uvloop.run(main())
    return asyncio.run(main())


# ------------------------------------------------------------------------------ timing


class Elapsed(float):
    """Seconds a call took, measured where the work ran (a peer process driven over a
    pipe): a contender that returns one is timed by it, not by the wall clock here,
    which would add the pipe's round trip."""


async def time_call(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes, awaiting its result when it is awaitable; the
    result itself when it is an :class:`Elapsed`.

    A plain function runs on the loop thread and blocks it meanwhile, on purpose: a raw
    baseline is measured with nothing else running.
    """
    t0 = time.perf_counter()
    result = fn()
    if inspect.isawaitable(result):
        result = await result
    t = time.perf_counter() - t0
    return float(result) if isinstance(result, Elapsed) else t


async def interleave(
    contenders: Mapping[str, Callable[[], object]],
    rounds: int,
    *,
    per_round: int = 1,
    warmup: int = 1,
) -> dict[str, list[float]]:
    """Time every contender ``per_round`` times in a row, in turn, for ``rounds`` rounds.

    The first ``warmup`` rounds (first touch of memory, thread starts, connection
    buffers) are run but not returned. Returns, per contender name, its
    ``rounds * per_round`` times in seconds.
    """
    times: dict[str, list[float]] = {name: [] for name in contenders}
    with steps(f"rounds: {', '.join(contenders)}", warmup + rounds) as bar:
        for r in range(warmup + rounds):
            for name, fn in contenders.items():
                for _ in range(per_round):
                    t = await time_call(fn)
                    if r >= warmup:
                        times[name].append(t)
            bar.advance()
    return times


def median(times: Sequence[float]) -> float:
    """The median of ``times``: the typical round, what every remote figure reports."""
    return statistics.median(times)


def gbps(nbytes: int | float, seconds: float) -> float:
    """Throughput in GB/s (10^9 bytes per second)."""
    return nbytes / seconds / 1e9


def scattered(count: int, seed: int) -> list[int]:
    """``count`` block indices out of ``2 * count``: every other block, shuffled.

    No two of them are neighbours in memory, so no transfer can merge them into one
    region; the order is a fixed-seed shuffle, so runs are comparable.
    """
    blocks = list(range(0, 2 * count, 2))
    random.Random(seed).shuffle(blocks)
    return blocks


# ------------------------------------------------------------------------ peer process


class Peer:
    """A child process started with ``spawn``, driven over a pipe.

    ``target(conn, *args)`` runs in the child; it must send one greeting on ``conn``
    first (a port, for instance: :attr:`hello`), then answer requests as it likes.
    :meth:`stop` sends ``("stop",)``, waits 10 s for the child to exit and kills it
    otherwise; :func:`spawned` starts and stops one off the event loop. ``fork`` is
    never used: forking after torch was imported hangs. The child is born with SIGINT
    blocked (:func:`~._interrupt.sigint_blocked`): Ctrl-C reaches the parent, which
    ends it.

    Raises:
        RuntimeError: the child sent no greeting within ``start_timeout`` seconds.
    """

    def __init__(self, target: Callable[..., None], *args: Any, start_timeout: float = 120) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        with sigint_blocked():
            self.proc.start()
        child.close()
        if not self.conn.poll(start_timeout):
            self.stop()
            raise RuntimeError(f"the peer process {target.__name__} did not start")
        self.hello: Any = self.conn.recv()

    async def request(self, *message: Any) -> Any:
        """Send ``message`` as a tuple and await the child's one reply (off the loop)."""
        self.conn.send(message)
        return await asyncio.to_thread(self.conn.recv)

    def stop(self) -> None:
        """Ask the child to stop, then make sure it is gone."""
        with contextlib.suppress(OSError):  # it is gone already
            self.conn.send(("stop",))
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


async def serve_requests(
    conn: Connection, handlers: Mapping[str, Callable[..., Awaitable[Any]]]
) -> None:
    """In a :class:`Peer` child: answer ``(name, *args)`` requests until ``("stop",)``.

    Each reply is ``await handlers[name](*args)``, sent back on ``conn``.
    """
    while True:
        name, *args = await asyncio.to_thread(conn.recv)
        if name == "stop":
            return
        conn.send(await handlers[name](*args))


# ------------------------------------------------------------------------- prompt peer

#: The prompt peer's cluster id; its one blocks cache is ``BlocksCacheKey(PEER_ID, 0)``.
PEER_ID = 1
#: Where a benchmark participant keeps its pool.
DeviceKind = Literal["cpu", "cuda", "npu"]

#: The decoder's cluster id in :func:`run_remote`.
DECODER_ID = 2
#: The pool of each side of the remote benchmarks.
POOL_BYTES = 1 << 30


def participant_config(
    pool_bytes: int,
    tls: TlsFiles | None = None,
    backend: Backend = "tcp",
    device_type: DeviceKind = "cpu",
    listen: str = "127.0.0.1:0",
    *,
    engine_thread: bool = True,
) -> LLMConfig:
    """A participant listening on ``listen`` with a ``pool_bytes`` pool on ``device_type``
    (``cpu``, ``cuda``), remote accessible, linking with ``backend``; its links over TLS
    with ``tls``'s files when given; its engine inline unless ``engine_thread``."""
    return LLMConfig(
        engine_thread=engine_thread,
        transfer_backend=backend,
        device_type=device_type,
        enable_cache_manager=True,
        listen_ip_info=listen,
        mem_pool_cfg=f'{{"memory_size": {pool_bytes}, "page_shift": 16}}',
        enable_remote_cache_accessible=True,
        sync_kv_timeout=60_000,
        **(tls.options() if tls is not None else {}),
    )


def random_fill(cache: Cache, seed: int = 0) -> None:
    """Fill tensor i of ``cache`` with random bytes seeded by ``seed + i`` (blocking)."""
    for i, t in enumerate(cache.tensors):
        g = torch.Generator().manual_seed(seed + i)
        t.view(torch.uint8).copy_(
            torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, generator=g)
        )


def digest(cache: Cache, blocks: Sequence[int]) -> str:
    """A hash of ``blocks`` of every tensor of ``cache``, in that order (blocking).

    Equal digests of the source blocks here and of the destination blocks on the peer
    prove that a transfer put every byte where it belongs.
    """
    h = hashlib.blake2b()
    index = torch.tensor(list(blocks), device=cache.tensors[0].device)
    for t in cache.tensors:
        h.update(t.view(torch.uint8).view(cache.num_blocks, -1)[index].cpu().numpy().data)
    return h.hexdigest()


async def _prompt_main(
    conn: Connection,
    pool_bytes: int,
    tls: TlsFiles | None,
    backend: Backend,
    device_type: DeviceKind,
) -> None:
    config = participant_config(pool_bytes, tls, backend, device_type)
    async with LLMDataDist(LLMRole.PROMPT, PEER_ID, config) as dd:
        cm = dd.cache_manager
        caches: list[Cache] = []

        async def cache(desc: CacheDesc) -> list[int]:
            while caches:
                await cm.deallocate_blocks_cache(caches.pop())
            caches.append(await cm.allocate_blocks_cache(desc, BlocksCacheKey(PEER_ID, 0)))
            await asyncio.to_thread(random_fill, caches[0])
            return caches[0].tensor_addrs

        async def clear() -> None:
            await asyncio.to_thread(lambda: [t.zero_() for t in caches[0].tensors])

        async def block_digest(blocks: list[int]) -> str:
            return await asyncio.to_thread(digest, caches[0], blocks)

        assert dd.listen_address is not None
        conn.send(dd.listen_address[1])
        await serve_requests(conn, {"cache": cache, "clear": clear, "digest": block_digest})


def apply_env(env: Mapping[str, str | None]) -> None:
    """In a peer process, before NIXL is imported (UCX reads its settings then): set
    ``env`` (``None``: remove the variable).

    Raises:
        RuntimeError: NIXL is imported already.
    """
    if not env:
        return
    if any(m.split(".")[0] in ("nixl", "nixl_cu12") for m in sys.modules):
        raise RuntimeError("UCX settings must be set before NIXL is imported")
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _prompt_peer(
    conn: Connection,
    pool_bytes: int,
    tls: TlsFiles | None,
    backend: Backend,
    env: Mapping[str, str | None],
    device_type: DeviceKind,
) -> None:
    apply_env(env)
    run_loop(lambda: _prompt_main(conn, pool_bytes, tls, backend, device_type))


class PromptPeer(Peer):
    """A prompt participant in a spawned process, listening on loopback.

    It holds one blocks cache at a time, keyed ``BlocksCacheKey(PEER_ID, 0)``, allocated
    from a ``pool_bytes`` pool (so remote accessible) and filled by :func:`random_fill`.
    With ``tls``, it accepts links over TLS only. It links with ``backend``, in a
    process whose environment has ``env`` applied first (``None``: removed). Its pool
    is on ``device_type``. Decoders link to it at ``(host, port)``.
    """

    host = "127.0.0.1"

    def __init__(
        self,
        pool_bytes: int,
        tls: TlsFiles | None = None,
        backend: Backend = "tcp",
        env: Mapping[str, str | None] | None = None,
        device_type: DeviceKind = "cpu",
    ) -> None:
        super().__init__(_prompt_peer, pool_bytes, tls, backend, dict(env or {}), device_type)
        self.port: int = self.hello

    async def cache(self, desc: CacheDesc) -> list[int]:
        """Replace the peer's cache with a new one of ``desc``; returns its tensor addresses."""
        addrs: list[int] = await self.request("cache", desc)
        return addrs

    async def clear(self) -> None:
        """Zero every byte of the peer's cache."""
        await self.request("clear")

    async def digest(self, blocks: Sequence[int]) -> str:
        """:func:`digest` of ``blocks`` of the peer's cache."""
        got: str = await self.request("digest", list(blocks))
        return got


class _Stoppable(Protocol):
    def stop(self) -> None: ...


S = TypeVar("S", bound=_Stoppable)


@contextlib.asynccontextmanager
async def spawned(start: Callable[[], S]) -> AsyncIterator[S]:
    """``start()`` (a :class:`Peer`, a :class:`~.raw.RawStream`) for the block, started
    and stopped on a worker thread: both wait for another process, never on the loop."""
    with steps("starting a peer process", 1) as bar, bar.step("starting a peer process"):
        peer = await asyncio.to_thread(start)
    try:
        yield peer
    finally:
        await asyncio.to_thread(peer.stop)


@contextlib.asynccontextmanager
async def spawned_all(starts: Sequence[Callable[[], S]]) -> AsyncIterator[list[S]]:
    """:func:`spawned` for several at once, started concurrently; all are stopped
    afterwards, and those that started are stopped if another fails to."""
    got = await asyncio.gather(*(asyncio.to_thread(s) for s in starts), return_exceptions=True)
    ok = [p for p in got if not isinstance(p, BaseException)]
    try:
        for p in got:
            if isinstance(p, BaseException):
                raise p
        yield ok
    finally:
        await asyncio.gather(*(asyncio.to_thread(p.stop) for p in ok))


@contextlib.asynccontextmanager
async def linked(
    peer: PromptPeer,
    cluster_id: int,
    pool_bytes: int,
    tls: TlsFiles | None = None,
    device_type: DeviceKind = "cpu",
    *,
    engine_thread: bool = True,
) -> AsyncIterator[LLMDataDist]:
    """A decoder participant with a ``pool_bytes`` pool on ``device_type``, linked to
    ``peer`` (over TLS with ``tls``'s files), for the block; its engine inline on this
    loop unless ``engine_thread``.

    Raises:
        RuntimeError: the link failed (its status code in the message).
    """
    config = participant_config(
        pool_bytes, tls, device_type=device_type, engine_thread=engine_thread
    )
    async with LLMDataDist(LLMRole.DECODER, cluster_id, config) as dd:
        info = LLMClusterInfo(
            remote_cluster_id=PEER_ID,
            local_ip_info=[("127.0.0.1", 0)],
            remote_ip_info=[(peer.host, peer.port)],
        )
        code, codes = await dd.link_clusters([info])
        if code != LLMStatusCode.LLM_SUCCESS:
            raise RuntimeError(f"link to the prompt peer failed: {code.name} {codes}")
        yield dd


def run_remote(
    main: Callable[[PromptPeer, LLMDataDist], Awaitable[None]],
    pool_bytes: int | None = None,
    start: Callable[[], PromptPeer] | None = None,
) -> None:
    """Run ``main(peer, decoder)`` on a new loop (uvloop where installed): a
    :class:`PromptPeer` (``start()``'s, by default a new one with a ``pool_bytes`` pool)
    and a decoder linked to it with a ``pool_bytes`` pool (by default this module's
    ``POOL_BYTES`` as it is at the call: the tests make it small), stopped afterwards
    whatever happens."""
    size = POOL_BYTES if pool_bytes is None else pool_bytes

    async def run() -> None:
        async with (
            spawned(start or (lambda: PromptPeer(size))) as peer,
            linked(peer, DECODER_ID, size) as decoder,
        ):
            await main(peer, decoder)

    run_loop(run)


# ------------------------------------------------------------------------------ report


@dataclass(slots=True)
class _Table:
    title: str
    rows: list[dict[str, Any]] = field(default_factory=list)


def _cell(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


@dataclass(slots=True)
class _Summary:
    template: str
    values: dict[str, Any]


@dataclass(slots=True)
class Report:
    """The results of one benchmark run: named tables and one-line summaries, in order.

    ``meta`` describes the run (loop, torch version, ...). :meth:`as_dict` is what
    ``--json`` prints; :meth:`render` prints the same figures for a reader.
    """

    bench: str
    meta: dict[str, Any] = field(default_factory=dict)
    _parts: dict[str, _Table | _Summary] = field(default_factory=dict)

    def table(self, name: str, title: str) -> list[dict[str, Any]]:
        """Add a table; returns its (live) list of rows.

        Every row is a dict with the same keys, in the same order: the keys are the
        column headers and the JSON keys; floats print with two decimals.
        """
        part = _Table(title)
        self._parts[name] = part
        return part.rows

    def summary(self, name: str, template: str, **values: Any) -> None:
        """Add a one-line result: ``template.format(**values)`` when rendered."""
        self._parts[name] = _Summary(template, values)

    def as_dict(self) -> dict[str, Any]:
        """``{"bench", "meta", name: rows | values, ...}``: plain JSON-able values."""
        out: dict[str, Any] = {"bench": self.bench, "meta": self.meta}
        for name, part in self._parts.items():
            out[name] = part.rows if isinstance(part, _Table) else part.values
        return out

    def render(self, console: Console | None = None) -> None:
        """Print the meta line, every table and every summary."""
        # piped output: wide enough for every table, not the 80 columns rich assumes
        console = console or Console(width=None if sys.stdout.isatty() else 160)
        if self.meta:
            console.print(", ".join(f"{k}: {v}" for k, v in self.meta.items()))
        for part in self._parts.values():
            if isinstance(part, _Summary):
                console.print(part.template.format(**part.values))
                continue
            table = Table(title=part.title)
            for key in part.rows[0] if part.rows else ():
                table.add_column(key, justify="right")
            for row in part.rows:
                table.add_row(*map(_cell, row.values()))
            console.print(table)
