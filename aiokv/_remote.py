"""The cache side of remote transfers: what bytes a request names, and serving peers.

Both sides of a transfer compute the same byte order independently: tensor-major over
the selected tensors, then the listed blocks (or the slot bytes) of each tensor. Each
side coalesces its own consecutive memory into one buffer, so buffer boundaries never
need to agree — only the byte order does.

:class:`PeerService` answers the requests of peers (the transport's ``RequestHandler``).
Everything a peer sends is untrusted: every field is type- and range-checked against
what this side registered before any buffer is handed out, so a request can only ever
reach the memory of a registered cache.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._cache import Cache, CacheRegistry, Entry
from ._enums import LLMStatusCode
from ._errors import LLMException, param_invalid
from ._models import BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex, LLMConfig
from .transport import Grant, PeerInfo

__all__ = ["Layout", "PeerService", "key_meta", "memview"]

PROTOCOL = 1
MAX_LIST = 1 << 20
U64 = 2**64 - 1
Code = LLMStatusCode


def memview(t: torch.Tensor) -> memoryview:
    """A writable ``'B'`` memoryview over a contiguous CPU tensor's bytes (no copy).

    The caller keeps the memory alive (caches are pinned while a transfer uses them).
    """
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def _runs(blocks: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive stretches of ``blocks`` in the given order, as ``(start, count)``."""
    out: list[tuple[int, int]] = []
    for b in blocks:
        if out and out[-1][0] + out[-1][1] == b:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((b, 1))
    return out


def tensor_range(op: str, ntensors: int, layers: range | None, per_layer: int) -> range:
    """Tensor indices of layer range ``layers`` (layer ``i`` = tensors ``[i*n, (i+1)*n)``).

    Raises:
        LLMException: ``LLM_PARAM_INVALID`` if ``per_layer`` does not divide the tensor
            count or the layers fall outside the cache.
    """
    if layers is None:
        return range(ntensors)
    if per_layer < 1 or per_layer > ntensors or ntensors % per_layer:
        param_invalid(op, f"tensor_num_per_layer {per_layer} does not divide {ntensors} tensors")
    if layers.step != 1 or layers.start < 0 or layers.stop * per_layer > ntensors or not layers:
        param_invalid(op, f"layer range {layers} is outside 0..{ntensors // per_layer - 1}")
    return range(layers.start * per_layer, layers.stop * per_layer)


@dataclass(frozen=True, slots=True)
class Layout:
    """Which bytes of which tensors a transfer moves, in wire order."""

    tensors: range
    blocks: tuple[int, ...] | None  # rows of dim 0 (blocks); None: a slot range
    slot: int = 0  # batch slot (slot transfers)
    offset: int = 0  # first byte within the slot
    nbytes: int = 0  # bytes per tensor (slot) or per block (blocks)

    def views(self, cache: Cache) -> list[memoryview]:
        """The buffers of ``cache`` this layout names, consecutive memory coalesced.

        One memoryview per tensor, sliced per run: slicing costs ~0.1 µs, a fresh view
        over raw memory several µs.
        """
        out: list[memoryview] = []
        n = self.nbytes
        if self.blocks is not None:
            runs = [(start * n, (start + count) * n) for start, count in _runs(self.blocks)]
            for ti in self.tensors:
                whole = memview(cache.tensors[ti])
                out.extend(whole[a:b] for a, b in runs)
        else:
            per_slot = cache.cache_desc.size // cache.cache_desc.batch_size
            a = self.slot * per_slot + self.offset
            for ti in self.tensors:
                out.append(memview(cache.tensors[ti])[a : a + n])
        return out


def slot_bytes(op: str, cache: Cache) -> int:
    """Bytes of one batch slot of one tensor; slots must be contiguous (batch dim 0)."""
    d = cache.cache_desc
    if d.batch_dim_index % max(len(d.shape), 1) != 0:
        param_invalid(op, "remote slot transfers need batch_dim_index 0")
    return d.size // d.batch_size


def require_host(op: str, cache: Cache) -> None:
    """The TCP transport reads and writes host-addressable memory only."""
    if cache.tensors and cache.tensors[0].device.type != "cpu":
        raise LLMException(
            f"{op}: cache {cache.cache_id} is on {cache.tensors[0].device}; the tcp transport "
            "moves host-addressable memory (use the nixl backend for device memory)",
            Code.LLM_FEATURE_NOT_ENABLED,
        )


def key_meta(key: CacheKey | BlocksCacheKey | CacheKeyByIdAndIndex) -> dict[str, Any]:
    """The wire form of a key."""
    if isinstance(key, BlocksCacheKey):
        return {"kind": "blocks", "cluster_id": key.cluster_id, "model_id": key.model_id}
    if isinstance(key, CacheKey):
        return {
            "kind": "key",
            "cluster_id": key.prompt_cluster_id,
            "req_id": key.req_id,
            "model_id": key.model_id,
            "prefix_id": key.prefix_id,
        }
    return {
        "kind": "id",
        "cluster_id": key.cluster_id,
        "cache_id": key.cache_id,
        "batch_index": key.batch_index,
    }


