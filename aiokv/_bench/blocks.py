"""Per-block cost of remote transfers: ``pull_blocks`` / ``push_blocks`` of K scattered
blocks against a raw socket stream of the same bytes, and the tail of consecutive pulls.

Against the spawned prompt peer, interleaved round by round: ``raw`` (a raw socket
stream of ``K * B`` bytes, :class:`.raw.RawStream`), ``pull`` and ``push`` of the same
bytes as K blocks that are never neighbours (so no run merges). Reported per (B, K): the
medians, the per-block overhead ``(t - t_raw) / K`` and the tail ``max / median`` of the
pulls (a collector pause shows there). The first pull is checked byte for byte.

Run: ``python -m aiokv._bench.blocks [--quick] [--json]`` (not an ``aiokv bench``
command yet).
"""

from __future__ import annotations

import asyncio
import json
import sys
from functools import partial

from .. import BlocksCacheKey, CacheDesc, DataType, LLMDataDist
from ._harness import (
    KIB,
    PEER_ID,
    PromptPeer,
    Report,
    digest,
    interleave,
    median,
    run_remote,
    scattered,
    spawned,
)
from .raw import RawStream

__all__ = ["run_blocks_bench"]

GRID = [(4 * KIB, 1024), (4 * KIB, 4096), (4 * KIB, 16384), (16 * KIB, 1024), (16 * KIB, 4096)]
QUICK = [(4 * KIB, 1024), (4 * KIB, 16384)]


def run_blocks_bench(*, quick: bool = False, rounds: int = 20) -> Report:
    """Pull / push of K scattered blocks vs a raw stream, ``rounds`` interleaved rounds.

    Args:
        quick: two grid points instead of five.
        rounds: timed rounds per grid point (after two warm-up rounds).
    """
    grid = QUICK if quick else GRID
    report = Report("blocks", {"rounds": rounds})
    rows = report.table(
        "blocks",
        "K scattered blocks of B bytes: raw socket stream vs pull/push (median ms; "
        "us_per_block = (t - t_raw) / K; tail = max / median of the pulls)",
    )

    async def main(peer: PromptPeer, decoder: LLMDataDist) -> None:
        cm = decoder.cache_manager
        key = BlocksCacheKey(PEER_ID, 0)
        async with spawned(lambda: RawStream(max(b * k for b, k in grid))) as raw:
            for block, count in grid:
                srcs, dsts = scattered(count, 1), scattered(count, 2)
                desc = CacheDesc(1, [2 * count, block], DataType.DT_UINT8)
                await peer.cache(desc)
                dst = await cm.allocate_blocks_cache(desc)
                try:
                    await cm.pull_blocks(key, dst, srcs, dsts)
                    if await asyncio.to_thread(digest, dst, dsts) != await peer.digest(srcs):
                        raise AssertionError("blocks benchmark: pull_blocks delivered wrong bytes")
                    n = block * count
                    t = await interleave(
                        {
                            "raw": partial(raw.receive, n),
                            "pull": partial(cm.pull_blocks, key, dst, srcs, dsts),
                            "push": partial(cm.push_blocks, key, dst, dsts, srcs),
                        },
                        rounds,
                        warmup=2,
                    )
                finally:
                    await cm.deallocate_blocks_cache(dst)
                r, p, q = median(t["raw"]), median(t["pull"]), median(t["push"])
                rows.append(
                    {
                        "block_kib": block // KIB,
                        "count": count,
                        "raw_ms": r * 1e3,
                        "pull_ms": p * 1e3,
                        "push_ms": q * 1e3,
                        "pull_ratio": r / p,
                        "push_ratio": r / q,
                        "pull_us_per_block": (p - r) / count * 1e6,
                        "push_us_per_block": (q - r) / count * 1e6,
                        "pull_tail": max(t["pull"]) / p,
                        "push_tail": max(t["push"]) / q,
                    }
                )

    run_remote(main)
    return report


if __name__ == "__main__":
    result = run_blocks_bench(quick="--quick" in sys.argv)
    if "--json" in sys.argv:
        print(json.dumps(result.as_dict()))
    else:
        result.render()
