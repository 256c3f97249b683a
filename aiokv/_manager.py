"""``CacheManager``: the public async operations on caches (SPEC §1.4–1.5), a façade.

Every operation checks its arguments (synchronously: a failed call changes nothing),
plans, and delegates: bookkeeping to the registry, copies to the copy scheduler, remote
transfers to the remote client (as a :class:`~aiokv._remote._parts.Transfer` of this
side's cache), layer-wise transfers to :mod:`aiokv._layerwise`. Caches an operation
touches are pinned for its duration, so a concurrent ``deallocate_cache`` defers the free
instead of handing the bytes to someone else mid-copy.

``KvCacheManager`` is the same class with llm_datadist's legacy role gates: a table the
base methods consult, so its signatures and docstrings are the base's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, ParamSpec, TypeVar

import numpy as np
import torch

from ._cache import Cache, wrap_memory
from ._checks import (
    MAX_BLOCK_INDEX,
    UINT64_MAX,
    check_blocks,
    check_index,
    check_instance,
    check_int,
    check_layer_range,
    check_list,
    check_unique,
    param_invalid,
    renamed,
    tensor_range,
)
from ._config import LLMConfig
from ._copy import CopyScheduler, copy_rows, fits_inline
from ._engine import Engine, Portal, checkpoint, on_asyncio
from ._enums import LLMRole, LLMStatusCode, Memtype, Placement
from ._errors import LLMException, map_errors
from ._layerwise import CacheTask, LayerSynchronizer, Source, plan, run_layers
from ._models import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    MemInfo,
    TransferConfig,
    TransferWithCacheKeyConfig,
)
from ._pool import MemPool, PoolStats, Span
from ._registry import CacheRegistry, Entry, RegistryStats, is_placeholder
from ._remote import RemoteClient, Transfer
from ._remote._protocol import (
    MAX_TENSORS,
    BlocksReq,
    ChunksReq,
    Request,
    SlotReq,
    Tensors,
    pack_blocks,
    wire_key,
)

__all__ = ["CacheManager", "KvCacheManager"]

P = ParamSpec("P")
R = TypeVar("R")

_PULL_ROLES = (LLMRole.DECODER, LLMRole.MIX)
_PROMPT_ROLES = (LLMRole.PROMPT, LLMRole.MIX)


class CacheManager:
    """Allocates, registers, copies, swaps and transfers caches of one ``LLMDataDist``.

    Obtained from ``LLMDataDist.cache_manager`` after ``init``; every operation is async
    (``transfer_cache_async`` returns its started ``CacheTask`` at once) and never blocks
    the event loop beyond a small inline host copy (tens of µs, see
    :mod:`aiokv._copy._inline`). Errors follow SPEC §1.2.
    """

    #: operation → roles allowed to call it (empty here; llm_datadist's legacy gates in
    #: :class:`KvCacheManager`).
    _GATES: ClassVar[Mapping[str, tuple[LLMRole, ...]]] = {}

    def __init__(
        self,
        *,
        role: LLMRole,
        config: LLMConfig,
        device: torch.device,
        scheduler: CopyScheduler,
        registry: CacheRegistry,
        client: RemoteClient,
        engine: Engine,
        device_pool: MemPool | None,
        host_pool: MemPool | None,
    ) -> None:
        self._role = role
        self._engine = engine
        self._config = config
        self._device = device
        self._scheduler = scheduler
        self._registry = registry
        self._client = client
        self._pools = {Placement.DEVICE: device_pool, Placement.HOST: host_pool}
        self._closed = False
        self._tasks: set[asyncio.Task[None]] = set()  # layer-wise transfers, owned here

    # ---- introspection ------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """The torch device DEVICE-placed caches live on (CPU when there is no accelerator)."""
        return self._device

    def get_pool_stats(self, placement: Placement = Placement.DEVICE) -> PoolStats | None:
        """Statistics of the device or host pool; ``None`` if that pool is not configured."""
        self._check_open("get_pool_stats")
        check_instance("get_pool_stats", "placement", placement, Placement)
        pool = self._pools[placement]
        if pool is None:
            return None
        with self._registry.lock:
            return pool.stats()

    def statistics(self) -> RegistryStats:
        """A snapshot of the caches, keys and pins this manager tracks."""
        return self._registry.statistics()

    @staticmethod
    def check_cache_key(cache_key: CacheKey) -> None:
        """Refuse a ``CacheKey`` naming neither or both of a request and a prefix, as
        llm_datadist: exactly one of ``req_id`` / ``prefix_id`` must be below ``2**64-1``.

        Raises:
            TypeError / NoneArgumentError: not a ``CacheKey``.
            LLMException: ``LLM_PARAM_INVALID`` otherwise.
        """
        op = "check_cache_key"
        check_instance(op, "cache_key", cache_key, CacheKey)
        req, prefix = cache_key.req_id != UINT64_MAX, cache_key.prefix_id != UINT64_MAX
        if req == prefix:
            which = "only one" if req else "one"
            param_invalid(
                op,
                f"{which} of req id and prefix id should contain a valid value [0, 2**64-1), "
                f"req id: {cache_key.req_id}, prefix id: {cache_key.prefix_id}",
            )

    def _check_open(self, op: str) -> None:
        """Refuse calls after ``finalize`` and calls the role gates forbid."""
        if self._closed:
            raise RuntimeError(f"{op}: the LLMDataDist was finalized")
        roles = self._GATES.get(op)
        if roles is not None and self._role not in roles:
            raise LLMException(
                f"{op}: not allowed for role {self._role.name}",
                status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                op=op,
            )

    # ---- allocation and registration ----------------------------------------------------
    def _allocate(self, op: str, desc: CacheDesc) -> tuple[list[torch.Tensor], list[Any]]:
        pool = self._pools[desc.placement]
        if pool is None:
            which = "mem_pool_cfg" if desc.placement == Placement.DEVICE else "host_mem_pool_cfg"
            raise LLMException(
                f"{op}: no {desc.placement.name.lower()} memory pool ({which} not set)",
                status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                op=op,
            )
        spans: list[Span] = []
        try:
            for _ in range(desc.num_tensors):
                spans.append(pool.allocate(desc.size))
        except BaseException as exc:
            for s in spans:
                pool.free(s)
            if isinstance(exc, LLMException) and exc.status_code == LLMStatusCode.LLM_OUT_OF_MEMORY:
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
            LLMException: ``LLM_PARAM_INVALID`` (memory not matching ``cache_desc``, more
                keys than batch slots).
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
            LLMException: ``LLM_PARAM_INVALID`` (memory not matching ``cache_desc``).
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
                return
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

    # ---- local copies -------------------------------------------------------------------
    @contextlib.contextmanager
    def _pinned(self, *entries: Entry | None) -> Iterator[None]:
        live = [e for e in entries if e is not None]
        self._registry.pin(*live)
        try:
            yield
        finally:
            self._registry.unpin(*live)

    def _blocks_entry(self, op: str, cache: Any, name: str) -> Entry | None:
        entry = self._registry.entry(op, cache, name)
        if not cache.is_blocks_cache:
            param_invalid(op, f"{name} {cache.cache_id} is not a blocks cache")
        return entry

    @staticmethod
    def _check_block_compat(op: str, src: Cache, dst: Cache) -> None:
        """``src`` and ``dst`` agree where a block copy needs it; else an error naming
        both caches, both values and the ``CacheDesc`` fields that must agree."""
        s, d = src.cache_desc, dst.cache_desc
        both = f"src cache {src.cache_id} has {{}}, dst cache {dst.cache_id} has {{}}"
        if s.num_tensors != d.num_tensors:
            param_invalid(
                op,
                "tensor counts differ: "
                + both.format(s.num_tensors, d.num_tensors)
                + "; CacheDesc.num_tensors must be equal",
            )
        if s.data_type != d.data_type:
            param_invalid(
                op,
                "data types differ: "
                + both.format(s.data_type.name, d.data_type.name)
                + "; CacheDesc.data_type must be equal",
            )
        if src.block_bytes != dst.block_bytes:
            param_invalid(
                op,
                "block sizes differ: "
                + both.format(
                    f"{src.block_bytes} bytes per block (shape {list(s.shape)})",
                    f"{dst.block_bytes} (shape {list(d.shape)})",
                )
                + "; CacheDesc.shape must be equal after dim 0 (the block count)",
            )

    async def copy_cache(
        self,
        dst: Cache,
        src: Cache,
        dst_batch_index: int = 0,
        src_batch_index: int = 0,
        offset: int = 0,
        size: int = -1,
        req_id: int | None = None,
    ) -> None:
        """Copy batch slot ``src_batch_index`` of every tensor of ``src`` into slot
        ``dst_batch_index`` of ``dst``: ``size`` bytes (``-1``: the rest of the slot) from
        byte ``offset`` of the slot.

        The descriptors must match in tensor count and dtype, and their shapes may differ
        only in the batch dimension. ``req_id`` is only logged.

        Raises:
            LLMException: ``LLM_PARAM_INVALID`` for mismatched caches or out-of-range
                indices, offset or size.
        """
        op = "copy_cache"
        self._check_open(op)
        de = self._registry.entry(op, dst, "dst")
        se = self._registry.entry(op, src, "src")
        dd, sd = dst.cache_desc, src.cache_desc
        di = check_index(op, "dst_batch_index", dst_batch_index, dd.batch_size)
        si = check_index(op, "src_batch_index", src_batch_index, sd.batch_size)
        check_int(op, "offset", offset, 0, MAX_BLOCK_INDEX)
        check_int(op, "size", size, -1, MAX_BLOCK_INDEX)
        if req_id is not None:
            check_int(op, "req_id", req_id, 0, UINT64_MAX)
        if dd.num_tensors != sd.num_tensors or dd.data_type != sd.data_type:
            param_invalid(
                op,
                f"src cache {src.cache_id} has {sd.num_tensors} tensors of "
                f"{sd.data_type.name}, dst cache {dst.cache_id} has {dd.num_tensors} of "
                f"{dd.data_type.name}; CacheDesc.num_tensors and data_type must be equal",
            )
        bd_s, bd_d = sd.batch_dim_index % len(sd.shape), dd.batch_dim_index % len(dd.shape)
        s_rest = [x for i, x in enumerate(sd.shape) if i != bd_s]
        d_rest = [x for i, x in enumerate(dd.shape) if i != bd_d]
        if s_rest != d_rest:
            param_invalid(
                op,
                f"shapes differ: src cache {src.cache_id} has {list(sd.shape)}, dst cache "
                f"{dst.cache_id} has {list(dd.shape)}; CacheDesc.shape must be equal but "
                "for the batch dimension",
            )
        slot = sd.size // sd.batch_size
        if size == 0 or offset >= slot or (size > 0 and offset + size > slot):
            param_invalid(op, f"offset {offset} + size {size} exceeds the {slot}-byte slot")
        n = slot - offset if size == -1 else size
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for ts, td in zip(src.tensors, dst.tensors, strict=True):
            if bd_s == 0 and bd_d == 0:
                fs = ts.view(torch.uint8).view(sd.batch_size, slot)[si, offset : offset + n]
                fd = td.view(torch.uint8).view(dd.batch_size, slot)[di, offset : offset + n]
                pairs.append((fs, fd))
            elif offset == 0 and n == slot:
                pairs.append((ts.select(bd_s, si), td.select(bd_d, di)))
            else:
                param_invalid(op, "offset/size need batch_dim_index 0")
        _check_no_overlap(op, pairs)
        with self._pinned(de, se), map_errors(op):
            await self._copy(self._scheduler.copy_many, pairs)

    async def copy_blocks(self, cache: Cache, copy_block_info: Mapping[int, Sequence[int]]) -> None:
        """Copy blocks within one blocks cache, one source to many destinations
        (copy-on-write forks): ``{src_block: [dst_block, ...]}``, for every tensor.

        A destination may appear once and may not also be a source.

        Raises:
            LLMException: ``LLM_PARAM_INVALID`` for out-of-range or conflicting blocks.
        """
        op = "copy_blocks"
        self._check_open(op)
        entry = self._blocks_entry(op, cache, "cache")
        check_instance(op, "copy_block_info", copy_block_info, dict)
        n = cache.num_blocks
        pairs: list[tuple[int, int]] = []
        for s, dsts in copy_block_info.items():
            s = check_index(op, "src block", s, n)
            for d in check_blocks(op, f"copy_block_info[{s}]", dsts, n).tolist():
                pairs.append((s, d))
        dsts_all = [d for _, d in pairs]
        if len(set(dsts_all)) != len(dsts_all):
            param_invalid(op, "a destination block appears twice")
        if set(dsts_all) & set(copy_block_info):
            param_invalid(op, "a block is both a source and a destination")
        if not pairs:
            return
        await self._copy_blocks(op, cache, cache, pairs, entry)

    async def copy_kv_blocks(
        self,
        src_cache: Cache,
        dst_cache: Cache,
        src_blocks: Sequence[int],
        dst_blocks_list: Sequence[Sequence[int]],
    ) -> None:
        """llm_datadist's ``CopyKvBlocks``: copy ``src_blocks`` of ``src_cache`` to each list
        in ``dst_blocks_list`` of ``dst_cache`` (``dst_list[i]`` gets ``src_blocks[i]``).

        Device↔device, device→host and host→device are supported; host→host is refused.

        Raises:
            LLMException: ``LLM_PARAM_INVALID`` for host→host, mismatched caches, list
                lengths, out-of-range blocks, a destination written twice, or a destination
                that is also a source in the same cache.
        """
        op = "copy_kv_blocks"
        self._check_open(op)
        se = self._blocks_entry(op, src_cache, "src_cache")
        de = self._blocks_entry(op, dst_cache, "dst_cache")
        if src_cache.placement == Placement.HOST and dst_cache.placement == Placement.HOST:
            param_invalid(op, "host to host copies are not supported")
        self._check_block_compat(op, src_cache, dst_cache)
        srcs = check_blocks(op, "src_blocks", src_blocks, src_cache.num_blocks).tolist()
        check_instance(op, "dst_blocks_list", dst_blocks_list, (list, tuple))
        pairs: list[tuple[int, int]] = []
        for i, lst in enumerate(dst_blocks_list):
            dsts = check_blocks(op, f"dst_blocks_list[{i}]", lst, dst_cache.num_blocks).tolist()
            if len(dsts) != len(srcs):
                param_invalid(
                    op, f"dst_blocks_list[{i}] has {len(dsts)} blocks, src has {len(srcs)}"
                )
            pairs.extend(zip(srcs, dsts, strict=True))
        dsts_all = [d for _, d in pairs]
        if len(set(dsts_all)) != len(dsts_all):
            param_invalid(op, "a destination block is written twice")
        if src_cache is dst_cache and set(dsts_all) & set(srcs):
            param_invalid(op, "a block is both a source and a destination")
        if not pairs:
            return
        await self._copy_blocks(op, src_cache, dst_cache, pairs, se, de)

    @renamed(src="src_cache", dst="dst_cache")
    async def swap_blocks(
        self, src_cache: Cache, dst_cache: Cache, src_to_dst: Mapping[int, int]
    ) -> None:
        """Swap blocks between a host and a device blocks cache: host→device is "swap in",
        device→host "swap out". ``{src_block: dst_block}``; per-block size and tensor count
        must match. (The legacy keywords ``src`` / ``dst`` also work.)

        Raises:
            TypeError / NoneArgumentError: wrong argument types (``None`` caches included).
            LLMException: ``LLM_PARAM_INVALID`` for same-placement caches, mismatched caches,
                out-of-range blocks or a destination written twice.
        """
        op = "swap_blocks"
        self._check_open(op)
        src, dst = src_cache, dst_cache
        se = self._blocks_entry(op, src, "src")
        de = self._blocks_entry(op, dst, "dst")
        check_instance(op, "src_to_dst", src_to_dst, dict)
        if src.placement == dst.placement:
            param_invalid(op, f"both caches are {src.placement.name}; swap needs host and device")
        self._check_block_compat(op, src, dst)
        pairs = [
            (
                check_index(op, "src block", s, src.num_blocks),
                check_index(op, "dst block", d, dst.num_blocks),
            )
            for s, d in src_to_dst.items()
        ]
        if len({d for _, d in pairs}) != len(pairs):
            param_invalid(op, "a destination block is written twice")
        if not pairs:
            return
        await self._copy_blocks(op, src, dst, pairs, se, de)

    async def _copy_blocks(
        self,
        op: str,
        src: Cache,
        dst: Cache,
        pairs: list[tuple[int, int]],
        *entries: Entry | None,
    ) -> None:
        """``dst`` block ``d`` = ``src`` block ``s`` for every pair, in every tensor, with
        ``entries`` pinned throughout.

        A small copy between host tensors (:func:`~aiokv._copy.fits_inline`) runs right
        here, after one checkpoint (cancelled there, nothing was copied): cheaper than
        the hop to a worker. Anything else is one job on the copy workers.
        """
        live = [e for e in entries if e is not None]
        self._registry.pin(*live)
        try:
            hs, hd = src.host_rows(), dst.host_rows()
            if (
                hs is not None
                and hd is not None
                and fits_inline(len(hs), len(pairs), hs[0].shape[1])
            ):
                await checkpoint()
                try:
                    with self._scheduler.inline.measure(len(hs) * len(pairs) * hs[0].shape[1]):
                        copy_rows(hs, hd, pairs)
                except Exception:
                    with map_errors(op):  # the same codes as from a worker
                        raise
                return
            with map_errors(op):
                await self._copy(self._scheduler.copy_blocks, src.rows(), dst.rows(), pairs)
        finally:
            self._registry.unpin(*live)

    async def _copy(self, fn: Callable[P, Awaitable[R]], *args: P.args, **kwargs: P.kwargs) -> R:
        """Await a copy job: straight from the caller's asyncio loop to the copy workers;
        from trio (whose loop the workers cannot wake), through the engine loop."""
        if on_asyncio():
            return await fn(*args, **kwargs)
        return await self._engine.run(fn, *args, **kwargs)

    # ---- remote -------------------------------------------------------------------------
    @staticmethod
    def _selection(
        op: str, local: Cache, local_layers: Any, remote_layers: Any, per_layer: Any
    ) -> tuple[range, Tensors]:
        """Local tensor indices, and which tensors the peer selects (the wire form)."""
        n = check_int(op, "tensor_num_per_layer", per_layer, 1, MAX_TENSORS)
        local_layers = check_layer_range(op, "local layer range", local_layers)
        remote_layers = check_layer_range(op, "remote layer range", remote_layers)
        if (
            local_layers is not None
            and remote_layers is not None
            and len(local_layers) != len(remote_layers)
        ):
            param_invalid(op, "src_layer_range and dst_layer_range differ in length")
        tensors = tensor_range(op, local.cache_desc.num_tensors, local_layers, n)
        wire = None if remote_layers is None else (remote_layers.start, remote_layers.stop)
        return tensors, Tensors(len(tensors), wire, n, int(local.cache_desc.data_type))

    async def _move(
        self,
        op: str,
        key: BlocksCacheKey | CacheKey | CacheKeyByIdAndIndex,
        cache: Cache,
        entry: Entry | None,
        job: Transfer,
        *,
        write: bool,
    ) -> None:
        """Move the bytes ``job`` names of ``cache`` to/from the peer."""
        link = self._client.link(op, key.cluster_id)
        with self._pinned(entry):
            await self._engine.run(
                self._client.move, op, link, cache, job, write=write, about={"key": key}
            )

    def _slot(
        self,
        op: str,
        cache: Any,
        name: str,
        batch_index: Any,
        size: Any,
        local_layers: Any,
        remote_layers: Any,
        per_layer: Any,
    ) -> tuple[Entry | None, range, Tensors, int, int]:
        """Check a slot transfer (pull_cache / push_cache) on the local ``cache``:
        ``(entry, local tensors, peer tensors, slot offset, bytes per tensor)``."""
        entry = self._registry.entry(op, cache, name)
        if cache.is_blocks_cache:
            param_invalid(op, f"{name} must be a contiguous cache (use the *_blocks call)")
        slot = check_index(op, "batch_index", batch_index, cache.cache_desc.batch_size)
        if not cache.slots_contiguous:
            param_invalid(op, "remote slot transfers need batch_dim_index 0")
        per_slot = cache.slot_bytes
        check_int(op, "size", size, -1, MAX_BLOCK_INDEX)
        if size == 0 or size > per_slot:
            param_invalid(op, f"size {size} is outside the {per_slot}-byte slot")
        n = per_slot if size == -1 else size
        tensors, wire = self._selection(op, cache, local_layers, remote_layers, per_layer)
        return entry, tensors, wire, slot * per_slot, n

    async def pull_cache(
        self,
        cache_key: CacheKey | CacheKeyByIdAndIndex,
        cache: Cache,
        batch_index: int = 0,
        size: int = -1,
        *,
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        tensor_num_per_layer: int = 2,
    ) -> None:
        """Pull one batch slot of a peer's contiguous cache into slot ``batch_index`` of
        ``cache``: ``size`` bytes per tensor (``-1``: the whole slot, which must then be the
        same size on both sides). A successful pull by ``CacheKey`` releases that key on
        the peer (as llm_datadist does).

        Layer ``i`` is tensors ``[i*n, (i+1)*n)`` with ``n = tensor_num_per_layer``.

        Raises:
            LLMException: ``LLM_NOT_YET_LINK`` (no link to ``cache_key``'s cluster),
                ``LLM_KV_CACHE_NOT_EXIST`` (unknown key), ``LLM_PARAM_INVALID`` (sizes,
                indices or layer ranges), ``LLM_TIMEOUT`` (past ``sync_kv_timeout``),
                ``LLM_LINK_FAILED``. On failure the destination slot's bytes are
                unspecified; nothing else is touched and the key is not released.
        """
        op = "pull_cache"
        self._check_open(op)
        check_instance(op, "cache_key", cache_key, (CacheKey, CacheKeyByIdAndIndex))
        if isinstance(cache_key, CacheKey):
            self.check_cache_key(cache_key)
        entry, tensors, wire, offset, n = self._slot(
            op,
            cache,
            "cache",
            batch_index,
            size,
            dst_layer_range,
            src_layer_range,
            tensor_num_per_layer,
        )
        req = SlotReq(
            wire_key(cache_key),  # type: ignore[arg-type]
            wire,
            n,
            exact=size == -1,
            release=isinstance(cache_key, CacheKey),
        )
        job = Transfer.of_span(req, tensors, offset, n)
        await self._move(op, cache_key, cache, entry, job, write=False)

    async def pull_blocks(
        self,
        src_cache_key: BlocksCacheKey | CacheKey | CacheKeyByIdAndIndex,
        dst_cache: Cache,
        src_blocks: Sequence[int] = (),
        dst_blocks: Sequence[int] = (),
        *,
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        tensor_num_per_layer: int = 2,
    ) -> None:
        """Pull blocks of a peer's cache into ``dst_blocks`` of the blocks cache ``dst_cache``.

        With a ``BlocksCacheKey``, block ``src_blocks[i]`` lands in ``dst_blocks[i]``. With
        a ``CacheKey`` / ``CacheKeyByIdAndIndex`` the source is a contiguous slot cut into
        block-sized chunks: chunk ``src_blocks[i]`` (default ``i``) lands in
        ``dst_blocks[i]``; a successful pull by ``CacheKey`` releases the key on the peer.

        Raises:
            LLMException: ``LLM_NOT_YET_LINK``, ``LLM_KV_CACHE_NOT_EXIST``,
                ``LLM_PARAM_INVALID`` (empty or mismatched block lists, out-of-range blocks
                or layers, different block sizes), ``LLM_TIMEOUT``, ``LLM_LINK_FAILED``.
                On failure the destination blocks' bytes are unspecified.
        """
        op = "pull_blocks"
        self._check_open(op)
        check_instance(
            op, "src_cache_key", src_cache_key, (BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex)
        )
        if isinstance(src_cache_key, CacheKey):
            self.check_cache_key(src_cache_key)
        entry = self._blocks_entry(op, dst_cache, "dst_cache")
        dsts = check_blocks(op, "dst_blocks", dst_blocks, dst_cache.num_blocks)
        srcs = check_blocks(op, "src_blocks", src_blocks, MAX_BLOCK_INDEX + 1)
        if not dsts.size:
            param_invalid(op, "dst_blocks is empty")
        check_unique(op, "a destination block", dsts)
        if (srcs.size or isinstance(src_cache_key, BlocksCacheKey)) and srcs.size != dsts.size:
            param_invalid(op, f"{srcs.size} src_blocks for {dsts.size} dst_blocks")
        tensors, wire = self._selection(
            op, dst_cache, dst_layer_range, src_layer_range, tensor_num_per_layer
        )
        bb = dst_cache.block_bytes
        key = wire_key(src_cache_key)
        req: Request
        if isinstance(src_cache_key, BlocksCacheKey):
            remote = srcs
            req = BlocksReq(key, wire, pack_blocks(srcs), bb)
        else:
            remote = srcs if srcs.size else np.arange(dsts.size, dtype=np.int64)
            release = isinstance(src_cache_key, CacheKey)
            req = ChunksReq(key, wire, pack_blocks(remote), bb, release)  # type: ignore[arg-type]
        job = Transfer.of_blocks(req, tensors, dsts, remote, bb)
        await self._move(op, src_cache_key, dst_cache, entry, job, write=False)

    def _check_push(self, op: str) -> None:
        """Pushing needs ``enable_remote_cache_accessible`` on this side, as llm_datadist."""
        if not self._config.enable_remote_cache_accessible:
            param_invalid(op, "pushing needs enable_remote_cache_accessible=True on this side")

    async def push_cache(
        self,
        dst_cache_key: CacheKeyByIdAndIndex,
        src_cache: Cache,
        src_batch_index: int = 0,
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        size: int = -1,
        tensor_num_per_layer: int = 2,
    ) -> None:
        """Push slot ``src_batch_index`` of ``src_cache`` into the peer's cache
        ``dst_cache_key``. Both sides need ``enable_remote_cache_accessible``, and the
        peer's cache must be remote accessible.

        Raises:
            LLMException: as :meth:`pull_cache`; ``LLM_PARAM_INVALID`` at once when this
                side lacks ``enable_remote_cache_accessible``; ``LLM_FEATURE_NOT_ENABLED``
                when the peer does not accept pushes into that memory. On failure the
                peer's slot bytes are unspecified.
        """
        op = "push_cache"
        self._check_open(op)
        self._check_push(op)
        check_instance(op, "dst_cache_key", dst_cache_key, CacheKeyByIdAndIndex)
        entry, tensors, wire, offset, n = self._slot(
            op,
            src_cache,
            "src_cache",
            src_batch_index,
            size,
            src_layer_range,
            dst_layer_range,
            tensor_num_per_layer,
        )
        req = SlotReq(wire_key(dst_cache_key), wire, n, exact=size == -1)  # type: ignore[arg-type]
        job = Transfer.of_span(req, tensors, offset, n)
        await self._move(op, dst_cache_key, src_cache, entry, job, write=True)

    async def push_blocks(
        self,
        dst_cache_key: BlocksCacheKey,
        src_cache: Cache,
        src_blocks: Sequence[int] = (),
        dst_blocks: Sequence[int] = (),
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        tensor_num_per_layer: int = 2,
    ) -> None:
        """Push ``src_blocks`` of the blocks cache ``src_cache`` into ``dst_blocks`` of the
        peer's blocks cache ``dst_cache_key`` (which must accept pushes).

        Raises:
            LLMException: as :meth:`pull_blocks`; ``LLM_PARAM_INVALID`` /
                ``LLM_FEATURE_NOT_ENABLED`` as :meth:`push_cache`.
        """
        op = "push_blocks"
        self._check_open(op)
        self._check_push(op)
        check_instance(op, "dst_cache_key", dst_cache_key, BlocksCacheKey)
        entry = self._blocks_entry(op, src_cache, "src_cache")
        srcs = check_blocks(op, "src_blocks", src_blocks, src_cache.num_blocks)
        dsts = check_blocks(op, "dst_blocks", dst_blocks, MAX_BLOCK_INDEX + 1)
        if not srcs.size or srcs.size != dsts.size:
            param_invalid(op, f"{srcs.size} src_blocks for {dsts.size} dst_blocks")
        check_unique(op, "a destination block", dsts)
        tensors, wire = self._selection(
            op, src_cache, src_layer_range, dst_layer_range, tensor_num_per_layer
        )
        bb = src_cache.block_bytes
        req = BlocksReq(wire_key(dst_cache_key), wire, pack_blocks(dsts), bb)
        job = Transfer.of_blocks(req, tensors, srcs, dsts, bb)
        await self._move(op, dst_cache_key, src_cache, entry, job, write=True)

    # ---- layer-wise ---------------------------------------------------------------------
    def transfer_cache_async(
        self,
        src_cache: Cache,
        layer_synchronizer: LayerSynchronizer,
        transfer_configs: Sequence[TransferConfig | TransferWithCacheKeyConfig],
        src_block_indices: Sequence[int] | None = None,
        dst_block_indices: Sequence[int] | None = None,
        dst_block_memory_size: int | None = None,
    ) -> CacheTask:
        """Start a layer-wise transfer of ``src_cache`` and return its ``CacheTask`` at once.

        A plain method, as llm_datadist's (not a coroutine): call it from a coroutine on
        any loop, from trio or from a plain thread; the transfer is already started on
        the engine when it returns. Await the task (or its ``synchronize`` /
        ``get_results``) for the outcome.

        For each layer in order (layer ``i`` = tensors ``2i, 2i+1``) the task awaits
        ``layer_synchronizer.synchronize_layer(i, None)`` (for as long as it takes) and
        then sends that layer to every destination needing it, each send bounded by
        ``sync_kv_timeout``, so layer i moves while layer i+1 computes.

        Destinations: a ``TransferConfig`` names raw tensor addresses registered on the
        peer (``dst_addrs[j]`` for the j-th tensor of ``src_layer_range``), checked by the
        peer against what it registered as remote accessible; a
        ``TransferWithCacheKeyConfig`` names a peer cache by ``CacheKeyByIdAndIndex``
        (contiguous) or ``BlocksCacheKey`` (paged). Both caches contiguous, or both paged
        (``src_block_indices[k]`` → ``dst_block_indices[k]``, destination blocks of
        ``dst_block_memory_size`` bytes, default the source block size). A paged source
        without block indices (both ``None`` or empty) sends every block ``k`` to block
        ``k``.

        Raises (at once, before anything is sent):
            TypeError / NoneArgumentError: wrong argument types.
            LLMException: ``LLM_PARAM_INVALID`` (layer ranges, block lists, address
                counts), ``LLM_NOT_YET_LINK`` (a destination cluster is not linked).
        """
        op = "transfer_cache_async"
        self._check_open(op)
        entry = self._registry.entry(op, src_cache, "src_cache")
        sync = check_instance(op, "layer_synchronizer", layer_synchronizer, LayerSynchronizer)
        configs = check_list(
            op, "transfer_configs", transfer_configs, (TransferConfig, TransferWithCacheKeyConfig)
        )
        if not configs:
            param_invalid(op, "transfer_configs is empty")
        ntensors = src_cache.cache_desc.num_tensors
        if ntensors % 2:
            param_invalid(op, f"{ntensors} tensors is not a whole number of K/V layers")
        srcs = dsts = np.empty(0, dtype=np.int64)
        no_src, no_dst = _no_blocks(src_block_indices), _no_blocks(dst_block_indices)
        if src_cache.is_blocks_cache and no_src and no_dst:
            srcs = dsts = np.arange(src_cache.num_blocks, dtype=np.int64)  # every block
        elif src_cache.is_blocks_cache:
            if no_src or no_dst:
                param_invalid(op, "give both src_block_indices and dst_block_indices, or neither")
            srcs = check_blocks(op, "src_block_indices", src_block_indices, src_cache.num_blocks)
            dsts = check_blocks(op, "dst_block_indices", dst_block_indices, MAX_BLOCK_INDEX + 1)
            if srcs.size != dsts.size:
                param_invalid(op, f"{srcs.size} src blocks for {dsts.size} dst blocks")
            check_unique(op, "a destination block", dsts)
        elif src_block_indices is not None or dst_block_indices is not None:
            param_invalid(op, "block indices need a blocks cache (both sides paged)")
        bb = src_cache.block_bytes
        dbs = bb
        if dst_block_memory_size:
            dbs = check_int(op, "dst_block_memory_size", dst_block_memory_size, 1, MAX_BLOCK_INDEX)
            if dbs < bb:
                param_invalid(op, f"dst_block_memory_size {dbs} < source block size {bb}")
        source = Source(src_cache, ntensors // 2, srcs, dsts, dbs)
        plans = [plan(op, self._client, source, cfg) for cfg in configs]
        results: list[LLMStatusCode | None] = [None] * len(plans)
        live = [entry] if entry is not None else []
        portal = Portal(self._engine.sync_lane)  # an async synchronizer: the caller's loop
        name = f"aiokv-{op}-{src_cache.cache_id}"

        def spawn() -> asyncio.Task[None] | None:  # on the engine, which owns the task
            if self._closed:  # finalize got there first
                self._registry.unpin(*live)
                return None
            loop = asyncio.get_running_loop()
            task = loop.create_task(run_layers(sync, portal, plans, results), name=name)
            self._tasks.add(task)

            def revoke(_: LLMStatusCode) -> None:  # unregister_cache of the source
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(task.cancel)

            self._registry.add_revoker(task, revoke, *live)

            def finished(t: asyncio.Task[None]) -> None:
                # a done callback, not a finally: it also runs for a task cancelled unstarted
                self._tasks.discard(t)
                self._registry.drop_revoker(t, *live)
                self._registry.unpin(*live)

            task.add_done_callback(finished)
            return task

        self._registry.pin(*live)  # now: the caller may deallocate before the task runs
        try:
            return CacheTask(self._engine, spawn, results)
        except BaseException:
            self._registry.unpin(*live)
            raise

    async def remap_registered_memory(self, mem_infos: MemInfo | list[MemInfo]) -> None:
        """llm_datadist's re-mapping of registered memory after a hardware memory fault.

        The arguments are checked as llm_datadist checks them; then, as aiokv registers
        no memory with a NIC, the call is refused with ``LLM_FEATURE_NOT_ENABLED``.

        Raises:
            LLMException: ``LLM_PARAM_INVALID`` (not a ``MemInfo`` or list of them, a
                host ``mem_type``, a zero ``addr``, ``size <= 0``), otherwise
                ``LLM_FEATURE_NOT_ENABLED``.
        """
        op = "remap_registered_memory"
        self._check_open(op)
        if not isinstance(mem_infos, list | MemInfo):
            param_invalid(op, f"mem_infos must be MemInfo or list[MemInfo], got {mem_infos!r}")
        for i, info in enumerate(mem_infos if isinstance(mem_infos, list) else [mem_infos]):
            if not isinstance(info, MemInfo):
                param_invalid(op, f"mem_infos[{i}] must be MemInfo, got {type(info).__name__}")
            if info.mem_type != Memtype.MEM_TYPE_DEVICE:
                param_invalid(op, f"mem_infos[{i}].mem_type must be MEM_TYPE_DEVICE")
            if info.addr == 0 or info.size <= 0:
                param_invalid(op, f"mem_infos[{i}]: addr must be non-zero and size > 0")
        raise LLMException(
            f"{op}: aiokv registers no memory with a NIC; there is nothing to remap",
            status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
            op=op,
        )

    # ---- lifecycle ----------------------------------------------------------------------
    async def _close(self) -> None:
        """Refuse new work and stop layer-wise transfers (``LLMDataDist.finalize``)."""
        self._closed = True
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._client.leases is not None:
            await self._client.leases.aclose()


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


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """``[first, last + 1)`` byte addresses a (possibly strided) tensor view touches."""
    start = t.data_ptr()
    span = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)) if t.numel() else -1
    return start, start + (span + 1) * t.element_size()


def _check_no_overlap(op: str, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Refuse a copy whose destinations overlap each other or a source (registered memory
    may alias): checked before anything is written. A pair copying a view onto itself is
    a no-op, and allowed."""
    spans = sorted(
        (*_extent(t), i, is_dst)
        for i, pair in enumerate(pairs)
        for is_dst, t in enumerate(pair)
        if t.numel()
    )
    reach: list[tuple[int, int, int]] = []  # (end, pair, is_dst) of spans still open
    for start, end, i, is_dst in spans:
        reach = [r for r in reach if r[0] > start]
        for _, j, other_dst in reach:
            if not (is_dst or other_dst):
                continue  # two sources may share memory
            if (
                i == j
                and pairs[i][0].data_ptr() == pairs[i][1].data_ptr()
                and (pairs[i][0].stride() == pairs[i][1].stride())
            ):
                continue  # a view onto itself
            param_invalid(op, "the memory of src and dst overlaps")
        reach.append((end, i, is_dst))


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _no_blocks(indices: Sequence[int] | None) -> bool:
    """Whether a block-index argument is absent (``None`` or an empty list/tuple)."""
    return indices is None or (isinstance(indices, list | tuple) and not indices)


class KvCacheManager(CacheManager):
    """Legacy-mode manager (``enable_cache_manager=False``): the same operations, with
    llm_datadist's role gates (only DECODER pulls; only PROMPT removes keys or calls
    ``transfer_cache_async``; MIX may do both). A gated call raises
    ``LLMException(LLM_FEATURE_NOT_ENABLED)``.
    """

    _GATES: ClassVar[Mapping[str, tuple[LLMRole, ...]]] = {
        "pull_cache": _PULL_ROLES,
        "pull_blocks": _PULL_ROLES,
        "remove_cache_key": _PROMPT_ROLES,
        "transfer_cache_async": _PROMPT_ROLES,
    }

    def is_initialized(self) -> bool:
        """Whether the ``LLMDataDist`` is still initialized (``False`` after ``finalize``)."""
        return not self._closed

    def get_cache_tensors(self, cache: Cache, tensor_index: int = 0) -> list[torch.Tensor]:
        """Tensor ``tensor_index`` of ``cache``, once per device: a one-item list here
        (aiokv drives one device per ``LLMDataDist``), the same memory, no copy.

        Raises:
            TypeError / NoneArgumentError / ValueError: wrong ``cache`` or index type.
            LLMException: ``LLM_PARAM_INVALID`` for an index outside
                ``[0, num_tensors)``; ``LLM_KV_CACHE_NOT_EXIST`` for a released cache.
        """
        op = "get_cache_tensors"
        self._check_open(op)
        self._registry.entry(op, cache, "cache")
        index = check_int(op, "tensor_index", tensor_index, -(2**31), 2**31 - 1)
        if not 0 <= index < cache.cache_desc.num_tensors:
            param_invalid(
                op, f"tensor_index {index} out of range, [0, {cache.cache_desc.num_tensors})"
            )
        return [cache.tensors[index]]
