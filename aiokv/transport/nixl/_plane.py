"""NixlPlane: the data plane of a TCP link that moves payload over NIXL where it can.

See :mod:`aiokv.transport.nixl._transport` for the design and
:mod:`aiokv.transport.tcp._plane` for the interface. The operations are the
:class:`~aiokv.transport.tcp._link.TcpLink`'s; the link hands this plane what it may
move. Requester side (:meth:`NixlPlane.offer`): a request whose buffers all lie in
registered memory gets a plan and is sent as a plane request; the peer plane's grant is
moved with one NIXL transfer (:meth:`NixlPlane.move`), any other answer as over TCP.
Descriptors are numpy rows throughout (:mod:`._descs`): no Python loop per block on
either side. Granter side (:meth:`NixlPlane.answer`): a plane request whose validated
grant lies in registered memory is answered with the grant's memory as coalesced runs
instead of DATA frames. The plane greets the peer with this side's agent metadata.

Buffers are off limits once an operation returns: a transfer still in flight is waited
for (shielded, at most :data:`SETTLE_S`) before it is released — NIXL frees a transfer
in flight without stopping its bytes (UCX over TCP moves them on) — and one that still
does not end breaks the link and has its local memory quarantined. A granter whose link
ends while it serves a NIXL WRITE grant never hears whether the peer's WRITE on it
ended: the grant's memory is quarantined too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence
from typing import Final
from typing import Protocol
from typing import TypeVar
from typing import cast

import numpy as np

from ..._enums import LLMStatusCode
from ..._errors import LLMException
from ..._layout import LayoutViews
from ..._threads import Lane
from ..._threads import on_loop
from ..._threads import on_loop_ran
from ..._threads import seen_out
from .._base import BY_ADDRESS
from .._base import ONE_SIDED
from .._base import Capability
from .._base import DeviceRuns
from .._base import DirectCheck
from .._base import Payload
from ..tcp._ops import MyOp
from ..tcp._ops import PeerOp
from ..tcp._ops import State
from ..tcp._ops import Stream
from ..tcp._plane import PlaneHost
from ._agent import Agent
from ._agent import Descs
from ._descs import Place
from ._descs import decode_grant
from ._descs import encode_grant
from ._descs import pair
from ._descs import runs_of
from ._regions import Regions

__all__ = ["NixlOwner", "NixlPlane"]

_log = logging.getLogger("aiokv.transport.nixl")
_S = LLMStatusCode
T = TypeVar("T")
#: How long an operation that must return waits for a transfer it cut short to end (NIXL
#: cannot stop one in flight), and a granter progresses UCX after served grants ended.
SETTLE_S: Final = 5.0
# Back-off bounds of every NIXL poll (transfer state, notifications), seconds.
POLL_MIN_S: Final = 20e-6
POLL_MAX_S: Final = 1e-3
# Transfers at least this big are polled from a worker thread (and posted there too past
# _POST_ON_LOOP): NIXL may move the whole payload inside the post call (shared memory /
# CMA), which must not hold the loop long, and over CMA every poll does part of the copy,
# which a loop that wakes at most once per millisecond (epoll's resolution) would starve
# (docs/design.md, "NIXL transport" and "NIXL descriptors and waits").
_OFF_LOOP: Final = 1 << 20
# Transfers up to this big are posted on the loop, and those the post completes (shared
# memory / CMA moves a few MiB within it) cost no thread hop: holding the loop for
# this many bytes is what the TCP link does between yields (tcp/_writer.YIELD_BYTES).
_POST_ON_LOOP: Final = 4 << 20
# Polls on the loop (one per turn) of a transfer below _OFF_LOOP that its post left in
# flight, before its wait moves to a worker thread.
_LOOP_POLLS: Final = 4
# One-sided transfers of at most this many descriptor rows are checked and described
# from Python ints (NixlPlane._few), not numpy calls.
_FEW_ROWS: Final = 32
#: ``(bytes, (local kind, remote kind), local descriptors, remote descriptors)``
_Descs = tuple[int, tuple[str, str], Descs, Descs]


class NixlOwner(Protocol):
    """What a NIXL plane needs from the transport that made it (:class:`NixlTransport`):
    its agent, registered memory and metadata, the grants it serves, its wait lane and
    transfer counters."""

    max_meta_bytes: int
    agent: Agent | None
    agent_name: str
    regions: Regions
    vram: dict[int, Regions]
    wait_lane: Lane
    xfer_lock: threading.Lock
    xfers: int
    moved: int
    moved_bytes: int

    def _table(self, device: str, *, create: bool = False) -> Regions | None: ...

    def addressable(self, device: str, addr: int, nbytes: int) -> bool: ...

    def quarantine(self, device: str, runs: np.ndarray) -> None: ...

    def generation(self) -> int: ...

    def metadata(self) -> tuple[int, bytes]: ...

    def ref_remote(self, name: str) -> None: ...

    def unref_remote(self, name: str) -> None: ...

    def serve(self, op: PeerOp) -> None: ...

    def lend(self) -> Callable[[], None]: ...


class NixlPlane:
    """The data plane of one TCP link (:class:`~aiokv.transport.tcp._plane.DataPlane`)
    that moves payload over NIXL where both ends can; also the link's
    :data:`~aiokv.transport._base.BY_ADDRESS` and
    :data:`~aiokv.transport._base.ONE_SIDED` capabilities once the peer's agent is
    loaded."""

    name = "nixl"

    def __init__(self, transport: NixlOwner) -> None:
        self._n = transport
        self._link: PlaneHost | None = None
        self.peer_agent: str | None = None  # the peer's NIXL agent, once loaded
        self._peer_cap = 0  # the largest meta the peer accepts
        self._md_gen = -1  # generation of the metadata we sent last
        # our NIXL transfers not yet released, and whether the peer agent was released
        # (link over, no transfer left): both changed under the owner's xfer_lock, as a
        # one-sided transfer may start on a caller's thread (docs/design.md, "Threads")
        self._xfers = 0
        self._retired = False
        self._loop: asyncio.AbstractEventLoop | None = None  # the link's (the engine's)
        # NIXL grants served, with their memory (the link's loop): those not over when
        # the link ends are quarantined (closed)
        self._grants: dict[PeerOp, Place] = {}

    def __repr__(self) -> str:
        return f"<NixlPlane of {self._link!r}>"

    @property
    def link(self) -> PlaneHost:
        assert self._link is not None, "a plane is bound to its link when the link is made"
        return self._link

    def bind(self, link: PlaneHost) -> None:
        self._link = link
        with contextlib.suppress(RuntimeError):  # made on its loop; a test's fake may not be
            self._loop = asyncio.get_running_loop()
        self._send_md()

    def _begin(self) -> Agent | None:
        """Count a transfer of ours (any thread): the agent to make it with, or None once
        the transport closed or the peer agent was released (nothing may start)."""
        n = self._n
        with n.xfer_lock:
            if n.agent is None or self._retired:
                return None
            self._xfers += 1
            n.xfers += 1
            return n.agent

    def _end(self, moved: int | None) -> None:
        """A transfer counted by :meth:`_begin` is released (any thread); ``moved``: its
        bytes if it completed. The peer agent is released on the link's loop if the link
        is over and it was the last."""
        n = self._n
        with n.xfer_lock:
            self._xfers -= 1
            n.xfers -= 1
            if moved is not None:
                n.moved += 1
                n.moved_bytes += moved
        # a link that breaks after this check retires through closed() (it sees no
        # transfer left), so only a broken one costs a hop to its loop
        if self.link.broken:
            on_loop(self._loop, self._retire)

    def extra(self, capability: Capability[T]) -> T | None:
        if (capability is BY_ADDRESS or capability is ONE_SIDED) and self._usable():
            return cast(T, self)
        return None

    # ------------------------------------------------------------------ metadata

    def _send_md(self) -> None:
        if self._n.agent is None:
            return
        gen, md = self._n.metadata()
        name = self._n.agent_name.encode()
        self.link._hello(len(name).to_bytes(2, "little") + name + md)
        self._md_gen = gen

    def hello(self, payload: bytes, cap: int) -> None:
        """The peer's agent metadata: loaded if it names the authenticated cluster's agent
        (checked before anything is loaded: metadata naming any other agent would take,
        or try to replace, that agent's entry in ours)."""
        agent, meta = self._n.agent, payload
        if len(meta) < 2 or agent is None or self.link.broken:
            return
        n = int.from_bytes(meta[:2], "little")
        name = bytes(meta[2 : 2 + n]).decode(errors="replace")
        # the agent must be the authenticated cluster's, and the same for the whole link
        peer = self.link.peer
        if not name.startswith(f"aiokv-{peer.cluster_id}-") or name == self._n.agent_name:
            _log.warning("%r: peer announced NIXL agent %r; not using NIXL", self, name)
            return
        if self.peer_agent not in (None, name):
            self.link._break("peer changed its NIXL agent")
            return
        md = bytes(meta[2 + n :])
        named = Agent.named(md)
        if named is None:  # a serialisation this aiokv cannot read: checked after loading
            _log.warning("%r: cannot read the agent name of the peer's NIXL metadata", self)
        elif named != name:
            self.link._break("peer's NIXL metadata names another agent")
            return
        try:
            loaded = agent.add_remote(md)
        except Exception as exc:
            _log.warning("%r: peer's NIXL metadata refused: %s", self, exc)
            return
        if loaded != name:  # NIXL read another name than we did: never use it
            self.link._break("peer's NIXL metadata names another agent")
            return
        if self.peer_agent is None:
            self._n.ref_remote(name)
            self.peer_agent = name
        self._peer_cap = cap

    def closed(self) -> None:
        """The link ended (before its operations are ended): the memory of every NIXL
        WRITE grant still served is quarantined — the peer's WRITE on it may not have
        ended (it breaks the link when it cannot stop one: :meth:`_settle`), and no
        word of its end can come now. A peer's READ only reads this side's memory:
        its grant's memory is released as before."""
        for op, (mem, dev, runs) in self._grants.items():
            if op.state is State.OVER or op.is_read:
                continue
            _log.error(
                "%r: the link ended while the peer's NIXL WRITE of request %d may still "
                "move; the granted memory (%d bytes) is kept from reuse",
                self.link,
                op.rid,
                int(runs[:, 1].sum()) if len(runs) else 0,
            )
            self._n.quarantine(_device(mem, dev), runs)
        self._grants.clear()
        self._retire()

    def _retire(self) -> None:
        """Release the peer agent once the link is over and no transfer uses it (on the
        link's loop; :meth:`_begin` starts none after)."""
        with self._n.xfer_lock:
            if not self.link.broken or self._xfers or self._retired:
                return
            self._retired = True
        if self.peer_agent is not None:
            self._n.unref_remote(self.peer_agent)

    # ------------------------------------------------------------------ granter side

    def answer(self, op: PeerOp, views: Sequence[memoryview], total: int) -> bytes | None:
        runs = self._n.regions.cut(runs_of(views))
        return None if runs is None else self._grant_place(op, ("DRAM", 0, runs))

    def direct(self, op: PeerOp) -> DirectCheck | None:
        n = self._n
        if not (n.vram and self.peer_agent is not None and n.agent is not None):
            return None
        return n.addressable

    def answer_device(self, op: PeerOp, dev: DeviceRuns) -> bytes | None:
        table = self._n._table(dev.device)
        runs = None if table is None else table.cut(dev.runs)
        if table is None or runs is None:
            return None
        return self._grant_place(op, (table.mem, table.dev, runs))

    def _grant_place(self, op: PeerOp, place: Place) -> bytes | None:
        """The grant of registered memory ``place`` for ``op``, which this plane serves
        from now on; None when it cannot (no peer agent, meta too big for the peer)."""
        n = self._n
        if self.peer_agent is None or n.agent is None or self.link.broken:
            return None
        meta = encode_grant(place)
        if len(meta) > min(self._peer_cap, n.max_meta_bytes):
            return None
        if n.generation() != self._md_gen:
            self._send_md()  # before the grant: the peer must know the regions it names
        # held until the link ends it: the reader's READ_DONE, the writer's
        # PLANE_WRITE_CHECK (after its WRITE completed), a CANCEL or a revocation
        n.serve(op)
        if not op.is_read:  # a peer's WRITE: its memory is quarantined if the link ends
            grants = self._grants
            for over in [g for g in grants if g.state is State.OVER]:
                del grants[over]
            grants[op] = place
        return meta

    # ------------------------------------------------------------------ requester side

    def accept(self, grant: bytes | bytearray, size: int) -> Place | None:
        return decode_grant(grant, size)

    def addressable(self, device: str, addr: int, nbytes: int) -> bool:
        return self._usable() and self._n.addressable(device, addr, nbytes)

    def _usable(self) -> bool:
        return self.peer_agent is not None and self._n.agent is not None and not self.link.broken

    def offer(self, views: Sequence[memoryview], total: int) -> Place | None:
        """Our ``("DRAM", 0, rows)`` of ``views`` if NIXL can move them on this link,
        else None (they move as DATA)."""
        if not total or not self._usable():
            return None
        runs = self._n.regions.cut(runs_of(views))
        return None if runs is None else ("DRAM", 0, runs)

    def offer_device(self, dev: DeviceRuns) -> Place | None:
        table = self._n._table(dev.device)
        if table is None or not dev.runs.size or not self._usable():
            return None
        runs = table.cut(dev.runs)
        return None if runs is None else (table.mem, table.dev, runs)

    def publish(self) -> None:
        if self._usable() and self._n.generation() != self._md_gen:
            self._send_md()

    def lend(self) -> Callable[[], None]:
        return self._n.lend()

    async def move_at(
        self, write: bool, local: Payload, remote: DeviceRuns, *, timeout: float
    ) -> None:
        total, mems, local_rows, far_rows = self._few(local, remote) or self._at(local, remote)
        kind, peer = "WRITE" if write else "READ", self.peer_agent
        agent = self._begin()
        if agent is None or peer is None:  # the link ended meanwhile
            if agent is not None:
                self._end(None)
            raise LLMException("the NIXL link is over", status_code=_S.LLM_LINK_FAILED)
        try:
            xfer = agent.xfer(kind, local_rows, far_rows, peer, b"", mems)
        except Exception as exc:  # e.g. memory the peer has not registered (any more)
            self._end(None)
            raise LLMException(
                f"NIXL refused a one-sided {kind}: {exc}", status_code=_S.LLM_FAILED
            ) from None
        state = "PROC"
        try:
            # posted on the loop as _run would, before the timeout is armed: a transfer
            # the post completes (shared memory / CMA) costs no timer
            posted = agent.post(xfer) if total <= _POST_ON_LOOP else None
            if posted is None or posted == "PROC":
                async with asyncio.timeout(timeout):
                    posted = await self._run(
                        agent, xfer, total, lambda: self.link.broken, posted=posted
                    )
            state = posted
        except TimeoutError:
            raise LLMException(
                f"one-sided NIXL {kind} not done within {timeout:.3g} s",
                status_code=_S.LLM_TIMEOUT,
            ) from None
        finally:
            await self._settle(
                agent, xfer, total if state == "DONE" else None, lambda: _local_runs(local)
            )
        if state == "DONE":
            return
        if state == "ERR":
            # broken before the caller hears of it (as a failure on the link's own loop
            # would be): the cluster is no longer listed as linked, and can be relinked
            await on_loop_ran(self._loop, self.link._break, "NIXL transfer failed")
        raise LLMException(f"one-sided NIXL {kind} failed", status_code=_S.LLM_LINK_FAILED)

    def _at(self, local: Payload, remote: DeviceRuns) -> _Descs:
        """:meth:`move_at`'s ``(bytes, (local kind, remote kind), local descriptors,
        remote descriptors)``: ``local`` paired with ``remote`` row by row.

        Raises:
            LLMException: as :meth:`move_at` (not registered; lengths differ).
        """
        if isinstance(local, DeviceRuns):
            total = local.total
            plan = self.offer_device(local)
        else:
            total = local.total if isinstance(local, LayoutViews) else sum(map(len, local))
            views = local if isinstance(local, list | LayoutViews) else list(local)
            plan = self.offer(views, total)
        far = _far_place(remote)
        if plan is None or far is None or self.peer_agent is None:
            raise LLMException(
                "one-sided NIXL transfer: the memory is not registered on both sides",
                status_code=_S.LLM_FEATURE_NOT_ENABLED,
            )
        if remote.total != total:
            raise LLMException(
                f"one-sided NIXL transfer of {total} bytes into {remote.total}",
                status_code=_S.LLM_PARAM_INVALID,
            )
        mem, dev, runs = plan
        far_mem, far_dev, far_runs = far
        return (total, (mem, far_mem), *pair(runs, far_runs, dev, far_dev))

    def _few(self, local: Payload, remote: DeviceRuns) -> _Descs | None:
        """:meth:`_at` from Python ints, where ``local`` and ``remote`` are device runs
        of at most :data:`_FEW_ROWS` rows, already paired (row by row of the same
        length), ``local`` inside one registered range: a leased transfer of a few
        blocks, for which numpy's fixed cost per call (~1-3 µs, several times that with
        cold caches) is more than the work. None for anything else (:meth:`_at`
        decides, and raises)."""
        if not isinstance(local, DeviceRuns) or not self._usable():
            return None
        count = len(local.runs)
        table, far = self._n._table(local.device), _far_place(remote)
        if not 0 < count <= _FEW_ROWS or len(remote.runs) != count or table is None or far is None:
            return None
        mine, theirs = local.runs.tolist(), remote.runs.tolist()
        if any(m[1] != t[1] for m, t in zip(mine, theirs, strict=True)):
            return None
        if not table.holds(min(a for a, _ in mine), max(a + n for a, n in mine)):
            return None
        dev, far_dev = table.dev, far[1]
        return (
            sum(n for _, n in mine),
            (table.mem, far[0]),
            [(a, n, dev) for a, n in mine],
            [(a, n, far_dev) for a, n in theirs],
        )

    async def move(self, op: MyOp, plan: Place) -> None:
        """Move ``op``'s payload with one NIXL transfer; when this returns or raises the
        transfer is over (done, aborted or, at worst, the link broken). A transfer that
        completed is marked moved whole (``op.stream`` sent) for the link to have the
        granter confirm it: the granter cannot stop a READ it did not post, and learns
        of a WRITE's landing only so. NIXL's completion of a WRITE is remote completion
        (its UCX backend flushes the endpoint), and the WRITE carries no notification:
        a notifying WRITE holds the next transfer on the link until the granter's
        progress sees the notification (measured: docs/benchmarks.md, "The raw WRITE
        without a notification")."""
        assert op.remote is not None and self.peer_agent is not None
        far_mem, far_dev, remote = op.remote
        mem, dev, runs = plan
        local, far = pair(runs, remote, dev, far_dev)
        kind = "READ" if op.is_read else "WRITE"
        agent = self._begin()
        if agent is None:  # the link is over: its operations fail with it
            op.finish(_S.LLM_LINK_FAILED)
            return
        try:
            xfer = agent.xfer(kind, local, far, self.peer_agent, b"", (mem, far_mem))
        except Exception as exc:  # e.g. a grant outside the peer's registered memory
            self._end(None)
            _log.warning("%r: NIXL refused a %s of request %d: %s", self.link, kind, op.rid, exc)
            peer = self.link.peer.cluster_id
            why = f"this side's NIXL refused the {kind} of cluster {peer}'s grant: {exc}"
            op.finish(_S.LLM_FAILED, why, ours=True)
            return
        state = "PROC"
        try:
            # the op ends before its check only badly (refused, revoked, link lost): stop then
            state = await self._run(agent, xfer, op.total, lambda: op.result is not None)
            if state == "ERR":
                self.link._break("NIXL transfer failed")
            elif state == "DONE":
                # every byte moved, but the granter may have revoked the grant (and
                # reused the memory) meanwhile: its confirmation ends the op
                op.stream = Stream(op.rid, [], 0)
                op.stream.sent = True
        finally:
            await self._settle(
                agent,
                xfer,
                op.total if state == "DONE" else None,
                lambda: (_device(mem, dev), runs),
            )

    async def _run(
        self,
        agent: Agent,
        xfer: object,
        total: int,
        stop: Callable[[], bool],
        *,
        posted: str | None = None,
    ) -> str:
        """Post ``xfer`` (``total`` bytes; unless ``posted``: its state after the post on
        this loop) and poll it until it ends or ``stop()``: posted on the running loop up
        to :data:`_POST_ON_LOOP` bytes and polled there :data:`_LOOP_POLLS` times, one
        per turn of the loop, below :data:`_OFF_LOOP`; else, and after those, from a
        worker thread, whose sleeps last as long as asked (a loop's, at least ~1 ms)."""
        if posted is None and total > _POST_ON_LOOP:
            return await self._wait_off_loop(agent, xfer, stop, posted=None)
        state = posted or agent.post(xfer)
        if total < _OFF_LOOP:
            for _ in range(_LOOP_POLLS):
                if state != "PROC" or stop():
                    return state
                await asyncio.sleep(0)
                state = agent.state(xfer)
        if state != "PROC" or stop():
            return state
        return await self._wait_off_loop(agent, xfer, stop, posted=state)

    async def _wait_off_loop(
        self, agent: Agent, xfer: object, stop: Callable[[], bool], *, posted: str | None
    ) -> str:
        """Post ``xfer`` (unless ``posted``: its state after the post) and poll it from a
        thread of the transport's wait lane (``time.sleep`` back-off) until it ends,
        ``stop()`` or we are cancelled. A job no thread took yet when we are cancelled
        never runs; one that started is always seen out."""
        stopped = threading.Event()

        def work() -> str:
            if posted is None and (stopped.is_set() or stop()):
                return "PROC"  # over before a thread was free: never posted
            state, delay = posted or agent.post(xfer), POLL_MIN_S
            while state == "PROC" and not stopped.is_set() and not stop():
                time.sleep(delay)
                delay = min(delay * 2, POLL_MAX_S)
                state = agent.state(xfer)
            return state

        # the transport's own lane: threads blocked elsewhere (a synchronizer) never delay it
        return await seen_out(
            self._n.wait_lane.submit(work, f"NIXL wait of {self.link!r}"), stopped.set
        )

    async def _settle(
        self,
        agent: Agent,
        xfer: object,
        moved: int | None,
        where: Callable[[], tuple[str, np.ndarray]],
    ) -> None:
        """Release ``xfer`` once it is no longer in flight, then :meth:`_end` it
        (``moved``: its bytes if it completed). NIXL frees a transfer in flight without
        stopping its bytes (UCX over TCP moves them on), so one not known to be over
        (cancelled, timed out, stopped) is waited for, shielded and bounded
        (:data:`SETTLE_S`); one that still does not end breaks the link, and its local
        memory ``where()`` (device, ``(addr, nbytes)`` rows) is quarantined: its bytes
        may still land there. A cancellation meanwhile is re-raised afterwards."""
        cancelled = False
        try:
            if moved is None:
                loop = asyncio.get_running_loop()
                end = loop.time() + SETTLE_S
                delay = POLL_MIN_S
                while agent.in_flight(xfer):
                    if loop.time() >= end:
                        _log.error(
                            "%r: a NIXL transfer does not end; dropping the link; its local "
                            "memory is kept from reuse",
                            self.link,
                        )
                        self._n.quarantine(*where())
                        on_loop(self._loop, self.link._break, "NIXL transfer could not be stopped")
                        break
                    try:
                        await asyncio.sleep(delay)
                    except asyncio.CancelledError:
                        cancelled = True
                    delay = min(delay * 2, POLL_MAX_S)
            if not agent.release(xfer):
                _log.warning("%r: NIXL did not release a transfer that is over", self.link)
        finally:
            self._end(moved)
        if cancelled:
            raise asyncio.CancelledError


def _device(mem: str, dev: int) -> str:
    """The device of NIXL memory ``mem`` (``DRAM`` / ``VRAM``) of device ``dev``."""
    return "cpu" if mem == "DRAM" else f"cuda:{dev}"


def _local_runs(local: Payload) -> tuple[str, np.ndarray]:
    """The device and ``(addr, nbytes)`` rows of a one-sided transfer's ``local``."""
    if isinstance(local, DeviceRuns):
        return local.device, local.runs
    views = local if isinstance(local, list | LayoutViews) else list(local)
    return "cpu", runs_of(views)


def _far_place(remote: DeviceRuns) -> Place | None:
    """The peer's memory ``remote`` as a NIXL place: host memory is ``DRAM``,
    ``cuda:N`` memory ``VRAM`` of device N; None for anything else."""
    if remote.device == "cpu":
        return ("DRAM", 0, remote.runs)
    kind, _, index = remote.device.partition(":")
    if kind == "cuda" and index.isdigit():
        return ("VRAM", int(index), remote.runs)
    return None
