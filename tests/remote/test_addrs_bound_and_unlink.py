"""A raw-address push is checked against registered memory before its block list is
unfolded; a graceful unlink waits for a staged transfer between its requests."""

from __future__ import annotations

import asyncio
import threading
import tracemalloc
from typing import Any

import numpy as np
import pytest
import torch
from _helpers import until

from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import DataType
from aiokv import LLMStatusCode
from aiokv import Placement
from aiokv._cache import Cache
from aiokv._copy import Stager
from aiokv._copy import _staging
from aiokv._registry import CacheRegistry
from aiokv._remote._protocol import AddrsReq
from aiokv._remote._protocol import encode
from aiokv._remote._service import PeerService
from aiokv.testing import cluster_info
from aiokv.testing import linked_pair
from aiokv.testing import make_config
from aiokv.transport import PeerInfo

CODE = LLMStatusCode
PEER = PeerInfo(7, ("127.0.0.1", 1))
MIB = 1 << 20


async def test_a_raw_address_write_to_unregistered_memory_is_refused_before_unfolding() -> None:
    """docs/security.md: "a few bytes can name no more than a whole-cache request names".
    A 70-byte ``AddrsReq`` whose folded block list names 2**20 blocks at an address no
    cache holds must be refused before its list is unfolded and laid out: it was
    unfolded first (2**20 int64s, ~17 MiB of numpy temporaries and ~17 ms on the loop
    per request), and only then was the address found to be unregistered."""
    reg = CacheRegistry()
    desc = CacheDesc(1, [1, MIB], DataType.DT_UINT8, Placement.HOST)
    cache = Cache(desc, [torch.zeros(1, MIB, dtype=torch.uint8)], is_blocks_cache=False)
    reg.add(cache, [], remote_accessible=True)
    service = PeerService(1, reg, make_config("local", enable_remote_cache_accessible=True))
    folded = np.array([0, -(MIB - 1)], dtype="<i8").tobytes()  # blocks 0 .. 2**20 - 1
    meta = encode(AddrsReq([12345], 1, 1, folded))  # an address nothing registered
    assert len(meta) < 100
    tracemalloc.start()
    try:
        grant = service.grant_now(PEER, meta, MIB, write=True, direct=None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert grant is not None and grant.status == CODE.LLM_PARAM_INVALID
    assert peak < 256 << 10, f"{peak} bytes allocated to refuse a {len(meta)}-byte request"
    # the same list at a registered address is still served (a whole-tensor write)
    meta = encode(AddrsReq([cache.tensor_addrs[0]], 1, 1, folded))
    grant = service.grant_now(PEER, meta, MIB, write=True, direct=None)
    assert grant is not None and grant.status == CODE.LLM_SUCCESS, grant
    assert grant.done is not None
    grant.done(False)
    # and one past the registered tensor is not
    meta = encode(AddrsReq([cache.tensor_addrs[0] + 1], 1, 1, folded))
    grant = service.grant_now(PEER, meta, MIB, write=True, direct=None)
    assert grant is not None and grant.status == CODE.LLM_PARAM_INVALID


async def test_a_graceful_unlink_waits_for_a_staged_push_still_gathering(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs/links.md: with ``force=False`` "this side's transfers in flight to the cluster
    may finish first". A push of staged (device) memory gathers its first part into a
    host buffer before its first request goes out; a graceful unlink issued then did not
    count it as in flight, closed the link at once, and the push failed."""
    monkeypatch.setattr(_staging, "_STAGE_HOST", True)  # host caches take the staged path
    entered, release = threading.Event(), threading.Event()
    gather = Stager.gather

    async def held_gather(self: Stager, *args: Any, **kwargs: Any) -> Any:
        entered.set()
        await asyncio.to_thread(release.wait, 10)  # on the engine loop: the test's thread sets it
        return await gather(self, *args, **kwargs)

    monkeypatch.setattr(Stager, "gather", held_gather)
    cfg = make_config(
        "tcp", host_pool=4 << 20, enable_remote_cache_accessible=True, sync_kv_timeout=5000
    )
    desc = CacheDesc(2, [4, 1024], DataType.DT_UINT8, Placement.HOST)
    async with linked_pair(cfg) as (p, d):
        dst = await p.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(1, 0))
        src = await d.cache_manager.allocate_blocks_cache(desc)
        for t in src.tensors:
            t.fill_(7)
        push = asyncio.create_task(
            d.cache_manager.push_blocks(BlocksCacheKey(1, 0), src, [0, 1], [2, 3])
        )
        await until(entered.is_set)
        unlink = asyncio.create_task(
            d.unlink_clusters([cluster_info(1, p.listen_address)], timeout=5000)
        )
        await asyncio.sleep(0.2)  # the unlink runs while the push gathers
        release.set()
        await push  # it was in flight: it finishes
        assert await unlink == (CODE.LLM_SUCCESS, [CODE.LLM_SUCCESS])
        assert all(bool((t[2:4] == 7).all()) for t in dst.tensors)
        assert d.linked_clusters() == []
