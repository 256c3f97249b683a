"""aiokv-nixl push and pull of scattered blocks between two processes, timed where they
run: the median of 16 of each (after 2 warm-ups each, in two alternating batches).

Uses the bench's own peers (:class:`aiokv._bench._harness.PromptPeer`,
:class:`aiokv._bench.nixl.NixlDecoder`) and nothing else in the rounds, so that two
versions of aiokv compare like for like: run it with ``PYTHONPATH`` set to each checkout
in turn (scripts/ab_bench.sh's companion; docs/benchmarks.md, "The transport re-cut").

Usage: python scripts/nixl_ops.py BLOCK_KIB COUNT {shm,utcp}
"""

from __future__ import annotations

import asyncio
import statistics
import sys

from aiokv._bench._harness import PromptPeer
from aiokv._bench._harness import scattered
from aiokv._bench._harness import spawned
from aiokv._bench.nixl import SETTINGS
from aiokv._bench.nixl import NixlDecoder
from aiokv._bench.nixl import _desc


async def main(block: int, count: int, setting: str) -> None:
    """Print ``push X ms pull Y ms`` for ``count`` blocks of ``block`` bytes."""
    pool = 4 * block * count + (64 << 20)
    env = SETTINGS[setting]
    async with (
        spawned(lambda: PromptPeer(pool, backend="nixl", env=env)) as peer,
        spawned(lambda: NixlDecoder(env, peer.port, pool)) as decoder,
    ):
        srcs = scattered(count, seed=block + count)
        dsts = scattered(count, seed=block + count + 1)
        await peer.cache(_desc(block, 2 * count))
        await decoder.setup(block, srcs, dsts)
        times: dict[str, list[float]] = {"push": [], "pull": []}
        for name in ("push", "pull", "push", "pull"):
            batch = [float(await decoder.op(name)) for _ in range(10)]
            times[name].extend(batch[2:])
        print(" ".join(f"{k} {statistics.median(v) * 1e3:.2f}ms" for k, v in times.items()))


if __name__ == "__main__":  # spawned peers re-import this module
    asyncio.run(main(int(sys.argv[1]) * 1024, int(sys.argv[2]), sys.argv[3]))