class _Refused(Exception):
    def __init__(self, code: LLMStatusCode, why: str) -> None:
        super().__init__(why)
        self.code = code


def _int(meta: dict[str, Any], name: str, lo: int = 0, hi: int = U64) -> int:
    v = meta.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _Refused(Code.LLM_PARAM_INVALID, f"{name} must be an int in [{lo}, {hi}]")
    return v


def _ints(meta: dict[str, Any], name: str, hi: int) -> tuple[int, ...]:
    v = meta.get(name)
    if not isinstance(v, list) or len(v) > MAX_LIST:
        raise _Refused(Code.LLM_PARAM_INVALID, f"{name} must be a list of ints")
    for x in v:
        if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < hi:
            raise _Refused(Code.LLM_PARAM_INVALID, f"{name} entry {x!r} out of range [0, {hi})")
    return tuple(v)


def _layers(meta: dict[str, Any], ntensors: int) -> range:
    v = meta.get("layers")
    if v is None:
        return range(ntensors)
    per = _int(meta, "per_layer", 1, max(ntensors, 1))
    if (
        not isinstance(v, list)
        or len(v) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in v)
    ):
        raise _Refused(Code.LLM_PARAM_INVALID, "layers must be [start, stop]")
    try:
        return tensor_range("remote", ntensors, range(v[0], v[1]) if v[0] >= 0 else range(0), per)
    except LLMException as exc:
        raise _Refused(Code.LLM_PARAM_INVALID, str(exc)) from None


