"""``aiokv bench transfer``: remote transfers through the whole stack, against raw baselines.

In ONE run, with a prompt peer in a second process (spawn) on loopback:

1. ``pull_blocks`` and ``push_blocks`` of K scattered blocks of B bytes, next to a raw
   socket stream of the same bytes (blocking ``sendall``/``recv_into``, measured in the
   same run by :func:`aiokv._bench.raw.raw_stream_gbps`): GB/s, ratio, and the
   per-block overhead ``(t_aiokv - t_raw) / K``.
2. Layer-wise ``transfer_cache_async`` with a synchronizer that releases one layer per
   simulated compute step: total time against ``max(compute, transfer)``.
3. 1,000 concurrent small pulls over 8 links: all must succeed byte-exact; p50/p99.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import random
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from .. import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    TransferConfig,
)
from .raw import raw_stream_gbps

KIB, MIB = 1 << 10, 1 << 20
PEER, ME = 1, 2
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


def _config(pool: int) -> LLMConfig:
    return LLMConfig(
        device_type="cpu",
        enable_cache_manager=True,
        listen_ip_info="127.0.0.1:0",
        mem_pool_cfg=f'{{"memory_size": {pool}, "page_shift": 16}}',
        enable_remote_cache_accessible=True,
        sync_kv_timeout=60_000,
    )


def _desc(block: int, nblocks: int, tensors: int = 1) -> CacheDesc:
    return CacheDesc(tensors, [nblocks, block], DataType.DT_UINT8)


async def _peer_main(conn: Connection, pool: int) -> None:
    async with LLMDataDist(LLMRole.PROMPT, PEER, _config(pool)) as dd:
        assert dd.listen_address is not None
        conn.send(dd.listen_address[1])
        cache = None
        while True:
            cmd, *args = await asyncio.to_thread(conn.recv)
            if cmd == "stop":
                return
            if cache is not None:
                await dd.cache_manager.deallocate_blocks_cache(cache)
            desc: CacheDesc = args[0]
            cache = await dd.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(PEER, 0))
            for i, t in enumerate(cache.tensors):
                t.copy_(
                    torch.randint(
                        0,
                        256,
                        t.shape,
                        dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(i),
                    )
                )
            conn.send(cache.tensor_addrs)


def _peer(conn: Connection, pool: int) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(_peer_main(conn, pool))
    else:
        uvloop.run(_peer_main(conn, pool))


class _Peer:
    def __init__(self, pool: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_peer, args=(child, pool), daemon=True)
        self.proc.start()
        self.port: int = self.conn.recv()

    async def cache(self, desc: CacheDesc) -> list[int]:
        self.conn.send(("cache", desc))
        addrs: list[int] = await asyncio.to_thread(self.conn.recv)
        return addrs

    def stop(self) -> None:
        self.conn.send(("stop",))
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def _typical(times: list[float]) -> float:
    """The median round: the raw baseline reports its median too."""
    return statistics.median(times)


async def _throughput(
    peer: _Peer, dd: LLMDataDist, grid: list[tuple[int, int]]
) -> list[dict[str, Any]]:
    cm = dd.cache_manager
    rows = []
    for block, count in grid:
        nblocks = 2 * count  # scattered: every other block, shuffled
        await peer.cache(_desc(block, nblocks))
        dst = await cm.allocate_blocks_cache(_desc(block, nblocks))
        rng = random.Random(block + count)
        srcs = rng.sample(range(nblocks), count)
        dsts = rng.sample(range(nblocks), count)
        nbytes = block * count
        repeat = max(3, min(30, (512 * MIB) // nbytes))
        key = BlocksCacheKey(PEER, 0)
        await cm.pull_blocks(key, dst, srcs, dsts)  # warm up
        pulls, pushes = [], []
        for _ in range(repeat):
            t0 = time.perf_counter()
            await cm.pull_blocks(key, dst, srcs, dsts)
            pulls.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await cm.push_blocks(key, dst, dsts, srcs)
            pushes.append(time.perf_counter() - t0)
        raw = await asyncio.to_thread(raw_stream_gbps, nbytes, repeat=repeat)
        t_raw = nbytes / (raw * 1e9)
        t_pull, t_push = _typical(pulls), _typical(pushes)
        rows.append(
            {
                "block": block,
                "count": count,
                "raw": raw,
                "pull": nbytes / t_pull / 1e9,
                "push": nbytes / t_push / 1e9,
                "pull_ratio": t_raw / t_pull,
                "push_ratio": t_raw / t_push,
                "pull_us_per_block": (t_pull - t_raw) / count * 1e6,
            }
        )
        await cm.deallocate_blocks_cache(dst)
    return rows


class _Compute:
    """Releases layer i after (i + 1) compute steps of ``step`` seconds."""

    def __init__(self, layers: int, step: float) -> None:
        self.ready = [asyncio.Event() for _ in range(layers)]
        self.step = step

    async def run(self) -> None:
        for ev in self.ready:
            await asyncio.sleep(self.step)  # stands in for a device kernel: no host CPU
            ev.set()

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        await self.ready[layer_index].wait()
        return True


async def _layerwise(
    peer: _Peer, dd: LLMDataDist, layers: int, block: int, count: int
) -> dict[str, Any]:
    desc = CacheDesc(2 * layers, [count, block], DataType.DT_UINT8)
    addrs = await peer.cache(desc)
    src = await dd.cache_manager.allocate_blocks_cache(desc)
    idx = list(range(count))
    cfgs = [TransferConfig(PEER, addrs)]

    class Ready:
        def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
            return True

    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        task = await dd.cache_manager.transfer_cache_async(src, Ready(), cfgs, idx, idx)
        got = await task
        assert got == [0], got
        times.append(time.perf_counter() - t0)
    transfer = min(times)
    step = transfer / layers  # compute per layer == transfer per layer: the hardest case
    totals = []
    for _ in range(3):
        compute = _Compute(layers, step)
        t0 = time.perf_counter()
        task = await dd.cache_manager.transfer_cache_async(src, compute, cfgs, idx, idx)
        await compute.run()
        assert await task == [0]
        totals.append(time.perf_counter() - t0)
    total = statistics.median(totals)
    compute_total = step * layers
    await dd.cache_manager.deallocate_blocks_cache(src)
    return {
        "layers": layers,
        "bytes": 2 * layers * count * block,
        "transfer": transfer,
        "compute": compute_total,
        "total": total,
        "ratio": total / max(transfer, compute_total),
    }


async def _concurrent(peer: _Peer, links: int, transfers: int) -> dict[str, Any]:
    block, nblocks = 16 * KIB, 256
    await peer.cache(_desc(block, nblocks))
    want = torch.randint(
        0, 256, (nblocks, block), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    ds = [LLMDataDist(LLMRole.DECODER, 100 + i, _config(64 * MIB)) for i in range(links)]
    for d in ds:
        await d.init(_config(64 * MIB))
        info = LLMClusterInfo(remote_cluster_id=PEER, remote_ip_info=[("127.0.0.1", peer.port)])
        code, _ = await d.link_clusters([info])
        assert code == 0
    try:
        caches = [await d.cache_manager.allocate_blocks_cache(_desc(block, nblocks)) for d in ds]
        lat: list[float] = []
        bad = 0

        async def one(i: int) -> None:
            nonlocal bad
            d, dst = ds[i % links], caches[i % links]
            slot = (i // links) % (nblocks // 2)
            src = [(7 * i) % nblocks, (7 * i + 1) % nblocks]
            t0 = time.perf_counter()
            await d.cache_manager.pull_blocks(
                BlocksCacheKey(PEER, 0), dst, src, [2 * slot, 2 * slot + 1]
            )
            lat.append(time.perf_counter() - t0)
            if not torch.equal(dst.tensors[0][2 * slot], want[src[0]]):
                bad += 1

        t0 = time.perf_counter()
        # i // links < 128: every pull of one link lands in its own pair of blocks
        await asyncio.gather(*(one(i) for i in range(transfers)))
        wall = time.perf_counter() - t0
    finally:
        for d in ds:
            await d.finalize()
    lat.sort()
    return {
        "transfers": transfers,
        "links": links,
        "completed": len(lat),
        "wall": wall,
        "p50": lat[len(lat) // 2] * 1e3,
        "p99": lat[int(len(lat) * 0.99) - 1] * 1e3,
        "mismatches": bad,
    }


async def run(quick: bool = False) -> None:
    """Run the three measurements and print tables."""
    console = Console()
    grid = QUICK if quick else GRID
    pool = 1 << 30
    peer = _Peer(pool)
    try:
        async with LLMDataDist(LLMRole.DECODER, ME, _config(pool)) as dd:
            info = LLMClusterInfo(remote_cluster_id=PEER, remote_ip_info=[("127.0.0.1", peer.port)])
            code, _ = await dd.link_clusters([info])
            assert code == 0, code
            rows = await _throughput(peer, dd, grid)
            table = Table(
                title="pull_blocks / push_blocks over loopback TCP vs a raw socket stream"
            )
            for col in (
                "block",
                "blocks",
                "raw GB/s",
                "pull GB/s",
                "pull/raw",
                "push GB/s",
                "push/raw",
                "pull µs/block over raw",
            ):
                table.add_column(col, justify="right")
            for r in rows:
                table.add_row(
                    f"{r['block'] // KIB} KiB",
                    str(r["count"]),
                    f"{r['raw']:.2f}",
                    f"{r['pull']:.2f}",
                    f"{r['pull_ratio']:.2f}",
                    f"{r['push']:.2f}",
                    f"{r['push_ratio']:.2f}",
                    f"{r['pull_us_per_block']:.2f}",
                )
            console.print(table)
            layers = 16 if quick else 32
            lw = await _layerwise(peer, dd, layers=layers, block=64 * KIB, count=32)
            console.print(
                f"layer-wise transfer_cache_async: {lw['layers']} layers, "
                f"{lw['bytes'] / MIB:.0f} MiB; "
                f"transfer alone {lw['transfer'] * 1e3:.1f} ms, compute alone "
                f"{lw['compute'] * 1e3:.1f} ms, together {lw['total'] * 1e3:.1f} ms = "
                f"{lw['ratio']:.2f} x max(compute, transfer)"
            )
        cc = await _concurrent(peer, links=8, transfers=400 if quick else 1000)
        console.print(
            f"concurrent: {cc['completed']}/{cc['transfers']} pulls over {cc['links']} links "
            f"completed in {cc['wall'] * 1e3:.0f} ms, p50 {cc['p50']:.2f} ms, "
            f"p99 {cc['p99']:.2f} ms, byte mismatches {cc['mismatches']}"
        )
    finally:
        peer.stop()
