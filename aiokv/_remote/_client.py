"""``RemoteClient``: the local half of pulls and pushes.

Given a validated :class:`~aiokv._remote._parts.Transfer` (the request and the local
bytes it moves), it sends the encoded request(s) over the link, moves the bytes within
``sync_kv_timeout`` — through host staging when the local cache is in device memory —
and reports failure as one ``LLMException`` carrying the public operation and what it
was about: context added here, once. Pinning the local cache is the caller's business.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from dataclasses import field
from dataclasses import replace
from typing import Any

import msgspec
import torch

from .._cache import Cache
from .._cancel import redeliver
from .._config import LLMConfig
from .._copy import MAX_STAGED_BYTES
from .._copy import PART_BYTES
from .._copy import Stager
from .._engine import completing
from .._enums import LLMStatusCode
from .._errors import LLMException
from .._errors import map_errors
from .._layout import ByteLayout
from .._layout import total_bytes
from .._stats import OpCounter
from .._stats import PeerCounters
from ..transport import BY_ADDRESS
from ..transport import ONE_SIDED
from ..transport import DeviceRuns
from ..transport import Link
from ..transport import Payload
from ._leases import LeaseKey
from ._leases import Leases
from ._leases import reply_size
from ._links import LinkTable
from ._parts import Part
from ._parts import Transfer
from ._protocol import BlocksReq
from ._protocol import ChunksReq
from ._protocol import KeyByBlocks
from ._protocol import KeyByReq
from ._protocol import LeaseReq
from ._protocol import Message
from ._protocol import SlotReq
from ._protocol import WhichReq
from ._protocol import encode
from ._route import Route
from ._route import part_route
from ._route import route

__all__ = ["Move", "RemoteClient", "payload"]

log = logging.getLogger("aiokv.remote")


@dataclass(frozen=True, slots=True)
class Move:
    """One transfer for :meth:`RemoteClient.move` / :meth:`RemoteClient.move_here`: push
    (``write``) or pull the bytes ``job`` names of the local ``cache`` over ``link``, for
    the public operation ``op``; ``about`` is the context a failure's ``LLMException``
    carries (the key, the cluster). ``counted``: counted as an operation of its own in
    the peer's ``requests`` statistics; ``False`` for one send of a layer-wise transfer,
    which is counted whole (:func:`~aiokv._layerwise.run_layers`)."""

    op: str
    link: Link
    cache: Cache
    job: Transfer
    write: bool
    about: dict[str, Any]
    counted: bool = True


class RemoteClient:
    """Sends requests over the links of one ``LLMDataDist``.

    Args:
        links: the link table (owned by ``LLMDataDist``).
        config: read at each call for ``sync_kv_timeout``.
        stager: host staging of device-resident bytes (shared with the peer service).
        counters: where each transfer is counted, per peer cluster: once per
            :meth:`move` / :meth:`move_here`, however many requests it takes.
        leases: the leases this side holds (and lends); shared with the peer service.
    """

    def __init__(
        self,
        links: LinkTable,
        config: LLMConfig,
        stager: Stager,
        counters: PeerCounters | None = None,
        leases: Leases | None = None,
    ) -> None:
        self._links = links
        self._config = config
        self._stager = stager
        self._counters = counters if counters is not None else PeerCounters()
        self.leases = leases

    @property
    def timeout(self) -> float:
        """``sync_kv_timeout`` in seconds, as configured now."""
        return self._config.sync_kv_timeout / 1000

    def requests(self, cluster_id: int) -> OpCounter:
        """The counter of this side's transfers to ``cluster_id`` (its ``requests``
        statistics); look it up on the engine thread, right before counting on it."""
        return self._counters.requests(cluster_id)

    def link(self, op: str, cluster_id: int) -> Link:
        """The live link to ``cluster_id`` (``LLM_NOT_YET_LINK`` when there is none)."""
        return self._links.require(op, cluster_id)

    async def move(self, m: Move) -> None:
        """Push (``m.write``) or pull the bytes ``m.job`` names of ``m.cache``, within
        ``sync_kv_timeout``.

        Host memory moves straight between the cache and the socket. Device memory that
        the link moves by address (:meth:`~aiokv.transport.Link.addressable`: NIXL with
        the cache registered as VRAM) moves directly, in parts of at most
        :data:`~aiokv._copy.MAX_STAGED_BYTES`, once work queued on the device's current
        stream is done; once the peer grants a part memory the link cannot reach by
        address (that part moved nothing), the route of the transfer's parts is staged
        (:func:`~._route.part_route`): that part's and those of every part started
        later, which are never asked by address. Other device memory moves through
        host staging, in parts (at least :data:`PIPELINE` parts of 1 MiB to
        :data:`~aiokv._copy.PART_BYTES`) pipelined :data:`DEPTH` deep: the device→host
        copy of one part overlaps the send of the previous one (a pull: the host→device
        copy of one part overlaps the receipt of the next). A transfer over
        :data:`~aiokv._copy.MAX_STAGED_BYTES` is split too, whatever its memory: that is
        what a peer serving from device memory accepts in one request. Only the last
        part of a pull by ``CacheKey`` releases the key, once every other part landed.

        Blocks of a blocks cache that a lease covers (:mod:`._leases`: one-sided links,
        memory both sides reach by address) move with one one-sided transfer and no
        request; after a transfer by request that a lease could have served, one is
        asked for in the background.

        It counts among the link table's requests in flight for all of its run, its
        parts' staging included, so a graceful unlink waits for it.

        Raises:
            LLMException: as :meth:`transfer`; ``LLM_TIMEOUT`` covers the whole transfer.
        """
        lease_key = self._lease_key(m)
        # in flight from its start to its end, between its requests too (a part being
        # staged, a settle): a graceful unlink waits for the whole transfer; counted once
        cid = m.link.peer.cluster_id
        counted: contextlib.AbstractContextManager[object, None] = (
            self._counters.requests(cid).measure(payload(m.job))
            if m.counted
            else contextlib.nullcontext()
        )
        with self._links.request(cid), counted:
            if lease_key is not None and await self._leased(m, lease_key, here=False):
                return
            await _Requests(self, m).run()
        if lease_key is not None:  # it moved: ask for a lease, so that the next one is quicker
            count = len(m.job.tensors)
            assert self.leases is not None
            self.leases.want(m.link, lease_key, self._ask(m.link, lease_key, count), count)

    async def move_here(self, m: Move) -> bool:
        """:meth:`move` of ``m`` on the caller's own asyncio loop, with no hop to the
        engine, where a lease held covers it and its memory here is host memory: one
        one-sided transfer, bounded by ``sync_kv_timeout``, after one yield to the loop;
        a cancellation aborts (or settles) it before it is raised. False when nothing
        moved and the transfer goes through the engine (:meth:`move`): no lease, device
        memory, or the lease failed as :meth:`move` would then go by request.

        What it touches off the engine (docs/design.md, "Threads"): the lease tables by
        single dict reads, the lease's ``using`` / ``forget`` (thread-safe), the link's
        one-sided transfer (its counters under the transport's lock; the link's state
        changes are sent to the engine loop) and the statistics counters (locked). It
        is not counted among the link table's requests in flight (engine-owned): an
        unlink waits for it through the lease instead (``Leases.end_link``).

        Raises:
            LLMException: as :meth:`move`.
        """
        if m.cache.tensors[m.job.tensors[0]].device.type != "cpu":
            return False
        key = self._lease_key(m)
        if key is None or self.leases is None or self.leases.held(m.link, key) is None:
            return False
        # a scheduling and cancellation point (nothing moved yet): a transfer NIXL
        # completes within its post would otherwise never yield to the caller's loop
        await asyncio.sleep(0)
        with self._counters.requests(m.link.peer.cluster_id).measure(payload(m.job)) as op:
            moved = await self._leased(m, key, here=True)
            if not moved:
                op.void()  # it goes through the engine (move), counted there
        return moved

    def _lease_key(self, m: Move) -> LeaseKey | None:
        """What a lease for ``m`` would cover, when one could serve it: blocks of a
        blocks cache named by ``BlocksCacheKey``, over a
        link with the ``ONE_SIDED`` capability, from host memory or device memory the
        link moves by address (whether host memory is registered is up to
        :meth:`~aiokv.transport.OneSided.move_at`)."""
        req, link = m.job.request, m.link
        if (
            self.leases is None
            or not isinstance(req, BlocksReq)
            or not isinstance(req.key, KeyByBlocks)
            or req.release
            or m.job.remote is None
            or m.job.local is None
            or link.extra(ONE_SIDED) is None
        ):
            return None
        device = m.cache.tensors[m.job.tensors[0]].device
        if route(device, lambda: _addressable(link, m.cache, m.job.tensors)) is Route.STAGED:
            return None
        return LeaseKey(req.key, req.tensors, req.block_bytes, m.write)

    async def _leased(self, m: Move, key: LeaseKey, *, here: bool) -> bool:
        """Move ``m`` one-sidedly under a lease held for ``key``; False (nothing moved)
        when no lease covers it, or this side's memory is not registered with the link.
        ``here``: on the caller's loop (:meth:`move_here`), not the engine's."""
        job = m.job
        assert self.leases is not None and job.remote is not None and job.local is not None
        held = self.leases.held(m.link, key)
        if held is None:
            return False
        rows = held.rows(job.remote, job.local, m.cache.bases(job.tensors), write=key.write)
        if rows is None:
            return False
        device = m.cache.tensors[job.tensors[0]].device
        if device.type != "cpu":  # routed BY_ADDRESS (a lease is never STAGED): settle first
            with map_errors(m.op):
                await self._stager.settle(device)
        local, remote = DeviceRuns(str(device), rows[0]), DeviceRuns(held.device, rows[1])
        try:
            with held.using() as ok:
                if not ok:  # ended meanwhile (revoked): the transfer goes by request
                    return False
                await self.transfer(
                    m.op,
                    m.link,
                    job.request,
                    local,
                    write=key.write,
                    about=m.about,
                    at=remote,
                    counted=not here,
                )
        except LLMException as exc:
            if exc.status_code is LLMStatusCode.LLM_FEATURE_NOT_ENABLED:
                return False  # nothing moved: this side's memory goes by request
            self.leases.forget(held)  # later transfers go by request (and may ask again)
            if exc.status_code is LLMStatusCode.LLM_FAILED:
                return False  # NIXL refused the lease's memory; nothing moved
            raise
        return True

    async def _ask(self, link: Link, key: LeaseKey, count: int) -> bytes | None:
        """Read the lease for ``key`` (on ``count`` tensors) from the peer; None if it
        refused (logged at DEBUG: the transfers just keep their requests)."""
        buf = bytearray(reply_size(count))
        req = LeaseReq(key.key, key.tensors, key.block_bytes, key.write)
        try:
            await link.read(encode(req), [memoryview(buf)], timeout=self.timeout)
        except LLMException as exc:
            log.debug("no lease from cluster %d: %s", link.peer.cluster_id, exc)
            return None
        return bytes(buf)

    async def transfer(
        self,
        op: str,
        link: Link,
        request: Message,
        views: Payload,
        *,
        write: bool,
        about: dict[str, Any],
        timeout: float | None = None,
        at: DeviceRuns | None = None,
        counted: bool = True,
    ) -> bool:
        """Push ``views`` (``write``) or pull into them, as ``request`` names on the peer.

        ``timeout``: seconds (default ``sync_kv_timeout``). ``views`` may be device
        memory by address where the link takes it. ``at``: the peer's memory under a
        lease: moved one-sidedly (:meth:`~aiokv.transport.Link.move_at`), no request.
        ``counted``: counted among the link table's requests in flight (engine only;
        not a leased move on the caller's loop).

        Returns:
            Whether it moved: False only for a request (no ``at``) on device memory by
            address that the peer granted memory the link cannot reach so (the
            transport's ``DIRECT_REFUSED``): nothing moved and the peer let go; where
            the bytes go then is the route's call (:func:`~._route.part_route`).

        Raises:
            LLMException: the peer's refusal code, ``LLM_TIMEOUT`` past the timeout,
                ``LLM_LINK_FAILED``; ``op`` and ``about`` attached. On failure the
                bytes of a pull's destination are unspecified.
        """
        meta = b"" if at is not None else encode(request)
        if timeout is None:
            timeout = self.timeout
        cid = link.peer.cluster_id
        nbytes = views.total if isinstance(views, DeviceRuns) else total_bytes(views)
        try:
            with (
                self._links.request(cid) if counted else contextlib.nullcontext(),
                map_errors(op),
            ):
                if at is not None:
                    await link.move_at(write, views, at, timeout=timeout)
                elif write:
                    await link.write(meta, views, timeout=timeout)
                else:
                    await link.read(meta, views, timeout=timeout)
        except LLMException as exc:
            if at is None and isinstance(views, DeviceRuns) and exc.context.get("direct") is False:
                return False
            ctx = exc.in_context(op, **about)
            log.debug("%s %s cluster %d failed: %s", op, _dir(write), cid, ctx)
            if ctx is exc:
                raise
            raise ctx from exc
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s: %d bytes %s cluster %d", op, nbytes, _dir(write), cid)
        return True


@dataclass(eq=False, slots=True)
class _Requests:
    """One transfer of :meth:`RemoteClient.move` by request(s), as its parts run.

    Attributes (after the client and the :class:`Move`):
        way: the route of the transfer's memory here (:func:`~._route.route`), decided
            before it is cut into parts.
        unreachable: the peer granted a part by address memory the link cannot reach
            so; each part's route (:func:`~._route.part_route`) is decided from it.
        committed: a releasing part arrived (the peer released the key).
    """

    client: RemoteClient
    m: Move
    way: Route = Route.HOST_VIEWS
    deadline: float = 0.0
    flat: list[torch.Tensor] = field(default_factory=list)
    unreachable: bool = False
    committed: bool = False

    async def run(self) -> None:
        """Move the transfer within ``sync_kv_timeout``, as :meth:`RemoteClient.move`
        tells."""
        job, cache, link = self.m.job, self.m.cache, self.m.link
        device = cache.tensors[0].device
        self.way = route(device, lambda: _addressable(link, cache, job.tensors))
        limit = MAX_STAGED_BYTES
        if self.way is Route.STAGED:  # at least PIPELINE parts of 1 MiB to PART_BYTES
            limit = max(min(PART_BYTES, -(-job.nbytes // PIPELINE)), min(PART_BYTES, _MIN_PART))
        timeout = self.client.timeout
        if self.way is Route.HOST_VIEWS and job.nbytes <= limit:  # one request, no copies
            await self._send(job.whole(), timeout)
            return
        self.deadline = asyncio.get_running_loop().time() + timeout
        parts = list(job.parts(limit))
        releasing = getattr(job.request, "release", False) and len(parts) > 1
        if self.way is not Route.HOST_VIEWS:
            self.flat = [_flat(cache.tensors[t]) for t in job.tensors]
        if self.way is Route.BY_ADDRESS:  # NIXL moves the memory as it is: settle first
            with map_errors(self.m.op):
                await self.client._stager.settle(device)
        if len(parts) > 1 and not self.m.write:
            parts = await self._pinned(parts)
        if releasing and self.way is not Route.HOST_VIEWS and isinstance(job.request, _OF_SLOT):
            # device memory: a part that landed is still copied here (staging) after the
            # peer released the key; release with a byte of it once all of it is here
            last = parts[-1]
            unreleased = msgspec.structs.replace(last.request, release=False)
            await self._pipelined([*parts[:-1], replace(last, request=unreleased)])
            tail = msgspec.structs.replace(job.tail(), key=last.request.key)  # type: ignore[union-attr]
            one = Part(tail, range(0), ByteLayout.of_span(0, 1), 1)
            await self._send(one, self._left(), [memoryview(bytearray(1))])
            return
        await self._pipelined(parts[:-1] if releasing else parts)
        if releasing:
            await self._one(parts[-1])

    async def _pinned(self, parts: list[Part]) -> list[Part]:
        """``parts`` of a pull by ``CacheKey`` naming the cache the key names now (asked
        of the peer first): a key bound anew between two parts fails the later one
        (``LLM_KV_CACHE_NOT_EXIST``) rather than read another cache. Other pulls: as
        they are."""
        key = getattr(parts[0].request, "key", None)
        if not isinstance(key, KeyByReq):
            return parts
        buf = bytearray(8)
        await self.client.transfer(
            self.m.op,
            self.m.link,
            WhichReq(key),
            [memoryview(buf)],
            write=False,
            about=self.m.about,
            timeout=self._left(),
        )
        pinned = msgspec.structs.replace(key, cache_id=int.from_bytes(buf, "little"))
        return [replace(p, request=msgspec.structs.replace(p.request, key=pinned)) for p in parts]

    async def _pipelined(self, parts: list[Part]) -> None:
        """Move ``parts``, :data:`DEPTH` at once. Cancelled once a releasing part
        arrived, it ends as done (the cancellation comes again at the next await)."""
        room = asyncio.Semaphore(DEPTH)

        async def slot(part: Part) -> None:
            try:
                await self._one(part)
            finally:
                room.release()

        try:
            async with asyncio.TaskGroup() as group:
                for part in parts:
                    await room.acquire()
                    group.create_task(slot(part))
        except BaseExceptionGroup as eg:
            raise _first(eg) from None
        except asyncio.CancelledError as exc:
            if not self.committed:  # (a pull in one part: the group held its releasing part)
                raise
            redeliver(exc)  # it has happened: done, the cancellation comes again later

    async def _one(self, part: Part) -> None:
        """Move ``part`` by its route (:func:`~._route.part_route`), decided when it
        starts; a grant by address of memory the link cannot reach (nothing moved)
        decides it again, for this part and every later one."""
        left = self._left()
        way = part_route(self.way, unreachable_grant=self.unreachable)
        if way is Route.BY_ADDRESS:
            bases = [self.flat[t - self.m.job.tensors.start].data_ptr() for t in part.tensors]
            runs = DeviceRuns(str(self.flat[0].device), part.layout.addresses(bases))
            if await self._send(part, left, runs):
                return
            self.unreachable = True
            way = part_route(self.way, unreachable_grant=True)
            left = self._left()
        if way is Route.STAGED:
            await self._staged(part, left)
        else:
            await self._send(part, left)

    async def _staged(self, part: Part, left: float) -> None:
        """Move ``part`` through a host staging buffer (gathered before a push,
        scattered after a pull)."""
        stager, write = self.client._stager, self.m.write
        bufs = [self.flat[t - self.m.job.tensors.start] for t in part.tensors]
        with map_errors(self.m.op):
            if write:
                box = await stager.gather(bufs, part.layout, left, self.m.link.peer)
            else:
                box = await stager.reserve(part.nbytes, bufs[0].device, left, self.m.link.peer)
        try:
            await self._send(part, left, [box.view])
            if not write:
                scatter = stager.scatter(box, bufs, part.layout)
                with map_errors(self.m.op):
                    if self.committed:
                        # the peer released the key on our READ_DONE: the pull has
                        # happened, so its bytes land whatever cancels us meanwhile
                        await completing(scatter)
                    else:
                        await scatter
        finally:
            box.release()

    async def _send(self, part: Part, left: float, views: Payload | None = None) -> bool:
        """One request: ``part`` between the peer and ``views`` (default: the host
        memory of the cache itself) within ``left`` seconds; whether it moved (see
        :meth:`RemoteClient.transfer`)."""
        if views is None:  # host memory: found by address, no Python object per tensor
            views = self.m.cache.at(part.layout, part.tensors)
        moved = await self.client.transfer(
            self.m.op,
            self.m.link,
            part.request,
            views,
            write=self.m.write,
            about=self.m.about,
            timeout=left,
        )
        self.committed = self.committed or (moved and getattr(part.request, "release", False))
        return moved

    def _left(self) -> float:
        """Seconds left until the deadline (``LLM_TIMEOUT`` when none are)."""
        left = self.deadline - asyncio.get_running_loop().time()
        if left <= 0:
            raise LLMException(
                f"{self.m.op}: not done within sync_kv_timeout",
                status_code=LLMStatusCode.LLM_TIMEOUT,
                op=self.m.op,
            )
        return left


def payload(job: Transfer) -> int:
    """Bytes ``job`` moves, without building its layout (a leased move never needs it)."""
    per_tensor = job.block_bytes if job.local is None else int(job.local.size) * job.block_bytes
    return len(job.tensors) * per_tensor


def _dir(write: bool) -> str:
    return "to" if write else "from"


#: Requests into one batch slot: a pull by a key that it may release.
_OF_SLOT = (SlotReq, ChunksReq)
#: Parts of one transfer in flight at once.
DEPTH = 3
#: A staged transfer is cut into at least this many parts (when they stay >= _MIN_PART).
PIPELINE = 4
_MIN_PART = 1 << 20


def _addressable(link: Link, cache: Cache, tensors: range) -> bool:
    """Whether ``link`` moves all of each of ``tensors`` of ``cache`` (accelerator
    memory) by address (its ``BY_ADDRESS`` capability)."""
    by_address = link.extra(BY_ADDRESS)
    chosen = [cache.tensors[t] for t in tensors]
    return (
        by_address is not None
        and chosen[0].device.type != "cpu"
        and all(
            by_address.addressable(str(t.device), t.data_ptr(), t.numel() * t.element_size())
            for t in chosen
        )
    )


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).reshape(-1)


def _first(eg: BaseExceptionGroup[BaseException]) -> BaseException:
    """The error to raise for a failed group of parts: the first ``LLMException``, else
    the first error (a ``CancelledError`` only if nothing else failed)."""
    leaves: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for x in e.exceptions:
                walk(x)
        else:
            leaves.append(e)

    walk(eg)
    for kinds in (LLMException, Exception):
        for e in leaves:
            if isinstance(e, kinds):
                return e
    return leaves[0]
