"""``CacheManager``: the public async operations on caches (SPEC §1.4–1.5).

Each operation validates everything first (synchronously: a failed call changes
nothing), pins the caches it touches, then awaits one job on the copy scheduler. Pins
keep memory alive while a job runs, so a concurrent ``deallocate_cache`` defers the free
instead of handing the bytes to someone else mid-copy.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from ._cache import Cache, CacheRegistry, Entry, wrap_memory
from ._copy import CopyScheduler
from ._enums import LLMRole, LLMStatusCode, Placement
from ._errors import (
    LLMException,
    check_index,
    check_instance,
    check_int,
    map_errors,
    param_invalid,
)
from ._layerwise import CacheTask, LayerJob, LayerSynchronizer, run_layers
from ._models import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    LLMConfig,
    TransferConfig,
    TransferWithCacheKeyConfig,
)
from ._pool import MemPool, PoolStats, Span
from ._remote import (
    PROTOCOL,
    Layout,
    PeerService,
    key_meta,
    memview,
    require_host,
    slot_bytes,
    tensor_range,
)
from .transport import Link

__all__ = ["CacheManager", "KvCacheManager"]


def _check_list(op: str, name: str, value: Any, item: type | tuple[type, ...]) -> list[Any]:
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
        self._links: dict[int, Link] = {}  # peer cluster id -> link (kept by LLMDataDist)
        self.peer_service = PeerService(cluster_id, self._registry, config)
        self._tasks: set[asyncio.Task[None]] = set()  # layer-wise transfers, owned here

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

    # ---- remote -------------------------------------------------------------------------
    def _link(self, op: str, cluster_id: int) -> Link:
        link = self._links.get(cluster_id)
        if link is None or link.broken:
            raise LLMException(
                f"{op}: cluster {cluster_id} is not linked", LLMStatusCode.LLM_NOT_YET_LINK
            )
        return link

    @staticmethod
    def _ranges(
        op: str,
        local: Cache,
        local_layers: Any,
        remote_layers: Any,
        per_layer: Any,
    ) -> tuple[range, list[int] | None, int]:
        """Local tensor indices, the remote layer range for the wire, and tensors per layer."""
        n = check_int(op, "tensor_num_per_layer", per_layer, 1, 2**31)
        for name, r in (("local layer range", local_layers), ("remote layer range", remote_layers)):
            if r is not None:
                check_instance(op, name, r, range)
                if r.step != 1 or r.start < 0 or len(r) == 0:
                    param_invalid(op, f"layer range {r} must be non-empty with step 1")
        if (
            local_layers is not None
            and remote_layers is not None
            and len(local_layers) != len(remote_layers)
        ):
            param_invalid(op, "src_layer_range and dst_layer_range differ in length")
        tensors = tensor_range(op, local.cache_desc.num_tensors, local_layers, n)
        wire = None if remote_layers is None else [remote_layers.start, remote_layers.stop]
        return tensors, wire, n

    async def _transfer(
        self,
        op: str,
        key: Any,
        cache: Cache,
        entry: Entry | None,
        layout: Layout,
        meta: dict[str, Any],
        *,
        write: bool,
    ) -> None:
        require_host(op, cache)
        link = self._link(op, key.cluster_id)
        meta = {"v": PROTOCOL, "key": key_meta(key), "ntensors": len(layout.tensors), **meta}
        views = layout.views(cache)
        timeout = self._config.sync_kv_timeout / 1000
        try:
            with self._pinned(entry), map_errors(op):
                if write:
                    await link.write(meta, views, timeout=timeout)
                else:
                    await link.read(meta, views, timeout=timeout)
        except LLMException as exc:
            if str(exc).startswith(op):
                raise
            raise LLMException(f"{op} ({key!r}): {exc}", exc.status_code) from exc

    def _slot_transfer(
        self,
        op: str,
        cache: Any,
        name: str,
        batch_index: Any,
        size: Any,
        local_layers: Any,
        remote_layers: Any,
        per_layer: Any,
    ) -> tuple[Entry | None, Layout, dict[str, Any]]:
        """Validate a slot transfer (pull_cache / push_cache) on the local ``cache``."""
        entry = self._registry.entry(op, cache, name)
        if cache.is_blocks_cache:
            param_invalid(op, f"{name} must be a contiguous cache (use the *_blocks call)")
        slot = check_index(op, "batch_index", batch_index, cache.cache_desc.batch_size)
        per_slot = slot_bytes(op, cache)
        check_int(op, "size", size, -1, 2**63)
        if size == 0 or size > per_slot:
            param_invalid(op, f"size {size} is outside the {per_slot}-byte slot")
        n = per_slot if size == -1 else size
        tensors, wire, per = self._ranges(op, cache, local_layers, remote_layers, per_layer)
        layout = Layout(tensors, None, slot=slot, nbytes=n)
        meta: dict[str, Any] = {
            "shape": "slot",
            "size": n,
            "offset": 0,
            "layers": wire,
            "per_layer": per,
            "exact": size == -1,
        }
        return entry, layout, meta

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
        entry, layout, meta = self._slot_transfer(
            op,
            cache,
            "cache",
            batch_index,
            size,
            dst_layer_range,
            src_layer_range,
            tensor_num_per_layer,
        )
        meta["release"] = isinstance(cache_key, CacheKey)
        await self._transfer(op, cache_key, cache, entry, layout, meta, write=False)

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
        entry = self._blocks_entry(op, dst_cache, "dst_cache")
        dsts = _check_blocks(op, "dst_blocks", dst_blocks, dst_cache.num_blocks)
        srcs = _check_blocks(op, "src_blocks", src_blocks, 2**63)
        if not dsts:
            param_invalid(op, "dst_blocks is empty")
        if len(set(dsts)) != len(dsts):
            param_invalid(op, "a destination block appears twice")
        if isinstance(src_cache_key, BlocksCacheKey):
            if len(srcs) != len(dsts):
                param_invalid(op, f"{len(srcs)} src_blocks for {len(dsts)} dst_blocks")
            shape = "blocks"
        else:
            if srcs and len(srcs) != len(dsts):
                param_invalid(op, f"{len(srcs)} src_blocks for {len(dsts)} dst_blocks")
            srcs = srcs or list(range(len(dsts)))
            shape = "chunks"
        tensors, wire, per = self._ranges(
            op, dst_cache, dst_layer_range, src_layer_range, tensor_num_per_layer
        )
        layout = Layout(tensors, tuple(dsts), nbytes=dst_cache.block_bytes)
        meta = {
            "shape": shape,
            "blocks": srcs,
            "block_bytes": dst_cache.block_bytes,
            "layers": wire,
            "per_layer": per,
            "release": isinstance(src_cache_key, CacheKey),
        }
        await self._transfer(op, src_cache_key, dst_cache, entry, layout, meta, write=False)

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
        ``dst_cache_key`` (which must have ``enable_remote_cache_accessible``).

        Raises:
            LLMException: as :meth:`pull_cache`; ``LLM_FEATURE_NOT_ENABLED`` when the peer
                does not accept pushes. On failure the peer's slot bytes are unspecified.
        """
        op = "push_cache"
        self._check_open(op)
        check_instance(op, "dst_cache_key", dst_cache_key, CacheKeyByIdAndIndex)
        entry, layout, meta = self._slot_transfer(
            op,
            src_cache,
            "src_cache",
            src_batch_index,
            size,
            src_layer_range,
            dst_layer_range,
            tensor_num_per_layer,
        )
        await self._transfer(op, dst_cache_key, src_cache, entry, layout, meta, write=True)

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
            LLMException: as :meth:`pull_blocks`; ``LLM_FEATURE_NOT_ENABLED`` when the peer
                does not accept pushes.
        """
        op = "push_blocks"
        self._check_open(op)
        check_instance(op, "dst_cache_key", dst_cache_key, BlocksCacheKey)
        entry = self._blocks_entry(op, src_cache, "src_cache")
        srcs = _check_blocks(op, "src_blocks", src_blocks, src_cache.num_blocks)
        dsts = _check_blocks(op, "dst_blocks", dst_blocks, 2**63)
        if not srcs or len(srcs) != len(dsts):
            param_invalid(op, f"{len(srcs)} src_blocks for {len(dsts)} dst_blocks")
        if len(set(dsts)) != len(dsts):
            param_invalid(op, "a destination block appears twice")
        tensors, wire, per = self._ranges(
            op, src_cache, src_layer_range, dst_layer_range, tensor_num_per_layer
        )
        layout = Layout(tensors, tuple(srcs), nbytes=src_cache.block_bytes)
        meta = {
            "shape": "blocks",
            "blocks": dsts,
            "block_bytes": src_cache.block_bytes,
            "layers": wire,
            "per_layer": per,
        }
        await self._transfer(op, dst_cache_key, src_cache, entry, layout, meta, write=True)

    # ---- layer-wise ---------------------------------------------------------------------
    async def transfer_cache_async(
        self,
        src_cache: Cache,
        layer_synchronizer: LayerSynchronizer,
        transfer_configs: Sequence[TransferConfig | TransferWithCacheKeyConfig],
        src_block_indices: Sequence[int] | None = None,
        dst_block_indices: Sequence[int] | None = None,
        dst_block_memory_size: int | None = None,
    ) -> CacheTask:
        """Start a layer-wise transfer of ``src_cache`` and return its ``CacheTask`` at once.

        For each layer in order (layer ``i`` = tensors ``2i, 2i+1``) the task awaits
        ``layer_synchronizer.synchronize_layer(i, sync_kv_timeout)`` and then sends that
        layer to every destination needing it, so layer i moves while layer i+1 computes.

        Destinations: a ``TransferConfig`` names raw tensor addresses registered on the
        peer (``dst_addrs[j]`` for the j-th tensor of ``src_layer_range``), checked by the
        peer against what it registered as remote accessible; a
        ``TransferWithCacheKeyConfig`` names a peer cache by ``CacheKeyByIdAndIndex``
        (contiguous) or ``BlocksCacheKey`` (paged). Both caches contiguous, or both paged
        (``src_block_indices[k]`` → ``dst_block_indices[k]``, destination blocks of
        ``dst_block_memory_size`` bytes, default the source block size).

        Raises (at once, before anything is sent):
            TypeError / NoneArgumentError: wrong argument types.
            LLMException: ``LLM_PARAM_INVALID`` (layer ranges, block lists, address
                counts), ``LLM_NOT_YET_LINK`` (a destination cluster is not linked).
        """
        op = "transfer_cache_async"
        self._check_open(op)
        entry = self._registry.entry(op, src_cache, "src_cache")
        require_host(op, src_cache)
        sync = check_instance(op, "layer_synchronizer", layer_synchronizer, LayerSynchronizer)
        configs = _check_list(
            op, "transfer_configs", transfer_configs, (TransferConfig, TransferWithCacheKeyConfig)
        )
        if not configs:
            param_invalid(op, "transfer_configs is empty")
        ntensors = src_cache.cache_desc.num_tensors
        if ntensors % 2:
            param_invalid(op, f"{ntensors} tensors is not a whole number of K/V layers")
        nlayers = ntensors // 2
        paged = src_cache.is_blocks_cache
        if paged:
            if src_block_indices is None or dst_block_indices is None:
                param_invalid(op, "a blocks cache needs src_block_indices and dst_block_indices")
            srcs = _check_blocks(op, "src_block_indices", src_block_indices, src_cache.num_blocks)
            dsts = _check_blocks(op, "dst_block_indices", dst_block_indices, 2**40)
            if not srcs or len(srcs) != len(dsts):
                param_invalid(op, f"{len(srcs)} src blocks for {len(dsts)} dst blocks")
            if len(set(dsts)) != len(dsts):
                param_invalid(op, "a destination block appears twice")
        else:
            if src_block_indices is not None or dst_block_indices is not None:
                param_invalid(op, "block indices need a blocks cache (both sides paged)")
            srcs = dsts = []
        bb = src_cache.block_bytes
        dbs = bb
        if dst_block_memory_size:
            dbs = check_int(op, "dst_block_memory_size", dst_block_memory_size, 1, 2**40)
            if dbs < bb:
                param_invalid(op, f"dst_block_memory_size {dbs} < source block size {bb}")
        jobs = [self._layer_job(op, src_cache, cfg, nlayers, srcs, dsts, dbs) for cfg in configs]
        results: list[LLMStatusCode | None] = [None] * len(jobs)
        live = [entry] if entry is not None else []
        self._registry.pin(*live)  # now: the caller may deallocate before the task runs
        task = asyncio.create_task(
            run_layers(sync, jobs, self._config.sync_kv_timeout, results),
            name=f"aiokv-{op}-{src_cache.cache_id}",
        )
        self._tasks.add(task)

        def finished(t: asyncio.Task[None]) -> None:
            # a done callback, not a finally: it also runs for a task cancelled unstarted
            self._tasks.discard(t)
            self._registry.unpin(*live)

        task.add_done_callback(finished)
        return CacheTask(task, results)

    def _layer_job(
        self,
        op: str,
        src: Cache,
        cfg: TransferConfig | TransferWithCacheKeyConfig,
        nlayers: int,
        srcs: list[int],
        dsts: list[int],
        dbs: int,
    ) -> LayerJob:
        layers = cfg.src_layer_range or range(nlayers)
        if layers.stop > nlayers:
            param_invalid(op, f"src_layer_range {layers} exceeds {nlayers} layers")
        batch = check_index(op, "src_batch_index", cfg.src_batch_index, src.cache_desc.batch_size)
        if isinstance(cfg, TransferWithCacheKeyConfig):
            key = cfg.cache_key
            dst_layers = cfg.dst_layer_range or layers
            if len(dst_layers) != len(layers):
                param_invalid(op, "src_layer_range and dst_layer_range differ in length")
            self._link(op, key.cluster_id)

            def to_dst(layer: int) -> range:
                d = dst_layers.start + layer - layers.start
                return range(d, d + 1)

            if isinstance(key, BlocksCacheKey):
                if not src.is_blocks_cache:
                    param_invalid(op, "a BlocksCacheKey destination needs a blocks cache")

                async def send_blocks(layer: int) -> None:
                    await self.push_blocks(
                        key, src, srcs, dsts, range(layer, layer + 1), to_dst(layer)
                    )

                return LayerJob(layers, send_blocks)
            if isinstance(key, CacheKeyByIdAndIndex) and not src.is_blocks_cache:

                async def send_slot(layer: int) -> None:
                    await self.push_cache(key, src, batch, range(layer, layer + 1), to_dst(layer))

                return LayerJob(layers, send_slot)
            param_invalid(op, f"{type(key).__name__} cannot name a destination of this cache")
        link = self._link(op, cfg.dst_cluster_id)
        if len(cfg.dst_addrs) != 2 * len(layers):
            param_invalid(
                op, f"{len(cfg.dst_addrs)} dst_addrs for {len(layers)} layers (need 2 per layer)"
            )
        timeout = self._config.sync_kv_timeout / 1000
        per_slot = slot_bytes(op, src) if not src.is_blocks_cache else 0

        def regions(layer: int) -> tuple[list[memoryview], list[list[int]]]:
            views: list[memoryview] = []
            regs: list[list[int]] = []
            for k in range(2):
                ti = 2 * layer + k
                addr = cfg.dst_addrs[2 * (layer - layers.start) + k]
                raw = src.tensors[ti].view(torch.uint8)
                if src.is_blocks_cache:
                    rows = raw.view(src.num_blocks, -1)
                    views.extend(memview(rows[s_b]) for s_b in srcs)
                    # merged within this destination tensor only: the peer checks each
                    # region against ONE registered tensor
                    regs.extend(_merge([[addr + d_b * dbs, src.block_bytes] for d_b in dsts]))
                else:
                    views.append(memview(raw.view(src.cache_desc.batch_size, -1)[batch]))
                    regs.append([addr, per_slot])
            return views, regs

        async def send_addrs(layer: int) -> None:
            views, regs = regions(layer)
            meta = {"v": PROTOCOL, "op": "addrs", "regions": regs}
            with map_errors(op):
                await link.write(meta, views, timeout=timeout)

        return LayerJob(layers, send_addrs)

    # ---- lifecycle ----------------------------------------------------------------------
    async def _close(self) -> None:
        """Refuse new work and stop layer-wise transfers (``LLMDataDist.finalize``)."""
        self._closed = True
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


def _merge(regs: list[list[int]]) -> list[list[int]]:
    """Merge regions that continue each other: fewer, larger regions for the peer to check."""
    out: list[list[int]] = []
    for addr, n in regs:
        if out and out[-1][0] + out[-1][1] == addr:
            out[-1][1] += n
        else:
            out.append([addr, n])
    return out


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

    async def remove_cache_key(self, cache_key: CacheKey) -> None:
        self._gate("remove_cache_key", _PROMPT_ROLES)
        await super().remove_cache_key(cache_key)

    async def pull_cache(self, *args: Any, **kwargs: Any) -> None:
        self._gate("pull_cache", _PULL_ROLES)
        await super().pull_cache(*args, **kwargs)

    async def pull_blocks(self, *args: Any, **kwargs: Any) -> None:
        self._gate("pull_blocks", _PULL_ROLES)
        await super().pull_blocks(*args, **kwargs)

    async def transfer_cache_async(self, *args: Any, **kwargs: Any) -> CacheTask:
        self._gate("transfer_cache_async", _PROMPT_ROLES)
        return await super().transfer_cache_async(*args, **kwargs)
