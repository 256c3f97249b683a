"""``CacheManager``: the public async operations on caches (SPEC §1.4–1.5).

Each operation validates everything first (synchronously: a failed call changes
nothing), pins the caches it touches, then awaits one job on the copy scheduler. Pins
keep memory alive while a job runs, so a concurrent ``deallocate_cache`` defers the free
instead of handing the bytes to someone else mid-copy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from ._cache import Cache, CacheRegistry, Entry, wrap_memory
from ._enums import LLMRole, LLMStatusCode, Placement
from ._errors import (
    LLMException,
    check_index,
    check_instance,
    check_int,
    map_errors,
    param_invalid,
)
from ._models import BlocksCacheKey, CacheDesc, CacheKey, LLMConfig
from ._pool import MemPool, PoolStats, Span
from ._scheduler import CopyScheduler

__all__ = ["CacheManager", "KvCacheManager"]


def _check_list(op: str, name: str, value: Any, item: type) -> list[Any]:
    check_instance(op, name, value, (list, tuple))
    for i, v in enumerate(value):
        check_instance(op, f"{name}[{i}]", v, item)
    return list(value)


def _check_blocks(op: str, name: str, value: Any, nblocks: int) -> list[int]:
    check_instance(op, name, value, (list, tuple))
    return [check_index(op, f"{name}[{i}]", b, nblocks) for i, b in enumerate(value)]


class CacheManager:
    """Allocates, registers, copies and swaps caches of one ``LLMDataDist``.

    Obtained from ``LLMDataDist.cache_manager`` after ``init``; every method is async and
    never blocks the event loop. Errors follow SPEC §1.2.
    """

    def __init__(
        self,
        *,
        cluster_id: int,
        role: LLMRole,
        config: LLMConfig,
        device: torch.device,
        scheduler: CopyScheduler,
        device_pool: MemPool | None,
        host_pool: MemPool | None,
    ) -> None:
        self._cluster_id = cluster_id
        self._role = role
        self._config = config
        self._device = device
        self._scheduler = scheduler
        self._pools = {Placement.DEVICE: device_pool, Placement.HOST: host_pool}
        self._registry = CacheRegistry()
        self._closed = False

    # ---- introspection ------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """The torch device DEVICE-placed caches live on (CPU when there is no accelerator)."""
        return self._device

    def get_pool_stats(self, placement: Placement = Placement.DEVICE) -> PoolStats | None:
        """Statistics of the device or host pool; ``None`` if that pool is not configured."""
        check_instance("get_pool_stats", "placement", placement, Placement)
        pool = self._pools[placement]
        return None if pool is None else pool.stats()

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise RuntimeError(f"{op}: the LLMDataDist was finalized")

    # ---- allocation ---------------------------------------------------------------------
    def _allocate(self, op: str, desc: CacheDesc) -> tuple[list[torch.Tensor], list[Any]]:
        pool = self._pools[desc.placement]
        if pool is None:
            which = "mem_pool_cfg" if desc.placement == Placement.DEVICE else "host_mem_pool_cfg"
            raise LLMException(
                f"{op}: no {desc.placement.name.lower()} memory pool ({which} not set)",
                LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
            )
        spans: list[Span] = []
        try:
            for _ in range(desc.num_tensors):
                spans.append(pool.allocate(desc.size))
        except BaseException:
            for s in spans:
                pool.free(s)
            raise
        tensors = [pool.view(s).view(desc.torch_dtype).view(desc.shape) for s in spans]
        return tensors, [(pool, s) for s in spans]

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
        op = "allocate_cache"
        self._check_open(op)
        check_instance(op, "cache_desc", cache_desc, CacheDesc)
        keys = _check_list(op, "cache_keys", cache_keys, CacheKey)
        if len(keys) > cache_desc.batch_size:
            param_invalid(op, f"{len(keys)} cache_keys for batch size {cache_desc.batch_size}")
        tensors, spans = self._allocate(op, cache_desc)
        cache = Cache(cache_desc, tensors, is_blocks_cache=False)
        self._registry.add(
            cache,
            spans,
            remote_accessible=self._config.enable_remote_cache_accessible,
            keys=keys,
        )
        return cache

    async def allocate_blocks_cache(
        self, cache_desc: CacheDesc, blocks_cache_key: BlocksCacheKey | None = None
    ) -> Cache:
        """Allocate a paged cache (``shape[0]`` blocks) from the pool of its placement.

        ``blocks_cache_key`` names it for peers (``pull_blocks``/``push_blocks``); a key
        already in use moves to this cache (the later wins; a warning is logged).

        Raises:
            TypeError / NoneArgumentError: wrong argument types.
            LLMException: ``LLM_FEATURE_NOT_ENABLED`` (no pool), ``LLM_OUT_OF_MEMORY``.
        """
        op = "allocate_blocks_cache"
        self._check_open(op)
        check_instance(op, "cache_desc", cache_desc, CacheDesc)
        if blocks_cache_key is not None:
            check_instance(op, "blocks_cache_key", blocks_cache_key, BlocksCacheKey)
        tensors, spans = self._allocate(op, cache_desc)
        cache = Cache(cache_desc, tensors, is_blocks_cache=True)
        self._registry.add(
            cache,
            spans,
            remote_accessible=self._config.enable_remote_cache_accessible,
            blocks_key=blocks_cache_key,
        )
        return cache

    def _release(self, op: str, cache: Any, *, blocks: bool) -> None:
        check_instance(op, "cache", cache, Cache)
        if cache._registry is not self._registry:
            if cache._registry is None:
                param_invalid(op, f"cache {cache.cache_id} was not allocated by this manager")
            param_invalid(op, f"cache {cache.cache_id} belongs to another LLMDataDist")
        entry = self._registry.by_id(cache.cache_id)
        if entry is None:
            return  # already released: a no-op, as llm_datadist
        if not entry.owned:
            param_invalid(op, f"cache {cache.cache_id} is registered memory; use unregister_cache")
        if entry.cache.is_blocks_cache != blocks:
            other = "deallocate_blocks_cache" if entry.cache.is_blocks_cache else "deallocate_cache"
            param_invalid(op, f"cache {cache.cache_id} must be released with {other}")
        self._registry.release_id(entry)

    async def deallocate_cache(self, cache: Cache) -> None:
        """Release the cache id reference; memory returns once no key references it either.

        Releasing an already released cache is a no-op.
        """
        self._release("deallocate_cache", cache, blocks=False)

    async def deallocate_blocks_cache(self, cache: Cache) -> None:
        """Release a blocks cache from ``allocate_blocks_cache`` (a no-op if already released)."""
        self._release("deallocate_blocks_cache", cache, blocks=True)

    async def remove_cache_key(self, cache_key: CacheKey) -> None:
        """Unbind ``cache_key`` so peers can no longer pull it (a no-op if not bound)."""
        check_instance("remove_cache_key", "cache_key", cache_key, CacheKey)
        self._registry.release_key(cache_key)

    # ---- registration of user memory ----------------------------------------------------
    def _remote(self, op: str, remote_accessible: Any) -> bool:
        if remote_accessible is None:
            return self._config.enable_remote_cache_accessible
        return check_instance(op, "remote_accessible", remote_accessible, bool)

    async def register_cache(
        self,
        cache_desc: CacheDesc,
        tensors_or_addrs: Sequence[torch.Tensor] | Sequence[int],
        cache_keys: Sequence[CacheKey] = (),
        remote_accessible: bool | None = None,
    ) -> Cache:
        """Register user memory as a contiguous cache (no copy; the user keeps ownership).

        Args:
            cache_desc: describes each tensor.
            tensors_or_addrs: ``num_tensors`` tensors (DEVICE placement: on this device)
                or host addresses.
            cache_keys: key i names batch slot i, as in ``allocate_cache``.
            remote_accessible: whether peers may push into / read by id from it
                (default: ``enable_remote_cache_accessible``).
        """
        op = "register_cache"
        self._check_open(op)
        check_instance(op, "cache_desc", cache_desc, CacheDesc)
        keys = _check_list(op, "cache_keys", cache_keys, CacheKey)
        if len(keys) > cache_desc.batch_size:
            param_invalid(op, f"{len(keys)} cache_keys for batch size {cache_desc.batch_size}")
        remote = self._remote(op, remote_accessible)
        tensors = wrap_memory(op, cache_desc, tensors_or_addrs, self._device)
        cache = Cache(cache_desc, tensors, is_blocks_cache=False)
        self._registry.add(cache, [], remote_accessible=remote, keys=keys)
        return cache

    async def register_blocks_cache(
        self,
        cache_desc: CacheDesc,
        tensors_or_addrs: Sequence[torch.Tensor] | Sequence[int],
        blocks_cache_key: BlocksCacheKey | None = None,
        remote_accessible: bool | None = None,
    ) -> Cache:
        """Register user memory as a blocks cache (``shape[0]`` blocks), optionally keyed.

        Registering a key already in use moves it here (the later wins; warned).
        """
        op = "register_blocks_cache"
        self._check_open(op)
        check_instance(op, "cache_desc", cache_desc, CacheDesc)
        if blocks_cache_key is not None:
            check_instance(op, "blocks_cache_key", blocks_cache_key, BlocksCacheKey)
        remote = self._remote(op, remote_accessible)
        tensors = wrap_memory(op, cache_desc, tensors_or_addrs, self._device)
        cache = Cache(cache_desc, tensors, is_blocks_cache=True)
        self._registry.add(cache, [], remote_accessible=remote, blocks_key=blocks_cache_key)
        return cache

    async def unregister_cache(self, cache_id: int) -> None:
        """Forget registered user memory (a no-op if unknown or already unregistered).

        Raises:
            LLMException: ``LLM_PARAM_INVALID`` if ``cache_id`` names pool memory.
        """
        op = "unregister_cache"
        check_int(op, "cache_id", cache_id, 0, 2**64 - 1)
        entry = self._registry.by_id(cache_id)
        if entry is None:
            return
        if entry.owned:
            param_invalid(op, f"cache {cache_id} was allocated from a pool; deallocate it")
        self._registry.release_id(entry)

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
        s, d = src.cache_desc, dst.cache_desc
        if s.num_tensors != d.num_tensors:
            param_invalid(op, f"tensor counts differ ({s.num_tensors} vs {d.num_tensors})")
        if src.block_bytes != dst.block_bytes:
            param_invalid(op, f"block sizes differ ({src.block_bytes} vs {dst.block_bytes} B)")

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
        check_int(op, "offset", offset, 0, 2**63)
        check_int(op, "size", size, -1, 2**63)
        if req_id is not None:
            check_int(op, "req_id", req_id, 0, 2**64 - 1)
        if dd.num_tensors != sd.num_tensors or dd.data_type != sd.data_type:
            param_invalid(op, "src and dst differ in tensor count or data type")
        bd_s, bd_d = sd.batch_dim_index % len(sd.shape), dd.batch_dim_index % len(dd.shape)
        s_rest = [x for i, x in enumerate(sd.shape) if i != bd_s]
        d_rest = [x for i, x in enumerate(dd.shape) if i != bd_d]
        if s_rest != d_rest:
            param_invalid(op, f"shapes {list(sd.shape)} and {list(dd.shape)} do not match")
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
        with self._pinned(de, se), map_errors(op):
            await self._scheduler.copy_many(pairs)

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
            for d in _check_blocks(op, f"copy_block_info[{s}]", dsts, n):
                pairs.append((s, d))
        dsts_all = [d for _, d in pairs]
        if len(set(dsts_all)) != len(dsts_all):
            param_invalid(op, "a destination block appears twice")
        if set(dsts_all) & set(copy_block_info):
            param_invalid(op, "a block is both a source and a destination")
        if not pairs:
            return
        rows = cache.rows()
        with self._pinned(entry), map_errors(op):
            await self._scheduler.copy_blocks(rows, rows, pairs)

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
        srcs = _check_blocks(op, "src_blocks", src_blocks, src_cache.num_blocks)
        check_instance(op, "dst_blocks_list", dst_blocks_list, (list, tuple))
        pairs: list[tuple[int, int]] = []
        for i, lst in enumerate(dst_blocks_list):
            dsts = _check_blocks(op, f"dst_blocks_list[{i}]", lst, dst_cache.num_blocks)
            if len(dsts) != len(srcs):
                param_invalid(op, f"dst_blocks_list[{i}] has {len(dsts)} blocks, src has {len(srcs)}")
            pairs.extend(zip(srcs, dsts, strict=True))
        dsts_all = [d for _, d in pairs]
        if len(set(dsts_all)) != len(dsts_all):
            param_invalid(op, "a destination block is written twice")
        if src_cache is dst_cache and set(dsts_all) & set(srcs):
            param_invalid(op, "a block is both a source and a destination")
        if not pairs:
            return
        with self._pinned(se, de), map_errors(op):
            await self._scheduler.copy_blocks(src_cache.rows(), dst_cache.rows(), pairs)

    async def swap_blocks(self, src: Cache, dst: Cache, src_to_dst: Mapping[int, int]) -> None:
        """Swap blocks between a host and a device blocks cache: host→device is "swap in",
        device→host "swap out". ``{src_block: dst_block}``; per-block size and tensor count
        must match.

        Raises:
            TypeError / NoneArgumentError: wrong argument types (``None`` caches included).
            LLMException: ``LLM_PARAM_INVALID`` for same-placement caches, mismatched caches,
                out-of-range blocks or a destination written twice.
        """
        op = "swap_blocks"
        self._check_open(op)
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
        with self._pinned(se, de), map_errors(op):
            await self._scheduler.copy_blocks(src.rows(), dst.rows(), pairs)

    # ---- lifecycle ----------------------------------------------------------------------
    def _close(self) -> None:
        """Mark closed (called by ``LLMDataDist.finalize`` after in-flight work ended)."""
        self._closed = True


_PULL_ROLES = (LLMRole.DECODER, LLMRole.MIX)
_PROMPT_ROLES = (LLMRole.PROMPT, LLMRole.MIX)


class KvCacheManager(CacheManager):
    """Legacy-mode manager (``enable_cache_manager=False``): the same engine, with
    llm_datadist's role gates (only DECODER pulls; only PROMPT removes keys or calls
    ``transfer_cache_async``). A gated call raises ``LLMException(LLM_FEATURE_NOT_ENABLED)``.
    """

    def _gate(self, op: str, roles: tuple[LLMRole, ...]) -> None:
        if self._role not in roles:
            raise LLMException(
                f"{op}: not allowed for role {self._role.name}",
                LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
            )

    async def remove_cache_key(self, cache_key: CacheKey) -> None:  # noqa: D102
        self._gate("remove_cache_key", _PROMPT_ROLES)
        await super().remove_cache_key(cache_key)
