"""What one request costs in Python on each side, without the socket.

``PYTHONPATH=. python scripts/request_cost.py`` (repository root). A prompt and a
decoder in this process, linked over TCP (``aiokv.testing.linked_pair``); a blocks cache
of 64 tensors (32 layers x K,V) of 64 x 4 KiB blocks on each. On each side's engine
thread, best of seven rounds of 3,000, µs per request:

* ``request``: one layer's send of a layer-wise push (``transfer_cache_async`` by
  ``BlocksCacheKey``, every block), up to the link: the request built, the
  route, the host memory found by address, counters, error mapping; ``TcpLink.write``
  replaced by a no-op for the rounds (what the link itself costs is in
  ``scripts/trace_hop.py``);
* ``grant``: the serving side's answer to a one-block pull (every tensor),
  ``PeerService.grant_now`` and the grant's ``done``: decode, look-up, access check,
  layout, host memory by address, pin, revoker, counters.

docs/benchmarks.md ("Fewer Python steps per request") reads these figures.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

import aiokv._layerwise as lw
from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import DataType
from aiokv import TransferWithCacheKeyConfig
from aiokv.testing import linked_pair
from aiokv.testing import make_config
from aiokv.transport import PeerInfo
from aiokv.transport.tcp import _link

ROUNDS, N = 7, 3000
LAYERS, BLOCKS, BLOCK = 32, 64, 4096


def _best(fn: Any) -> float:
    """Best of ``ROUNDS`` rounds of ``N`` calls of ``fn``, µs per call."""
    best = float("inf")
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for _ in range(N):
            fn()
        best = min(best, (time.perf_counter() - t0) / N * 1e6)
    return best


async def _main() -> None:
    key = BlocksCacheKey(1, 0)
    desc = CacheDesc(2 * LAYERS, [BLOCKS, BLOCK], DataType.DT_UINT8)
    async with linked_pair(make_config("tcp")) as (prompt, decoder):
        src = await prompt.cache_manager.allocate_blocks_cache(desc, key)
        dst = await decoder.cache_manager.allocate_blocks_cache(desc)
        try:
            metas: list[bytes] = []
            read = _link.TcpLink.read

            async def kept(self: Any, meta: bytes, into: Any, *, timeout: float) -> None:
                metas.append(meta)
                await read(self, meta, into, timeout=timeout)

            _link.TcpLink.read = kept  # type: ignore[method-assign]
            try:
                await decoder.cache_manager.pull_blocks(key, dst, [3], [5])
            finally:
                _link.TcpLink.read = read  # type: ignore[method-assign]
            print(f"request {await _request_cost(decoder, dst, key):6.1f} µs")
            print(f"grant   {await _grant_cost(prompt, metas[-1]):6.1f} µs")
        finally:
            await decoder.cache_manager.deallocate_blocks_cache(dst)
            await prompt.cache_manager.deallocate_blocks_cache(src)


async def _request_cost(decoder: Any, cache: Any, key: BlocksCacheKey) -> float:
    client = decoder.cache_manager._client
    blocks = np.arange(BLOCKS, dtype=np.int64)
    source = lw.Source(cache, LAYERS, blocks, blocks, cache.block_bytes)
    plan = lw.plan("transfer_cache_async", client, source, TransferWithCacheKeyConfig(key))

    async def rounds() -> float:
        write = _link.TcpLink.write

        async def nothing(self: Any, meta: bytes, src: Any, *, timeout: float) -> None:
            return None

        _link.TcpLink.write = nothing  # type: ignore[method-assign]
        try:
            best = float("inf")
            for _ in range(ROUNDS):
                t0 = time.perf_counter()
                for _ in range(N):
                    await plan.send(range(3, 4))
                best = min(best, (time.perf_counter() - t0) / N * 1e6)
            return best
        finally:
            _link.TcpLink.write = write  # type: ignore[method-assign]

    result: float = await decoder._engine.run(rounds)
    return result


async def _grant_cost(prompt: Any, meta: bytes) -> float:
    service = prompt._transport.handler
    peer = PeerInfo(2, ("127.0.0.1", 0))

    def one() -> None:
        service.grant_now(peer, meta, 2 * LAYERS * BLOCK, write=False, direct=None).done(True)

    result: float = await prompt._engine.run_sync(_best, one)
    return result


if __name__ == "__main__":
    asyncio.run(_main())
