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

import msgspec
import numpy as np

from .._cache import Cache
from .._checks import Blocks, tensor_range
from .._config import LLMConfig
from .._enums import LLMStatusCode
from .._errors import LLMException
from .._layout import ByteLayout, tensor_bytes
from .._models import BlocksCacheKey, CacheKey
from .._registry import CacheRegistry, Entry
from .._stats import PeerCounters
from ..transport import Grant, PeerInfo
from ._protocol import (
    MAX_BLOCKS,
    AddrsReq,
    BlocksReq,
    ChunksReq,
    Key,
    KeyByBlocks,
    KeyById,
    KeyByReq,
    SlotReq,
    Tensors,
    blocks_of,
    decode,
)

__all__ = ["PeerService"]

log = logging.getLogger("aiokv.remote")

Code = LLMStatusCode


class _Refused(Exception):
    """A request this side will not serve; becomes a refusal ``Grant`` with ``code``."""

    def __init__(self, code: LLMStatusCode, why: str) -> None:
        super().__init__(why)
        self.code = code


def _invalid(why: str) -> _Refused:
    return _Refused(Code.LLM_PARAM_INVALID, why)


def _blocks(raw: bytes, limit: int, what: str, *, unique: bool, most: int | None = None) -> Blocks:
    """A peer's block list, checked in numpy before anything is built from it: entries
    in ``[0, limit)``, at most ``most`` of them (default ``limit``), distinct if
    ``unique``. Capping the count at what the served memory holds bounds the work of one
    request by the cost of a legitimate whole-cache transfer."""
    if len(raw) // 8 > (limit if most is None else most):
        raise _invalid(f"{what} names {len(raw) // 8} entries; at most {most or limit}")
    blocks = blocks_of(raw)
    if blocks is None:
        raise _invalid(f"{what} is not a list of int64")
    if blocks.size == 0:
        raise _invalid(f"{what} is empty")
    top = int(blocks.max())
    if top >= limit:
        raise _invalid(f"{what} entry {top} is out of range [0, {limit})")
    if unique and np.unique(blocks).size != blocks.size:
        raise _invalid(f"a block of {what} appears twice")
    return blocks


