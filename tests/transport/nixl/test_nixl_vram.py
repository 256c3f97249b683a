"""Device memory over ``nixl`` by address (issue #10 item 3): ``cuda`` memory registered
as NIXL VRAM moves GPU-direct, with no host staging on a side whose memory NIXL reaches;
the staged path stays for everything else (a TCP peer, memory NIXL could not register).

The CUDA tests skip without a CUDA device (or NIXL); the contract tests run anywhere:
device memory by address never becomes socket payload.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from _helpers import fill_bytes
from _helpers import pull_a_slot_by_key
from _helpers import pull_and_push_blocks
from _helpers import pull_every_other_block
from _helpers import raises
from _helpers import same_rows

from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import DataType
from aiokv import LLMConfig
from aiokv import LLMDataDist
from aiokv import LLMStatusCode
from aiokv import Placement
from aiokv._copy import Stager
from aiokv.testing import linked_pair
from aiokv.testing import make_config
from aiokv.testing import requires_transport
from aiokv.transport import DeviceRuns
from aiokv.transport import Grant
from aiokv.transport import PeerInfo
from aiokv.transport import get_transport
from aiokv.transport._base import check_grant

CODE = LLMStatusCode
HAS_CUDA = torch.cuda.is_available()


def needs_cuda_nixl(test: Callable[..., Any]) -> Callable[..., Any]:
    """Skip ``test`` without CUDA or without NIXL."""
    return pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")(requires_transport("nixl")(test))


# ---------------------------------------------------------------- contract, anywhere


def _runs(*rows: tuple[int, int]) -> np.ndarray[Any, np.dtype[np.uint64]]:
    return np.array(rows, dtype=np.uint64).reshape(-1, 2)


def test_a_device_grant_is_refused_unless_direct_was_offered() -> None:
    dev = DeviceRuns("cuda:0", _runs((4096, 100), (9000, 28)))
    assert dev.total == 128
    grant = Grant(CODE.LLM_SUCCESS, device=dev)
    assert check_grant(grant, "grant_read", writable=False)[0] is CODE.LLM_FAILED
    assert check_grant(grant, "grant_read", writable=False, device_ok=True) == (
        CODE.LLM_SUCCESS,
        [],
        128,
    )
    bad = [
        Grant(CODE.LLM_SUCCESS, [memoryview(bytearray(8))], device=dev),  # both kinds
        Grant(CODE.LLM_SUCCESS, device=DeviceRuns("cuda:0", _runs((1, 0)))),  # empty run
        Grant(CODE.LLM_SUCCESS, device=DeviceRuns("cuda:0", _runs())),  # no run
    ]
    for g in bad:
        assert check_grant(g, "grant_read", writable=False, device_ok=True)[0] is CODE.LLM_FAILED


class DeviceGranter:
    """A handler that answers every request with device memory by address."""

    def __init__(self) -> None:
        self.done: list[bool] = []
        self.direct: list[object] = []

    def _grant(self, direct: object) -> Grant:
        self.direct.append(direct)
        dev = DeviceRuns("cuda:0", _runs((1 << 40, 64)))
        return Grant(CODE.LLM_SUCCESS, device=dev, done=self.done.append)

    async def grant_read(self, peer: PeerInfo, meta: bytes, *, direct: object = None) -> Grant:
        return self._grant(direct)

    async def grant_write(
        self, peer: PeerInfo, meta: bytes, nbytes: int, *, direct: object = None
    ) -> Grant:
        return self._grant(direct)


@pytest.mark.parametrize("backend", ["tcp", "local"])
async def test_device_memory_never_travels_as_socket_payload(backend: str) -> None:
    """A link without device access refuses DeviceRuns, is never offered ``direct``, and
    refuses a handler's device grant instead of sending anything."""
    cls = get_transport(backend)
    handler = DeviceGranter()
    async with cls(1, handler) as a, cls(2, DeviceGranter()) as b:
        host, port = await a.listen("127.0.0.1", 0)
        link = await b.connect(host, port, timeout=5)
        dev = DeviceRuns("cuda:0", _runs((1 << 40, 64)))
        assert not link.addressable("cuda:0", 1 << 40, 64)
        for op in (link.read, link.write):
            await raises(CODE.LLM_PARAM_INVALID, op(b"m", dev, timeout=5))
        buf = memoryview(bytearray(64))
        await raises(CODE.LLM_FAILED, link.read(b"m", [buf], timeout=5))
        await raises(CODE.LLM_FAILED, link.write(b"m", [buf], timeout=5))
        assert handler.direct == [None, None] and handler.done == [False, False]


@requires_transport("nixl")
def test_nixl_keeps_one_region_table_per_memory_kind() -> None:
    t = get_transport("nixl")(1, DeviceGranter())
    t.register_memory(1 << 40, 4096, device="cuda:1")
    t.register_memory(1 << 40, 4096, device="cuda:1")  # counted
    t.register_memory(1 << 41, 4096, device="npu:0")  # not NIXL's: staged above
    t.register_memory(1 << 42, 4096, device="cuda")  # no index: staged above
    assert list(t.vram) == [1] and t.vram[1].mem == "VRAM" and t.vram[1].dev == 1
    assert len(t.vram[1].all()) == 1 and not t.regions.all()
    assert not t.addressable("cuda:1", 1 << 40, 4096)  # no agent yet
    gen = t.generation()
    t.deregister_memory(1 << 40, 4096)  # the same numbers on the host: not this range
    t.deregister_memory(1 << 40, 4096, device="cuda:0")  # nor on another device
    assert len(t.vram[1].all()) == 1 and t.generation() == gen
    t.deregister_memory(1 << 40, 4096, device="cuda:1")
    assert len(t.vram[1].all()) == 1 and t.generation() == gen
    t.deregister_memory(1 << 40, 4096, device="cuda:1")
    assert not t.vram[1].all() and t.generation() > gen


