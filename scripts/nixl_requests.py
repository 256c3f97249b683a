"""aiokv-nixl pulls and pushes that go by request (no lease), timed: what every transfer
of a device cache pays, and the first transfer of any other.

``PYTHONPATH=<checkout> python scripts/nixl_requests.py [ROUNDS]`` (default 30): a
prompt and a decoder in this process (``aiokv.testing.linked_pair`` over ``nixl``, UCX's
defaults, host pools), leases turned off (the requester never asks for one), then per
row (4 KiB × 1, 64 KiB × 64, 16 KiB × 1024 scattered blocks) ``ROUNDS`` pulls and pushes
alternating; prints the median ms of each after the first 5, and checks that NIXL moved
every one. Run it with ``PYTHONPATH`` set to two checkouts in turn to compare them.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from typing import Any

import numpy as np

from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import DataType
from aiokv._remote import _client
from aiokv.testing import linked_pair
from aiokv.testing import make_config

ROWS = ((4 << 10, 1), (64 << 10, 64), (16 << 10, 1024))


async def _no_lease(*_: Any) -> bytes | None:
    """The requester's question for a lease, answered "no" without asking."""
    return None


async def main(rounds: int) -> None:
    """Print one line per row: its median pull and push in ms."""
    _client.RemoteClient._ask = _no_lease  # type: ignore[method-assign,assignment]
    config = make_config("nixl", pool=256 << 20, page_shift=16, sync_kv_timeout=60_000)
    async with linked_pair(config) as (prompt, decoder):
        cm, key = decoder.cache_manager, BlocksCacheKey(1, 0)
        transport: Any = decoder._transport
        for block, count in ROWS:
            desc = CacheDesc(1, [2 * count, block], DataType.DT_UINT8)
            src = await prompt.cache_manager.allocate_blocks_cache(desc, key)
            dst = await cm.allocate_blocks_cache(desc)
            rng = np.random.default_rng(count)
            srcs = [int(b) for b in rng.permutation(2 * count)[:count]]
            dsts = [int(b) for b in rng.permutation(2 * count)[:count]]
            times: dict[str, list[float]] = {"pull": [], "push": []}
            moved = transport.moved
            for _ in range(rounds):
                for name, times_of in times.items():
                    t0 = time.perf_counter()
                    if name == "pull":
                        await cm.pull_blocks(key, dst, srcs, dsts)
                    else:
                        await cm.push_blocks(key, dst, dsts, srcs)
                    times_of.append(time.perf_counter() - t0)
            if transport.moved != moved + 2 * rounds:
                raise AssertionError("a transfer did not move over NIXL")
            medians = {k: statistics.median(v[5:]) * 1e3 for k, v in times.items()}
            print(
                f"{block >> 10} KiB x {count}: pull {medians['pull']:.3f} ms, "
                f"push {medians['push']:.3f} ms",
                flush=True,
            )
            await prompt.cache_manager.deallocate_blocks_cache(src)
            await cm.deallocate_blocks_cache(dst)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 30))