class PeerService:
    """Serves peers' requests for one ``LLMDataDist`` (a transport ``RequestHandler``)."""

    def __init__(
        self,
        cluster_id: int,
        registry: CacheRegistry,
        config: LLMConfig,
        counters: PeerCounters | None = None,
    ) -> None:
        self._cluster_id = cluster_id
        self._registry = registry
        self._config = config
        self._counters = counters if counters is not None else PeerCounters()

    # ---- RequestHandler -----------------------------------------------------------------
    async def grant_read(self, peer: PeerInfo, meta: bytes) -> Grant:
        """A peer pulls from us: the buffers to send, or a refusal."""
        return self._grant(peer, meta, write=False)

    async def grant_write(self, peer: PeerInfo, meta: bytes, nbytes: int) -> Grant:
        """A peer pushes ``nbytes`` into us: the buffers to fill, or a refusal.

        The transport refuses a grant whose buffers do not total ``nbytes``.
        """
        return self._grant(peer, meta, write=True)

    # ---- requests -----------------------------------------------------------------------
    def _grant(self, peer: PeerInfo, meta: bytes, *, write: bool) -> Grant:
        with self._registry.lock:  # look up and pin as one step (callers free concurrently)
            return self._grant_locked(peer, meta, write=write)

    def _grant_locked(self, peer: PeerInfo, meta: bytes, *, write: bool) -> Grant:
        try:
            try:
                req = decode(meta)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                raise _invalid(f"malformed request: {exc}") from None
            if isinstance(req, AddrsReq):
                if not write:
                    raise _invalid("address reads are not served")
                entries, views = self._addrs(req)
                release = None
            else:
                entry, slot, release = self._lookup(req.key)
                self._check_access(entry, write=write, key=req.key)
                views = self._views(req, entry.cache, slot, write=write)
                entries = [entry]
                if write or not req.release:
                    release = None
        except _Refused as r:
            log.warning(
                "refused a %s from cluster %d (%s): %s",
                _kind(write),
                peer.cluster_id,
                r.code.name,
                r,
            )
            self._counters.served(peer.cluster_id).refused(r.code)
            return Grant(r.code, reason=str(r))
        served = self._counters.served(peer.cluster_id)
        try:
            grant = self._issue(entries, views, release)
        except LLMException as exc:  # e.g. the memory is being unregistered
            served.refused(exc.status_code)
            raise
        served.granted()
        nbytes = sum(map(len, views))
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

    def _issue(
        self, entries: list[Entry], views: list[memoryview], release: CacheKey | None
    ) -> Grant:
        """Pin ``entries`` and hand out a grant over ``views``, bounded in time.

        The grant is revocable: ``unregister_cache`` of its memory aborts it (through the
        registry's revokers), and so does its deadline — this side's ``sync_kv_timeout``
        from grant to ``done`` — so a peer that stops reading cannot pin memory forever.
        On ``done(True)`` a pull by ``CacheKey`` releases the key, only if it is still
        bound to the cache that was read.
        """
        loop = asyncio.get_running_loop()
        self._registry.pin(*entries)  # refuses memory being unregistered
        grant = Grant(Code.LLM_SUCCESS, views)
        token = object()  # Grant is a dataclass, not hashable

        def revoke(status: LLMStatusCode) -> None:  # from any thread
            if _running_loop() is loop:
                grant.abort(status)
                return
            with contextlib.suppress(RuntimeError):  # the loop is closed: the grant is over
                loop.call_soon_threadsafe(grant.abort, status)

        expiry = loop.call_later(self._config.sync_kv_timeout / 1000, _expire, grant)

        def done(ok: bool) -> None:
            expiry.cancel()
            self._registry.drop_revoker(token, *entries)
            self._registry.unpin(*entries)
            if ok and release is not None:
                self._registry.release_key(release, entries[0])

        grant.done = done
        self._registry.add_revoker(token, revoke, *entries)
        return grant

    def _lookup(self, key: Key) -> tuple[Entry, int | None, CacheKey | None]:
        """``(entry, batch slot or None, the CacheKey a successful read may release)``."""
        missing = _Refused(Code.LLM_KV_CACHE_NOT_EXIST, f"no cache for {key}")
        if key.cluster_id != self._cluster_id:
            raise missing
        if isinstance(key, KeyByBlocks):
            e = self._registry.by_blocks_key(BlocksCacheKey(key.cluster_id, key.model_id))
            if e is None:
                raise missing
            return e, None, None
        if isinstance(key, KeyByReq):
            ck = CacheKey(key.cluster_id, key.req_id, key.model_id, key.prefix_id)
            hit = self._registry.by_key(ck)
            if hit is None:
                raise missing
            return hit[0], hit[1], ck
        e = self._registry.by_id(key.cache_id)
        if e is None:
            raise missing
        if key.batch_index >= e.cache.cache_desc.batch_size:
            raise _invalid(f"batch_index {key.batch_index} out of range")
        return e, key.batch_index, None

    def _check_access(self, entry: Entry, *, write: bool, key: Key) -> None:
        """Pushes, and reads that address a cache by its id, need the cache to be remote
        accessible (``remote_accessible`` and ``enable_remote_cache_accessible``); reads
        by a key this side bound (``CacheKey``, ``BlocksCacheKey``) need nothing more."""
        direct = write or isinstance(key, KeyById)
        if direct and not (self._config.enable_remote_cache_accessible and entry.remote_accessible):
            raise _Refused(
                Code.LLM_FEATURE_NOT_ENABLED,
                f"cache {entry.cache.cache_id} is not remote accessible "
                f"({'push' if write else 'read by cache id'}; enable_remote_cache_accessible)",
            )
        if write and isinstance(key, KeyByReq):
            raise _invalid("a push needs a CacheKeyByIdAndIndex")
        if not entry.cache.on_host:
            raise _Refused(Code.LLM_FEATURE_NOT_ENABLED, "device memory over tcp")

    @staticmethod
    def _tensors(sel: Tensors, cache: Cache) -> range:
        ntensors = cache.cache_desc.num_tensors
        if sel.layers is None:
            tensors = range(ntensors)
        else:
            start, stop = sel.layers
            try:
                tensors = tensor_range("remote", ntensors, range(start, stop), sel.per_layer)
            except LLMException as exc:
                raise _invalid(str(exc)) from None
        if sel.count != len(tensors):
            raise _invalid(f"tensor counts differ ({sel.count} vs {len(tensors)})")
        if sel.dtype is not None and sel.dtype != int(cache.cache_desc.data_type):
            raise _invalid(f"data types differ ({sel.dtype} vs {cache.cache_desc.data_type})")
        return tensors

    def _views(
        self, req: BlocksReq | ChunksReq | SlotReq, cache: Cache, slot: int | None, *, write: bool
    ) -> list[memoryview]:
        tensors = self._tensors(req.tensors, cache)
        if isinstance(req, BlocksReq):
            if not cache.is_blocks_cache:
                raise _invalid("the cache is not a blocks cache")
            if req.block_bytes != cache.block_bytes:
                raise _invalid(
                    f"block sizes differ ({req.block_bytes} vs {cache.block_bytes} bytes)"
                )
            blocks = _blocks(req.blocks, cache.num_blocks, "blocks", unique=write)
            layout = ByteLayout.of_blocks(blocks, req.block_bytes)
        else:
            if slot is None or not cache.slots_contiguous:
                raise _invalid("slot transfers need a contiguous cache with batch_dim_index 0")
            per_slot = cache.slot_bytes
            if isinstance(req, ChunksReq):
                if req.chunk_bytes > per_slot or per_slot % req.chunk_bytes:
                    raise _invalid("the slot is not a whole number of chunks")
                per = per_slot // req.chunk_bytes
                chunks = _blocks(req.chunks, per, "chunks", unique=write)
                layout = ByteLayout.of_blocks(slot * per + chunks, req.chunk_bytes)
            else:
                if req.size > per_slot or (req.exact and req.size != per_slot):
                    raise _invalid(f"slot sizes differ ({req.size} vs {per_slot} bytes)")
                layout = ByteLayout.of_span(slot * per_slot, req.size)
        return layout.views([tensor_bytes(cache.tensors[t]) for t in tensors])

    def _addrs(self, req: AddrsReq) -> tuple[list[Entry], list[memoryview]]:
        """Raw destination addresses: each must lie inside ONE registered, remote-accessible
        host tensor, together with every byte the layout touches from it, and no two
        addresses' regions may overlap (a byte written twice, like a destination block
        named twice) — which bounds the views of one request by the registered memory."""
        blocks = None
        extent = req.block_bytes
        if req.blocks is not None:
            if req.stride < req.block_bytes:
                raise _invalid("stride is smaller than the block size")
            # the blocks b whose last byte b * stride + block_bytes - 1 stays in int64
            limit = (2**63 - 1 - req.block_bytes) // req.stride + 1
            blocks = _blocks(req.blocks, limit, "blocks", unique=True, most=MAX_BLOCKS)
            extent = int(blocks.max()) * req.stride + req.block_bytes
        bases = sorted(req.bases)
        if any(b - a < extent for a, b in itertools.pairwise(bases)):
            raise _invalid("the regions of two destination addresses overlap")
        entries: list[Entry] = []
        buffers: list[memoryview] = []
        for base in req.bases:
            hit = self._registry.find_region(base, extent) if base else None
            if hit is None:
                raise _invalid(f"[{base}, +{extent}) is not inside one registered tensor")
            entry, ti, off = hit
            if not (self._config.enable_remote_cache_accessible and entry.remote_accessible):
                raise _Refused(Code.LLM_FEATURE_NOT_ENABLED, "memory is not remote accessible")
            if not entry.cache.on_host:
                raise _Refused(Code.LLM_FEATURE_NOT_ENABLED, "device memory over tcp")
            entries.append(entry)
            buffers.append(tensor_bytes(entry.cache.tensors[ti])[off : off + extent])
        if blocks is None:
            layout = ByteLayout.of_span(0, req.block_bytes)
        else:
            layout = ByteLayout.of_blocks(blocks, req.block_bytes, stride=req.stride)
        return entries, layout.views(buffers)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _expire(grant: Grant) -> None:
    log.warning("a grant outlived sync_kv_timeout; revoked")
    grant.abort(Code.LLM_TIMEOUT)


def _kind(write: bool) -> str:
    return "push" if write else "pull"
