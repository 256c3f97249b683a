"""``aiokv bench transfer``: remote transfers through the whole stack, against raw baselines.

In ONE run, with a prompt peer in a second process (spawn) on loopback:

1. ``pull_blocks`` and ``push_blocks`` of K scattered blocks of B bytes, interleaved
   round by round with a raw socket stream of the same bytes (:class:`.raw.RawStream`):
   GB/s, ratio, and the per-block overhead ``(t_pull - t_raw) / K``. A pull into a
   zeroed cache is checked byte for byte (digests) before the timed rounds. With
   ``--tls``, a second prompt peer and decoder linked over TLS (a throwaway CA and
   certificate pair made at the start) join the same rounds: a second table with their
   GB/s, their ratio to the raw stream and to plain TCP.
2. Layer-wise ``transfer_cache_async`` overlapped with simulated compute
   (:func:`.layerwise.overlap`) and, without ``--quick``, its overhead over one
   ``push_blocks`` (:func:`.layerwise.overhead`, also ``aiokv bench layerwise``).
3. 1,000 concurrent small pulls over 8 links: all must succeed byte-exact; p50/p99.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch

from .. import BlocksCacheKey, Cache, CacheDesc, CacheManager, DataType, LLMDataDist
from ._harness import (
    DECODER_ID,
    KIB,
    MIB,
    PEER_ID,
    POOL_BYTES,
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
from ._pki import make_pki
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


#: A decoder's cache manager and the prompt peer it is linked to.
Pair = tuple[CacheManager, PromptPeer]


async def _checked_pull(
    pair: Pair, block: int, srcs: list[int], dsts: list[int], what: str
) -> Cache:
    """A fresh cache of ``2 * len(srcs)`` blocks on both sides of ``pair``, then one pull
    into it checked byte for byte; returns the decoder's cache (the caller frees it)."""
    cm, peer = pair
    await peer.cache(_desc(block, 2 * len(srcs)))
    dst = await cm.allocate_blocks_cache(_desc(block, 2 * len(srcs)))
    await cm.pull_blocks(BlocksCacheKey(PEER_ID, 0), dst, srcs, dsts)
    if await asyncio.to_thread(digest, dst, dsts) != await peer.digest(srcs):
        await cm.deallocate_blocks_cache(dst)
        raise AssertionError(f"transfer benchmark: pull_blocks {what} delivered wrong bytes")
    return dst


async def _throughput_row(
    plain: Pair, raw: RawStream, block: int, count: int, tls: Pair | None
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """One ``(B, K)``: check that a pull delivers, then time raw, pull and push rounds
    (and, with ``tls``, pull and push over TLS in the same rounds). Returns the plain
    row and the TLS row (``None`` without ``tls``)."""
    srcs = scattered(count, seed=block + count)
    dsts = scattered(count, seed=block + count + 1)
    key = BlocksCacheKey(PEER_ID, 0)
    nbytes = block * count
    caches: list[tuple[CacheManager, Cache]] = []
    try:
        for name, pair in (("", plain), (" over TLS", tls)):
            if pair is not None:
                caches.append((pair[0], await _checked_pull(pair, block, srcs, dsts, name)))
        contenders: dict[str, Any] = {"raw": lambda: raw.receive(nbytes)}
        for prefix, (cm, dst) in zip(("", "tls_"), caches, strict=False):
            contenders[f"{prefix}pull"] = lambda cm=cm, dst=dst: cm.pull_blocks(
                key, dst, srcs, dsts
            )
            contenders[f"{prefix}push"] = lambda cm=cm, dst=dst: cm.push_blocks(
                key, dst, dsts, srcs
            )
        times = await interleave(contenders, max(3, min(30, (512 * MIB) // nbytes)))
    finally:
        for cm, dst in caches:
            await cm.deallocate_blocks_cache(dst)
    t = {k: median(v) for k, v in times.items()}
    row = {
        "block_kib": block // KIB,
        "count": count,
        "raw_gbps": gbps(nbytes, t["raw"]),
        "pull_gbps": gbps(nbytes, t["pull"]),
        "pull_ratio": t["raw"] / t["pull"],
        "push_gbps": gbps(nbytes, t["push"]),
        "push_ratio": t["raw"] / t["push"],
        "pull_us_per_block": (t["pull"] - t["raw"]) / count * 1e6,
    }
    if tls is None:
        return row, None
    return row, {
        "block_kib": block // KIB,
        "count": count,
        "raw_gbps": row["raw_gbps"],
        "tls_pull_gbps": gbps(nbytes, t["tls_pull"]),
        "tls_pull_ratio": t["raw"] / t["tls_pull"],
        "tls_push_gbps": gbps(nbytes, t["tls_push"]),
        "tls_push_ratio": t["raw"] / t["tls_push"],
        "vs_tcp_pull": t["pull"] / t["tls_pull"],
        "vs_tcp_push": t["push"] / t["tls_push"],
    }


async def _throughput(
    report: Report, plain: Pair, grid: list[tuple[int, int]], tls: Pair | None
) -> None:
    rows = report.table(
        "throughput",
        "pull_blocks / push_blocks over loopback TCP vs a raw socket stream (median rounds)",
    )
    tls_rows = None
    if tls is not None:
        tls_rows = report.table(
            "throughput_tls",
            "the same over TLS, in the same rounds: ratio to the raw stream, vs_tcp = "
            "t_tcp / t_tls",
        )
    async with spawned(lambda: RawStream(max(b * k for b, k in grid))) as raw:
        for block, count in grid:
            row, tls_row = await _throughput_row(plain, raw, block, count, tls)
            rows.append(row)
            if tls_rows is not None and tls_row is not None:
                tls_rows.append(tls_row)


@contextlib.asynccontextmanager
async def _tls_pair() -> AsyncIterator[Pair]:
    """A prompt peer and a decoder linked over TLS, with throwaway certificates."""
    with tempfile.TemporaryDirectory(prefix="aiokv-bench-pki-") as directory:
        pki = await asyncio.to_thread(make_pki, Path(directory))
        async with (
            spawned(lambda: PromptPeer(POOL_BYTES, tls=pki.leaves["a"])) as peer,
            linked(peer, DECODER_ID + 1, POOL_BYTES, tls=pki.leaves["b"]) as decoder,
        ):
            yield decoder.cache_manager, peer


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


def run_transfer_bench(*, quick: bool = False, tls: bool = False) -> Report:
    """``aiokv bench transfer``: throughput, layer-wise overlap (and, without ``quick``,
    overhead), and concurrency, against one prompt peer, in one run.

    Args:
        quick: fewer sizes, 16 layers for the overlap, 400 concurrent pulls, and no
            layer-wise overhead table (``aiokv bench layerwise`` runs it alone).
        tls: also time pull and push over TLS in the throughput rounds (a second peer
            process and decoder, throwaway certificates; needs the ``openssl`` command).
    """
    report = Report("transfer", {"quick": quick, "tls": tls})

    async def main(peer: PromptPeer, decoder: LLMDataDist) -> None:
        cm = decoder.cache_manager
        grid = QUICK if quick else GRID
        if tls:
            async with _tls_pair() as secure:
                await _throughput(report, (cm, peer), grid, secure)
        else:
            await _throughput(report, (cm, peer), grid, None)
        layers = 16 if quick else 32
        await overlap(report, cm, peer, layers=layers, block=64 * KIB, count=32)
        if not quick:
            await overhead(report, cm, peer, rounds=7)
        await _concurrent(report, peer, links=8, transfers=400 if quick else 1000)

    run_remote(main)
    return report
