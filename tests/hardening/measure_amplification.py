"""Measure the serving side's cost of the worst read request at the meta cap (issue #9, 8).

One ``BlocksReq`` of ~1 MiB naming blocks 0, 2, 0, 2, ... (no two adjacent: every block
its own run) of a 64-tensor, 64-block cache, handed to ``PeerService.grant_read`` as the
transport would. Prints the time the call held the loop and the peak RSS growth.

    PYTHONPATH=<tree> python tests/hardening/measure_amplification.py
"""

from __future__ import annotations

import asyncio
import resource
import time

import numpy as np
import torch

from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import DataType
from aiokv import LLMConfig
from aiokv._cache import Cache
from aiokv._registry import CacheRegistry
from aiokv._remote._protocol import BlocksReq
from aiokv._remote._protocol import KeyByBlocks
from aiokv._remote._protocol import Tensors
from aiokv._remote._protocol import encode
from aiokv._remote._protocol import pack_blocks
from aiokv._remote._service import PeerService
from aiokv.transport import PeerInfo

TENSORS, BLOCKS, BLOCK_BYTES = 64, 64, 4096
META_CAP = 1 << 20


def main() -> None:
    desc = CacheDesc(TENSORS, [BLOCKS, BLOCK_BYTES], DataType.DT_UINT8)
    tensors = [torch.zeros(BLOCKS, BLOCK_BYTES, dtype=torch.uint8) for _ in range(TENSORS)]
    registry = CacheRegistry()
    cache = Cache(desc, tensors, is_blocks_cache=True)
    registry.add(cache, [], remote_accessible=True, blocks_key=BlocksCacheKey(1, 0))
    service = PeerService(1, registry, LLMConfig(enable_remote_cache_accessible=True))
    n = (META_CAP - 256) // 8
    blocks = np.tile(np.array([0, 2], dtype=np.int64), n // 2)
    meta = encode(BlocksReq(KeyByBlocks(1, 0), Tensors(TENSORS), pack_blocks(blocks), BLOCK_BYTES))
    assert len(meta) <= META_CAP

    async def once() -> tuple[float, object]:
        t0 = time.perf_counter()
        grant = await service.grant_read(PeerInfo(2, ("127.0.0.1", 1)), meta)
        dt = time.perf_counter() - t0
        if grant.done is not None:
            grant.done(False)
        return dt, grant.status

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    dt, status = asyncio.run(once())
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        f"request {len(meta)} B, {blocks.size} blocks x {TENSORS} tensors: {status!s}, "
        f"{dt * 1000:.1f} ms on the loop, peak RSS +{(rss1 - rss0) / 1024:.0f} MiB"
    )


if __name__ == "__main__":
    main()
