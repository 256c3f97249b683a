"""Layer-wise push: the prefill sends each layer's KV blocks to the decoder as soon as
the model has written that layer, while it computes the next one.

Run: ``python -m aiokv.examples.layerwise_push``. Both sides live in this process and
link over loopback TCP; in real life they are two processes or machines.
``transfer_cache_async`` returns a started ``CacheTask`` at once; for each layer it
awaits ``synchronize_layer(i, None)`` and then sends layer ``i`` (its K and V tensors).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import torch

from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import DataType
from aiokv import LayerSynchronizer
from aiokv import LLMClusterInfo
from aiokv import LLMConfig
from aiokv import LLMDataDist
from aiokv import LLMRole
from aiokv import LLMStatusCode
from aiokv import TransferWithCacheKeyConfig

PREFILL, DECODE = 1, 2
LAYERS, BLOCKS = 8, 64
DESC = CacheDesc(2 * LAYERS, [BLOCKS, 16, 4, 64], DataType.DT_FLOAT16)


def config() -> LLMConfig:
    """Peers may push into this instance's caches (``enable_remote_cache_accessible``)."""
    return LLMConfig(
        device_type="cpu",
        enable_cache_manager=True,
        enable_remote_cache_accessible=True,
        listen_ip_info="127.0.0.1:0",
        mem_pool_cfg='{"memory_size": 33554432, "page_shift": 16}',
        sync_kv_timeout=10_000,
    )


class LayersDone(LayerSynchronizer):
    """Tells the transfer when the model has written a layer (one event per layer)."""

    def __init__(self, layers: int) -> None:
        self.done = [asyncio.Event() for _ in range(layers)]

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        """Wait until layer ``layer_index`` is in the cache; ``True``: send it."""
        await self.done[layer_index].wait()
        return True


async def main(say: Callable[..., Any] = print) -> None:
    """Prefill a request into blocks 0..5 layer by layer, pushing each layer into the
    decoder's blocks 10..15 as it completes; check the bytes."""
    async with (
        LLMDataDist(LLMRole.PROMPT, PREFILL, config()) as prefill,
        LLMDataDist(LLMRole.DECODER, DECODE, config()) as decode,
    ):
        # the decoder's blocks cache, named by a key the prefill pushes to
        dst = await decode.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(DECODE))
        assert prefill.listen_address is not None
        peer = LLMClusterInfo(
            remote_cluster_id=PREFILL,
            local_ip_info=[("127.0.0.1", 0)],
            remote_ip_info=[prefill.listen_address],
        )
        code, _ = await decode.link_clusters([peer], timeout=10_000)  # serves both directions
        assert code == LLMStatusCode.LLM_SUCCESS, code

        src = await prefill.cache_manager.allocate_blocks_cache(DESC)
        table, remote_table = list(range(6)), list(range(10, 16))  # the request's blocks
        sync = LayersDone(LAYERS)
        t0 = time.perf_counter()
        task = prefill.cache_manager.transfer_cache_async(
            src, sync, [TransferWithCacheKeyConfig(BlocksCacheKey(DECODE))], table, remote_table
        )
        for layer in range(LAYERS):  # the "model": writes K and V of one layer at a time
            await asyncio.sleep(0.005)  # compute
            for t in src.tensors[2 * layer : 2 * layer + 2]:
                t[table] = torch.full_like(t[table], layer + 1)
            sync.done[layer].set()  # layer `layer` may go now, while the next computes
        codes = await task
        dt = time.perf_counter() - t0
        say(f"{LAYERS} layers pushed layer by layer in {dt * 1e3:.1f} ms: {codes}")
        ok = all(
            torch.equal(d[remote_table], s[table])
            for d, s in zip(dst.tensors, src.tensors, strict=True)
        )
        say(f"decoder blocks 10..15 hold the prefill's blocks 0..5: {ok}")
        if not ok or any(c != LLMStatusCode.LLM_SUCCESS for c in codes):
            raise RuntimeError(f"layer-wise push failed: {codes}, bytes identical {ok}")


if __name__ == "__main__":
    asyncio.run(main())
