"""A prompt-side peer run in a separate process (multiprocessing "spawn") for tests.

It registers paged KV caches filled with deterministic data, listens on 127.0.0.1:0,
sends its port back, then answers commands from the test over a pipe until "stop".
"""

from __future__ import annotations

import asyncio
from multiprocessing.connection import Connection
from typing import Any

import torch

from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import CacheKey
from aiokv import DataType
from aiokv import LLMDataDist
from aiokv import LLMRole
from aiokv import Placement
from aiokv.testing import make_config

LAYERS = 4
SHAPE = [64, 16, 2, 32]  # [num_blocks, block_size, kv_heads, head_dim]
DTYPES = {0: DataType.DT_BF16, 1: DataType.DT_FLOAT16}  # model_id -> dtype


def expected(model_id: int, tensor: int, shape: list[int] = SHAPE) -> torch.Tensor:
    """The deterministic content of tensor ``tensor`` of model ``model_id``'s cache."""
    g = torch.Generator().manual_seed(1000 * model_id + tensor)
    return torch.randn(shape, generator=g).to(DTYPES[model_id].torch_dtype)


async def _serve(conn: Connection, cluster_id: int, secret: str | None, backend: str) -> None:
    cfg = make_config(backend, pool=32 << 20, link_secret=secret)
    async with LLMDataDist(LLMRole.PROMPT, cluster_id, cfg) as dd:
        cm = dd.cache_manager
        keep: list[Any] = []
        for model_id, dt in DTYPES.items():
            tensors = [expected(model_id, i) for i in range(2 * LAYERS)]
            keep.append(tensors)
            desc = CacheDesc(2 * LAYERS, SHAPE, dt, Placement.DEVICE)
            await cm.register_blocks_cache(desc, tensors, BlocksCacheKey(cluster_id, model_id))
        # a contiguous cache with one CacheKey per batch slot, from the pool
        cdesc = CacheDesc(2 * LAYERS, [2, 16 * 2 * 32 * 4], DataType.DT_BF16)
        keys = [CacheKey(cluster_id, req_id=100), CacheKey(cluster_id, req_id=101)]
        contig = await cm.allocate_cache(cdesc, keys)
        for i, t in enumerate(contig.tensors):
            t.copy_(expected(0, i, list(cdesc.shape)))
        await cm.deallocate_cache(contig)  # the keys keep it alive
        assert dd.listen_address is not None
        conn.send(dd.listen_address[1])
        while True:
            cmd = await asyncio.to_thread(conn.recv)
            if cmd == "stop":
                conn.send("bye")
                return
            if cmd == "stats":
                stats = cm.get_pool_stats()
                assert stats is not None
                conn.send((stats.used, cm.statistics().keys))
            elif cmd == "pushed":
                # what push_blocks wrote into model 0's blocks 60..63 of every tensor
                conn.send([t[60:64].clone() for t in keep[0]])


def serve(
    conn: Connection, cluster_id: int, secret: str | None = None, backend: str = "tcp"
) -> None:
    """Process entry point."""
    asyncio.run(_serve(conn, cluster_id, secret, backend))
