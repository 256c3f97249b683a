"""``CacheManager``'s bookkeeping: allocate and register caches, bind and release ids
and keys, deallocate and unregister (with the leases and pins that must end first)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from .._cache import Cache
from .._cache import wrap_memory
from .._checks import UINT64_MAX
from .._checks import check_instance
from .._checks import check_int
from .._checks import check_list
from .._checks import param_invalid
from .._checks import renamed
from .._enums import LLMStatusCode
from .._enums import Placement
from .._errors import LLMException
from .._models import BlocksCacheKey
from .._models import CacheDesc
from .._models import CacheKey
from .._pool import MemPool
from .._pool import Span
from .._registry import Entry
from .._registry import is_placeholder
from ._base import ManagerBase

__all__ = ["Bookkeeping"]


class Bookkeeping(ManagerBase):
    """Allocation, registration, keys and release: the caches a manager tracks."""

    def _allocate(self, op: str, desc: CacheDesc) -> tuple[list[torch.Tensor], list[Any]]:
        pool = self._pools[desc.placement]
        if pool is None:
            which = "mem_pool_cfg" if desc.placement == Placement.DEVICE else "host_mem_pool_cfg"
            raise LLMException(
                f"{op}: no {desc.placement.name.lower()} memory pool ({which} not set)",
                status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                op=op,
            )
        try:
            spans: list[Span] = pool.allocate_many(desc.size, desc.num_tensors)
        except LLMException as exc:
            if exc.status_code == LLMStatusCode.LLM_OUT_OF_MEMORY:
                raise _pool_too_small(op, desc, pool) from exc
            raise
        tensors = [pool.view(s).view(desc.torch_dtype).view(desc.shape) for s in spans]
        return tensors, [(pool, s) for s in spans]

    async def _add(
        self,
        op: str,
        desc: Any,
        memory: Any,
        *,
        blocks: bool,
        keys: Any = (),
        blocks_key: Any = None,
        remote_accessible: Any = None,
    ) -> Cache:
        """The one body of allocate_* and register_*: check, take memory, track.

        ``memory`` is None to allocate from the pool of ``desc.placement``, else the
        user's tensors or host addresses to register. A ``blocks_key`` that names a cache
        lent to peers (leases, over NIXL) moves only once those leases have ended: until
        then peers still reach the old cache by it, lease or not (:meth:`_move_key`).
        """
        cache, entry, moving = self._track(
            op, desc, memory, blocks, keys, blocks_key, remote_accessible
        )
        if moving:
            await self._move_key(entry, blocks_key)
        return cache

    async def _move_key(self, entry: Entry, key: BlocksCacheKey) -> None:
        """Bind ``key`` to ``entry`` once no peer holds a lease on the cache it names:
        that cache is lent no more, its leases are revoked (a round trip to each holder),
        then the key moves. The revocation is not cancellable (``Engine.finish``); the
        engine stopped, the new cache is released: nothing changed."""
        leases = self._client.leases
        assert leases is not None
        old: Entry | None = None
        try:
            while True:
                with self._registry.lock:  # lend() runs under it too
                    old = self._registry.by_blocks_key(key)
                    if old is None or old is entry or not leases.lent(old):
                        self._registry.bind_blocks_key(entry, key)
                        return
                    old.lendable = False
                await self._end_leases(old)
        except BaseException:
            with self._registry.lock:
                if old is not None and old.blocks_key == key:
                    old.lendable = True
                self._registry.release_id(entry)
            raise

    def _track(
        self,
        op: str,
        desc: Any,
        memory: Any,
        blocks: bool,
        keys: Any,
        blocks_key: Any,
        remote_accessible: Any,
    ) -> tuple[Cache, Entry, bool]:
        """Check, take memory and track: ``(cache, entry, whether blocks_key is still
        to be bound)``, the last when it names a cache lent to peers."""
        self._check_open(op)
        check_instance(op, "cache_desc", desc, CacheDesc)
        key_list = check_list(op, "cache_keys", keys, CacheKey)
        if len(key_list) > desc.batch_size:
            param_invalid(op, f"{len(key_list)} cache_keys for batch size {desc.batch_size}")
        for key in key_list:
            if not is_placeholder(key):
                self.check_cache_key(key)
        if blocks_key is not None:
            check_instance(op, "blocks_cache_key", blocks_key, BlocksCacheKey)
        if remote_accessible is not None:
            remote = check_instance(op, "remote_accessible", remote_accessible, bool)
        elif memory is None:  # pool memory: the LLMDataDist's setting
            remote = self._config.enable_remote_cache_accessible
        else:  # registered memory: llm_datadist's default by placement
            remote = desc.placement == Placement.DEVICE
        spans: list[tuple[MemPool, Span]] = []
        if memory is not None:
            tensors = wrap_memory(op, desc, memory, self._device)
            self._check_not_pooled(op, tensors, desc.size)
        leases = self._client.leases
        with self._registry.lock:  # pools are freed under it, from any thread
            if memory is None:
                tensors, spans = self._allocate(op, desc)
            cache = Cache(desc, tensors, is_blocks_cache=blocks)
            old = None if blocks_key is None else self._registry.by_blocks_key(blocks_key)
            moving = old is not None and leases is not None and leases.lent(old)
            entry = self._registry.add(
                cache,
                spans,
                remote_accessible=remote,
                keys=key_list,
                blocks_key=None if moving else blocks_key,
            )
        return cache, entry, moving

    def _check_not_pooled(self, op: str, tensors: list[torch.Tensor], nbytes: int) -> None:
        """Refuse user memory that overlaps a pool: pool memory is served by
        ``allocate_*`` and goes back to the pool at their release, so registered as well
        it would reach, after that, the bytes of the next cache allocated there.

        Raises:
            LLMException: ``LLM_PARAM_INVALID``.
        """
        for pool in self._pools.values():
            if pool is None:
                continue
            region = pool.region
            lo = region.data_ptr()
            hi = lo + region.numel()
            for i, t in enumerate(tensors):
                addr = t.data_ptr()
                if t.device == region.device and addr < hi and lo < addr + nbytes:
                    param_invalid(
                        op,
                        f"tensor {i} ({nbytes} bytes at {addr:#x}) lies in the {pool.name} "
                        f"({region.numel()} bytes at {lo:#x}); its memory belongs to "
                        "allocate_cache / allocate_blocks_cache caches, register your own",
                    )

    async def allocate_cache(
        self, cache_desc: CacheDesc, cache_keys: Sequence[CacheKey] = ()
    ) -> Cache:
        """Allocate a contiguous cache from the pool of ``cache_desc.placement``.

        ``cache_keys[i]`` binds batch slot ``i`` (``req_id=2**64-1`` is a placeholder; a
        duplicate key binds its last slot). The memory goes back to the pool once
        ``deallocate_cache`` has released the id AND every key is released (by
        ``remove_cache_key`` or a peer's successful ``pull_cache``).

        Raises:
            TypeError / NoneArgumentError: wrong argument types.
            LLMException: ``LLM_PARAM_INVALID`` (more keys than batch slots),
                ``LLM_FEATURE_NOT_ENABLED`` (no pool), ``LLM_OUT_OF_MEMORY``.
        """
        return await self._add("allocate_cache", cache_desc, None, blocks=False, keys=cache_keys)

    async def allocate_blocks_cache(
        self, cache_desc: CacheDesc, blocks_cache_key: BlocksCacheKey | None = None
    ) -> Cache:
        """Allocate a paged cache (``shape[0]`` blocks) from the pool of its placement.

        ``blocks_cache_key`` names it for peers (``pull_blocks``/``push_blocks``); a key
        already in use moves to this cache (the later wins; a warning is logged). If the
        cache it named is lent to peers (leases, over NIXL), those leases are taken back
        first (a round trip to each holder): once the call returns, every transfer by
        the key reaches this cache, none the old one.

        Raises:
            TypeError / NoneArgumentError: wrong argument types.
            LLMException: ``LLM_FEATURE_NOT_ENABLED`` (no pool), ``LLM_OUT_OF_MEMORY``.
        """
        return await self._add(
            "allocate_blocks_cache", cache_desc, None, blocks=True, blocks_key=blocks_cache_key
        )

    @renamed(tensors_or_addrs="addrs")
    async def register_cache(
        self,
        cache_desc: CacheDesc,
        addrs: Sequence[torch.Tensor] | Sequence[int],
        cache_keys: Sequence[CacheKey] = (),
        remote_accessible: bool | None = None,
    ) -> Cache:
        """Register user memory as a contiguous cache (no copy; the user keeps ownership).

        Args:
            cache_desc: describes each tensor.
            addrs: ``num_tensors`` tensors (DEVICE placement: on this device) or host
                addresses (today's keyword ``tensors_or_addrs`` also works).
            cache_keys: key i names batch slot i, as in ``allocate_cache``.
            remote_accessible: whether peers may push into it / address it directly
                (when this side also has ``enable_remote_cache_accessible``). ``None``,
                as llm_datadist: ``True`` for DEVICE placement, ``False`` for HOST.

        Raises:
            TypeError / NoneArgumentError: wrong argument types.
            LLMException: ``LLM_PARAM_INVALID`` (memory not matching ``cache_desc``, an
                address not aligned to its elements, memory of a pool, more keys than
                batch slots).
        """
        return await self._add(
            "register_cache",
            cache_desc,
            addrs,
            blocks=False,
            keys=cache_keys,
            remote_accessible=remote_accessible,
        )

    @renamed(tensors_or_addrs="addrs")
    async def register_blocks_cache(
        self,
        cache_desc: CacheDesc,
        addrs: Sequence[torch.Tensor] | Sequence[int],
        blocks_cache_key: BlocksCacheKey | None = None,
        remote_accessible: bool | None = None,
    ) -> Cache:
        """Register user memory as a blocks cache (``shape[0]`` blocks), optionally keyed.

        Arguments as :meth:`register_cache`. Registering a ``model_id`` already in use
        moves it here (the later wins; warned), after the leases on the cache it named
        are taken back, as in :meth:`allocate_blocks_cache`.

        Raises:
            TypeError / NoneArgumentError: wrong argument types.
            LLMException: ``LLM_PARAM_INVALID`` (memory not matching ``cache_desc``, an
                address not aligned to its elements, memory of a pool).
        """
        return await self._add(
            "register_blocks_cache",
            cache_desc,
            addrs,
            blocks=True,
            blocks_key=blocks_cache_key,
            remote_accessible=remote_accessible,
        )

    def _release(self, op: str, cache: Any, *, blocks: bool) -> Entry | None:
        """Drop ``cache``'s id reference; the entry, or None if it was released already."""
        self._check_open(op)
        check_instance(op, "cache", cache, Cache)
        if cache._owner is not self._registry:
            if cache._owner is None:
                param_invalid(op, f"cache {cache.cache_id} was not allocated by this manager")
            param_invalid(op, f"cache {cache.cache_id} belongs to another LLMDataDist")
        with self._registry.lock:
            entry: Entry | None = self._registry.by_id(cache.cache_id)
            if entry is None:
                return None  # already released: a no-op, as llm_datadist
            if not entry.owned:
                param_invalid(
                    op, f"cache {cache.cache_id} is registered memory; use unregister_cache"
                )
            if entry.cache.is_blocks_cache != blocks:
                other = (
                    "deallocate_blocks_cache" if entry.cache.is_blocks_cache else "deallocate_cache"
                )
                param_invalid(op, f"cache {cache.cache_id} must be released with {other}")
            self._registry.release_id(entry)
            return entry

    async def _end_leases(self, entry: Entry | None) -> None:
        """Take back the leases of ``entry``'s cache (:mod:`aiokv._remote._leases`):
        returns once no peer uses one any more. Past the point of no return (the cache
        was released, or its key is moving), so not cancellable (``Engine.finish``)."""
        leases = self._client.leases
        if entry is not None and leases is not None and leases.lent(entry):
            await self._engine.finish(leases.revoke, entry)

    async def deallocate_cache(self, cache: Cache) -> None:
        """Release the cache id reference; memory returns once no key references it either.

        Releasing an already released cache is a no-op.
        """
        self._release("deallocate_cache", cache, blocks=False)

    async def deallocate_blocks_cache(self, cache: Cache) -> None:
        """Release a blocks cache from ``allocate_blocks_cache`` (a no-op if already released).

        If the cache is lent to peers (leases, over NIXL), it returns once each of them
        stopped using it (a round trip each; one that does not answer within the revoke
        timeout loses its link); cancelled meanwhile, it still waits for that (the
        release happened) and returns.
        """
        entry = self._release("deallocate_blocks_cache", cache, blocks=True)
        await self._end_leases(entry)

    async def remove_cache_key(self, cache_key: CacheKey) -> None:
        """Unbind ``cache_key`` so peers can no longer pull it (a no-op if not bound)."""
        op = "remove_cache_key"
        self._check_open(op)
        check_instance(op, "cache_key", cache_key, CacheKey)
        self._registry.release_key(cache_key)

    async def unregister_cache(self, cache_id: int) -> None:
        """Forget registered user memory (a no-op if unknown or already unregistered).

        When it returns, no transfer or copy touches that memory any more. At once, the
        cache is no longer granted to peers nor pinned by new operations (they get
        ``LLM_KV_CACHE_NOT_EXIST``), and what can be revoked is: a peer's pull or push
        being served from/into it fails on the peer with ``LLM_KV_CACHE_NOT_EXIST`` (no
        further byte is read or written), a layer-wise transfer from it is cancelled.
        Then the call waits for this side's own pulls/pushes and local copies on it to
        end (each is bounded: by ``sync_kv_timeout``, or by the copy itself) — also when
        cancelled meanwhile: the unregistration happened, so the call returns once it
        holds (the cancellation comes at the caller's next checkpoint).

        Raises:
            LLMException: ``LLM_PARAM_INVALID`` if ``cache_id`` names pool memory.
        """
        op = "unregister_cache"
        self._check_open(op)
        check_int(op, "cache_id", cache_id, 0, UINT64_MAX)
        with self._registry.lock:
            entry = self._registry.by_id(cache_id)
            if entry is None:
                # already unregistered; maybe still in use (an earlier unregister_cache
                # still waits): this call, too, returns only once nothing touches it
                entry = self._registry.entries.get(cache_id)
                if entry is None or entry.owned or not entry.pins:
                    return
            else:
                if entry.owned:
                    param_invalid(op, f"cache {cache_id} was allocated from a pool; deallocate it")
                self._registry.release_id(entry)
                self._registry.revoke(entry, LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
                if not entry.pins:
                    return
        await self._end_leases(entry)
        await self._engine.finish(self._until_unpinned, entry)

    async def _until_unpinned(self, entry: Entry) -> None:
        """On the engine: wait until no operation pins ``entry`` any more."""
        loop = asyncio.get_running_loop()
        unpinned: asyncio.Future[None] = loop.create_future()

        def wake() -> None:  # from whichever thread unpins, under the registry lock
            with contextlib.suppress(RuntimeError):  # the engine stopped: nobody waits
                loop.call_soon_threadsafe(_resolve, unpinned)

        if self._registry.when_unpinned(entry, wake):
            await unpinned


def _pool_too_small(op: str, desc: CacheDesc, pool: MemPool) -> LLMException:
    """The out-of-memory error of an allocation: how much was asked, what the pool has,
    and the option that sizes it."""
    stats = pool.stats()
    which = "mem_pool_cfg" if desc.placement == Placement.DEVICE else "host_mem_pool_cfg"
    need = desc.num_tensors * -(-desc.size // stats.page_size) * stats.page_size
    return LLMException(
        f"{op}: the {pool.name} cannot hold this cache: {desc.num_tensors} tensor(s) of "
        f"{desc.size} bytes need {need} bytes; {stats.free} of {stats.total} bytes are free "
        f"(largest free span {stats.largest_free}). Free caches, or raise "
        f"{which}.memory_size (it reserves {stats.total} bytes now)",
        status_code=LLMStatusCode.LLM_OUT_OF_MEMORY,
        op=op,
    )


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