class PeerService:
    """Answers peers' reads and writes against this side's registry (a ``RequestHandler``)."""

    def __init__(self, cluster_id: int, registry: CacheRegistry, config: LLMConfig) -> None:
        self._cluster_id = cluster_id
        self._registry = registry
        self._config = config

    # ---- lookups ------------------------------------------------------------------------
    def _lookup(self, meta: dict[str, Any]) -> tuple[Entry, int | None, CacheKey | None]:
        """``(entry, slot or None, the CacheKey to release after a successful read)``."""
        key = meta.get("key")
        if not isinstance(key, dict):
            raise _Refused(Code.LLM_PARAM_INVALID, "key must be an object")
        kind = key.get("kind")
        cluster = _int(key, "cluster_id")
        missing = _Refused(Code.LLM_KV_CACHE_NOT_EXIST, f"no cache for key {key}")
        if cluster != self._cluster_id:
            raise missing
        if kind == "blocks":
            bk = BlocksCacheKey(cluster_id=cluster, model_id=_int(key, "model_id"))
            e = self._registry.by_blocks_key(bk)
            if e is None:
                raise missing
            return e, None, None
        if kind == "key":
            ck = CacheKey(
                prompt_cluster_id=cluster,
                req_id=_int(key, "req_id"),
                model_id=_int(key, "model_id"),
                prefix_id=_int(key, "prefix_id"),
            )
            hit = self._registry.by_key(ck)
            if hit is None:
                raise missing
            return hit[0], hit[1], ck
        if kind == "id":
            e = self._registry.by_id(_int(key, "cache_id"))
            if e is None:
                raise missing
            slot = _int(key, "batch_index")
            if slot >= e.cache.cache_desc.batch_size:
                raise _Refused(Code.LLM_PARAM_INVALID, f"batch_index {slot} out of range")
            return e, slot, None
        raise _Refused(Code.LLM_PARAM_INVALID, f"unknown key kind {kind!r}")

    def _layout(self, meta: dict[str, Any], e: Entry, slot: int | None) -> Layout:
        cache = e.cache
        tensors = _layers(meta, cache.cache_desc.num_tensors)
        if _int(meta, "ntensors") != len(tensors):
            raise _Refused(Code.LLM_PARAM_INVALID, "tensor counts differ between the two sides")
        shape = meta.get("shape")
        if shape == "blocks":
            if not cache.is_blocks_cache:
                raise _Refused(Code.LLM_PARAM_INVALID, "the cache is not a blocks cache")
            blocks = _ints(meta, "blocks", cache.num_blocks)
            bb = _int(meta, "block_bytes", 1)
            if bb != cache.block_bytes:
                raise _Refused(
                    Code.LLM_PARAM_INVALID,
                    f"block sizes differ ({bb} vs {cache.block_bytes} bytes)",
                )
            return Layout(tensors, blocks, nbytes=bb)
        if slot is None:
            raise _Refused(Code.LLM_PARAM_INVALID, "a slot transfer needs a CacheKey or id key")
        try:
            per_slot = slot_bytes("remote", cache)
        except LLMException as exc:
            raise _Refused(Code.LLM_PARAM_INVALID, str(exc)) from None
        if shape == "chunks":  # a contiguous slot moved as block-sized chunks
            cb = _int(meta, "block_bytes", 1, per_slot)
            if per_slot % cb:
                raise _Refused(Code.LLM_PARAM_INVALID, "slot size is not a multiple of blocks")
            per = per_slot // cb
            chunks = _ints(meta, "blocks", per)
            return Layout(tensors, tuple(slot * per + c for c in chunks), nbytes=cb)
        if shape == "slot":
            size = _int(meta, "size", 0, per_slot)
            offset = _int(meta, "offset", 0, per_slot)
            if size == 0 or offset + size > per_slot:
                raise _Refused(Code.LLM_PARAM_INVALID, f"{offset}+{size} exceeds the slot")
            if meta.get("exact") is True and size != per_slot:
                raise _Refused(
                    Code.LLM_PARAM_INVALID, f"slot sizes differ ({size} vs {per_slot} bytes)"
                )
            return Layout(tensors, None, slot=slot, offset=offset, nbytes=size)
        raise _Refused(Code.LLM_PARAM_INVALID, f"unknown shape {shape!r}")

    # ---- RequestHandler -----------------------------------------------------------------
    def _grant(self, meta: dict[str, Any], *, write: bool, nbytes: int = -1) -> Grant:
        try:
            if meta.get("v") != PROTOCOL:
                raise _Refused(Code.LLM_PARAM_INVALID, "unsupported protocol version")
            if meta.get("op") == "addrs":
                if not write:
                    raise _Refused(Code.LLM_PARAM_INVALID, "address reads are not served")
                return self._grant_addrs(meta, nbytes)
            entry, slot, key = self._lookup(meta)
            cache = entry.cache
            if write and not (
                self._config.enable_remote_cache_accessible and entry.remote_accessible
            ):
                raise _Refused(
                    Code.LLM_FEATURE_NOT_ENABLED,
                    f"cache {cache.cache_id} does not accept pushes "
                    "(enable_remote_cache_accessible)",
                )
            if write and key is not None:
                raise _Refused(Code.LLM_PARAM_INVALID, "push needs a CacheKeyByIdAndIndex")
            if cache.tensors and cache.tensors[0].device.type != "cpu":
                raise _Refused(Code.LLM_FEATURE_NOT_ENABLED, "device memory over tcp")
            layout = self._layout(meta, entry, slot)
            views = layout.views(cache)
        except _Refused as r:
            return Grant(r.code)
        self._registry.pin(entry)
        release = key if (not write and meta.get("release") is True) else None

        def done(ok: bool) -> None:
            self._registry.unpin(entry)
            if ok and release is not None:
                self._registry.release_key(release)

        return Grant(Code.LLM_SUCCESS, views, done)

    def _grant_addrs(self, meta: dict[str, Any], nbytes: int) -> Grant:
        regions = meta.get("regions")
        if not isinstance(regions, list) or not regions or len(regions) > MAX_LIST:
            raise _Refused(Code.LLM_PARAM_INVALID, "regions must be a non-empty list")
        views: list[memoryview] = []
        entries: list[Entry] = []
        total = 0
        for r in regions:
            if (
                not isinstance(r, list)
                or len(r) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in r)
            ):
                raise _Refused(Code.LLM_PARAM_INVALID, "a region is [addr, nbytes]")
            addr, n = r
            if n <= 0 or addr <= 0 or addr > U64:
                raise _Refused(Code.LLM_PARAM_INVALID, f"bad region {r}")
            hit = self._registry.find_region(addr, n)
            if hit is None:
                raise _Refused(Code.LLM_PARAM_INVALID, f"region {r} is not registered memory")
            entry, ti, off = hit
            if not (self._config.enable_remote_cache_accessible and entry.remote_accessible):
                raise _Refused(Code.LLM_FEATURE_NOT_ENABLED, "memory is not remote accessible")
            t = entry.cache.tensors[ti]
            if t.device.type != "cpu":
                raise _Refused(Code.LLM_FEATURE_NOT_ENABLED, "device memory over tcp")
            views.append(memview(t.view(torch.uint8).view(-1)[off : off + n]))
            entries.append(entry)
            total += n
        if total != nbytes:
            raise _Refused(Code.LLM_PARAM_INVALID, "regions do not total the payload")
        self._registry.pin(*entries)
        return Grant(Code.LLM_SUCCESS, views, lambda ok: self._registry.unpin(*entries))

    async def grant_read(self, peer: PeerInfo, meta: dict[str, Any]) -> Grant:
        """A peer pulls from us."""
        return self._grant(meta, write=False)

    async def grant_write(self, peer: PeerInfo, meta: dict[str, Any], nbytes: int) -> Grant:
        """A peer pushes ``nbytes`` into us."""
        return self._grant(meta, write=True, nbytes=nbytes)
