"""A leased one-block pull and push over NIXL, timed back to back and after idle.

``PYTHONPATH=<checkout> python scripts/leased_block.py [ROUNDS]`` (default 400): this
process is a decoder (uvloop, an engine thread, as ``aiokv bench latency --backend
nixl``'s) linked to a spawned prompt peer over NIXL with shared memory (the bench's
``shm`` UCX setting), both with host pools; after 50 pulls and pushes of one 4 KiB block
(the lease is asked for and held from then on), ``ROUNDS`` pushes and pulls
alternating, first back to back, then each 3 ms after the one before (as between the
bench's rounds, where caches go cold). Prints the median µs of each, and checks that
every timed transfer moved over NIXL. Run it with ``PYTHONPATH`` set to two checkouts in
turn to compare them.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from typing import Any

import uvloop

from aiokv import BlocksCacheKey
from aiokv import LLMClusterInfo
from aiokv import LLMDataDist
from aiokv import LLMRole
from aiokv._bench._harness import DECODER_ID
from aiokv._bench._harness import PEER_ID
from aiokv._bench._harness import PromptPeer
from aiokv._bench._harness import apply_env
from aiokv._bench._harness import participant_config
from aiokv._bench._harness import spawned
from aiokv._bench.nixl import SETTINGS
from aiokv._bench.nixl import _desc

BLOCK = 4096
GAPS = (0.0, 0.003)


async def main(rounds: int) -> None:
    """Print ``{op@gap: median µs}`` for push and pull, back to back and after 3 ms."""
    env = SETTINGS["shm"]
    async with spawned(lambda: PromptPeer(64 << 20, backend="nixl", env=env)) as peer:
        config = participant_config(64 << 20, backend="nixl")
        async with LLMDataDist(LLMRole.DECODER, DECODER_ID, config) as dd:
            where = [("127.0.0.1", peer.port)]
            info = LLMClusterInfo(PEER_ID, local_ip_info=[("127.0.0.1", 0)], remote_ip_info=where)
            await dd.link_clusters([info])
            cm, key = dd.cache_manager, BlocksCacheKey(PEER_ID, 0)
            await peer.cache(_desc(BLOCK, 2))
            dst = await cm.allocate_blocks_cache(_desc(BLOCK, 2))
            for _ in range(50):  # the first goes by request and asks for the lease
                await cm.pull_blocks(key, dst, [1], [0])
                await cm.push_blocks(key, dst, [0], [1])
            transport: Any = dd._transport
            moved = transport.moved
            medians: dict[str, float] = {}
            for gap in GAPS:
                times: dict[str, list[float]] = {"push": [], "pull": []}
                for _ in range(rounds):
                    for name, of in times.items():
                        if gap:
                            await asyncio.sleep(gap)
                        t0 = time.perf_counter()
                        if name == "pull":
                            await cm.pull_blocks(key, dst, [1], [0])
                        else:
                            await cm.push_blocks(key, dst, [0], [1])
                        of.append(time.perf_counter() - t0)
                for name, of in times.items():
                    medians[f"{name}@{gap * 1e3:g}ms"] = round(statistics.median(of) * 1e6, 1)
            if transport.moved != moved + 2 * rounds * len(GAPS):
                raise AssertionError("a transfer did not move over NIXL")
            print(medians, flush=True)
            await cm.deallocate_blocks_cache(dst)


if __name__ == "__main__":
    apply_env(SETTINGS["shm"])
    uvloop.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 400))
