"""NixlTransport: TCP links as the control plane, NIXL moving the payload.

Composition: it *is* a :class:`~aiokv.transport.tcp.TcpTransport` (listening, the
authenticated handshake, ``link_secret``, TLS, pre-auth caps, PING/PONG, every request's
meta, grant and refusal), whose links each carry a :class:`NixlPlane` (their data
plane). A link that comes up sends this side's NIXL agent metadata over itself (the
plane's greeting); the peer loads it
(``add_remote_agent``) and unloads it when the last link to that agent ends. No etcd,
no NIXL listener. A request whose buffers all lie in registered memory asks for a
NIXL grant; the granter answers with the validated grant's memory as descriptors and the
requester moves the bytes itself with one NIXL READ (pull, which succeeds only once
the granter confirmed that it still served the grant after the READ ended: a READ is
one-sided, the granter cannot stop it when it revokes) or WRITE (push, which lands
for the granter when the requester reports, over the link, that NIXL completed it: no
NIXL notification). Anything else moves as TCP ``DATA``.

Memory is registered by kind: host memory as ``DRAM``, ``cuda:N`` memory as ``VRAM``
of device N (one region table each). Device memory moves only by address: requester
buffers as :class:`~aiokv.transport.DeviceRuns` (where :meth:`NixlPlane.addressable`),
grants as :attr:`~aiokv.transport.Grant.device` (offered to the handler as ``direct``
for a NIXL request); either side's device memory pairs with the other's host or device
memory in one transfer (UCX moves it GPU-direct where it can).

Progress without threads that spin: the requester polls its transfer's state (a small
one a few times on its loop, then, like a big one, from a thread of the wait lane), the
granter progresses UCX (a poll of notifications) from a wait-lane thread while it serves
NIXL grants or lends memory; both back off from :data:`POLL_MIN_S` to :data:`POLL_MAX_S`
with sleeps that last as asked, where a loop's last at least ~1 ms (docs/design.md,
"NIXL transport", has the measurements behind the choice).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING
from typing import Any
from typing import Final

import numpy as np

from ..._enums import LLMStatusCode as _S
from ..._errors import LLMException
from ..._threads import Lane
from ..._threads import seen_out
from .._base import Link
from .._base import check_address
from .._base import check_connect_timeout
from ..tcp import TcpTransport
from ..tcp._ops import PeerOp
from ..tcp._ops import State
from ._agent import Agent
from ._plane import POLL_MAX_S
from ._plane import POLL_MIN_S
from ._plane import SETTLE_S
from ._plane import NixlOwner
from ._plane import NixlPlane
from ._regions import Regions

__all__ = ["POLL_MAX_S", "POLL_MIN_S", "NixlTransport"]

_log = logging.getLogger("aiokv.transport.nixl")

# how long aclose waits for transfers still being settled before it drops the agent
_CLOSE_WAIT_S: Final = 5.0
#: Threads of a transport's wait lane: big transfers waited for at once (more wait for
#: a thread within their deadline; one whose deadline passes first is never posted).
WAIT_THREADS: Final = 32
#: The longest the pump's thread progresses UCX before the pump's loop looks again
#: whether any grant is still served (seconds), and the same while memory is only lent.
_WATCH_S: Final = 0.005
_LEND_WATCH_S: Final = 0.1


class NixlTransport(TcpTransport):
    """The ``nixl`` transport: a :class:`TcpTransport` whose payload moves over NIXL
    between memory registered with :meth:`register_memory` (host memory, and ``cuda``
    memory as VRAM; other ranges, and peers without NIXL, use the TCP path).

    Arguments as :class:`TcpTransport`. The NIXL agent (UCX backend) is created on the
    first :meth:`listen` / :meth:`connect`, off the event loop; memory registered
    before is registered with it then.
    """

    def _init_state(self) -> None:
        super()._init_state()
        self.regions = Regions()  # host memory ("DRAM")
        self.vram: dict[int, Regions] = {}  # CUDA memory by device id ("VRAM")
        #: this side's agent name; peers check it names the cluster they authenticated
        self.agent_name = f"aiokv-{self.local_cluster_id}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.agent: Agent | None = None
        #: the agent's creation, once started: run to its end whoever awaited it, as it
        #: publishes the agent itself (see _make_agent)
        self._agent_job: concurrent.futures.Future[Agent] | None = None
        #: guards the agent's publication and end against registrations (any thread):
        #: a region has a handle exactly when it is registered with the published agent
        self._reg_lock = threading.Lock()
        #: registrations NIXL could not use (an overlap, a refusal), by (mem, dev, addr,
        #: nbytes): their deregistrations undo these, not a range registered since
        self._refused: Counter[tuple[str, int, int, int]] = Counter()
        self._md: tuple[int, bytes] | None = None  # (generation, metadata) cache
        self._remote_refs: dict[str, int] = {}  # peer agent -> links using it
        self._served: set[PeerOp] = set()  # NIXL grants being served
        # until when the pump goes on after served grants ended: a peer's transfer on a
        # grant that ended early (revoked, cancelled) may need this side's progress to
        # end, and the peer waits for that end (SETTLE_S) before it lets its memory go
        self._linger_until = 0.0
        self._pump_task: asyncio.Task[None] | None = None
        #: set by a new grant (the pump's thread polls at once, from POLL_MIN_S again) and
        #: when the pump is cancelled (its thread returns)
        self._hurry = threading.Event()
        self._lent = 0  # memory lent for one-sided transfers (progress while any is)
        #: guards the three counters below, the planes' transfer counts and the agent's
        #: end: a one-sided transfer may start and end on a caller's thread
        self.xfer_lock = threading.Lock()
        self.xfers = 0  # NIXL transfers not yet released (all links)
        self.moved = 0  # transfers this side made over NIXL (requests' and one-sided)
        self.moved_bytes = 0  # their bytes
        #: threads that post and wait for big transfers (and create the agent): this
        #: transport's own, so nothing blocked elsewhere can delay a transfer
        self.wait_lane = Lane("aiokv-nixl-wait", WAIT_THREADS)
        #: local memory of transfers that could not be stopped, by device: (addr, nbytes)
        #: rows (under xfer_lock); never handed out again (:meth:`outlived`)
        self._outlived: list[tuple[str, np.ndarray]] = []
        self.outlived_bytes = 0

    # ------------------------------------------------------------------ memory hooks

    def register_memory(self, addr: int, nbytes: int, *, device: str = "cpu") -> None:
        """Host memory is registered as NIXL ``DRAM``, ``cuda:N`` memory as ``VRAM`` of
        device N; other devices (and ``cuda`` without an index) are not: their bytes
        move through host staging above the transport."""
        if nbytes <= 0:
            return
        table = self._table(device, create=True)
        if table is None:
            return
        with self._reg_lock:  # not between the agent's registrations and its publication
            agent, mem, dev = self.agent, table.mem, table.dev
            register = None
            if agent is not None:

                def register(a: int, n: int) -> object:
                    return agent.register(a, n, mem, dev)

            try:
                table.add(addr, nbytes, register)
            except Exception as exc:  # an overlap, or NIXL refusing: that memory is not used
                _log.warning("NIXL cannot register %s [%#x, +%d): %s", device, addr, nbytes, exc)
                self._refused[(table.mem, table.dev, addr, nbytes)] += 1

    def deregister_memory(self, addr: int, nbytes: int, *, device: str = "cpu") -> None:
        """Undo one :meth:`register_memory` of the range on ``device``: a refused one
        first (it counted nothing), so it never takes away another registration of the
        same range made since (e.g. once the range it overlapped was gone)."""
        table = self._table(device)
        if table is None or nbytes <= 0:
            return
        with self._reg_lock:
            refused = (table.mem, table.dev, addr, nbytes)
            if self._refused[refused]:
                self._refused[refused] -= 1
                if not self._refused[refused]:
                    del self._refused[refused]
                return
            agent = self.agent
            region = table.remove(addr, nbytes)
            if region is not None and region.handle is not None and agent is not None:
                try:
                    agent.deregister(region.handle)
                except Exception:
                    _log.exception("NIXL deregistration of [%#x, +%d) failed", addr, nbytes)

    def quarantine(self, device: str, runs: np.ndarray) -> None:
        """Keep ``runs`` (``(addr, nbytes)`` rows) of ``device`` from reuse: a transfer
        on them could not be stopped, so its bytes may still land there (any thread)."""
        rows = np.array(runs, dtype=np.uint64).reshape(-1, 2)
        with self.xfer_lock:
            self._outlived.append((device, rows))
            self.outlived_bytes += int(rows[:, 1].sum())

    def outlived(self, addr: int, nbytes: int, *, device: str = "cpu") -> bool:
        """Whether ``[addr, addr + nbytes)`` of ``device`` overlaps memory of a transfer
        that could not be stopped (:meth:`quarantine`)."""
        with self.xfer_lock:
            kept = list(self._outlived)
        lo, hi = np.uint64(addr), np.uint64(addr + nbytes)
        return any(
            dev == device and bool(np.any((rows[:, 0] < hi) & (rows[:, 0] + rows[:, 1] > lo)))
            for dev, rows in kept
        )

    def _table(self, device: str, *, create: bool = False) -> Regions | None:
        """The region table of ``device`` ("cpu", "cuda:N"), or None for memory NIXL is
        not given here."""
        if device.startswith("cpu"):
            return self.regions
        kind, _, index = device.partition(":")
        if kind != "cuda" or not index.isdigit():
            return None
        dev = int(index)
        table = self.vram.get(dev)
        if table is None and create:
            table = self.vram.setdefault(dev, Regions("VRAM", dev))
        return table

    def addressable(self, device: str, addr: int, nbytes: int) -> bool:
        """Whether ``[addr, addr + nbytes)`` of ``device`` lies in memory registered with
        NIXL (the agent running)."""
        table = self._table(device)
        if table is None or self.agent is None or nbytes <= 0 or addr < 0:
            return False
        return table.covers(np.array([[addr, nbytes]], dtype=np.uint64))

    def generation(self) -> int:
        """Changes whenever any region table does (its registrations)."""
        return self.regions.generation + sum(t.generation for t in self.vram.values())

    # ------------------------------------------------------------------ the agent

    async def listen(self, host: str, port: int) -> tuple[str, int]:
        check_address("listen", host, port)
        await self._start_agent("listen")
        return await super().listen(host, port)

    async def connect(self, host: str, port: int, *, timeout: float) -> Link:
        check_address("connect", host, port)
        check_connect_timeout("connect", timeout)
        loop = self._bind_loop("connect")
        end = loop.time() + timeout
        await self._start_agent("connect")
        link = await super().connect(host, port, timeout=end - loop.time())
        # The accepting side sent its metadata as the link came up, before it reads our
        # frames: once it answers a probe, its metadata (if it speaks NIXL) is loaded
        # here, and the link's first request can already use NIXL.
        # Reported to on_link already, but not returned if this is cancelled: then no
        # one else could close it (the caller never holds it), so it is closed here.
        left = end - loop.time()
        if left > 0:
            try:
                await link.probe(left)
            except BaseException:
                await link.aclose()
                raise
        return link

    async def _start_agent(self, op: str) -> None:
        """Create the agent unless it exists: one creation, on the wait lane, which runs
        to its end (and publishes the agent) even if every caller awaiting it is
        cancelled; a creation that failed is tried again by the next caller.

        Raises:
            LLMException: ``LLM_LINK_FAILED``: the transport closed meanwhile.
            Exception: the creation's error.
        """
        self._bind_loop(op)
        if self.agent is not None:
            return
        job = self._agent_job
        if job is None:
            job = self._agent_job = self.wait_lane.submit(self._make_agent, "NIXL agent creation")
        # a cancellation here leaves the job alone (asyncio.wait cancels nothing)
        await asyncio.wait([asyncio.wrap_future(job)])
        if (job.cancelled() or job.exception() is not None) and self._agent_job is job:
            self._agent_job = None  # failed: the next caller tries again
        if job.cancelled():  # the lane closed before a thread took it: so did we
            raise LLMException(f"{op}: transport is closed", status_code=_S.LLM_LINK_FAILED)
        job.result()

    def _make_agent(self) -> Agent:
        """(wait-lane thread) A new agent, with every region registered so far; published
        (:attr:`agent`) here, under the registration lock, unless the transport closed
        meanwhile: a region registered at any time is registered with it exactly once."""
        agent = Agent(self.agent_name)
        with self._reg_lock:
            if self._closed:
                return agent  # never published: nothing registered with it
            done: list[Any] = []
            try:
                for region in self.regions.all():  # memory registered before the agent
                    if region.handle is None:
                        region.handle = agent.register(region.addr, region.nbytes)
                        done.append(region)
            except BaseException:
                for region in done:  # an agent that failed to start holds nothing
                    with contextlib.suppress(Exception):
                        agent.deregister(region.handle)
                    region.handle = None
                raise
            for table in list(self.vram.values()):
                for region in table.all():
                    if region.handle is None:
                        try:
                            region.handle = agent.register(
                                region.addr, region.nbytes, "VRAM", table.dev
                            )
                        except Exception as exc:  # e.g. a NIXL/UCX built without CUDA
                            _log.warning("NIXL cannot register cuda:%d memory: %s", table.dev, exc)
                            table.failed = True  # staged, as without NIXL
            self.agent = agent
        return agent

    def metadata(self) -> tuple[int, bytes]:
        """``(generation, metadata)``: this agent's metadata as of the regions' generation
        (made under the registration lock: a region leaves its table, a new generation,
        before NIXL deregisters it, and metadata made in between would still list it)."""
        md = self._md
        if md is None or md[0] != self.generation():
            with self._reg_lock:
                gen = self.generation()
                assert self.agent is not None
                md = self._md = (gen, self.agent.metadata())
        return md

    def ref_remote(self, name: str) -> None:
        self._remote_refs[name] = self._remote_refs.get(name, 0) + 1

    def unref_remote(self, name: str) -> None:
        left = self._remote_refs.get(name, 0) - 1
        if left > 0:
            self._remote_refs[name] = left
            return
        self._remote_refs.pop(name, None)
        if self.agent is not None:
            try:
                self.agent.remove_remote(name)
            except Exception as exc:
                _log.debug("removing NIXL agent %s: %s", name, exc)

    # ------------------------------------------------------------------ serving side

    def _new_plane(self) -> NixlPlane:
        """Every link of this transport moves its payload over NIXL where it can."""
        return NixlPlane(self)

    def serve(self, op: PeerOp) -> None:
        """Track a NIXL grant being served: this side progresses UCX until it is over,
        since UCX moves some transfers only when the target progresses too (RMA emulated
        over active messages: UCX over TCP)."""
        self._served.add(op)
        self._hurry.set()
        self._progress()

    def lend(self) -> Callable[[], None]:
        """Memory lent for the peers' one-sided transfers: poll (UCX progress) while any
        is, since UCX moves some of them only when this side progresses (RMA emulated
        over active messages: small transfers, UCX over TCP). Returns the release."""
        self._lent += 1
        self._progress()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._lent -= 1

        return release

    def _progress(self) -> None:
        if self._pump_task is None:
            self._pump_task = self._spawn(self._pump(), "aiokv-nixl-progress")

    async def _pump(self) -> None:
        """Progress UCX while NIXL grants are served or memory is lent (:meth:`lend`),
        from a thread of the wait lane (:meth:`_watch`): a loop's sleeps last at least
        ~1 ms (epoll's and libuv's resolution), which the progress of every transfer
        that needs this side's would wait for."""
        delay = POLL_MIN_S
        try:
            while (
                self._served or self._lent or time.monotonic() < self._linger_until
            ) and self.agent is not None:
                delay = await self._progress_off_loop(self.agent, delay)
                served = {op for op in self._served if op.state is not State.OVER}
                if len(served) < len(self._served):
                    self._linger_until = time.monotonic() + SETTLE_S
                self._served = served
        finally:
            self._pump_task = None

    async def _progress_off_loop(self, agent: Agent, delay: float) -> float:
        """:meth:`_watch` on a thread of the wait lane; a cancellation stops it and is
        re-raised once the thread is done with the agent."""
        stop = threading.Event()

        def stopped() -> None:
            stop.set()
            self._hurry.set()  # wakes the thread, which returns

        job = self.wait_lane.submit(lambda: self._watch(agent, stop, delay), "NIXL progress")
        return await seen_out(job, stopped)

    def _watch(self, agent: Agent, stop: threading.Event, delay: float) -> float:
        """(wait-lane thread) Progress ``agent`` (a poll of its notifications, which
        are dropped: aiokv sends none) with back-off to :data:`POLL_MAX_S` from ``delay``
        (where the last window left it) until the window passes (:data:`_WATCH_S` while
        grants are served, :data:`_LEND_WATCH_S` while memory is only lent) or ``stop``
        is set; returns the delay reached. :attr:`_hurry` (a new grant) has it poll at
        once and restart the back-off from :data:`POLL_MIN_S`. So memory lent for long
        with nothing served costs one poll per :data:`POLL_MAX_S` and a hop to the loop
        per window (the back-off restarted each window: 12.6% of a core, measured)."""
        if self._hurry.is_set():  # a grant since the last poll: from the shortest again
            self._hurry.clear()  # (the first poll below covers every grant served so far)
            delay = POLL_MIN_S
        end = time.monotonic() + (_WATCH_S if self._served else _LEND_WATCH_S)
        while not stop.is_set():
            agent.notifs()
            if time.monotonic() >= end:
                return delay
            if self._hurry.wait(delay):
                self._hurry.clear()
                delay = POLL_MIN_S
            else:
                delay = min(delay * 2, POLL_MAX_S)
        return delay

    # ------------------------------------------------------------------ closing

    async def aclose(self) -> None:
        await super().aclose()
        loop = asyncio.get_running_loop()
        end = loop.time() + _CLOSE_WAIT_S
        # callers still settling their transfers (each bounded): a short, bounded poll
        while self.xfers and loop.time() < end:  # noqa: ASYNC110
            await asyncio.sleep(0.001)
        self.wait_lane.close(0)  # no transfer is waited for now (or it is leaked below)
        # no transfer starts after this (NixlPlane._begin), nor is an agent published
        with self._reg_lock, self.xfer_lock:
            agent, self.agent = self.agent, None
            left = self.xfers
        if agent is None or left:
            return  # leaked transfers keep the agent alive; NIXL frees it with them
        for name in list(self._remote_refs):
            with contextlib.suppress(Exception):
                agent.remove_remote(name)
        self._remote_refs.clear()
        for table in (self.regions, *self.vram.values()):
            for region in table.all():
                if region.handle is not None:
                    with contextlib.suppress(Exception):
                        agent.deregister(region.handle)
                    region.handle = None


if TYPE_CHECKING:

    def _owns_links(transport: NixlTransport) -> NixlOwner:
        """Static check (mypy): a NixlTransport is what its planes expect of their owner."""
        return transport
