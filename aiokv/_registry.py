"""The registry of one ``LLMDataDist``'s caches: ids, keys, reference counts, pins.

Memory goes back to its pool when the id reference is dropped, no key is bound and no
operation pins it. Everything here is synchronous bookkeeping: no method awaits, so a
cancelled caller can never leave it half-updated (STYLE convention 3).

Keys are looked up as llm_datadist does: a ``BlocksCacheKey`` by its ``model_id``, a
``CacheKey`` by ``(req_id or prefix_id, model_id)``; their cluster id only chooses the
link a peer sends on, so it is not part of the identity (:func:`key_id`).

Thread-safe: callers' threads (allocation, local copies) and the engine thread (the
peer service) share one registry. Every method runs under :attr:`CacheRegistry.lock`
(re-entrant), which also guards the pools' allocate/free; a caller that needs several
steps to be one (look up, then pin) holds it around them.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import Concatenate
from typing import ParamSpec
from typing import TypeVar

import torch
from sortedcontainers import SortedDict

from ._cache import Cache
from ._checks import UINT64_MAX
from ._checks import check_instance
from ._checks import param_invalid
from ._enums import LLMStatusCode
from ._errors import LLMException
from ._models import BlocksCacheKey
from ._models import CacheKey
from ._pool import MemPool
from ._pool import Span

__all__ = ["CacheRegistry", "Entry", "KeyId", "RegistryStats", "is_placeholder", "key_id"]

log = logging.getLogger("aiokv")

P = ParamSpec("P")
R = TypeVar("R")

#: what a ``CacheKey`` is found by: ``(req_id, prefix_id, model_id)``, one id valid
KeyId = tuple[int, int, int]


def key_id(key: CacheKey) -> KeyId:
    """The identity of ``key`` in a registry (its cluster id left out)."""
    return (key.req_id, key.prefix_id, key.model_id)


def is_placeholder(key: CacheKey) -> bool:
    """A key naming no request and no prefix: it holds a batch slot, binds nothing."""
    return key.req_id == UINT64_MAX and key.prefix_id == UINT64_MAX


def _locked(
    fn: Callable[Concatenate[CacheRegistry, P], R],
) -> Callable[Concatenate[CacheRegistry, P], R]:
    def locked(self: CacheRegistry, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with self.lock:
            return fn(self, *args, **kwargs)

    functools.update_wrapper(locked, fn)
    return locked


@dataclass(frozen=True, slots=True)
class RegistryStats:
    """A snapshot of a registry's bookkeeping (``CacheManager.statistics()``).

    Attributes:
        caches: caches whose memory is still held (id held, or kept by keys or pins).
        allocated: of those, caches allocated from a pool.
        registered: of those, registered user memory.
        released: caches whose id was released but whose memory keys or pins still hold.
        keys: bound ``CacheKey`` s.
        blocks_keys: bound ``BlocksCacheKey`` s.
        pins: operations (local copies, remote grants, layer-wise tasks) holding a cache.
        leases: caches lent to peers by address (leases, over NIXL), each holding its
            cache until it is taken back (``deallocate_blocks_cache`` does that).
        quarantined_bytes: pool memory of released caches kept out of the pool for
            good, because a NIXL transfer on it could not be stopped, or its link ended
            while it was granted to a peer's (it may still write there; docs/design.md,
            "Ending an operation").
    """

    caches: int
    allocated: int
    registered: int
    released: int
    keys: int
    blocks_keys: int
    pins: int
    leases: int = 0
    quarantined_bytes: int = 0


@dataclass(slots=True, eq=False)
class Entry:
    """Bookkeeping of one cache known to a registry.

    Memory (``spans``) goes back to its pool when the id reference is dropped, no key is
    bound and no operation pins it.
    """

    cache: Cache
    spans: list[tuple[MemPool, Span]]
    remote_accessible: bool
    id_held: bool = True
    keys: set[KeyId] = field(default_factory=set)
    #: per bound key pulled by layer ranges: the tensors not pulled yet (llm_datadist
    #: releases a key once every tensor of its cache was pulled)
    unread: dict[KeyId, set[int]] = field(default_factory=dict)
    blocks_key: BlocksCacheKey | None = None
    pins: int = 0
    leases: int = 0  # of the pins, those of leases
    #: whether peers may be lent its memory (leases); False from the moment its
    #: ``BlocksCacheKey`` starts moving to another cache: the key is how a lease names it
    lendable: bool = True
    freed: bool = False
    #: how to revoke the operations that may be ended early (served grants, layer-wise
    #: tasks): token -> ``revoke(status)``, callable from any thread
    revokers: dict[object, Callable[[LLMStatusCode], None]] = field(default_factory=dict)
    #: called (from whichever thread unpins) once ``pins`` drops to 0
    unpinned: list[Callable[[], None]] = field(default_factory=list)

    @property
    def owned(self) -> bool:
        """Memory allocated from a pool (vs. registered user memory)."""
        return bool(self.spans)


class CacheRegistry:
    """Ids, keys, refcounts and address ranges of the caches of one ``LLMDataDist``."""

    def __init__(self) -> None:
        self.entries: dict[int, Entry] = {}
        self.keys: dict[KeyId, tuple[int, int]] = {}  # key_id -> (cache_id, batch_index)
        self.blocks_keys: dict[int, int] = {}  # model_id -> cache_id
        # start -> [(end, cache_id, tensor_index), ...]: several caches may register the
        # same memory (aliases); each keeps its own region until it is freed
        self._regions: SortedDict[int, list[tuple[int, int, int]]] = SortedDict()
        self._longest = 0  # the longest region ever: how far back find_region looks
        self.lock = threading.RLock()
        # ids as llm_datadist's cache engine gives them: 1, 2, ... per LLMDataDist
        # (llm_datadist allows one per process), never reused
        self._ids = itertools.count(1)
        #: told of registered user memory as it comes and goes (the transport's
        #: ``register_memory`` / ``deregister_memory``); called under :attr:`lock`
        self.on_register: Callable[[int, int, str], None] | None = None
        self.on_deregister: Callable[[int, int, str], None] | None = None
        #: whether a transfer that could not be stopped may still touch ``(addr, nbytes,
        #: device)`` (the transport's ``outlived``): such pool memory is never freed
        self.outlived: Callable[[int, int, str], bool] | None = None
        self._quarantined = 0  # bytes of pool memory kept so

    # ---- adding -------------------------------------------------------------------------
    @_locked
    def add(
        self,
        cache: Cache,
        spans: list[tuple[MemPool, Span]],
        *,
        remote_accessible: bool,
        keys: Sequence[CacheKey] = (),
        blocks_key: BlocksCacheKey | None = None,
    ) -> Entry:
        """Track ``cache`` under the next cache id (1, 2, ... in allocation and
        registration order, as llm_datadist numbers them; never reused); bind ``keys``
        (key i → batch slot i, placeholders skipped, the last duplicate wins) or
        ``blocks_key``. A key already bound to another cache moves here (the last
        registration wins, with a warning)."""
        entry = Entry(cache, spans, remote_accessible)
        cache.cache_id = next(self._ids)
        cache._owner = self
        self.entries[cache.cache_id] = entry
        for i, t in enumerate(cache.tensors):
            self._regions.setdefault(t.data_ptr(), []).append(
                (t.data_ptr() + cache.cache_desc.size, cache.cache_id, i)
            )
            self._longest = max(self._longest, cache.cache_desc.size)
            if not spans and self.on_register is not None:  # pools are registered whole
                self.on_register(t.data_ptr(), cache.cache_desc.size, str(t.device))
        for slot, key in enumerate(keys):
            if not is_placeholder(key):
                self._bind_key(key, entry, slot)
        if blocks_key is not None:
            self.bind_blocks_key(entry, blocks_key)
        return entry

    @_locked
    def bind_blocks_key(self, entry: Entry, key: BlocksCacheKey) -> None:
        """Bind ``key`` to ``entry``'s cache; a cache it named before loses it (the later
        registration wins, with a warning). Leases on that cache must have ended first
        (``CacheManager`` sees to it): they name it by this key."""
        old = self.blocks_keys.get(key.model_id)
        if old is not None and old != entry.cache.cache_id:
            log.warning(
                "%s: model_id %d was registered to cache %d; now cache %d",
                key,
                key.model_id,
                old,
                entry.cache.cache_id,
            )
            self.entries[old].blocks_key = None
        self.blocks_keys[key.model_id] = entry.cache.cache_id
        entry.blocks_key = key

    def _bind_key(self, key: CacheKey, entry: Entry, slot: int) -> None:
        kid = key_id(key)
        old = self.keys.get(kid)
        if old is not None and old[0] != entry.cache.cache_id:
            log.warning("%s was bound to cache %d; now cache %d", key, old[0], entry.cache.cache_id)
            self.release_key(key)
        self.keys[kid] = (entry.cache.cache_id, slot)
        entry.keys.add(kid)

    # ---- lookups ------------------------------------------------------------------------
    @_locked
    def entry(self, op: str, cache: Any, name: str = "cache") -> Entry | None:
        """The live entry of ``cache``; ``None`` for a user-owned ``create_cpu_cache`` cache.

        Raises:
            TypeError / NoneArgumentError: not a ``Cache``.
            LLMException: ``LLM_PARAM_INVALID`` if it belongs to another ``LLMDataDist``;
                ``LLM_KV_CACHE_NOT_EXIST`` if already released.
        """
        check_instance(op, name, cache, Cache)
        if cache._owner is None:
            return None
        if cache._owner is not self:
            param_invalid(op, f"{name} {cache.cache_id} belongs to another LLMDataDist")
        e: Entry | None = self.entries.get(cache.cache_id)
        if e is None or not e.id_held:
            raise LLMException(
                f"{op}: cache {cache.cache_id} is not allocated or registered here",
                status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
            )
        return e

    @_locked
    def by_key(self, key: CacheKey) -> tuple[Entry, int] | None:
        """``(entry, batch_index)`` bound to ``key`` (by :func:`key_id`), or ``None``."""
        hit = self.keys.get(key_id(key))
        return None if hit is None else (self.entries[hit[0]], hit[1])

    @_locked
    def slot_key(self, entry: Entry, slot: int, cluster_id: int) -> CacheKey | None:
        """The request key (not a prefix key) bound to batch slot ``slot`` of ``entry``,
        as a ``CacheKey`` of ``cluster_id``, or ``None``."""
        for req_id, prefix_id, model_id in entry.keys:
            if prefix_id == UINT64_MAX and self.keys.get((req_id, prefix_id, model_id)) == (
                entry.cache.cache_id,
                slot,
            ):
                return CacheKey(cluster_id, req_id, model_id, prefix_id)
        return None

    def by_blocks_key(self, key: BlocksCacheKey) -> Entry | None:
        """The entry registered under ``key.model_id``, or ``None``."""
        return self.by_model_id(key.model_id)

    @_locked
    def by_model_id(self, model_id: int) -> Entry | None:
        """The entry registered under the ``BlocksCacheKey`` of ``model_id``, or ``None``
        (what a peer's key names, without building a ``BlocksCacheKey`` for it)."""
        cid = self.blocks_keys.get(model_id)
        return None if cid is None else self.entries[cid]

    @_locked
    def by_id(self, cache_id: int) -> Entry | None:
        """The entry of a cache whose id reference is still held, or ``None``."""
        e = self.entries.get(cache_id)
        return e if e is not None and e.id_held else None

    @_locked
    def find_region(self, addr: int, nbytes: int) -> tuple[Entry, int, int] | None:
        """The ``(entry, tensor_index, byte_offset)`` whose tensor holds ``[addr, addr+nbytes)``
        entirely, or ``None`` — how raw addresses from a peer are checked. Registrations
        may overlap (the same memory registered twice, or within another): the one that
        starts nearest below ``addr`` wins, among those the latest."""
        if nbytes < 0:
            return None
        # a region holding [addr, addr + nbytes) starts at most _longest bytes below its end
        for start in self._regions.irange(addr + nbytes - self._longest, addr, reverse=True):
            for end, cid, ti in reversed(self._regions[start]):
                e = self.entries.get(cid)
                if addr + nbytes <= end and e is not None and e.id_held:
                    return e, ti, addr - start
        return None

    # ---- releasing ----------------------------------------------------------------------
    @_locked
    def release_id(self, entry: Entry) -> None:
        """Drop the id reference (``deallocate_cache`` / ``unregister_cache``)."""
        if entry.blocks_key is not None:
            self.blocks_keys.pop(entry.blocks_key.model_id, None)
            entry.blocks_key = None
        if not entry.owned:
            # user memory: keys die with the registration; the user owns the bytes
            for key in list(entry.keys):
                self.keys.pop(key, None)
            entry.keys.clear()
            entry.unread.clear()
        entry.id_held = False
        self._maybe_free(entry)

    @_locked
    def release_key(self, key: CacheKey, entry: Entry | None = None) -> bool:
        """Unbind ``key``; ``False`` if it was not bound (a no-op, as llm_datadist).

        With ``entry``, only if ``key`` is still bound to that cache: a pull that read one
        cache must not release a key that was rebound to another meanwhile.
        """
        kid = key_id(key)
        hit = self.keys.get(kid)
        if hit is None or (entry is not None and hit[0] != entry.cache.cache_id):
            return False
        del self.keys[kid]
        entry = self.entries[hit[0]]
        entry.keys.discard(kid)
        entry.unread.pop(kid, None)
        self._maybe_free(entry)
        return True

    @_locked
    def read_by_key(self, key: CacheKey, entry: Entry, tensors: range | None) -> None:
        """A pull of ``entry`` by ``key`` succeeded (its releasing request): as
        llm_datadist, the key is released once every tensor of the cache was read
        (``tensors``: those this pull covered, ``None`` for all)."""
        kid = key_id(key)
        hit = self.keys.get(kid)
        if hit is None or hit[0] != entry.cache.cache_id:
            return
        if tensors is not None:
            n = entry.cache.cache_desc.num_tensors
            pending = entry.unread.setdefault(kid, set(range(n)))
            pending.difference_update(tensors)
            if pending:
                return
        self.release_key(key, entry)

    @_locked
    def pin(self, *entries: Entry, lease: bool = False) -> None:
        """Keep memory alive while an operation (or, with ``lease``, a lease) uses it.

        Raises:
            LLMException: ``LLM_KV_CACHE_NOT_EXIST`` if one was freed meanwhile (another
                thread dropped its last reference after it was looked up); none is pinned.
        """
        self._pin(entries, lease)

    def _pin(self, entries: Sequence[Entry], lease: bool) -> None:
        _check_live(entries)
        for e in entries:
            e.pins += 1
            e.leases += lease

    @_locked
    def unpin(self, *entries: Entry, lease: bool = False) -> None:
        """End a :meth:`pin` (of the same ``lease``); frees memory whose last reference
        went meanwhile."""
        self._unpin(entries, lease)

    @_locked
    def hold(self, token: object, revoke: Callable[[LLMStatusCode], None], *entries: Entry) -> None:
        """:meth:`pin` ``entries`` and :meth:`add_revoker` ``revoke`` as ``token`` on
        them, as one step (a served grant; :meth:`let_go` ends it).

        Raises:
            LLMException: as :meth:`pin`; nothing is pinned or recorded then.
        """
        self._pin(entries, False)
        _add_revoker(token, revoke, entries)

    @_locked
    def let_go(self, token: object, *entries: Entry) -> None:
        """End a :meth:`hold`: :meth:`drop_revoker` ``token``, then :meth:`unpin`."""
        _drop_revoker(token, entries)
        self._unpin(entries, False)

    def _unpin(self, entries: Sequence[Entry], lease: bool) -> None:
        for e in entries:
            e.pins -= 1
            e.leases -= lease
            if not e.pins and e.unpinned:
                waiters, e.unpinned = e.unpinned, []
                for wake in waiters:
                    wake()
            self._maybe_free(e)

    @_locked
    def when_unpinned(self, entry: Entry, wake: Callable[[], None]) -> bool:
        """Call ``wake()`` (from the thread that unpins, under the lock: it must only
        schedule) once no operation pins ``entry``; ``False`` if none pins it now."""
        if not entry.pins:
            return False
        entry.unpinned.append(wake)
        return True

    @_locked
    def add_revoker(
        self, token: object, revoke: Callable[[LLMStatusCode], None], *entries: Entry
    ) -> None:
        """Record how to end an operation on ``entries`` early (:meth:`revoke`)."""
        _add_revoker(token, revoke, entries)

    @_locked
    def attach(
        self, token: object, revoke: Callable[[LLMStatusCode], None], *entries: Entry
    ) -> None:
        """:meth:`add_revoker` for an operation that pinned ``entries`` before it
        awaited something (staging, the engine): as one step with the check that none
        was released meanwhile, which :meth:`revoke` would have ended it for.

        Raises:
            LLMException: ``LLM_KV_CACHE_NOT_EXIST``, as :meth:`pin`; nothing is
                recorded then (the operation's pin is the caller's to end).
        """
        _check_live(entries)
        _add_revoker(token, revoke, entries)

    @_locked
    def drop_revoker(self, token: object, *entries: Entry) -> None:
        """The operation ``token`` ended; it can no longer be revoked."""
        _drop_revoker(token, entries)

    @_locked
    def revoke(self, entry: Entry, status: LLMStatusCode) -> int:
        """Ask every revocable operation on ``entry`` to end now with ``status`` (served
        grants are aborted, layer-wise tasks cancelled); returns how many were asked."""
        revokers, entry.revokers = list(entry.revokers.values()), {}
        for revoke in revokers:
            try:
                revoke(status)
            except Exception:
                log.exception("revoking an operation on cache %d failed", entry.cache.cache_id)
        return len(revokers)

    def _maybe_free(self, e: Entry) -> None:
        if e.freed or e.id_held or e.keys or e.pins:
            return
        e.freed = True
        for t in e.cache.tensors:
            regions = self._regions.get(t.data_ptr())
            if regions is not None:
                regions[:] = [r for r in regions if r[1] != e.cache.cache_id]
                if not regions:
                    del self._regions[t.data_ptr()]
            if not e.spans and self.on_deregister is not None:
                self._warn_outlived(e.cache.cache_id, t)
                self.on_deregister(t.data_ptr(), e.cache.cache_desc.size, str(t.device))
        for pool, span in e.spans:
            if not self._quarantine(pool, span, e.cache.cache_id):
                pool.free(span)
        if e.spans:
            e.cache._memory_freed()
        del self.entries[e.cache.cache_id]

    def _quarantine(self, pool: MemPool, span: Span, cache_id: int) -> bool:
        """Whether ``span`` of ``pool`` stays allocated for good (:meth:`MemPool.keep`): a
        transfer that could not be stopped may still write into (or read) it
        (docs/design.md, "Ending an operation")."""
        if self.outlived is None:
            return False
        addr = pool.region.data_ptr() + span.start * pool.page_size
        nbytes = span.npages * pool.page_size
        if not self.outlived(addr, nbytes, str(pool.region.device)):
            return False
        pool.keep(span)
        self._quarantined += nbytes
        log.error(
            "cache %d: %d bytes of %s memory are kept out of the pool for good: a NIXL "
            "transfer on them could not be stopped and may still write into them",
            cache_id,
            nbytes,
            pool.name,
        )
        return True

    def _warn_outlived(self, cache_id: int, t: torch.Tensor) -> None:
        """Registered user memory is the user's to free: say so loudly when a transfer
        that could not be stopped may still write into it."""
        if self.outlived is not None and self.outlived(t.data_ptr(), t.nbytes, str(t.device)):
            log.error(
                "cache %d: a NIXL transfer that could not be stopped may still write into "
                "its registered memory: keep that tensor alive, do not reuse it",
                cache_id,
            )

    @_locked
    def close(self) -> None:
        """``finalize``: forget every cache, once nothing serves or copies any more. The
        pools go with the instance, so the ``Cache`` objects of pool memory lose their
        tensors (as at their release): one kept past ``finalize`` holds no pool memory
        alive. Registered memory is the user's and keeps its tensors."""
        for e in self.entries.values():
            e.freed = True
            if e.spans:
                e.cache._memory_freed()
        self.entries.clear()
        self.keys.clear()
        self.blocks_keys.clear()
        self._regions.clear()

    @_locked
    def statistics(self) -> RegistryStats:
        """A consistent snapshot of the bookkeeping (see :class:`RegistryStats`)."""
        live = list(self.entries.values())
        allocated = sum(1 for e in live if e.owned)
        return RegistryStats(
            caches=len(live),
            allocated=allocated,
            registered=len(live) - allocated,
            released=sum(1 for e in live if not e.id_held),
            keys=len(self.keys),
            blocks_keys=len(self.blocks_keys),
            pins=sum(e.pins - e.leases for e in live),
            leases=sum(e.leases for e in live),
            quarantined_bytes=self._quarantined,
        )


def _check_live(entries: Sequence[Entry]) -> None:
    """Raise ``LLM_KV_CACHE_NOT_EXIST`` if one of ``entries`` may no longer be used:
    freed, or registered user memory whose ``unregister_cache`` started (it is the
    user's again); the registry's lock held."""
    for e in entries:
        if e.freed or not (e.owned or e.id_held):
            raise LLMException(
                f"cache {e.cache.cache_id} was released meanwhile",
                status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
            )


def _add_revoker(
    token: object, revoke: Callable[[LLMStatusCode], None], entries: Sequence[Entry]
) -> None:
    """:meth:`CacheRegistry.add_revoker`'s step, the registry's lock held."""
    for e in entries:
        e.revokers[token] = revoke


def _drop_revoker(token: object, entries: Sequence[Entry]) -> None:
    """:meth:`CacheRegistry.drop_revoker`'s step, the registry's lock held."""
    for e in entries:
        e.revokers.pop(token, None)
