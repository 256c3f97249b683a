"""``aiokv bench device``: caches in accelerator memory over TCP (host staging), against
a raw pipeline of the same bytes, in one run.

A decoder here with its pool on the accelerator, linked to two prompt peers in spawned
processes on loopback: one with its pool in host memory, one on the accelerator. For
each ``(B, K)`` — K scattered blocks of B bytes — and round by round, interleaved:

* ``raw``: the baseline a user would write by hand: a raw socket stream of the same
  bytes received into host memory (:class:`.raw.RawStream`), then ONE copy of that many
  bytes from pinned host memory to the device (``cudaMemcpy`` through torch), waited for.
* ``socket``: the raw socket stream alone (the bound: what loopback TCP moves).
* ``pull`` / ``push``: ``pull_blocks`` into / ``push_blocks`` from the decoder's device
  cache, peer in host memory (staging on this side only).
* ``pull_dd`` / ``push_dd``: the same with the peer's cache on the device too (staging
  on both sides).
* ``pull_host``: for reference, ``pull_blocks`` between host caches (no staging), the
  same bytes: what staging costs on top of the plain path.

Every pull is checked byte for byte (digests) before the timed rounds. The table gives
GB/s and each contender's ratio to ``raw``; the goal (issue #10) is ≥ 0.85.

``--backend nixl`` runs :mod:`.device_nixl` instead: device caches over NIXL (VRAM)
against raw NIXL.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from .. import BlocksCacheKey
from .. import CacheDesc
from .. import DataType
from .. import LLMException
from .. import LLMStatusCode
from .._copy import resolve_device
from ..transport import get_transport
from ._harness import DECODER_ID
from ._harness import KIB
from ._harness import MIB
from ._harness import PEER_ID
from ._harness import Backend
from ._harness import DeviceKind
from ._harness import PromptPeer
from ._harness import Report
from ._harness import digest
from ._harness import gbps
from ._harness import interleave
from ._harness import linked
from ._harness import median
from ._harness import run_loop
from ._harness import scattered
from ._harness import spawned
from .raw import RawStream

__all__ = ["run_device_bench"]

GRID = [(16 * KIB, 1024), (64 * KIB, 1024), (256 * KIB, 256), (1 * MIB, 128), (64 * KIB, 4096)]
QUICK = [(64 * KIB, 256), (1 * MIB, 32)]
POOL = 1 << 30


def run_device_bench(
    *, quick: bool = False, device_type: str = "cuda", backend: Backend = "tcp"
) -> Report:
    """``aiokv bench device`` (see the module docstring); with ``backend="nixl"``, the
    NIXL mode instead (:mod:`.device_nixl`: CUDA only, ``device_type`` is ignored).

    Raises:
        LLMException: ``LLM_FEATURE_NOT_ENABLED`` when ``device_type`` has no device here,
            or, for ``backend="nixl"``, when NIXL is not installed (naming
            ``pip install 'aiokv[nixl]'``).
    """
    if backend == "nixl":
        get_transport("nixl")  # NIXL missing: fail now, with the install hint
        device_type = "cuda"  # NIXL registers CUDA memory only
    try:
        device = resolve_device(device_type, 0)
    except LLMException as exc:  # the command prints "aiokv bench device: " before this
        why = str(exc).removeprefix("resolve_device: ")
        raise LLMException(
            f"needs an accelerator: {why} (aiokv info lists this machine's devices)",
            status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
        ) from None
    kind: DeviceKind = "npu" if device.type == "npu" else "cuda"
    grid = QUICK if quick else GRID
    if backend == "nixl":
        from .device_nixl import run_device_nixl_bench

        name = torch.cuda.get_device_name(device)
        return run_device_nixl_bench(grid, {"quick": quick, "device": str(device)}, name)
    report = Report("device", {"quick": quick, "device": str(device)})
    top = max(b * k for b, k in grid)

    async def main() -> None:
        async with (
            spawned(lambda: PromptPeer(POOL)) as host_peer,
            spawned(lambda: PromptPeer(POOL, device_type=kind)) as dev_peer,
            spawned(lambda: RawStream(top)) as raw,
            linked(host_peer, DECODER_ID, POOL, device_type=kind) as d1,
            linked(dev_peer, DECODER_ID + 1, POOL, device_type=kind) as d2,
            linked(host_peer, DECODER_ID + 2, POOL) as d3,
        ):
            pinned = torch.empty(top, dtype=torch.uint8, pin_memory=True)
            target = torch.empty(top, dtype=torch.uint8, device=device)
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
            rows = report.table("device", f"device caches over TCP on {name}")
            for block, count in grid:
                rows.append(
                    await _row(
                        block, count, (d1, host_peer), (d2, dev_peer), raw, pinned, target, d3
                    )
                )

    run_loop(main)
    report.summary(
        "baseline",
        "ratios are against receiving the bytes from a raw socket and then copying them "
        "host→device in one pinned cudaMemcpy; goal ≥ 0.85",
    )
    return report


async def _row(
    block: int,
    count: int,
    host_side: tuple[Any, PromptPeer],
    dev_side: tuple[Any, PromptPeer],
    raw: RawStream,
    pinned: torch.Tensor,
    target: torch.Tensor,
    plain: Any,
) -> dict[str, Any]:
    nbytes = block * count
    srcs = scattered(count, seed=block + count)
    dsts = scattered(count, seed=block + count + 1)
    desc = CacheDesc(1, [2 * count, block], DataType.DT_UINT8)
    key = BlocksCacheKey(PEER_ID, 0)
    caches = []
    contenders: dict[str, Any] = {}
    for suffix, (dd, peer) in (
        ("", host_side),
        ("_dd", dev_side),
        ("_host", (plain, host_side[1])),
    ):
        cm = dd.cache_manager
        if suffix != "_host":  # the host peer's cache serves both of its decoders
            await peer.cache(desc)
        dst = await cm.allocate_blocks_cache(desc)
        caches.append((cm, dst))
        await cm.pull_blocks(key, dst, srcs, dsts)
        if await asyncio.to_thread(digest, dst, dsts) != await peer.digest(srcs):
            raise AssertionError(f"device benchmark: pull{suffix} delivered wrong bytes")
        contenders[f"pull{suffix}"] = lambda cm=cm, dst=dst: cm.pull_blocks(key, dst, srcs, dsts)
        if suffix != "_host":
            contenders[f"push{suffix}"] = lambda cm=cm, dst=dst: cm.push_blocks(
                key, dst, dsts, srcs
            )

    def baseline() -> None:
        raw.receive(nbytes)
        target[:nbytes].copy_(pinned[:nbytes])
        torch.accelerator.synchronize(target.device)

    contenders = {"raw": baseline, "socket": lambda: raw.receive(nbytes), **contenders}
    try:
        times = await interleave(contenders, max(3, min(20, (512 * MIB) // nbytes)))
    finally:
        for cm, dst in caches:
            await cm.deallocate_blocks_cache(dst)
    t = {k: median(v) for k, v in times.items()}
    row: dict[str, Any] = {"block_kib": block // KIB, "count": count, "mib": nbytes // MIB}
    for name in contenders:
        row[f"{name}_gbps"] = gbps(nbytes, t[name])
    for name in ("socket", "pull", "push", "pull_dd", "push_dd", "pull_host"):
        row[f"{name}_ratio"] = t["raw"] / t[name]
    return row
