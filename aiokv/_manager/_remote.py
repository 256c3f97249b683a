"""``CacheManager``'s remote transfers: ``pull_cache``, ``pull_blocks``, ``push_cache``,
``push_blocks``, each checked here and handed to the remote client as a
:class:`~aiokv._remote._parts.Transfer`; and ``remap_registered_memory``."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._cache import Cache
from .._checks import MAX_BLOCK_INDEX
from .._checks import BlockList
from .._checks import check_blocks
from .._checks import check_index
from .._checks import check_instance
from .._checks import check_int
from .._checks import check_layer_range
from .._checks import check_unique
from .._checks import param_invalid
from .._checks import tensor_range
from .._engine import on_asyncio
from .._enums import LLMStatusCode
from .._enums import Memtype
from .._errors import LLMException
from .._models import BlocksCacheKey
from .._models import CacheKey
from .._models import CacheKeyByIdAndIndex
from .._models import MemInfo
from .._registry import Entry
from .._remote import Move
from .._remote import Transfer
from .._remote._protocol import MAX_TENSORS
from .._remote._protocol import BlocksReq
from .._remote._protocol import ChunksReq
from .._remote._protocol import Request
from .._remote._protocol import SlotReq
from .._remote._protocol import Tensors
from .._remote._protocol import pack_blocks
from .._remote._protocol import wire_key
from ._base import ManagerBase

__all__ = ["RemoteTransfers"]


class RemoteTransfers(ManagerBase):
    """Pulls and pushes of caches between this side and a linked peer."""

    @staticmethod
    def _selection(
        op: str,
        local: Cache,
        local_layers: Any,
        remote_layers: Any,
        per_layer: Any,
        *,
        write: bool,
    ) -> tuple[range, Tensors]:
        """Local tensor indices, and which tensors the peer selects (the wire form).
        ``write``: a push (the local layers are ``src_layer_range``), else a pull."""
        n = check_int(op, "tensor_num_per_layer", per_layer, 1, MAX_TENSORS)
        names = ("src_layer_range", "dst_layer_range")
        local_name, remote_name = names if write else names[::-1]
        local_layers = check_layer_range(op, local_name, local_layers)
        remote_layers = check_layer_range(op, remote_name, remote_layers)
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
        """Move the bytes ``job`` names of ``cache`` to/from the peer: under a lease
        held, from an asyncio caller, on the caller's own loop (no engine hop:
        :meth:`~aiokv._remote._client.RemoteClient.move_here`); else on the engine."""
        link = self._client.link(op, key.cluster_id)
        move = Move(op, link, cache, job, write=write, about={"key": key})
        with self._pinned(entry):
            if on_asyncio() and not self._engine.on_engine() and await self._client.move_here(move):
                return
            await self._engine.run(self._client.move, move)

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
        *,
        write: bool,
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
        tensors, wire = self._selection(
            op, cache, local_layers, remote_layers, per_layer, write=write
        )
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
            write=False,
        )
        req = SlotReq(
            wire_key(cache_key),  # type: ignore[arg-type]
            wire,
            n,
            exact=size == -1,
            release=isinstance(cache_key, CacheKey | CacheKeyByIdAndIndex),
        )
        job = Transfer.of_span(req, tensors, offset, n)
        await self._move(op, cache_key, cache, entry, job, write=False)

    async def pull_blocks(
        self,
        src_cache_key: BlocksCacheKey | CacheKey | CacheKeyByIdAndIndex,
        dst_cache: Cache,
        src_blocks: BlockList = (),
        dst_blocks: BlockList = (),
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
            op, dst_cache, dst_layer_range, src_layer_range, tensor_num_per_layer, write=False
        )
        bb = dst_cache.block_bytes
        key = wire_key(src_cache_key)
        req: Request
        if isinstance(src_cache_key, BlocksCacheKey):
            remote = srcs
            req = BlocksReq(key, wire, pack_blocks(srcs), bb)
        else:
            remote = srcs if srcs.size else np.arange(dsts.size, dtype=np.int64)
            release = isinstance(src_cache_key, CacheKey | CacheKeyByIdAndIndex)
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
            write=True,
        )
        req = SlotReq(wire_key(dst_cache_key), wire, n, exact=size == -1)  # type: ignore[arg-type]
        job = Transfer.of_span(req, tensors, offset, n)
        await self._move(op, dst_cache_key, src_cache, entry, job, write=True)

    async def push_blocks(
        self,
        dst_cache_key: BlocksCacheKey,
        src_cache: Cache,
        src_blocks: BlockList = (),
        dst_blocks: BlockList = (),
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
            op, src_cache, src_layer_range, dst_layer_range, tensor_num_per_layer, write=True
        )
        bb = src_cache.block_bytes
        req = BlocksReq(wire_key(dst_cache_key), wire, pack_blocks(dsts), bb)
        job = Transfer.of_blocks(req, tensors, srcs, dsts, bb)
        await self._move(op, dst_cache_key, src_cache, entry, job, write=True)

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
