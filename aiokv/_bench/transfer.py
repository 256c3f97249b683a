"""``aiokv bench transfer``: remote transfers through the whole stack, against raw baselines.

In ONE run, with a prompt peer in a second process (spawn) on loopback:

1. ``pull_blocks`` and ``push_blocks`` of K scattered blocks of B bytes, interleaved
   round by round with a raw socket stream of the same bytes (:class:`.raw.RawStream`):
   GB/s, ratio, and the per-block overhead ``(t_pull - t_raw) / K``. A pull into a
   zeroed cache is checked byte for byte (digests) before the timed rounds.
2. Layer-wise ``transfer_cache_async`` overlapped with simulated compute
   (:func:`.layerwise.overlap`) and, without ``--quick``, its overhead over one
   ``push_blocks`` (:func:`.layerwise.overhead`, also ``aiokv bench layerwise``).
3. 1,000 concurrent small pulls over 8 links: all must succeed byte-exact; p50/p99.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import torch

from .. import BlocksCacheKey, CacheDesc, CacheManager, DataType, LLMDataDist
from ._harness import (
    KIB,
    MIB,
    PEER_ID,
    PromptPeer,
    Report,
    digest,
    gbps,
    interleave,
    linked,
    median,
    run_remote,
    scattered,
    spawned,
)
from .layerwise import overhead, overlap
from .raw import RawStream

__all__ = ["run_transfer_bench"]

GRID = [
    (16 * KIB, 256),
    (16 * KIB, 1024),
    (16 * KIB, 4096),
    (64 * KIB, 64),
    (64 * KIB, 1024),
    (256 * KIB, 256),
    (1 * MIB, 64),
    (1 * MIB, 128),
]
QUICK = [(16 * KIB, 1024), (64 * KIB, 256), (1 * MIB, 64)]


def _desc(block: int, nblocks: int, tensors: int = 1) -> CacheDesc:
    return CacheDesc(tensors, [nblocks, block], DataType.DT_UINT8)


async def _throughput_row(
    cm: CacheManager, peer: PromptPeer, raw: RawStream, block: int, count: int
) -> dict[str, Any]:
    """One ``(B, K)``: check that a pull delivers, then time raw, pull and push rounds."""
    await peer.cache(_desc(block, 2 * count))
    dst = await cm.allocate_blocks_cache(_desc(block, 2 * count))
    try:
        srcs = scattered(count, seed=block + count)
        dsts = scattered(count, seed=block + count + 1)
        key = BlocksCacheKey(PEER_ID, 0)
        await cm.pull_blocks(key, dst, srcs, dsts)
        if await asyncio.to_thread(digest, dst, dsts) != await peer.digest(srcs):
            raise AssertionError("transfer benchmark: pull_blocks delivered wrong bytes")
        nbytes = block * count
        times = await interleave(
            {
                "raw": lambda: raw.receive(nbytes),
                "pull": lambda: cm.pull_blocks(key, dst, srcs, dsts),
                "push": lambda: cm.push_blocks(key, dst, dsts, srcs),
            },
            max(3, min(30, (512 * MIB) // nbytes)),
        )
    finally:
        await cm.deallocate_blocks_cache(dst)
    t = {k: median(v) for k, v in times.items()}
    return {
        "block_kib": block // KIB,
        "count": count,
        "raw_gbps": gbps(nbytes, t["raw"]),
        "pull_gbps": gbps(nbytes, t["pull"]),
        "pull_ratio": t["raw"] / t["pull"],
        "push_gbps": gbps(nbytes, t["push"]),
        "push_ratio": t["raw"] / t["push"],
        "pull_us_per_block": (t["pull"] - t["raw"]) / count * 1e6,
    }


async def _throughput(
    report: Report, cm: CacheManager, peer: PromptPeer, grid: list[tuple[int, int]]
) -> None:
    rows = report.table(
        "throughput",
        "pull_blocks / push_blocks over loopback TCP vs a raw socket stream (median rounds)",
    )
    async with spawned(lambda: RawStream(max(b * k for b, k in grid))) as raw:
        for block, count in grid:
            rows.append(await _throughput_row(cm, peer, raw, block, count))


async def _concurrent(report: Report, peer: PromptPeer, links: int, transfers: int) -> None:
    """``transfers`` pulls of 2 blocks at once over ``links`` decoders; check every one."""
    block, nblocks = 16 * KIB, 256
    await peer.cache(_desc(block, nblocks))
    want = torch.randint(
        0, 256, (nblocks, block), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    lat: list[float] = []
    bad = 0
    async with contextlib.AsyncExitStack() as stack:
        ds = [
            await stack.enter_async_context(linked(peer, 100 + i, 64 * MIB)) for i in range(links)
        ]
        caches = [await d.cache_manager.allocate_blocks_cache(_desc(block, nblocks)) for d in ds]

        async def one(i: int) -> None:
            nonlocal bad
            cm, dst = ds[i % links].cache_manager, caches[i % links]
            slot = (i // links) % (nblocks // 2)
            src = [(7 * i) % nblocks, (7 * i + 1) % nblocks]
            t0 = time.perf_counter()
            await cm.pull_blocks(BlocksCacheKey(PEER_ID, 0), dst, src, [2 * slot, 2 * slot + 1])
            lat.append(time.perf_counter() - t0)
            if not torch.equal(dst.tensors[0][2 * slot], want[src[0]]):
                bad += 1

        t0 = time.perf_counter()
        # i // links < 128: every pull of one link lands in its own pair of blocks
        await asyncio.gather(*(one(i) for i in range(transfers)))
        wall = time.perf_counter() - t0
    lat.sort()
    report.summary(
        "concurrent",
        "concurrent: {completed}/{transfers} pulls over {links} links completed in "
        "{wall_ms:.0f} ms, p50 {p50_ms:.2f} ms, p99 {p99_ms:.2f} ms, byte mismatches "
        "{mismatches}",
        transfers=transfers,
        links=links,
        completed=len(lat),
        wall_ms=wall * 1e3,
        p50_ms=lat[len(lat) // 2] * 1e3,
        p99_ms=lat[int(len(lat) * 0.99) - 1] * 1e3,
        mismatches=bad,
    )


def run_transfer_bench(*, quick: bool = False) -> Report:
    """``aiokv bench transfer``: throughput, layer-wise overlap (and, without ``quick``,
    overhead), and concurrency, against one prompt peer, in one run.

    Args:
        quick: fewer sizes, 16 layers for the overlap, 400 concurrent pulls, and no
            layer-wise overhead table (``aiokv bench layerwise`` runs it alone).
    """
    report = Report("transfer", {"quick": quick})

    async def main(peer: PromptPeer, decoder: LLMDataDist) -> None:
        cm = decoder.cache_manager
        await _throughput(report, cm, peer, QUICK if quick else GRID)
        layers = 16 if quick else 32
        await overlap(report, cm, peer, layers=layers, block=64 * KIB, count=32)
        if not quick:
            await overhead(report, cm, peer, rounds=7)
        await _concurrent(report, peer, links=8, transfers=400 if quick else 1000)

    run_remote(main)
    return report
