"""``PeerService``: answers peers' reads and writes against this side's registry.

It is the transport's ``RequestHandler``. Everything a peer sends is untrusted: the
request is decoded and bound-checked by :mod:`._protocol` first, then every field is
checked against what this side registered — the key exists, the tensors, blocks, slot
and sizes are inside that cache, pushes are allowed — before a single buffer is handed
out. A request can only ever reach the memory of a registered cache (or, for raw
addresses, of ONE registered, remote-accessible tensor per address).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from .._cache import Cache
from .._checks import Blocks
from .._checks import repeated
from .._checks import tensor_range
from .._config import LLMConfig
from .._copy import MAX_STAGED_BYTES
from .._copy import Stager
from .._copy import is_staged
from .._enums import DataType
from .._enums import LLMStatusCode
from .._errors import LLMException
from .._errors import code_of_failure
from .._layout import ByteLayout
from .._layout import LayoutViews
from .._layout import total_bytes
from .._models import CacheKey
from .._registry import CacheRegistry
from .._registry import Entry
from .._stats import PeerCounters
from ..transport import DeviceRuns
from ..transport import DirectCheck
from ..transport import Grant
from ..transport import PeerInfo
from ..transport._base import decode_reason
from ._inbox import Inbox
from ._leases import Leases
from ._protocol import MAX_BLOCKS
from ._protocol import AddrsReq
from ._protocol import BlocksReq
from ._protocol import ChunksReq
from ._protocol import Key
from ._protocol import KeyByBlocks
from ._protocol import KeyById
from ._protocol import KeyByReq
from ._protocol import LeaseReq
from ._protocol import Message
from ._protocol import NotifyReq
from ._protocol import RevokeReq
from ._protocol import SlotReq
from ._protocol import Tensors
from ._protocol import WhichReq
from ._protocol import blocks_of
from ._protocol import decode
from ._protocol import top_block
from ._route import Route
from ._route import route

__all__ = ["PeerService"]

#: where a checked request's buffers are: tensors of the one cache it names, or
#: ``(entry, tensor, offset)`` of each raw address it names
_Places = range | list[tuple[Entry, int, int]]

log = logging.getLogger("aiokv.remote")

Code = LLMStatusCode


class _Refused(Exception):
    """A request this side will not serve; becomes a refusal ``Grant`` with ``code``."""

    def __init__(self, code: LLMStatusCode, why: str) -> None:
        super().__init__(why)
        self.code = code


def _invalid(why: str) -> _Refused:
    return _Refused(Code.LLM_PARAM_INVALID, why)


def _missing(key: Key) -> _Refused:
    return _Refused(Code.LLM_KV_CACHE_NOT_EXIST, f"no cache for {key}")


def _blocks(raw: bytes, limit: int, what: str, *, unique: bool, most: int | None = None) -> Blocks:
    """A peer's block list, checked in numpy before anything is built from it: entries
    in ``[0, limit)``, at most ``most`` of them (default ``limit``; counted before the
    list is unfolded), distinct if ``unique``. Capping the count at what the served
    memory holds bounds the work of one request by the cost of a legitimate whole-cache
    transfer."""
    try:
        blocks = blocks_of(raw, limit if most is None else most)
    except ValueError as exc:
        raise _invalid(f"{what} {exc}") from None
    if blocks.size == 0:
        raise _invalid(f"{what} is empty")
    top = int(blocks.max())
    if top >= limit:
        raise _invalid(f"{what} entry {top} is out of range [0, {limit})")
    if unique and (twice := repeated(blocks)) is not None:
        raise _invalid(f"a block of {what} appears twice: {twice}")
    return blocks


class _LayoutMemo:
    """The last few block lists this side validated and laid out, by their wire bytes.

    A layer-wise transfer sends the same block list with every layer's request; its
    checks (:func:`_blocks`) and runs (:meth:`ByteLayout.of_blocks`) depend only on the
    bytes and the limits, so they are made once (a layout is immutable). Only lists
    that passed are kept (a refused one is checked again, and refused again), at most
    :data:`SIZE` of lists that unfold to at most :data:`MOST_BYTES` bytes of int64 each.
    """

    SIZE = 8
    MOST_BYTES = 256 << 10

    def __init__(self) -> None:
        self._kept: OrderedDict[tuple[bytes, int, bool, int, int | None], ByteLayout] = (
            OrderedDict()
        )

    def get(
        self,
        raw: bytes,
        limit: int,
        *,
        unique: bool,
        block_bytes: int,
        stride: int | None = None,
        most: int | None = None,
    ) -> ByteLayout:
        """The layout of the blocks ``raw`` names: :func:`_blocks` (entries in
        ``[0, limit)``, at most ``limit`` or, with a ``stride``, ``most`` (default
        :data:`MAX_BLOCKS`) of them), then :meth:`ByteLayout.of_blocks`. ``most`` must
        depend only on ``raw`` and the other arguments (it is not part of the memo's key).

        Raises:
            _Refused: as :func:`_blocks`.
        """
        key = (raw, limit, unique, block_bytes, stride)
        hit = self._kept.get(key)
        if hit is not None:
            self._kept.move_to_end(key)
            return hit
        if stride is None:
            most = None
        elif most is None:
            most = MAX_BLOCKS
        blocks = _blocks(raw, limit, "blocks", unique=unique, most=most)
        layout = ByteLayout.of_blocks(blocks, block_bytes, stride=stride)
        if 8 * blocks.size <= self.MOST_BYTES:  # unfolded: a folded list may be tiny
            self._kept[key] = layout
            if len(self._kept) > self.SIZE:
                self._kept.popitem(last=False)
        return layout


class PeerService:
    """Serves peers' requests for one ``LLMDataDist`` (a transport ``RequestHandler``).

    Args:
        cluster_id: this side's cluster id (keys naming another are not ours).
        registry: the caches requests may reach.
        config: read at each request (``sync_kv_timeout``, remote access).
        stager: host staging for device memory; without one, requests on device
            memory are refused with ``LLM_FEATURE_NOT_ENABLED``.
        counters: where each request served is counted, per peer cluster.
        leases: the leases this side lends and holds; without them, lease requests are
            refused with ``LLM_FEATURE_NOT_ENABLED``.
        inbox: where peers' notifications are filed; without one, they are refused
            with ``LLM_FEATURE_NOT_ENABLED``.
    """

    def __init__(
        self,
        cluster_id: int,
        registry: CacheRegistry,
        config: LLMConfig,
        stager: Stager | None = None,
        counters: PeerCounters | None = None,
        leases: Leases | None = None,
        inbox: Inbox | None = None,
    ) -> None:
        self._cluster_id = cluster_id
        self._registry = registry
        self._config = config
        self._stager = stager
        self._counters = counters if counters is not None else PeerCounters()
        self._leases = leases
        self._inbox = inbox
        self._layouts = _LayoutMemo()

    # ---- RequestHandler -----------------------------------------------------------------
    async def grant_read(
        self, peer: PeerInfo, meta: bytes, *, direct: DirectCheck | None = None
    ) -> Grant:
        """A peer pulls from us: the buffers to send, or a refusal. Device memory that
        ``direct`` accepts is granted by address (:attr:`Grant.device`), else staged."""
        return await self._grant(peer, meta, None, write=False, direct=direct)

    async def grant_write(
        self, peer: PeerInfo, meta: bytes, nbytes: int, *, direct: DirectCheck | None = None
    ) -> Grant:
        """A peer pushes ``nbytes`` into us: the buffers to fill, or a refusal
        (``direct`` as for :meth:`grant_read`).

        The transport refuses a grant whose buffers do not total ``nbytes``.
        """
        return await self._grant(peer, meta, nbytes, write=True, direct=direct)

    def grant_now(
        self, peer: PeerInfo, meta: bytes, nbytes: int, *, write: bool, direct: DirectCheck | None
    ) -> Grant | None:
        """The answer of :meth:`grant_write` (``write``) or :meth:`grant_read` when it
        needs no waiting: host memory, a refusal, a lease, a notification (the
        transport asks this first: see :class:`~aiokv.transport._base.ImmediateHandler`).
        None for device memory and a lease's revocation, which wait (staging, the
        lease's users): checked, but nothing pinned, counted or logged; the transport
        then awaits the method, which checks the request again."""
        with self._registry.lock:  # look up and pin as one step (callers free concurrently)
            answer = self._grant_locked(
                peer, meta, nbytes, write=write, direct=direct, pin_device=False
            )
        return answer if isinstance(answer, Grant) else None

    # ---- requests -----------------------------------------------------------------------
    async def _grant(
        self, peer: PeerInfo, meta: bytes, nbytes: int | None, *, write: bool, direct: _Direct
    ) -> Grant:
        with self._registry.lock:  # look up and pin as one step (callers free concurrently)
            answer = self._grant_locked(peer, meta, nbytes, write=write, direct=direct)
        if isinstance(answer, Grant):
            return answer
        if isinstance(answer, RevokeReq):
            assert self._leases is not None
            await self._leases.release(peer, answer.lease)
            return Grant(Code.LLM_SUCCESS, [], done=_ignore)
        return await self._staged(peer, answer, write=write)

    def _grant_locked(
        self,
        peer: PeerInfo,
        meta: bytes,
        nbytes: int | None,
        *,
        write: bool,
        direct: DirectCheck | None,
        pin_device: bool = True,
    ) -> Grant | _Device | RevokeReq:
        """The answer to a request whose frame names ``nbytes`` of payload (None: not
        known here; the transport checks the grant's size): a grant (or refusal), a
        device plan (pinned unless not ``pin_device``) or a lease's revocation, both
        still to serve. A transfer of another size than ``nbytes`` is refused before
        anything is staged or pinned for it."""
        try:
            req = _decoded(meta, nbytes, write=write)
            places: _Places
            if isinstance(req, LeaseReq | RevokeReq):
                return self._lease_req(peer, req, write=write)
            if isinstance(req, NotifyReq):
                return self._notify(peer, req, write=write)
            if isinstance(req, WhichReq):
                return self._which(peer, req, write=write)
            if isinstance(req, AddrsReq):
                if not write:
                    raise _invalid("address reads are not served")
                entries, layout, places = self._addrs(req)
                release = None
            else:
                entry, slot, key = self._lookup(req.key)
                self._check_access(entry, write=write, key=req.key)
                layout, places = self._layout(req, entry.cache, slot, write=write)
                entries = [entry]
                release = None
                # only the releasing request of a pull counts as read (its other parts
                # do not: a pull that fails after some of them marks nothing read)
                if not write and key is not None and getattr(req, "release", False):
                    release = _Release(key, _read_tensors(req.tensors))
            if nbytes is not None and (total := layout.total(len(places))) != nbytes:
                raise _invalid(f"the request is {nbytes} bytes, not {total}")
            device = views = None
            if is_staged(entries[0].cache.tensors[0].device):  # not HOST_VIEWS: see there
                device = self._device_plan(entries, layout, places, release, direct)
            else:
                views = _host_views(entries[0].cache, layout, places)
        except _Refused as r:
            return self._refuse(peer, write, r.code, str(r))
        try:
            if device is not None:
                if pin_device:
                    self._registry.pin(*entries)  # refuses memory being unregistered
                return device
            assert views is not None
            grant = self._issue(entries, views, release)
        except LLMException as exc:  # e.g. the memory is being unregistered
            self._counters.served(peer.cluster_id).refused(exc.status_code)
            raise
        return self._counted(peer, write, grant, total_bytes(views))

    def _lease_req(
        self, peer: PeerInfo, req: LeaseReq | RevokeReq, *, write: bool
    ) -> Grant | RevokeReq:
        """A lease asked for (a read: its reply) or revoked by its granter (a write of
        nothing: answered once this side stopped using it)."""
        if self._leases is None:
            raise _Refused(Code.LLM_FEATURE_NOT_ENABLED, "no leases here")
        if isinstance(req, RevokeReq):
            if not write:
                raise _invalid("a revocation is a write")
            return req
        if write:
            raise _invalid("a lease is asked for with a read")
        entry, _, _ = self._lookup(req.key)
        self._check_access(entry, write=req.write, key=req.key)
        tensors = self._tensors(req.tensors, entry.cache)
        _check_blocks_cache(entry.cache, req.block_bytes)
        try:
            lid, reply = self._leases.lend(peer, entry, tensors, write=req.write)
        except LLMException as exc:
            raise _Refused(exc.status_code, str(exc)) from None
        leases = self._leases

        def done(ok: bool) -> None:
            if not ok:  # the holder did not get it: it never started
                leases.cancel(lid)

        grant = Grant(Code.LLM_SUCCESS, [memoryview(bytearray(reply))], done=done)
        return self._counted(peer, False, grant, len(reply))

    def _which(self, peer: PeerInfo, req: WhichReq, *, write: bool) -> Grant:
        """Which cache a ``CacheKey`` names now (a read of its id: 8 bytes, uint64 LE),
        for the parts of a pull by it to name (:attr:`KeyByReq.cache_id`)."""
        if write:
            raise _invalid("a cache key is looked up with a read")
        entry, _, _ = self._lookup(req.key)
        self._check_access(entry, write=False, key=req.key)
        reply = int(entry.cache.cache_id).to_bytes(8, "little")
        grant = Grant(Code.LLM_SUCCESS, [memoryview(bytearray(reply))], done=_ignore)
        return self._counted(peer, False, grant, len(reply))

    def _notify(self, peer: PeerInfo, req: NotifyReq, *, write: bool) -> Grant:
        """A notification (a write of nothing, its payload bounded by the decoder): filed
        in the inbox, or refused with ``LLM_LINK_BUSY`` when the inbox is full."""
        if self._inbox is None:
            raise _Refused(Code.LLM_FEATURE_NOT_ENABLED, "no notifications here")
        if not write:
            raise _invalid("a notification is a write")
        if not self._inbox.put(peer.cluster_id, req.payload):
            raise _Refused(Code.LLM_LINK_BUSY, "the notification queue is full")
        return Grant(Code.LLM_SUCCESS, [], done=_ignore)

    def _refuse(self, peer: PeerInfo, write: bool, code: LLMStatusCode, why: str) -> Grant:
        """A refusal, logged, counted and carrying its reason to the peer."""
        log.warning(
            "refused a %s from cluster %d (%s): %s", _kind(write), peer.cluster_id, code.name, why
        )
        self._counters.served(peer.cluster_id).refused(code)
        return Grant(code, reason=why)

    def _counted(self, peer: PeerInfo, write: bool, grant: Grant, nbytes: int) -> Grant:
        """``grant``, counted as granted now and as over (moved or not) at its ``done``."""
        served = self._counters.served(peer.cluster_id)
        served.granted()
        done = grant.done
        assert done is not None

        def counted(ok: bool) -> None:
            done(ok)
            served.over(nbytes, ok)

        grant.done = counted
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "granted a %s of %d bytes to cluster %d", _kind(write), nbytes, peer.cluster_id
            )
        return grant

    @staticmethod
    def _device_plan(
        entries: list[Entry],
        layout: ByteLayout,
        places: _Places,
        release: _Release | None,
        direct: DirectCheck | None,
    ) -> _Device:
        """A request into staged (device) memory: one device; by address when the
        transport can reach every buffer so (``direct``), else through host staging, at
        most :data:`~aiokv._copy.MAX_STAGED_BYTES` bytes (the host memory serving it
        needs). The buffers come from validated indices only."""
        if isinstance(places, range):
            places = [(entries[0], t, 0) for t in places]
        buffers = [_flat(e, t, off, layout.extent) for e, t, off in places]
        device = buffers[0].device
        if any(b.device != device for b in buffers):
            raise _invalid("the destination addresses are on different devices")
        runs = None
        name = str(device)

        def by_address() -> bool:
            return direct is not None and all(
                direct(name, b.data_ptr(), layout.extent) for b in buffers
            )

        if route(device, by_address) is Route.BY_ADDRESS:
            runs = DeviceRuns(name, layout.addresses([b.data_ptr() for b in buffers]))
        total = layout.total(len(buffers))
        if runs is None and total > MAX_STAGED_BYTES:
            raise _invalid(
                f"a request on {device} memory moves at most {MAX_STAGED_BYTES} bytes "
                f"through host staging, not {total}: aiokv cuts a transfer into parts of "
                "at most that, but not finer than one block (or batch slot) of one tensor; "
                "keep a tensor this big as blocks of a blocks cache, or move it over the "
                "nixl transport (device memory by address, no staging)"
            )
        return _Device(entries, buffers, layout, release, runs)

    async def _staged(self, peer: PeerInfo, plan: _Device, *, write: bool) -> Grant:
        """Serve a pinned device plan by address (``plan.runs``: once work queued on the
        device is done) or through a host staging buffer: a read's bytes are gathered
        into it before the grant; a write lands in it and is scattered to the device by
        the grant's ``commit``, before the writer hears that it landed."""
        timeout = self._config.sync_kv_timeout / 1000
        stager = self._stager
        if stager is None:
            self._registry.unpin(*plan.entries)
            return self._refuse(peer, write, Code.LLM_FEATURE_NOT_ENABLED, "no host staging")
        try:
            if plan.runs is not None:  # by address: once queued work on it is done
                await stager.settle(plan.buffers[0].device)
            elif write:
                nbytes = plan.layout.total(len(plan.buffers))
                staged = await stager.reserve(nbytes, plan.buffers[0].device, timeout, peer)
            else:
                staged = await stager.gather(plan.buffers, plan.layout, timeout, peer)
        except BaseException as exc:
            self._registry.unpin(*plan.entries)
            if isinstance(exc, LLMException):
                return self._refuse(peer, write, exc.status_code, f"staging: {exc}")
            if isinstance(exc, Exception):  # the code a caller here would see
                log.exception("staging a %s failed", _kind(write))
                why = f"staging failed: {type(exc).__name__}"
                return self._refuse(peer, write, code_of_failure(exc), why)
            raise
        try:  # unregister_cache may have begun while this awaited
            if plan.runs is not None:
                grant = self._issue(plan.entries, [], plan.release, pinned=True, device=plan.runs)
                return self._counted(peer, write, grant, plan.runs.total)
            grant = self._issue(plan.entries, [staged.view], plan.release, pinned=True)
        except LLMException as exc:
            if plan.runs is None:
                staged.release()
            self._registry.unpin(*plan.entries)
            return self._refuse(peer, write, exc.status_code, str(exc))
        finish = grant.done
        assert finish is not None
        committing = over = False
        ended: list[bool] = []

        def done(ok: bool) -> None:  # after a commit that is running: when it ends
            nonlocal over
            if committing:
                ended.append(ok)
                return
            over = True
            staged.release()
            finish(ok)

        async def commit() -> LLMStatusCode:
            nonlocal committing
            if over:  # the grant ended (cancelled, revoked, expired) before its commit
                return Code.LLM_FAILED  # began: its staging buffer is gone, nothing lands
            committing = True
            try:
                await stager.scatter(staged, plan.buffers, plan.layout)
            finally:
                committing = False
                if ended:
                    done(ended[0])
            return Code.LLM_SUCCESS

        grant.done = done
        if write:
            grant.commit = commit
        return self._counted(peer, write, grant, staged.host.numel())

    def _issue(
        self,
        entries: list[Entry],
        views: Sequence[memoryview],
        release: _Release | None,
        *,
        pinned: bool = False,
        device: DeviceRuns | None = None,
    ) -> Grant:
        """Pin ``entries`` (unless ``pinned`` already) and hand out a grant over ``views``
        (or ``device`` memory by address), bounded in time.

        The grant is revocable: ``unregister_cache`` of its memory aborts it (through the
        registry's revokers), and so does its deadline — this side's ``sync_kv_timeout``
        from grant to ``done`` — so a peer that stops reading cannot pin memory forever.
        On ``done(True)`` a pull by ``CacheKey`` releases the key, only if it is still
        bound to the cache that was read.
        """
        loop = asyncio.get_running_loop()
        grant = Grant(Code.LLM_SUCCESS, views, device=device)
        token = object()  # Grant is a dataclass, not hashable

        def revoke(status: LLMStatusCode) -> None:  # from any thread
            if _running_loop() is loop:
                grant.abort(status)
                return
            with contextlib.suppress(RuntimeError):  # the loop is closed: the grant is over
                loop.call_soon_threadsafe(grant.abort, status)

        def done(ok: bool) -> None:
            expiry.cancel()
            self._registry.let_go(token, *entries)
            if ok and release is not None:
                self._registry.read_by_key(release.key, entries[0], release.tensors)

        if pinned:  # pinned with the plan (one pin, as a grant has), then awaited
            self._registry.attach(token, revoke, *entries)  # refuses memory unregistered since
        else:
            self._registry.hold(token, revoke, *entries)  # refuses memory being unregistered
        expiry = loop.call_later(self._config.sync_kv_timeout / 1000, _expire, grant)
        grant.done = done
        return grant

    def _lookup(self, key: Key) -> tuple[Entry, int | None, CacheKey | None]:
        """``(entry, batch slot or None, the CacheKey a successful read may release)``."""
        if key.cluster_id != self._cluster_id:
            raise _missing(key)
        if isinstance(key, KeyByBlocks):
            e = self._registry.by_model_id(key.model_id)
            if e is None:
                raise _missing(key)
            return e, None, None
        if isinstance(key, KeyByReq):
            ck = CacheKey(key.cluster_id, key.req_id, key.model_id, key.prefix_id)
            hit = self._registry.by_key(ck)
            if hit is None:
                raise _missing(key)
            if key.cache_id is not None and hit[0].cache.cache_id != key.cache_id:
                raise _Refused(
                    Code.LLM_KV_CACHE_NOT_EXIST,
                    f"{ck} names cache {hit[0].cache.cache_id} now, not cache {key.cache_id} "
                    "that the earlier parts of this pull read (the key was bound anew)",
                )
            # as llm_datadist: a pull never releases a prefix key (a shared prefix) nor a
            # key of registered memory (send_state.cc: !is_prefix && cache_entry.is_owned)
            shared = key.prefix_id != _NO_ID or not hit[0].owned
            return hit[0], hit[1], None if shared else ck
        e = self._registry.by_id(key.cache_id)
        if e is None:
            raise _missing(key)
        if key.batch_index >= e.cache.cache_desc.batch_size:
            raise _invalid(f"batch_index {key.batch_index} out of range")
        # as llm_datadist (send_state.cc GetCacheKey): a read by id of a slot a request
        # key is bound to goes through that key, and releases it as a read by the key
        bound = self._registry.slot_key(e, key.batch_index, key.cluster_id) if e.owned else None
        return e, key.batch_index, bound

    def _check_access(self, entry: Entry, *, write: bool, key: Key) -> None:
        """Who may reach ``entry``, as llm_datadist decides (docs/security.md):

        * pushes need the cache to be remote accessible (``remote_accessible`` and
          ``enable_remote_cache_accessible`` on this side);
        * reads by a key this side bound (``CacheKey``, ``BlocksCacheKey``) need nothing;
        * reads by cache id (``CacheKeyByIdAndIndex``): in legacy mode, or without
          ``enable_remote_cache_accessible``, nothing (llm_datadist serves them by
          request); with it, a ``remote_accessible`` cache (llm_datadist reads it
          one-sided and refuses one that is not, ``LLM_PARAM_INVALID``). The option
          ``restrict_reads_by_id`` makes them need what pushes need, in every mode.
        """
        cfg = self._config
        shared = cfg.enable_remote_cache_accessible and entry.remote_accessible
        cid = entry.cache.cache_id
        if write and not shared:
            raise _Refused(
                Code.LLM_FEATURE_NOT_ENABLED,
                f"cache {cid} of cluster {self._cluster_id} does not take pushes: its owner "
                "must set enable_remote_cache_accessible and register it remote_accessible",
            )
        if not write and isinstance(key, KeyById) and not shared:
            if cfg.restrict_reads_by_id:
                raise _Refused(
                    Code.LLM_FEATURE_NOT_ENABLED,
                    f"cache {cid} of cluster {self._cluster_id} is not readable by cache id: "
                    "its owner set restrict_reads_by_id, so it needs "
                    "enable_remote_cache_accessible and a remote_accessible cache "
                    "(or read it by a CacheKey its owner bound)",
                )
            if cfg.enable_cache_manager and cfg.enable_remote_cache_accessible:
                raise _invalid(
                    f"cache {cid} of cluster {self._cluster_id} is not remote accessible: "
                    "with enable_remote_cache_accessible, reads by cache id need a cache "
                    "registered remote_accessible=True (or read it by a CacheKey its owner bound)"
                )
        if write and isinstance(key, KeyByReq):
            raise _invalid("a push needs a CacheKeyByIdAndIndex")

    @staticmethod
    def _tensors(sel: Tensors, cache: Cache) -> range:
        ntensors = cache.cache_desc.num_tensors
        if sel.span is not None:  # a part of a layer range: checked as the whole range
            start, stop, per = sel.span
            try:
                around = tensor_range("remote", ntensors, range(start, stop), per)
            except LLMException as exc:
                raise _invalid(str(exc)) from None
        if sel.layers is None:
            tensors = range(ntensors)
        else:
            start, stop = sel.layers
            try:
                tensors = tensor_range("remote", ntensors, range(start, stop), sel.per_layer)
            except LLMException as exc:
                raise _invalid(str(exc)) from None
        mine = f"cache {cache.cache_id} here (the owner's)"
        # a part cut inside layers is checked as its whole transfer (every tensor)
        theirs, ours = (sel.count, len(tensors)) if sel.whole is None else (sel.whole, ntensors)
        if sel.span is not None and not around.start <= tensors.start < tensors.stop <= around.stop:
            raise _invalid(f"a part's tensors {tensors} are outside its transfer's {around}")
        if theirs != ours or sel.count != len(tensors):
            raise _invalid(
                f"tensor counts differ: the requester's cache moves {theirs} tensors, "
                f"{mine} has {ours} (in the layer range); CacheDesc.num_tensors "
                "(and the layer ranges) must agree"
            )
        if sel.dtype is not None and sel.dtype != int(cache.cache_desc.data_type):
            raise _invalid(
                f"data types differ: the requester's cache is {_dtype_name(sel.dtype)}, "
                f"{mine} is {cache.cache_desc.data_type.name}; CacheDesc.data_type must be "
                "equal on both sides"
            )
        return tensors

    def _layout(
        self, req: BlocksReq | ChunksReq | SlotReq, cache: Cache, slot: int | None, *, write: bool
    ) -> tuple[ByteLayout, range]:
        """What ``req`` moves of ``cache``: the layout and the tensors it applies to."""
        tensors = self._tensors(req.tensors, cache)
        if isinstance(req, BlocksReq):
            _check_blocks_cache(cache, req.block_bytes)
            _check_top(req.top, cache.num_blocks, "blocks")
            layout = self._layouts.get(
                req.blocks, cache.num_blocks, unique=write, block_bytes=req.block_bytes
            )
        else:
            if slot is None or not cache.slots_contiguous:
                raise _invalid("slot transfers need a contiguous cache with batch_dim_index 0")
            per_slot = cache.slot_bytes
            if isinstance(req, ChunksReq):
                if req.chunk_bytes > per_slot or per_slot % req.chunk_bytes:
                    raise _invalid("the slot is not a whole number of chunks")
                per = per_slot // req.chunk_bytes
                _check_top(req.top, per, "chunks")
                chunks = _blocks(req.chunks, per, "chunks", unique=write)
                layout = ByteLayout.of_blocks(slot * per + chunks, req.chunk_bytes)
            else:
                if req.size > per_slot or (req.exact and req.size != per_slot):
                    raise _invalid(
                        f"slot sizes differ: the requester's batch slot is {req.size} bytes, "
                        f"cache {cache.cache_id} here (the owner's) has {per_slot}; the "
                        "CacheDescs' shapes must be equal but for the batch dimension"
                    )
                layout = ByteLayout.of_span(slot * per_slot, req.size)
        return layout, tensors

    def _addrs(self, req: AddrsReq) -> tuple[list[Entry], ByteLayout, list[tuple[Entry, int, int]]]:
        """Raw destination addresses: each must lie inside ONE registered, remote-accessible
        host tensor, together with every byte the layout touches from it, and no two
        addresses' regions may overlap (a byte written twice, like a destination block
        named twice) — which bounds the views of one request by the registered memory.

        Returns the entries, the layout and, per address, ``(entry, tensor, offset)``."""
        extent = req.block_bytes
        top = limit = 0
        if req.blocks is not None:
            if req.stride < req.block_bytes:
                raise _invalid("stride is smaller than the block size")
            # the blocks b whose last byte b * stride + block_bytes - 1 stays in int64
            limit = (2**63 - 1 - req.block_bytes) // req.stride + 1
            try:  # from the list as sent: nothing of the size it names is built yet
                top = top_block(req.blocks)
            except ValueError as exc:
                raise _invalid(f"blocks {exc}") from None
            if top >= limit:
                raise _invalid(f"blocks entry {top} is out of range [0, {limit})")
            extent = top * req.stride + req.block_bytes  # the last block's end
        bases = sorted(req.bases)
        if any(b - a < extent for a, b in itertools.pairwise(bases)):
            raise _invalid("the regions of two destination addresses overlap")
        entries: list[Entry] = []
        places: list[tuple[Entry, int, int]] = []
        for base in req.bases:
            hit = self._registry.find_region(base, extent) if base else None
            if hit is None:
                raise _invalid(f"[{base}, +{extent}) is not inside one registered tensor")
            entry, ti, off = hit
            if not (self._config.enable_remote_cache_accessible and entry.remote_accessible):
                raise _Refused(Code.LLM_FEATURE_NOT_ENABLED, "memory is not remote accessible")
            if entries and entry.cache.on_host != entries[0].cache.on_host:
                raise _invalid("the destination addresses are in host and device memory")
            entries.append(entry)
            places.append((entry, ti, off))
        # only now, inside registered memory, is the list unfolded: its distinct blocks
        # are at most top + 1, each stride bytes of a registered tensor
        layout = ByteLayout.of_span(0, req.block_bytes)
        if req.blocks is not None:
            layout = self._layouts.get(
                req.blocks,
                limit,
                unique=True,
                block_bytes=req.block_bytes,
                stride=req.stride,
                most=min(MAX_BLOCKS, top + 1),
            )
        return entries, layout, places


_NO_ID = 2**64 - 1


@dataclass(frozen=True, slots=True)
class _Release:
    """What a successful read by ``key`` that asks for the release (a pull's last
    request) does to it: ``tensors`` of its transfer read (``None``: all)."""

    key: CacheKey
    tensors: range | None


def _read_tensors(sel: Tensors) -> range | None:
    """The served cache's tensors a request's transfer reads (all its parts); ``None``
    for all of them (no layer range, or a part of a transfer of every tensor)."""
    if sel.layers is None or sel.whole is not None:
        return None
    if sel.span is not None:
        start, stop, per = sel.span
        return range(start * per, stop * per)
    return range(sel.layers[0] * sel.per_layer, sel.layers[1] * sel.per_layer)


@dataclass(frozen=True, slots=True)
class _Device:
    """A checked, pinned request on staged (device) memory, before its staging;
    ``runs``: its memory by address when the transport moves it so (no staging)."""

    entries: list[Entry]
    buffers: list[torch.Tensor]
    layout: ByteLayout
    release: _Release | None
    runs: DeviceRuns | None = None


def _check_top(top: int | None, limit: int, what: str) -> None:
    """A part's ``top`` (its whole transfer's highest entry) is in ``[0, limit)``: a
    transfer the served memory cannot hold is refused at its first part."""
    if top is not None and top >= limit:
        raise _invalid(f"{what} entry {top} is out of range [0, {limit})")


def _check_blocks_cache(cache: Cache, block_bytes: int) -> None:
    """Blocks of ``block_bytes`` of ``cache`` may be named: it is a blocks cache of that
    block size."""
    if not cache.is_blocks_cache:
        raise _invalid(
            f"cache {cache.cache_id} here (the owner's) is not a blocks cache: allocate or "
            "register it with the *_blocks_cache calls to move it by blocks"
        )
    if block_bytes != cache.block_bytes:
        raise _invalid(
            f"block sizes differ: the requester's cache has {block_bytes} bytes per block, "
            f"cache {cache.cache_id} here (the owner's) has {cache.block_bytes} (shape "
            f"{list(cache.cache_desc.shape)}, {cache.cache_desc.data_type.name}); "
            "CacheDesc.shape after dim 0 and data_type must give equal blocks"
        )


def _dtype_name(value: int) -> str:
    """``DataType`` ``value``'s name (a peer's number: maybe no member)."""
    try:
        return DataType(value).name
    except ValueError:
        return f"data type {value}"


def _ignore(ok: bool) -> None:
    """``done`` of a grant with nothing to release."""


def _host_views(cache: Cache, layout: ByteLayout, places: _Places) -> LayoutViews:
    """The host memory a checked request moves, by address (no Python object per
    tensor): ``places`` is tensors of ``cache``, or ``(entry, tensor, offset)`` of each
    checked raw address (whose region, :attr:`~ByteLayout.extent` bytes, lies inside
    that tensor)."""
    if isinstance(places, range):
        return cache.at(layout, places)
    addrs = [e.cache.tensors[t].data_ptr() + off for e, t, off in places]
    return layout.at(np.array(addrs, dtype=np.uint64), layout.extent)


def _flat(entry: Entry, tensor: int, offset: int, extent: int) -> torch.Tensor:
    """Bytes ``[offset, offset + extent)`` of a (device) tensor as a flat ``uint8`` view."""
    t = entry.cache.tensors[tensor]
    return t.view(torch.uint8).reshape(-1)[offset : offset + extent]


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _expire(grant: Grant) -> None:
    log.warning("a grant outlived sync_kv_timeout; revoked")
    grant.abort(Code.LLM_TIMEOUT)


#: a transport's check of device memory it can move by address (None: it moves none)
_Direct = DirectCheck | None


def _decoded(meta: bytes, nbytes: int | None, *, write: bool) -> Message:
    """The request ``meta`` holds, checked before anything acts on it.

    Raises:
        _Refused: a malformed request (its reason made safe and bounded: msgspec quotes
            what it refused, the peer's text up to the meta cap, and the reason is logged
            and sent back); a notification or revocation that is not a write of 0 bytes
            (the transport would refuse it only after it acted).
    """
    try:
        req = decode(meta)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise _invalid(f"malformed request: {decode_reason(str(exc))}") from None
    if write and nbytes and isinstance(req, RevokeReq | NotifyReq):
        raise _invalid(f"a {_what(req)} is a write of 0 bytes, not of {nbytes}")
    return req


def _what(req: RevokeReq | NotifyReq) -> str:
    """What ``req`` is, for a refusal's reason."""
    return "revocation" if isinstance(req, RevokeReq) else "notification"


def _kind(write: bool) -> str:
    return "push" if write else "pull"
