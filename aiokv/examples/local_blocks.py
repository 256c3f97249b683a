"""Allocate paged KV caches, swap blocks out to host and back, fork blocks copy-on-write.

Run: ``python -m aiokv.examples.local_blocks`` (or ``aiokv demo``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import torch

from aiokv import CacheDesc
from aiokv import DataType
from aiokv import LLMConfig
from aiokv import LLMDataDist
from aiokv import LLMRole
from aiokv import Placement


async def main(layers: int = 8, blocks: int = 256, say: Callable[..., Any] = print) -> None:
    """Walk through the local operations and report what moved."""
    out = say
    config = LLMConfig(
        device_type="auto",
        enable_cache_manager=True,
        mem_pool_cfg='{"memory_size": 268435456, "page_shift": 16}',
        host_mem_pool_cfg='{"memory_size": 268435456, "page_shift": 16}',
    )
    async with LLMDataDist(LLMRole.MIX, cluster_id=1, config=config) as dd:
        cm = dd.cache_manager
        shape = [blocks, 16, 4, 64]  # [num_blocks, block_size, kv_heads, head_dim]
        dev = await cm.allocate_blocks_cache(CacheDesc(2 * layers, shape, DataType.DT_BF16))
        host = await cm.allocate_blocks_cache(
            CacheDesc(2 * layers, shape, DataType.DT_BF16, Placement.HOST)
        )
        block_kib = dev.block_bytes // 1024
        out(f"device {cm.device}: {len(dev.tensors)} tensors x {blocks} blocks of {block_kib} KiB")
        for t in dev.tensors:
            t.copy_(torch.randn(t.shape).to(t.dtype))

        evict = {b: b for b in range(0, blocks, 2)}  # every other block out to host
        t0 = time.perf_counter()
        await cm.swap_blocks(dev, host, evict)
        dt = time.perf_counter() - t0
        moved = len(evict) * dev.block_bytes * len(dev.tensors)
        out(f"swap out {len(evict)} blocks: {moved / 2**20:.1f} MiB in {dt * 1e3:.2f} ms")

        saved = [t[0].clone() for t in dev.tensors]
        for t in dev.tensors:
            t[0].zero_()  # the device block gets reused...
        await cm.swap_blocks(host, dev, {0: 0})  # ...and swapped back in
        ok = all(torch.equal(t[0], s) for t, s in zip(dev.tensors, saved, strict=True))
        out(f"swap block 0 back in: bytes identical = {ok}")

        await cm.copy_blocks(dev, {1: [blocks - 1, blocks - 2]})  # fork a shared prefix
        ok = all(torch.equal(t[blocks - 1], t[1]) for t in dev.tensors)
        out(f"copy_blocks 1 -> [{blocks - 1}, {blocks - 2}]: forked = {ok}")

        stats = cm.get_pool_stats(Placement.DEVICE)
        assert stats is not None
        out(f"device pool: {stats.used >> 20} MiB used of {stats.total >> 20} MiB")
        await cm.deallocate_blocks_cache(dev)
        await cm.deallocate_blocks_cache(host)
        stats = cm.get_pool_stats(Placement.DEVICE)
        assert stats is not None
        out(f"after deallocate: {stats.used} bytes used, {stats.allocations} allocations")


if __name__ == "__main__":
    asyncio.run(main())
