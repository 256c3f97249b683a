"""``CacheManager``'s local copies: ``copy_cache``, ``copy_blocks``, ``copy_kv_blocks``
and ``swap_blocks``, checked here and run inline or on the copy workers."""

from __future__ import annotations

import math
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import ParamSpec
from typing import TypeVar

import anyio
import anyio.lowlevel
import numpy as np
import torch

from .._cache import Cache
from .._checks import MAX_BLOCK_INDEX
from .._checks import UINT64_MAX
from .._checks import BlockList
from .._checks import check_blocks
from .._checks import check_index
from .._checks import check_instance
from .._checks import check_int
from .._checks import check_unique
from .._checks import param_invalid
from .._checks import renamed
from .._copy import copy_rows
from .._copy import fits_inline
from .._engine import checkpoint
from .._engine import on_asyncio
from .._enums import Placement
from .._errors import map_errors
from .._registry import Entry
from ._base import ManagerBase

__all__ = ["LocalCopies"]

P = ParamSpec("P")
R = TypeVar("R")


class LocalCopies(ManagerBase):
    """Copies and swaps between caches of this side."""

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
        # pinned before the tensors are read: a cache freed by another thread after its
        # look-up has none any more (LLM_KV_CACHE_NOT_EXIST from the pin)
        with self._pinned(de, se):
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
            with map_errors(op):
                await self._copy(self._scheduler.copy_many, pairs)

    async def copy_blocks(self, cache: Cache, copy_block_info: Mapping[int, BlockList]) -> None:
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
            check_unique(op, "a destination block", np.array(dsts_all, dtype=np.int64))
        if set(dsts_all) & set(copy_block_info):
            param_invalid(op, "a block is both a source and a destination")
        if not pairs:
            return
        await self._copy_blocks(op, cache, cache, pairs, entry)

    async def copy_kv_blocks(
        self,
        src_cache: Cache,
        dst_cache: Cache,
        src_blocks: BlockList,
        dst_blocks_list: Sequence[BlockList],
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
        # the hop starts the job before the first checkpoint: a scope cancelled already
        # must not start it (as the inline path's checkpoint, and trio's own rule)
        await anyio.lowlevel.checkpoint_if_cancelled()
        return await self._engine.run(fn, *args, **kwargs)


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
            a, b = pairs[i][is_dst], pairs[j][other_dst]
            if max(_run_count(a), _run_count(b)) <= _EXACT_OVERLAP_MAX and not _share_bytes(a, b):
                continue  # strided views whose extents interleave but share no byte
            param_invalid(op, "the memory of src and dst overlaps")
        reach.append((end, i, is_dst))


#: Views of up to this many contiguous byte runs are checked byte-exactly when their
#: extents overlap (beyond: refused as overlapping; the check's arrays grow with the
#: number of runs, not with the bytes: a slot along batch dim 1 of a large cache is a
#: few thousand long runs).
_EXACT_OVERLAP_MAX = 1 << 22


def _inner(t: torch.Tensor) -> tuple[int, int]:
    """``(k, inner)``: dims ``k..`` of ``t`` are one contiguous run of ``inner`` elements."""
    shape, stride = t.shape, t.stride()
    inner, k = 1, len(shape)
    while k and (shape[k - 1] == 1 or stride[k - 1] == inner):
        inner *= shape[k - 1]
        k -= 1
    return k, inner


def _run_count(t: torch.Tensor) -> int:
    """How many contiguous byte runs a (strided) view touches (:func:`_byte_runs`)."""
    k, _ = _inner(t)
    return math.prod(t.shape[:k])


def _byte_runs(t: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Sorted ``(starts, ends)`` of the contiguous byte runs a (strided) view touches."""
    shape, stride, size = list(t.shape), list(t.stride()), t.element_size()
    k, inner = _inner(t)
    offs = np.zeros(1, dtype=np.int64)
    for n, st in zip(shape[:k], stride[:k], strict=True):
        offs = (offs[:, None] + np.arange(n, dtype=np.int64)[None, :] * st).ravel()
    starts = np.sort(t.data_ptr() + offs * size)
    return starts, starts + inner * size


def _share_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether views ``a`` and ``b`` (whose extents overlap) touch a common byte."""
    a_starts, a_ends = _byte_runs(a)
    b_starts, b_ends = _byte_runs(b)
    # the last run of ``a`` starting before each run of ``b`` ends reaches furthest
    last = np.searchsorted(a_starts, b_ends, side="left") - 1
    ok = last >= 0
    return bool((a_ends[last[ok]] > b_starts[ok]).any())
