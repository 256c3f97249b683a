"""Caches, their ids and keys, and the reference counts that decide when memory is freed.

Everything here is synchronous bookkeeping run on the event-loop thread: no method
awaits, so a cancelled caller can never leave it half-updated (STYLE convention 3).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from sortedcontainers import SortedDict

from ._enums import LLMStatusCode, Placement
from ._errors import LLMException, check_instance, param_invalid
from ._models import BlocksCacheKey, CacheDesc, CacheKey
from ._pool import MemPool, Span

__all__ = ["Cache", "CacheRegistry", "KvCache"]

log = logging.getLogger("aiokv")

UINT64_MAX = 2**64 - 1
_ids = itertools.count(1)


class Cache:
    """A KV cache: ``num_tensors`` tensors of ``cache_desc.shape`` and dtype.

    Attributes:
        cache_id: unique in the process.
        cache_desc: its descriptor.
        tensors: the tensors (views of a pool region, or of user memory).
        tensor_addrs: ``data_ptr()`` of each tensor.
        is_blocks_cache: a paged cache (dim 0 is the block index).
        placement: ``HOST`` or ``DEVICE``.
    """

    __slots__ = ("_registry", "cache_desc", "cache_id", "is_blocks_cache", "tensors")

    def __init__(
        self, cache_desc: CacheDesc, tensors: list[torch.Tensor], *, is_blocks_cache: bool
    ) -> None:
        self.cache_id = next(_ids)
        self.cache_desc = cache_desc
        self.tensors = tensors
        self.is_blocks_cache = is_blocks_cache
        # the registry that tracks this cache; None for create_cpu_cache (user-owned)
        self._registry: CacheRegistry | None = None

    @property
    def placement(self) -> Placement:
        """Where the cache lives."""
        return self.cache_desc.placement

    @property
    def tensor_addrs(self) -> list[int]:
        """Address of each tensor's first byte."""
        return [t.data_ptr() for t in self.tensors]

    @property
    def num_blocks(self) -> int:
        """``shape[0]`` (blocks of a paged cache, batch of a contiguous one)."""
        return self.cache_desc.shape[0] if self.cache_desc.shape else 1

    @property
    def block_bytes(self) -> int:
        """Bytes of one dim-0 row of one tensor."""
        return self.cache_desc.size // self.num_blocks

    def rows(self) -> list[torch.Tensor]:
        """Each tensor as a ``[num_blocks, block_bytes]`` uint8 view (same memory)."""
        return [t.view(torch.uint8).view(self.num_blocks, self.block_bytes) for t in self.tensors]

    def __repr__(self) -> str:
        kind = "blocks" if self.is_blocks_cache else "contiguous"
        d = self.cache_desc
        return (
            f"Cache(id={self.cache_id}, {kind}, {d.num_tensors}x{list(d.shape)} "
            f"{d.data_type.name}, {d.placement.name})"
        )

    @classmethod
    def create_cpu_cache(
        cls,
        cache_desc: CacheDesc,
        tensors_or_addrs: Sequence[torch.Tensor] | Sequence[int],
        *,
        is_blocks_cache: bool = True,
    ) -> Cache:
        """Wrap existing host memory as a cache, without copying.

        Args:
            cache_desc: describes the memory; its placement must be ``HOST``.
            tensors_or_addrs: ``num_tensors`` CPU tensors (contiguous, of the described shape
                and dtype) or ``num_tensors`` integer host addresses of ``cache_desc.size``
                bytes each. The caller keeps that memory alive while the cache is used.
            is_blocks_cache: whether dim 0 is a block index (llm_datadist uses these for
                ``swap_blocks``).

        Raises:
            TypeError / NoneArgumentError: wrong argument types.
            LLMException: ``LLM_PARAM_INVALID`` if the tensors do not match the descriptor.
        """
        op = "Cache.create_cpu_cache"
        check_instance(op, "cache_desc", cache_desc, CacheDesc)
        if cache_desc.placement != Placement.HOST:
            param_invalid(op, "cache_desc.placement must be HOST")
        tensors = wrap_memory(op, cache_desc, tensors_or_addrs, torch.device("cpu"))
        return cls(cache_desc, tensors, is_blocks_cache=is_blocks_cache)


KvCache = Cache


