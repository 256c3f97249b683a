"""Layer-wise transfers: their overhead over one ``push_blocks``, and their overlap
with compute.

* :func:`overhead` (``aiokv bench layerwise``; also part of ``aiokv bench transfer``
  without ``--quick``) — ``transfer_cache_async`` to a prompt peer in a second process,
  with a synchronizer that releases every layer at once, (a) by key
  (``TransferWithCacheKeyConfig`` with a ``BlocksCacheKey``) and (b) by raw addresses
  (``TransferConfig`` with the peer's registered tensor addresses), against ONE
  ``push_blocks`` of the same bytes laid out the same way: every contender moves the
  same contiguous source blocks of every tensor into the same contiguous destination
  blocks (:func:`block_lists`: one run per tensor on each side), and
  ``t_transfer_cache_async / t_push_blocks`` is the cost of sending layer-wise over one
  push (target ≤ 1.1). The layers the engine takes together go in one request, so with
  every layer ready the transfer makes as few as the push; each row says how many one
  transfer made (``by_key_requests``, ``by_addrs_requests``, from the decoder's
  statistics, in the verifying run). Interleaved rounds, medians. Shapes:
  32 layers × K,V of 4,096 blocks of 256 B (64 MiB), and of 256 blocks of 16 KiB
  (256 MiB). After the timed rounds every contender runs once more into a zeroed
  destination and the peer's digest of the destination blocks must equal the digest of
  the source blocks, so a fast wrong result cannot be reported.
* :func:`overlap` (``aiokv bench layerwise`` and ``aiokv bench transfer``) — a
  synchronizer that releases layer i after i + 1 simulated compute steps, each as long
  as one layer's transfer: total time against ``max(compute, transfer)`` (target ≤ 1.1).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

from .. import BlocksCacheKey
from .. import Cache
from .. import CacheDesc
from .. import CacheManager
from .. import DataType
from .. import LayerSynchronizer
from .. import LLMDataDist
from .. import LLMStatusCode
from .. import TransferConfig
from .. import TransferWithCacheKeyConfig
from ._harness import KIB
from ._harness import MIB
from ._harness import PEER_ID
from ._harness import POOL_BYTES
from ._harness import PromptPeer
from ._harness import Report
from ._harness import digest
from ._harness import interleave
from ._harness import median
from ._harness import random_fill
from ._harness import run_remote
from ._harness import time_call
from ._progress import steps

__all__ = [
    "SHAPES",
    "block_lists",
    "overhead",
    "overlap",
    "overlap_setup",
    "requests_to_peer",
    "run_layerwise_bench",
]

#: ``(blocks, block bytes)`` per tensor of the overhead benchmark; 32 layers x K,V.
SHAPES = ((4096, 256), (256, 16 * KIB))
LAYERS = 32


def block_lists(count: int) -> tuple[list[int], list[int]]:
    """The source and destination blocks of every contender of :func:`overhead`.

    Source blocks ``0 .. count-1`` into destination blocks ``count .. 2*count-1`` of a
    cache of ``2 * count`` blocks per tensor: contiguous on both sides, so each tensor is
    one run per side whichever way it is sent, and the destination is not the source's
    own place.
    """
    return list(range(count)), list(range(count, 2 * count))


class ReleaseAll:
    """A LayerSynchronizer whose every layer is ready at once: no compute to wait for."""

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return True


class _Compute:
    """Layer i is ready (i + 1) compute steps of ``step`` seconds after construction.

    The steps stand in for device kernels: they take no host CPU.
    """

    def __init__(self, step: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._start = self._loop.time()
        self._step = step

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        ready = self._start + (layer_index + 1) * self._step
        await asyncio.sleep(max(0.0, ready - self._loop.time()))
        return True


async def _layerwise(
    cm: CacheManager,
    src: Cache,
    sync: LayerSynchronizer,
    configs: Sequence[TransferConfig | TransferWithCacheKeyConfig],
    srcs: Sequence[int] | None,
    dsts: Sequence[int] | None,
) -> None:
    """One ``transfer_cache_async``, awaited to the end.

    Raises:
        RuntimeError: a destination did not report success.
    """
    task = cm.transfer_cache_async(src, sync, configs, srcs, dsts)
    codes = await task
    if codes != [LLMStatusCode.LLM_SUCCESS] * len(configs):
        raise RuntimeError(f"transfer_cache_async failed: {codes}")


def requests_to_peer(decoder: LLMDataDist) -> Callable[[], int]:
    """How many requests ``decoder`` has started to the prompt peer so far."""

    def started() -> int:
        stats = decoder.statistics().links[PEER_ID].requests
        return stats.ops + stats.in_flight

    return started


async def overhead(
    report: Report,
    cm: CacheManager,
    peer: PromptPeer,
    *,
    requests: Callable[[], int],
    rounds: int,
    shapes: Sequence[tuple[int, int]] = SHAPES,
    layers: int = LAYERS,
) -> None:
    """Add the ``layerwise_overhead`` table to ``report``: one row per shape;
    ``requests`` counts the requests made to the peer (:func:`requests_to_peer`).

    Raises:
        AssertionError: a contender left wrong bytes at the destination.
    """
    rows = report.table(
        "layerwise_overhead",
        f"transfer_cache_async (every layer ready at once) vs ONE push_blocks of the same "
        f"bytes, {layers} layers x K,V, the same contiguous blocks (one run per tensor); "
        f"ms = median; ratio = t / t_push_blocks (target <= 1.1); requests = requests one "
        f"layer-wise transfer made (layers taken together go in one; a send over 64 MiB "
        f"is cut into 64 MiB requests, as a push is)",
    )
    with steps("layer-wise overhead", len(shapes)) as part:
        for count, block in shapes:
            with part.step(f"layer-wise overhead {count} x {block} B"):
                row = await _overhead_row(cm, peer, requests, count, block, layers, rounds)
                rows.append(row)


async def _overhead_row(
    cm: CacheManager,
    peer: PromptPeer,
    requests: Callable[[], int],
    count: int,
    block: int,
    layers: int,
    rounds: int,
) -> dict[str, Any]:
    """One shape of :func:`overhead`: time the three contenders, then verify each (and
    count its requests)."""
    key = BlocksCacheKey(PEER_ID, 0)
    desc = CacheDesc(2 * layers, [2 * count, block], DataType.DT_UINT8)
    addrs = await peer.cache(desc)
    src = await cm.allocate_blocks_cache(desc)
    try:
        await asyncio.to_thread(random_fill, src, 1000)
        srcs, dsts = block_lists(count)
        by_key = [TransferWithCacheKeyConfig(key)]
        by_addrs = [TransferConfig(PEER_ID, addrs)]
        contenders: dict[str, Callable[[], object]] = {
            "push_blocks": lambda: cm.push_blocks(key, src, srcs, dsts),
            "by_key": lambda: _layerwise(cm, src, ReleaseAll(), by_key, srcs, dsts),
            "by_addrs": lambda: _layerwise(cm, src, ReleaseAll(), by_addrs, srcs, dsts),
        }
        t = {k: median(v) for k, v in (await interleave(contenders, rounds)).items()}
        want = await asyncio.to_thread(digest, src, srcs)
        made: dict[str, int] = {}
        for name, fn in contenders.items():
            await peer.clear()
            before = requests()
            await time_call(fn)
            made[name] = requests() - before
            if await peer.digest(dsts) != want:
                raise AssertionError(f"layer-wise benchmark: {name} delivered wrong bytes")
    finally:
        await cm.deallocate_blocks_cache(src)
    return {
        "blocks": count,
        "block_bytes": block,
        "mib": 2 * layers * count * block / MIB,
        "push_blocks_ms": t["push_blocks"] * 1e3,
        "by_key_ms": t["by_key"] * 1e3,
        "by_key_ratio": t["by_key"] / t["push_blocks"],
        "by_addrs_ms": t["by_addrs"] * 1e3,
        "by_addrs_ratio": t["by_addrs"] / t["push_blocks"],
        "by_key_requests": made["by_key"],
        "by_addrs_requests": made["by_addrs"],
        "verified": True,
    }


async def overlap_setup(
    cm: CacheManager, peer: PromptPeer, *, layers: int, block: int, count: int
) -> tuple[Cache, list[TransferConfig], list[int]]:
    """The overlap scenario: a new source cache of ``layers`` x K,V x ``count`` blocks of
    ``block`` bytes (the caller deallocates it), the peer's new cache of the same shape
    as the destination by raw addresses, and the blocks moved (all, in order)."""
    desc = CacheDesc(2 * layers, [count, block], DataType.DT_UINT8)
    addrs = await peer.cache(desc)
    src = await cm.allocate_blocks_cache(desc)
    return src, [TransferConfig(PEER_ID, addrs)], list(range(count))


async def overlap(
    report: Report, cm: CacheManager, peer: PromptPeer, *, layers: int, block: int, count: int
) -> None:
    """Add the ``layerwise_overlap`` summary: transfer overlapped with simulated compute."""
    src, cfgs, idx = await overlap_setup(cm, peer, layers=layers, block=block, count=count)
    try:
        alone = await interleave(
            {"transfer": lambda: _layerwise(cm, src, ReleaseAll(), cfgs, idx, idx)}, 3
        )
        transfer = min(alone["transfer"])
        step = transfer / layers  # compute per layer == transfer per layer: the hardest case

        def together() -> Awaitable[None]:
            return _layerwise(cm, src, _Compute(step), cfgs, idx, idx)

        total = median((await interleave({"together": together}, 3))["together"])
    finally:
        await cm.deallocate_blocks_cache(src)
    compute_total = step * layers
    report.summary(
        "layerwise_overlap",
        "layer-wise transfer_cache_async: {layers} layers, {mib:.0f} MiB; transfer alone "
        "{transfer_ms:.1f} ms, compute alone {compute_ms:.1f} ms, together {total_ms:.1f} ms "
        "= {ratio:.2f} x max(compute, transfer)",
        layers=layers,
        mib=2 * layers * count * block / MIB,
        transfer_ms=transfer * 1e3,
        compute_ms=compute_total * 1e3,
        total_ms=total * 1e3,
        ratio=total / max(transfer, compute_total),
    )


def run_layerwise_bench(
    *,
    quick: bool = False,
    shapes: Sequence[tuple[int, int]] = SHAPES,
    layers: int = LAYERS,
    pool_bytes: int = POOL_BYTES,
) -> Report:
    """``aiokv bench layerwise``: :func:`overhead`, then :func:`overlap` (``layers`` x K,V
    x 32 blocks of 64 KiB), in one run, against a new prompt peer.

    Args:
        quick: 2 timed rounds per figure instead of 7 (the shapes stay the same).
        shapes: ``(blocks, block bytes)`` per tensor, one row each.
        layers: layers of K and V.
        pool_bytes: the pool of each side; must hold twice the largest shape, and the
            overlap's cache.

    Raises:
        AssertionError: a contender left wrong bytes at the destination.
    """
    rounds = 2 if quick else 7
    report = Report("layerwise", {"rounds": rounds, "layers": layers})

    async def main(peer: PromptPeer, decoder: LLMDataDist) -> None:
        cm = decoder.cache_manager
        started = requests_to_peer(decoder)
        await overhead(
            report, cm, peer, requests=started, rounds=rounds, shapes=shapes, layers=layers
        )
        await overlap(report, cm, peer, layers=layers, block=64 * KIB, count=32)

    run_remote(main, pool_bytes)
    return report
