"""``RemoteClient``: the local half of pulls and pushes.

Given a validated :class:`~aiokv._remote._parts.Transfer` (the request and the local
bytes it moves), it sends the encoded request(s) over the link, moves the bytes within
``sync_kv_timeout`` — through host staging when the local cache is in device memory —
and reports failure as one ``LLMException`` carrying the public operation and what it
was about: context added here, once. Pinning the local cache is the caller's business.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import torch

from .._cache import Cache
from .._cancel import redeliver
from .._config import LLMConfig
from .._copy import MAX_STAGED_BYTES, PART_BYTES, Stager
from .._engine import completing
from .._enums import LLMStatusCode
from .._errors import LLMException, map_errors
from .._layout import tensor_bytes, total_bytes
from .._stats import PeerCounters
from ..transport import BY_ADDRESS, ONE_SIDED, DeviceRuns, Link
from ._leases import LeaseKey, Leases, reply_size
from ._links import LinkTable
from ._parts import Part, Transfer
from ._protocol import BlocksReq, KeyByBlocks, LeaseReq, Request, encode
from ._route import Route, route

__all__ = ["RemoteClient"]

log = logging.getLogger("aiokv.remote")


class RemoteClient:
    """Sends requests over the links of one ``LLMDataDist``.

    Args:
        links: the link table (owned by ``LLMDataDist``).
        config: read at each call for ``sync_kv_timeout``.
        stager: host staging of device-resident bytes (shared with the peer service).
        counters: where each transfer is counted, per peer cluster.
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

    def link(self, op: str, cluster_id: int) -> Link:
        """The live link to ``cluster_id`` (``LLM_NOT_YET_LINK`` when there is none)."""
        return self._links.require(op, cluster_id)

    async def move(
        self,
        op: str,
        link: Link,
        cache: Cache,
        job: Transfer,
        *,
        write: bool,
        about: dict[str, Any],
    ) -> None:
        """Push (``write``) or pull the bytes ``job`` names of ``cache``, within
        ``sync_kv_timeout``.

        Host memory moves straight between the cache and the socket. Device memory that
        the link moves by address (:meth:`~aiokv.transport.Link.addressable`: NIXL with
        the cache registered as VRAM) moves directly, in parts of at most
        :data:`~aiokv._copy.MAX_STAGED_BYTES`, once work queued on the device's current
        stream is done; a part the peer grants from memory the link cannot reach by
        address moves through host staging instead. Other device memory moves through
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

        Raises:
            LLMException: as :meth:`transfer`; ``LLM_TIMEOUT`` covers the whole transfer.
        """
        lease_key = self._lease_key(link, cache, job, write)
        if lease_key is not None and await self._leased(op, link, cache, job, lease_key, about):
            return
        await self._move(op, link, cache, job, write=write, about=about)
        if lease_key is not None:  # it moved: ask for a lease, so that the next one is quicker
            count = len(job.tensors)
            assert self.leases is not None
            self.leases.want(link, lease_key, self._ask(link, lease_key, count), count)

    def _lease_key(self, link: Link, cache: Cache, job: Transfer, write: bool) -> LeaseKey | None:
        """What a lease for ``job`` would cover, when one could serve it: blocks of a
        blocks cache named by ``BlocksCacheKey``, over a
        link with the ``ONE_SIDED`` capability, from host memory or device memory the
        link moves by address (whether host memory is registered is up to
        :meth:`~aiokv.transport.OneSided.move_at`)."""
        req = job.request
        if (
            self.leases is None
            or not isinstance(req, BlocksReq)
            or not isinstance(req.key, KeyByBlocks)
            or req.release
            or job.remote is None
            or link.extra(ONE_SIDED) is None
        ):
            return None
        tensors = [cache.tensors[t] for t in job.tensors]
        if route(tensors[0].device, lambda: _addressable(link, tensors)) is Route.STAGED:
            return None
        return LeaseKey(req.key, req.tensors, req.block_bytes, write)

    async def _leased(
        self,
        op: str,
        link: Link,
        cache: Cache,
        job: Transfer,
        key: LeaseKey,
        about: dict[str, Any],
    ) -> bool:
        """Move ``job`` one-sidedly under a lease held for ``key``; False (nothing moved)
        when no lease covers it, or this side's memory is not registered with the link."""
        assert self.leases is not None and job.remote is not None
        held = self.leases.held(link, key)
        remote = None if held is None else held.remote(job.remote, write=key.write)
        if held is None or remote is None:
            return False
        tensors = [_flat(cache.tensors[t]) for t in job.tensors]
        device = tensors[0].device
        if device.type != "cpu":  # routed BY_ADDRESS (a lease is never STAGED): settle first
            with map_errors(op):
                await self._stager.settle(device)
        local = DeviceRuns(str(device), job.layout.addresses([t.data_ptr() for t in tensors]))
        try:
            with held.using():
                await self.transfer(
                    op, link, job.request, local, write=key.write, about=about, at=remote
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
            await link.read(
                encode(req), [memoryview(buf)], timeout=self._config.sync_kv_timeout / 1000
            )
        except LLMException as exc:
            log.debug("no lease from cluster %d: %s", link.peer.cluster_id, exc)
            return None
        return bytes(buf)

    async def _move(
        self,
        op: str,
        link: Link,
        cache: Cache,
        job: Transfer,
        *,
        write: bool,
        about: dict[str, Any],
    ) -> None:
        """:meth:`move` by request(s) (see there)."""
        device = cache.tensors[0].device
        way = route(device, lambda: _addressable(link, [cache.tensors[t] for t in job.tensors]))
        staged, direct = way is not Route.HOST_VIEWS, way is Route.BY_ADDRESS
        # staged: at least PIPELINE parts (so copies overlap the wire), of 1 MiB to PART_BYTES
        limit = (
            max(min(PART_BYTES, -(-job.nbytes // PIPELINE)), min(PART_BYTES, _MIN_PART))
            if staged and not direct
            else MAX_STAGED_BYTES
        )
        timeout = self._config.sync_kv_timeout / 1000
        if not staged and job.nbytes <= limit:  # the common case: one request, no copies
            views = job.layout.views([tensor_bytes(cache.tensors[t]) for t in job.tensors])
            await self.transfer(op, link, job.request, views, write=write, about=about)
            return
        deadline = asyncio.get_running_loop().time() + timeout
        parts = list(job.parts(limit))
        releasing = getattr(job.request, "release", False) and len(parts) > 1
        flat = [_flat(cache.tensors[t]) for t in job.tensors] if staged else []
        if direct:  # NIXL reads / writes the memory as it is: settle queued work first
            with map_errors(op):
                await self._stager.settle(device)

        def time_left() -> float:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                raise LLMException(
                    f"{op}: not done within sync_kv_timeout",
                    status_code=LLMStatusCode.LLM_TIMEOUT,
                    op=op,
                )
            return left

        committed = False  # a releasing part arrived: the peer released the key

        async def send(part: Part, views: Sequence[memoryview] | DeviceRuns, left: float) -> None:
            nonlocal committed
            await self.transfer(
                op, link, part.request, views, write=write, about=about, timeout=left
            )
            committed = committed or getattr(part.request, "release", False)

        async def one(part: Part) -> None:
            left = time_left()
            if direct:
                bases = [flat[t - job.tensors.start].data_ptr() for t in part.tensors]
                try:
                    await send(part, DeviceRuns(str(device), part.layout.addresses(bases)), left)
                    return
                except _NotDirect:  # the peer granted host memory NIXL cannot reach
                    left = time_left()
            if not staged:
                await send(
                    part,
                    part.layout.views([tensor_bytes(cache.tensors[t]) for t in part.tensors]),
                    left,
                )
                return
            bufs = [flat[t - job.tensors.start] for t in part.tensors]
            with map_errors(op):
                if write:
                    box = await self._stager.gather(bufs, part.layout, left, link.peer)
                else:
                    box = await self._stager.reserve(part.nbytes, bufs[0].device, left, link.peer)
            try:
                await send(part, [box.view], left)
                if not write:
                    scatter = self._stager.scatter(box, bufs, part.layout)
                    with map_errors(op):
                        if committed:
                            # the peer released the key on our READ_DONE: the pull has
                            # happened, so its bytes land whatever cancels us meanwhile
                            await completing(scatter)
                        else:
                            await scatter
            finally:
                box.release()

        body = parts[:-1] if releasing else parts
        room = asyncio.Semaphore(DEPTH)

        async def slot(part: Part) -> None:
            try:
                await one(part)
            finally:
                room.release()

        try:
            async with asyncio.TaskGroup() as group:
                for part in body:
                    await room.acquire()
                    group.create_task(slot(part))
        except BaseExceptionGroup as eg:
            raise _first(eg) from None
        except asyncio.CancelledError as exc:
            if not committed:  # (a pull in one part: the group held its releasing part)
                raise
            redeliver(exc)  # it has happened: done, the cancellation comes again later
        if releasing:
            await one(parts[-1])

    async def transfer(
        self,
        op: str,
        link: Link,
        request: Request,
        views: Sequence[memoryview] | DeviceRuns,
        *,
        write: bool,
        about: dict[str, Any],
        timeout: float | None = None,  # noqa: ASYNC109
        at: DeviceRuns | None = None,
    ) -> None:
        """Push ``views`` (``write``) or pull into them, as ``request`` names on the peer.

        ``timeout``: seconds (default ``sync_kv_timeout``). ``views`` may be device
        memory by address where the link takes it; a grant it cannot reach that way
        raises :class:`_NotDirect` (nothing moved). ``at``: the peer's memory under a
        lease: moved one-sidedly (:meth:`~aiokv.transport.Link.move_at`), no request.

        Raises:
            LLMException: the peer's refusal code, ``LLM_TIMEOUT`` past the timeout,
                ``LLM_LINK_FAILED``; ``op`` and ``about`` attached. On failure the
                bytes of a pull's destination are unspecified.
        """
        meta = b"" if at is not None else encode(request)
        if timeout is None:
            timeout = self._config.sync_kv_timeout / 1000
        cid = link.peer.cluster_id
        nbytes = views.total if isinstance(views, DeviceRuns) else total_bytes(views)
        try:
            with (
                self._links.request(cid),
                self._counters.requests(cid).measure(nbytes),
                map_errors(op),
            ):
                if at is not None:
                    await link.move_at(write, views, at, timeout=timeout)
                elif write:
                    await link.write(meta, views, timeout=timeout)
                else:
                    await link.read(meta, views, timeout=timeout)
        except LLMException as exc:
            if isinstance(views, DeviceRuns) and exc.context.get("direct") is False:
                raise _NotDirect from exc
            ctx = exc.in_context(op, **about)
            log.debug("%s %s cluster %d failed: %s", op, _dir(write), cid, ctx)
            if ctx is exc:
                raise
            raise ctx from exc
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s: %d bytes %s cluster %d", op, nbytes, _dir(write), cid)


def _dir(write: bool) -> str:
    return "to" if write else "from"


#: Parts of one transfer in flight at once.
DEPTH = 3
#: A staged transfer is cut into at least this many parts (when they stay >= _MIN_PART).
PIPELINE = 4
_MIN_PART = 1 << 20


class _NotDirect(Exception):
    """A request on device memory by address was granted memory the link cannot reach
    by address (``DIRECT_REFUSED``): nothing moved; stage it instead."""


def _addressable(link: Link, tensors: list[torch.Tensor]) -> bool:
    """Whether ``link`` moves all of each (accelerator) tensor by address (its
    ``BY_ADDRESS`` capability)."""
    by_address = link.extra(BY_ADDRESS)
    return (
        by_address is not None
        and tensors[0].device.type != "cpu"
        and all(
            by_address.addressable(str(t.device), t.data_ptr(), t.numel() * t.element_size())
            for t in tensors
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
