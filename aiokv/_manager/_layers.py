"""``CacheManager``'s layer-wise transfers: ``transfer_cache_async`` checks and plans,
then starts :func:`aiokv._layerwise.run_layers` on the engine, owned by the manager."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import numpy as np

from .._cache import Cache
from .._checks import MAX_BLOCK_INDEX
from .._checks import BlockList
from .._checks import check_blocks
from .._checks import check_instance
from .._checks import check_int
from .._checks import check_list
from .._checks import check_unique
from .._checks import param_invalid
from .._engine import Portal
from .._enums import LLMStatusCode
from .._errors import LLMException
from .._layerwise import CacheTask
from .._layerwise import LayerSynchronizer
from .._layerwise import Source
from .._layerwise import plan
from .._layerwise import run_layers
from .._models import TransferConfig
from .._models import TransferWithCacheKeyConfig
from ._base import ManagerBase

__all__ = ["LayerWise"]


class LayerWise(ManagerBase):
    """Layer-wise transfers (``transfer_cache_async``)."""

    def transfer_cache_async(
        self,
        src_cache: Cache,
        layer_synchronizer: LayerSynchronizer,
        transfer_configs: Sequence[TransferConfig | TransferWithCacheKeyConfig],
        src_block_indices: BlockList | None = None,
        dst_block_indices: BlockList | None = None,
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
        ``sync_kv_timeout``, so layer i moves while layer i+1 computes. Layers that are
        released together (written already when asked for: their synchronizer returns
        before the task gets to them) go to a destination in one request of all of
        them, as one ``push_blocks`` of those layers would.

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
        # checked whenever given (a falsy False, 0.0 or "" is a TypeError too); 0 means
        # "not given", as llm_datadist's engine reads it
        if dst_block_memory_size is not None and (
            given := check_int(
                op, "dst_block_memory_size", dst_block_memory_size, 0, MAX_BLOCK_INDEX
            )
        ):
            dbs = given
            if dbs < bb:
                param_invalid(op, f"dst_block_memory_size {dbs} < source block size {bb}")
        source = Source(src_cache, ntensors // 2, srcs, dsts, dbs)
        plans = [plan(op, self._client, source, cfg) for cfg in configs]
        results: list[LLMStatusCode | None] = [None] * len(plans)
        errors: list[str | None] = [None] * len(plans)
        live = [entry] if entry is not None else []
        portal = Portal(self._engine.sync_lane)  # an async synchronizer: the caller's loop
        name = f"aiokv-{op}-{src_cache.cache_id}"

        def spawn() -> asyncio.Task[None] | None:  # on the engine, which owns the task
            if self._closed:  # finalize got there first
                self._registry.unpin(*live)
                return None
            loop = asyncio.get_running_loop()
            task = loop.create_task(run_layers(sync, portal, plans, results, errors), name=name)
            self._tasks.add(task)

            def revoke(_: LLMStatusCode) -> None:  # unregister_cache of the source
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(task.cancel)

            try:  # unregister_cache of the source may have begun since it was pinned
                self._registry.attach(task, revoke, *live)
            except LLMException:
                task.cancel()  # as its revoke would have: it ends unstarted

            def finished(t: asyncio.Task[None]) -> None:
                # a done callback, not a finally: it also runs for a task cancelled unstarted
                self._tasks.discard(t)
                self._registry.drop_revoker(t, *live)
                self._registry.unpin(*live)

            task.add_done_callback(finished)
            return task

        self._registry.pin(*live)  # now: the caller may deallocate before the task runs
        try:
            return CacheTask(self._engine, spawn, results, errors)
        except BaseException:
            self._registry.unpin(*live)
            raise


def _no_blocks(indices: BlockList | None) -> bool:
    """Whether a block-index argument is absent (``None``, or an empty list, tuple or
    array)."""
    if isinstance(indices, np.ndarray):
        return not indices.size
    return indices is None or (isinstance(indices, list | tuple) and not indices)