def wrap_memory(
    op: str, desc: CacheDesc, tensors_or_addrs: Any, device: torch.device
) -> list[torch.Tensor]:
    """Validate user memory against ``desc`` and return tensors viewing it (no copy).

    Integer addresses are host addresses (wrapped with ctypes); tensors must be contiguous,
    on ``device``'s type (or CPU for HOST placement), of ``desc``'s shape and dtype.
    """
    if tensors_or_addrs is None:
        check_instance(op, "tensors_or_addrs", tensors_or_addrs, (list, tuple))
    if not isinstance(tensors_or_addrs, list | tuple):
        raise TypeError(
            f"{op}: tensors_or_addrs must be a list or tuple, got {type(tensors_or_addrs).__name__}"
        )
    items = list(tensors_or_addrs)
    if len(items) != desc.num_tensors:
        param_invalid(op, f"got {len(items)} tensors/addresses, cache_desc has {desc.num_tensors}")
    if all(isinstance(a, int) and not isinstance(a, bool) for a in items):
        if desc.placement != Placement.HOST and device.type != "cpu":
            param_invalid(op, "integer addresses are only supported for host memory")
        out = []
        for a in items:
            if not 0 < a <= UINT64_MAX:
                raise ValueError(f"{op}: address {a} out of range")
            buf = (ctypes.c_uint8 * desc.size).from_address(a)
            t = torch.frombuffer(buf, dtype=torch.uint8)
            out.append(t.view(desc.torch_dtype).view(desc.shape))
        return out
    want_type = "cpu" if desc.placement == Placement.HOST else device.type
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: tensors_or_addrs[{i}] must be a torch.Tensor or an int")
        if tuple(t.shape) != desc.shape or t.dtype != desc.torch_dtype:
            param_invalid(
                op,
                f"tensor {i} is {list(t.shape)} {t.dtype}, "
                f"cache_desc says {list(desc.shape)} {desc.torch_dtype}",
            )
        if not t.is_contiguous():
            param_invalid(op, f"tensor {i} is not contiguous")
        if t.device.type != want_type:
            param_invalid(op, f"tensor {i} is on {t.device}, expected {want_type}")
    return [t.detach() for t in items]


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
    keys: set[CacheKey] = field(default_factory=set)
    blocks_key: BlocksCacheKey | None = None
    pins: int = 0
    freed: bool = False

    @property
    def owned(self) -> bool:
        """Memory allocated from a pool (vs. registered user memory)."""
        return bool(self.spans)


