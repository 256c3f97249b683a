"""``aiokv bench transfer``: remote transfers through the whole stack, against raw baselines.

In ONE run, with a prompt peer in a second process (spawn) on loopback:

1. ``pull_blocks`` and ``push_blocks`` of K scattered blocks of B bytes, interleaved
   round by round with a raw socket stream of the same bytes (:class:`.raw.RawStream`):
   GB/s, ratio, the overhead per block ``(t - t_raw) / K`` and, after the rounds, the
   tail of :data:`TAIL_PULLS` consecutive pulls (slowest / median: a collector pause
   shows there), each followed by a round of the raw stream, whose tail is reported
   beside it (what the machine did to a stream with no Python in it). A raw stream
   between the same scattered blocks (:class:`.raw.RawBlocks`: blocking ``writev`` /
   ``readv``, no protocol) runs in the same rounds: the kernel's floor for those
   blocks. Per block size, the *slope* between consecutive block counts: the overhead
   each added block costs, ``Δ(t - t_raw) / ΔK`` (the per-call cost cancels out;
   growth with the count shows as a rising slope). A pull into a zeroed cache is
   checked byte for byte (digests) before the timed rounds. With ``--tls``, a second
   prompt peer and decoder linked over TLS (a throwaway CA and
   certificate pair made at the start) join the same rounds: a second table with their
   GB/s, their ratio to the raw stream and to plain TCP. With ``--backend nixl``, aiokv
   over NIXL and raw NIXL, each with UCX's default (shared memory / CMA) and with UCX
   over loopback TCP (:mod:`.nixl`), and a one-thread ``memcpy`` of the same scattered
   blocks join the same rounds: a table of GB/s and one of ratios (aiokv-nixl / raw
   NIXL per UCX setting; the fastest path / memcpy). With ``--peers``, Mooncake
   Transfer Engine over TCP (:mod:`.mooncake`) READs and WRITEs the same blocks in the
   same rounds: a table of GB/s and one of ratios (aiokv pull / push vs Mooncake).
2. Layer-wise ``transfer_cache_async`` overlapped with simulated compute
   (:func:`.layerwise.overlap`) and, without ``--quick``, its overhead over one
   ``push_blocks`` (:func:`.layerwise.overhead`, also ``aiokv bench layerwise``).
3. 1,000 concurrent small pulls over 8 links: all must succeed byte-exact; p50/p99.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import tempfile
import time
from collections.abc import AsyncIterator
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from .. import BlocksCacheKey
from .. import Cache
from .. import CacheDesc
from .. import CacheManager
from .. import DataType
from .. import LLMDataDist
from .._copy import host_empty
from ..transport import get_transport
from ._harness import DECODER_ID
from ._harness import KIB
from ._harness import MIB
from ._harness import PEER_ID
from ._harness import POOL_BYTES
from ._harness import Backend
from ._harness import PromptPeer
from ._harness import Report
from ._harness import digest
from ._harness import gbps
from ._harness import interleave
from ._harness import linked
from ._harness import median
from ._harness import run_remote
from ._harness import scattered
from ._harness import spawned
from ._harness import time_call
from ._pki import make_pki
from ._progress import steps
from .layerwise import overhead
from .layerwise import overlap
from .layerwise import requests_to_peer
from .mooncake import Peers
from .mooncake import missing
from .mooncake import mooncake_contenders
from .nixl import NixlContenders
from .nixl import nixl_contenders
from .raw import RawBlocks
from .raw import RawStream
from .remote import RemotePeer
from .remote import RemoteRawStream

__all__ = ["run_transfer_bench"]

#: (block bytes, blocks) of each row: per block size, its block counts
GRID = [
    (block, count)
    for block, counts in (
        (4 * KIB, (1024, 4096, 16384)),
        (16 * KIB, (256, 1024, 4096, 16384)),
        (64 * KIB, (64, 1024)),
        (256 * KIB, (256,)),
        (1 * MIB, (64, 128)),
    )
    for count in counts
]
QUICK = [(16 * KIB, 1024), (64 * KIB, 256), (1 * MIB, 64)]
#: Consecutive pulls timed after each row's rounds, for the tail figure.
TAIL_PULLS = 20
#: The rows the per-block summary covers: blocks of 4-16 KiB, 1,024-16,384 of them.
_PER_BLOCK_SIZES, _PER_BLOCK_COUNTS = (4 * KIB, 16 * KIB), (1024, 16384)


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


class _Memcpy:
    """One thread copying ``len(srcs)`` scattered blocks of one buffer into scattered
    blocks of another, one ``memmove`` per block: the same bytes without a second
    process, the ceiling of every same-host path."""

    def __init__(self, block: int, srcs: list[int], dsts: list[int]) -> None:
        n, cpu = 2 * len(srcs) * block, torch.device("cpu")
        self._src = host_empty(n, cpu).fill_(0xA5)  # allocated as the pools are
        self._dst = host_empty(n, cpu).fill_(0)  # every page touched
        sa, da = self._src.data_ptr(), self._dst.data_ptr()
        self._block = block
        self._pairs = [(da + d * block, sa + s * block) for s, d in zip(srcs, dsts, strict=True)]

    def __call__(self) -> None:
        move, block = ctypes.memmove, self._block
        for dst, src in self._pairs:
            move(dst, src, block)


#: The paths of the NIXL table, in its column order (``memcpy`` first, then transfers).
_PATHS = ("memcpy", "socket", "tcp_pull", "tcp_push")


def _nixl_rows(
    t: dict[str, float], nbytes: int, block: int, count: int, build_ms: dict[str, float]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The GB/s row and the ratio row of one ``(B, K)`` from its median times."""
    t = {**t, "socket": t["raw"], "tcp_pull": t["pull"], "tcp_push": t["push"]}
    settings = list(build_ms)
    paths = [*_PATHS] + [
        f"{u}_{p}" for u in settings for p in ("pull", "push", "raw_read", "raw_write")
    ]
    speeds: dict[str, Any] = {"block_kib": block // KIB, "count": count}
    speeds.update({p: gbps(nbytes, t[p]) for p in paths})
    fastest = min(paths[1:], key=lambda p: t[p])
    aiokv = min(
        (p for p in paths[1:] if not p.startswith(("socket", *(f"{u}_raw" for u in settings)))),
        key=lambda p: t[p],
    )
    ratios: dict[str, Any] = {"block_kib": block // KIB, "count": count}
    for u in settings:
        ratios[f"{u}_read"] = t[f"{u}_raw_read"] / t[f"{u}_pull"]
        ratios[f"{u}_write"] = t[f"{u}_raw_write"] / t[f"{u}_push"]
    for u in settings:
        ratios[f"{u}_build_ms"] = build_ms[u]
    ratios.update(
        fastest=fastest,
        fastest_vs_memcpy=t["memcpy"] / t[fastest],
        best_aiokv=aiokv,
        best_aiokv_vs_memcpy=t["memcpy"] / t[aiokv],
        verified=True,
    )
    return speeds, ratios


async def _throughput_row(
    plain: Pair,
    raw: RawStream,
    raw_blocks: RawBlocks | None,
    block: int,
    count: int,
    tls: Pair | None,
    nixl: NixlContenders | None,
    peers: Peers,
) -> tuple[dict[str, Any], dict[str, Any] | None, tuple[dict[str, Any], dict[str, Any]] | None]:
    """One ``(B, K)``: check that every pull delivers, then time raw, pull and push
    rounds (and, with ``tls``, ``nixl`` or ``peers``, theirs in the same rounds). Returns
    the plain row, the TLS row and the NIXL rows (``None`` without them); ``peers`` adds
    its rows to its own tables."""
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
        if raw_blocks is not None:
            await asyncio.to_thread(raw_blocks.blocks, block, srcs, dsts)
            contenders["raw_blocks"] = raw_blocks.receive
        for prefix, (cm, dst) in zip(("", "tls_"), caches, strict=False):
            contenders[f"{prefix}pull"] = lambda cm=cm, dst=dst: cm.pull_blocks(
                key, dst, srcs, dsts
            )
            contenders[f"{prefix}push"] = lambda cm=cm, dst=dst: cm.push_blocks(
                key, dst, dsts, srcs
            )
        if nixl is not None:
            await nixl.row(block, srcs, dsts)
            contenders["memcpy"] = _Memcpy(block, srcs, dsts)
            contenders.update(nixl.contenders())
        await peers.row(block, srcs, dsts)
        contenders.update(peers.contenders())
        times = await interleave(contenders, max(3, min(30, (512 * MIB) // nbytes)))
        tail, raw_tail = await _tails(contenders)
    finally:
        for cm, dst in caches:
            await cm.deallocate_blocks_cache(dst)
    t = {k: median(v) for k, v in times.items()}
    peers.add(t, block, count)
    row = {
        "block_kib": block // KIB,
        "count": count,
        "raw_gbps": gbps(nbytes, t["raw"]),
        "pull_gbps": gbps(nbytes, t["pull"]),
        "pull_ratio": t["raw"] / t["pull"],
        "push_gbps": gbps(nbytes, t["push"]),
        "push_ratio": t["raw"] / t["push"],
        "pull_us_per_block": (t["pull"] - t["raw"]) / count * 1e6,
        "push_us_per_block": (t["push"] - t["raw"]) / count * 1e6,
        "pull_tail": max(tail) / median(tail),
        "raw_tail": max(raw_tail) / median(raw_tail),
    }
    if "raw_blocks" in t:  # the kernel's floor for these blocks: their raw stream
        row |= {
            "raw_blocks_gbps": gbps(nbytes, t["raw_blocks"]),
            "raw_blocks_us_per_block": (t["raw_blocks"] - t["raw"]) / count * 1e6,
            "pull_vs_raw_blocks": t["raw_blocks"] / t["pull"],
            "push_vs_raw_blocks": t["raw_blocks"] / t["push"],
        }
    nixl_rows = None
    if nixl is not None:
        nixl_rows = _nixl_rows(t, nbytes, block, count, await nixl.build_ms())
    if tls is None:
        return row, None, nixl_rows
    return (
        row,
        {
            "block_kib": block // KIB,
            "count": count,
            "raw_gbps": row["raw_gbps"],
            "tls_pull_gbps": gbps(nbytes, t["tls_pull"]),
            "tls_pull_ratio": t["raw"] / t["tls_pull"],
            "tls_push_gbps": gbps(nbytes, t["tls_push"]),
            "tls_push_ratio": t["raw"] / t["tls_push"],
            "vs_tcp_pull": t["pull"] / t["tls_pull"],
            "vs_tcp_push": t["push"] / t["tls_push"],
        },
        nixl_rows,
    )


async def _throughput(
    report: Report,
    plain: Pair,
    grid: list[tuple[int, int]],
    tls: Pair | None,
    nixl: NixlContenders | None,
    raw_stream: Callable[[int], RawStream],
    peers: Peers,
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
    nixl_rows = nixl_ratios = None
    if nixl is not None:
        nixl_rows = report.table(
            "nixl",
            "the same bytes, same rounds, GB/s: one-thread memcpy; raw socket; aiokv tcp; "
            "per UCX setting (shm: UCX default, shared memory/CMA; utcp: UCX_TLS=tcp,self "
            "on lo) aiokv-nixl pull/push and raw NIXL READ/WRITE",
        )
        nixl_ratios = report.table(
            "nixl_ratios",
            "aiokv-nixl / raw NIXL (t_raw / t_aiokv; read: pull, write: push) per UCX "
            "setting; raw build_ms: initialize_xfer per transfer; fastest path / memcpy",
        )
    most = max(b * k for b, k in grid)
    async with contextlib.AsyncExitStack() as stack:
        raw = await stack.enter_async_context(spawned(lambda: raw_stream(most)))
        raw_blocks = None
        if raw_stream is RawStream:  # (not across hosts)
            raw_blocks = await stack.enter_async_context(spawned(lambda: RawBlocks(most)))
        with steps("throughput", len(grid)) as part:
            for block, count in grid:
                with part.step(f"throughput {block // KIB} KiB x {count}"):
                    row, tls_row, nixl_row = await _throughput_row(
                        plain, raw, raw_blocks, block, count, tls, nixl, peers
                    )
                rows.append(row)
                if tls_rows is not None and tls_row is not None:
                    tls_rows.append(tls_row)
                if nixl_rows is not None and nixl_ratios is not None and nixl_row is not None:
                    nixl_rows.append(nixl_row[0])
                    nixl_ratios.append(nixl_row[1])
    _per_block(report, rows)
    peers.summarize()
    if nixl_ratios:
        report.summary(
            "nixl_summary",
            "aiokv-nixl / raw NIXL, worst row: shm read {shm_read:.2f} write {shm_write:.2f}, "
            "utcp read {utcp_read:.2f} write {utcp_write:.2f} (target >= 0.9); fastest "
            "same-host path / memcpy, best row: {fastest_vs_memcpy:.2f} (goal >= 0.6)",
            **{
                k: min(r[k] for r in nixl_ratios)
                for k in ("shm_read", "shm_write", "utcp_read", "utcp_write")
            },
            fastest_vs_memcpy=max(r["fastest_vs_memcpy"] for r in nixl_ratios),
        )


async def _tails(contenders: dict[str, Any]) -> tuple[list[float], list[float]]:
    """:data:`TAIL_PULLS` pulls, each followed by a round of the raw stream of the same
    blocks (``raw_blocks``; ``raw`` across hosts): their times, so that the pulls' tail
    reads against what the machine itself did to a raw stream meanwhile."""
    raw = contenders.get("raw_blocks", contenders["raw"])
    tail: list[float] = []
    raw_tail: list[float] = []
    for _ in range(TAIL_PULLS):
        tail.append(await time_call(contenders["pull"]))
        raw_tail.append(await time_call(raw))
    return tail, raw_tail


def _per_block(report: Report, rows: list[dict[str, Any]]) -> None:
    """The slope table (per block size, the overhead per added block between
    consecutive counts) and the summary of the per-block goals over the rows of 4-16 KiB
    blocks at 1,024-16,384 blocks: slope, ratio to the raw stream (and, where measured,
    to the raw stream between the same blocks, the kernel's floor), tail."""
    slopes = _slopes(rows)
    if slopes:
        report.table(
            "per_block",
            "overhead per added block, us: d(t - t_raw) / dK between consecutive block "
            "counts of one block size (the per-call cost cancels out)",
        ).extend(slopes)
    sizes = {b // KIB for b in _PER_BLOCK_SIZES}
    lo, hi = _PER_BLOCK_COUNTS
    picked = [r for r in rows if r["block_kib"] in sizes and lo <= r["count"] <= hi]
    steep = [r for r in slopes if r["block_kib"] in sizes and lo <= r["from"] and r["to"] <= hi]
    if not picked:
        return
    floor_text, floor = _against_floor(picked)
    report.summary(
        "per_block_goals",
        "4-16 KiB x 1,024-16,384 blocks, worst row: slope pull {slope_pull:.2f} push "
        "{slope_push:.2f} us/block (goal <= 0.5); vs raw stream pull {pull_ratio:.2f} push "
        "{push_ratio:.2f} (goal >= 0.9)" + floor_text + "; tail of {pulls} pulls {tail:.2f} x "
        "median (goal <= 1.3; the raw stream's, same rounds: {raw_tail:.2f})",
        slope_pull=max((r["pull_us"] for r in steep), default=float("nan")),
        slope_push=max((r["push_us"] for r in steep), default=float("nan")),
        pull_ratio=min(r["pull_ratio"] for r in picked),
        push_ratio=min(r["push_ratio"] for r in picked),
        pulls=TAIL_PULLS,
        tail=max(r["pull_tail"] for r in picked),
        raw_tail=max(r["raw_tail"] for r in picked),
        **floor,
    )


def _against_floor(picked: list[dict[str, Any]]) -> tuple[str, dict[str, float]]:
    """The summary's part on the raw stream between the same blocks (the kernel's floor)
    and its values, worst of ``picked``; nothing where it was not measured (across
    hosts)."""
    if not all("pull_vs_raw_blocks" in r for r in picked):
        return "", {}
    return (
        "; vs the same blocks' raw stream (itself {floor:.2f} of the raw stream) pull "
        "{pull_floor:.2f} push {push_floor:.2f}",
        {
            "floor": min(r["raw_blocks_gbps"] / r["raw_gbps"] for r in picked),
            "pull_floor": min(r["pull_vs_raw_blocks"] for r in picked),
            "push_floor": min(r["push_vs_raw_blocks"] for r in picked),
        },
    )


def _slopes(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per pair of consecutive rows of one block size (more blocks in the second): the
    overhead each added block costs, ``d(t - t_raw) / dK``, per contender measured."""
    slopes: list[dict[str, Any]] = []
    for a, b in itertools.pairwise(rows):
        if a["block_kib"] != b["block_kib"] or b["count"] <= a["count"]:
            continue
        span = b["count"] - a["count"]
        slope = {
            f"{op}_us": (
                b[f"{op}_us_per_block"] * b["count"] - a[f"{op}_us_per_block"] * a["count"]
            )
            / span
            for op in ("pull", "push", "raw_blocks")
            if f"{op}_us_per_block" in b
        }
        slopes.append({"block_kib": b["block_kib"], "from": a["count"], "to": b["count"]} | slope)
    return slopes


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
            bar.advance()
            if not torch.equal(dst.tensors[0][2 * slot], want[src[0]]):
                bad += 1

        t0 = time.perf_counter()
        # i // links < 128: every pull of one link lands in its own pair of blocks
        with steps(f"{transfers} concurrent pulls", transfers) as bar:
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


def run_transfer_bench(
    *,
    quick: bool = False,
    tls: bool = False,
    backend: Backend = "tcp",
    connect: tuple[str, int] | None = None,
    peers: bool = False,
) -> Report:
    """``aiokv bench transfer``: throughput, layer-wise overlap (and, without ``quick``,
    overhead), and concurrency, against one prompt peer, in one run.

    Args:
        quick: fewer sizes, 16 layers for the overlap, 400 concurrent pulls, and no
            layer-wise overhead table (``aiokv bench layerwise`` runs it alone).
        tls: also time pull and push over TLS in the throughput rounds (a second peer
            process and decoder, throwaway certificates; needs the ``openssl`` command).
        backend: ``"nixl"``: also aiokv over NIXL, raw NIXL and memcpy in the throughput
            rounds (:mod:`.nixl`: eight more processes).
        connect: ``(host, port)`` of ``aiokv bench transfer --listen`` (:mod:`.remote`):
            the prompt peer and the raw stream's sender are there instead of in child
            processes here (neither ``tls`` nor ``backend="nixl"`` then).
        peers: also the other engines installed here in the throughput rounds: Mooncake
            Transfer Engine over TCP (:mod:`.mooncake`: two more processes).

    Raises:
        ValueError: ``connect`` with ``tls``, ``backend="nixl"`` or ``peers``.
        RuntimeError: ``peers`` without Mooncake installed (the message names the fix).
        OSError: the listener cannot be reached.
        LLMException: ``backend="nixl"`` without NIXL installed (``LLM_FEATURE_NOT_ENABLED``,
            naming ``pip install 'aiokv[nixl]'``).
    """
    if connect is not None and (tls or backend != "tcp" or peers):
        raise ValueError("--connect runs plain TCP only: no --tls, --backend nixl or --peers")
    if peers and (why := missing()) is not None:
        raise RuntimeError(why)
    if backend == "nixl":
        get_transport("nixl")  # NIXL missing: fail now, with the install hint
    meta: dict[str, object] = {"quick": quick, "tls": tls, "backend": backend, "peers": peers}
    start: Callable[[], PromptPeer] | None = None
    raw_stream: Callable[[int], RawStream] = RawStream
    if connect is not None:
        host, port = connect
        meta["connect"] = f"{host}:{port}"
        start = partial(RemotePeer, host, port)
        raw_stream = partial(RemoteRawStream, host, port)
    report = Report("transfer", meta)

    async def main(peer: PromptPeer, decoder: LLMDataDist) -> None:
        cm = decoder.cache_manager
        grid = QUICK if quick else GRID
        async with contextlib.AsyncExitStack() as stack:
            secure = await stack.enter_async_context(_tls_pair()) if tls else None
            nixl, others = None, Peers()
            raw_bytes = 2 * max(b * k for b, k in grid)
            if backend == "nixl":
                nixl = await stack.enter_async_context(nixl_contenders(POOL_BYTES, raw_bytes))
            if peers:
                others = await stack.enter_async_context(mooncake_contenders(report, raw_bytes))
            await _throughput(report, (cm, peer), grid, secure, nixl, raw_stream, others)
        layers = 16 if quick else 32
        await overlap(report, cm, peer, layers=layers, block=64 * KIB, count=32)
        if not quick:
            await overhead(report, cm, peer, requests=requests_to_peer(decoder), rounds=7)
        await _concurrent(report, peer, links=8, transfers=400 if quick else 1000)

    run_remote(main, start=start)
    return report