# ---------------------------------------------------------------- on a CUDA device


def config(device: str, backend: str) -> LLMConfig:
    pools = {"pool": 64 << 20, "host_pool": 64 << 20, "page_shift": 16}
    return make_config(backend, device_type=device, sync_kv_timeout=20000, **pools)


@contextlib.asynccontextmanager
async def linked(
    backends: tuple[str, str] = ("nixl", "nixl"),
) -> AsyncIterator[tuple[LLMDataDist, LLMDataDist]]:
    async with linked_pair(config("cuda", backends[0]), config("cuda", backends[1])) as (p, d):
        yield p, d
        assert stager(p).in_use == 0 and stager(d).in_use == 0


def stager(dd: LLMDataDist) -> Stager:
    return dd.cache_manager._client._stager  # type: ignore[attr-defined,no-any-return]


def moved(dd: LLMDataDist) -> int:
    return int(dd._transport.moved)  # type: ignore[attr-defined]


@pytest.fixture
def staging(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every staging buffer lent (``gather`` / ``reserve``), by kind."""
    lent: list[str] = []
    gather, reserve = Stager.gather, Stager.reserve

    async def spy_gather(self: Stager, *a: Any, **kw: Any) -> Any:
        lent.append("gather")
        return await gather(self, *a, **kw)

    async def spy_reserve(self: Stager, *a: Any, **kw: Any) -> Any:
        lent.append("reserve")
        return await reserve(self, *a, **kw)

    monkeypatch.setattr(Stager, "gather", spy_gather)
    monkeypatch.setattr(Stager, "reserve", spy_reserve)
    return lent


def paged(placement: Placement = Placement.DEVICE) -> CacheDesc:
    return CacheDesc(4, [96, 8192], DataType.DT_FLOAT16, placement)  # 16 KiB blocks


@needs_cuda_nixl
async def test_device_caches_move_gpu_direct_both_ways(staging: list[str]) -> None:
    async with linked() as (p, d):
        assert p._transport.vram[0].all(), "the device pool is registered as VRAM"  # type: ignore[attr-defined]
        src = await p.cache_manager.allocate_blocks_cache(paged(), BlocksCacheKey(1, 0))
        dst = await d.cache_manager.allocate_blocks_cache(paged(), BlocksCacheKey(2, 0))
        n = moved(d)
        await pull_and_push_blocks(p.cache_manager, d.cache_manager, src, dst)
        assert moved(d) > n and moved(p) > 0
    assert staging == []  # no host buffer lent on either side


@needs_cuda_nixl
@pytest.mark.parametrize("placements", [("device", "host"), ("host", "device")])
async def test_device_and_host_caches_mix(staging: list[str], placements: tuple[str, str]) -> None:
    """One side's VRAM with the other side's DRAM, in one NIXL transfer."""
    place = {"device": Placement.DEVICE, "host": Placement.HOST}
    async with linked() as (p, d):
        src, dst = (paged(place[name]) for name in placements)
        await pull_every_other_block(p.cache_manager, d.cache_manager, src, dst)
    assert staging == []


@needs_cuda_nixl
async def test_a_contiguous_device_cache_is_pulled_by_key_directly(staging: list[str]) -> None:
    async with linked() as (p, d):
        await pull_a_slot_by_key(p.cache_manager, d.cache_manager, paged())
    assert staging == []


@needs_cuda_nixl
async def test_memory_nixl_cannot_reach_is_staged(staging: list[str]) -> None:
    """P's VRAM registration failed (as with a UCX built without CUDA): P stages, and
    D, asked for DATA into its VRAM, takes the staged path for that part."""
    async with linked() as (p, d):
        p._transport.vram[0].failed = True  # type: ignore[attr-defined]
        src = await p.cache_manager.allocate_blocks_cache(paged(), BlocksCacheKey(1, 0))
        dst = await d.cache_manager.allocate_blocks_cache(paged(), BlocksCacheKey(2, 0))
        fill_bytes(src, 6)
        blocks = list(range(96))
        await d.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, blocks, blocks[::-1])
        await same_rows(dst, blocks[::-1], src, blocks)
        fill_bytes(src, 7)
        await d.cache_manager.push_blocks(BlocksCacheKey(1, 0), dst, blocks[:8], blocks[8:16])
        await same_rows(src, blocks[8:16], dst, blocks[:8])
    assert "gather" in staging and "reserve" in staging


@needs_cuda_nixl
async def test_a_tcp_peer_of_a_nixl_side_is_staged(staging: list[str]) -> None:
    async with linked(("nixl", "tcp")) as (p, d):
        src = await p.cache_manager.allocate_blocks_cache(paged(), BlocksCacheKey(1, 0))
        dst = await d.cache_manager.allocate_blocks_cache(paged())
        fill_bytes(src, 8)
        blocks = list(range(0, 96, 3))
        await d.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, blocks, blocks)
        await same_rows(dst, blocks, src, blocks)
    assert staging  # staged on both sides, as before