class CacheRegistry:
    """Ids, keys, refcounts and address ranges of the caches of one ``LLMDataDist``."""

    def __init__(self) -> None:
        self.entries: dict[int, Entry] = {}
        self.keys: dict[CacheKey, tuple[int, int]] = {}  # key -> (cache_id, batch_index)
        self.blocks_keys: dict[BlocksCacheKey, int] = {}
        self._regions: SortedDict[int, tuple[int, int, int]] = SortedDict()

    # ---- adding -------------------------------------------------------------------------
    def add(
        self,
        cache: Cache,
        spans: list[tuple[MemPool, Span]],
        *,
        remote_accessible: bool,
        keys: Sequence[CacheKey] = (),
        blocks_key: BlocksCacheKey | None = None,
    ) -> Entry:
        """Track ``cache``; bind ``keys`` (key i → batch slot i, placeholders skipped, the last
        duplicate wins) or ``blocks_key``. A key already bound elsewhere moves here (warned)."""
        entry = Entry(cache, spans, remote_accessible)
        cache._registry = self
        self.entries[cache.cache_id] = entry
        for i, t in enumerate(cache.tensors):
            self._regions[t.data_ptr()] = (t.data_ptr() + cache.cache_desc.size, cache.cache_id, i)
        for slot, key in enumerate(keys):
            if key.req_id != UINT64_MAX:
                self._bind_key(key, entry, slot)
        if blocks_key is not None:
            old = self.blocks_keys.get(blocks_key)
            if old is not None:
                log.warning(
                    "%s was registered to cache %d; now cache %d", blocks_key, old, cache.cache_id
                )
                self.entries[old].blocks_key = None
            self.blocks_keys[blocks_key] = cache.cache_id
            entry.blocks_key = blocks_key
        return entry

    def _bind_key(self, key: CacheKey, entry: Entry, slot: int) -> None:
        old = self.keys.get(key)
        if old is not None and old[0] != entry.cache.cache_id:
            log.warning("%s was bound to cache %d; now cache %d", key, old[0], entry.cache.cache_id)
            self.release_key(key)
        self.keys[key] = (entry.cache.cache_id, slot)
        entry.keys.add(key)

    # ---- lookups ------------------------------------------------------------------------
    def entry(self, op: str, cache: Any, name: str = "cache") -> Entry | None:
        """The live entry of ``cache``; ``None`` for a user-owned ``create_cpu_cache`` cache.

        Raises:
            TypeError / NoneArgumentError: not a ``Cache``.
            LLMException: ``LLM_PARAM_INVALID`` if it belongs to another ``LLMDataDist``;
                ``LLM_KV_CACHE_NOT_EXIST`` if already released.
        """
        check_instance(op, name, cache, Cache)
        if cache._registry is None:
            return None
        if cache._registry is not self:
            param_invalid(op, f"{name} {cache.cache_id} belongs to another LLMDataDist")
        e: Entry | None = self.entries.get(cache.cache_id)
        if e is None or not e.id_held:
            raise LLMException(
                f"{op}: cache {cache.cache_id} is not allocated or registered here",
                LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
            )
        return e

    def by_key(self, key: CacheKey) -> tuple[Entry, int] | None:
        """``(entry, batch_index)`` bound to ``key``, or ``None``."""
        hit = self.keys.get(key)
        return None if hit is None else (self.entries[hit[0]], hit[1])

    def by_blocks_key(self, key: BlocksCacheKey) -> Entry | None:
        """The entry registered under ``key``, or ``None``."""
        cid = self.blocks_keys.get(key)
        return None if cid is None else self.entries[cid]

    def by_id(self, cache_id: int) -> Entry | None:
        """The entry of a cache whose id reference is still held, or ``None``."""
        e = self.entries.get(cache_id)
        return e if e is not None and e.id_held else None

    def find_region(self, addr: int, nbytes: int) -> tuple[Entry, int, int] | None:
        """The ``(entry, tensor_index, byte_offset)`` whose tensor holds ``[addr, addr+nbytes)``
        entirely, or ``None`` — how raw addresses from a peer are checked."""
        i = self._regions.bisect_right(addr)
        if i == 0 or nbytes < 0:
            return None
        start, (end, cid, ti) = self._regions.peekitem(i - 1)
        if addr + nbytes > end:
            return None
        e = self.entries.get(cid)
        if e is None or not e.id_held:
            return None
        return e, ti, addr - start

    # ---- releasing ----------------------------------------------------------------------
    def release_id(self, entry: Entry) -> None:
        """Drop the id reference (``deallocate_cache`` / ``unregister_cache``)."""
        if entry.blocks_key is not None:
            self.blocks_keys.pop(entry.blocks_key, None)
            entry.blocks_key = None
        if not entry.owned:
            # user memory: keys die with the registration; the user owns the bytes
            for key in list(entry.keys):
                self.keys.pop(key, None)
            entry.keys.clear()
        entry.id_held = False
        self._maybe_free(entry)

    def release_key(self, key: CacheKey) -> bool:
        """Unbind ``key``; ``False`` if it was not bound (a no-op, as llm_datadist)."""
        hit = self.keys.pop(key, None)
        if hit is None:
            return False
        entry = self.entries[hit[0]]
        entry.keys.discard(key)
        self._maybe_free(entry)
        return True

    def pin(self, *entries: Entry) -> None:
        """Keep memory alive while an operation uses it."""
        for e in entries:
            e.pins += 1

    def unpin(self, *entries: Entry) -> None:
        """End a :meth:`pin`; frees memory whose last reference went meanwhile."""
        for e in entries:
            e.pins -= 1
            self._maybe_free(e)

    def _maybe_free(self, e: Entry) -> None:
        if e.freed or e.id_held or e.keys or e.pins:
            return
        e.freed = True
        for t in e.cache.tensors:
            region = self._regions.get(t.data_ptr())
            if region is not None and region[1] == e.cache.cache_id:
                del self._regions[t.data_ptr()]
        for pool, span in e.spans:
            pool.free(span)
        del self.entries[e.cache.cache_id]

    def live_entries(self) -> list[Entry]:
        """Entries not yet freed."""
        return list(self.entries.values())
