"""Prefill on one participant, decode on another: link, pull blocks, push, layer-wise.

Both participants live in this process for the demo; across processes or machines the
code is the same (give ``listen_ip_info`` a reachable address).

Run: ``python -m aiokv.examples.disaggregated`` (or ``aiokv demo``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import torch

from aiokv import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    TransferConfig,
)

PROMPT, DECODER = 1, 2


def config() -> LLMConfig:
    return LLMConfig(
        device_type="auto",
        enable_cache_manager=True,
        listen_ip_info="127.0.0.1:0",  # port 0: pick a free port
        mem_pool_cfg='{"memory_size": 268435456, "page_shift": 16}',
        enable_remote_cache_accessible=True,
        link_secret="demo-secret",  # both sides prove they know it; it never travels
    )


class Model:
    """Stands in for the prefill model: computes one layer at a time (a short wait)."""

    def __init__(self, layers: int, ms_per_layer: float) -> None:
        self.done = [asyncio.Event() for _ in range(layers)]
        self.ms = ms_per_layer

    async def forward(self) -> None:
        for ev in self.done:
            await asyncio.sleep(self.ms / 1000)  # "compute" layer i
            ev.set()

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        """The LayerSynchronizer: layer ``layer_index`` may go once computed."""
        await self.done[layer_index].wait()
        return True


async def main(layers: int = 16, blocks: int = 128, say: Callable[..., Any] = print) -> None:
    """Walk a request from prefill to decode and report what moved."""
    desc = CacheDesc(2 * layers, [blocks, 16, 4, 64], DataType.DT_BF16)  # K,V per layer
    async with (
        LLMDataDist(LLMRole.PROMPT, PROMPT, config()) as p,
        LLMDataDist(LLMRole.DECODER, DECODER, config()) as d,
    ):
        say(f"prompt listens on {p.listen_address}, decoder on {d.listen_address}")
        p_cache = await p.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(PROMPT))
        d_cache = await d.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(DECODER))
        for t in p_cache.tensors:
            t.copy_(torch.randn(t.shape).to(t.dtype))

        assert p.listen_address is not None
        peer = LLMClusterInfo(remote_cluster_id=PROMPT, remote_ip_info=[p.listen_address])
        code, codes = await d.link_clusters([peer], timeout=3000)
        say(f"decoder links to prompt: {code.name} {[c.name for c in codes]}")

        # decode pulls the request's blocks (positional lists, as serving frameworks do)
        src_blocks = list(range(0, 64))
        dst_blocks = list(range(64, 128))
        t0 = time.perf_counter()
        await d.cache_manager.pull_blocks(BlocksCacheKey(PROMPT), d_cache, src_blocks, dst_blocks)
        dt = time.perf_counter() - t0
        nbytes = len(src_blocks) * d_cache.block_bytes * len(d_cache.tensors)
        ok = all(
            torch.equal(a[dst_blocks], b[src_blocks])
            for a, b in zip(d_cache.tensors, p_cache.tensors, strict=True)
        )
        say(
            f"pull_blocks: {nbytes / 2**20:.1f} MiB in {dt * 1e3:.1f} ms "
            f"({nbytes / dt / 1e9:.2f} GB/s), byte-exact = {ok}"
        )

        # layer-wise: prefill sends layer i while it computes layer i+1
        model = Model(layers, ms_per_layer=5)
        t0 = time.perf_counter()
        task = p.cache_manager.transfer_cache_async(
            p_cache,
            model,
            [TransferConfig(DECODER, d_cache.tensor_addrs)],
            src_block_indices=list(range(64)),
            dst_block_indices=list(range(64)),
        )
        await model.forward()
        results = await task
        dt = time.perf_counter() - t0
        ok = all(
            torch.equal(a[:64], b[:64])
            for a, b in zip(d_cache.tensors, p_cache.tensors, strict=True)
        )
        names = [r.name for r in results if r is not None]
        say(
            f"transfer_cache_async over {layers} layers: {names} "
            f"in {dt * 1e3:.1f} ms (compute alone {layers * 5} ms), byte-exact = {ok}"
        )

        code, codes = await d.unlink_clusters([peer])
        say(f"unlink: {code.name}")


if __name__ == "__main__":
    asyncio.run(main())
