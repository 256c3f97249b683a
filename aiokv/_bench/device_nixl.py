"""``aiokv bench device --backend nixl``: caches in CUDA memory over NIXL, against raw
NIXL moving the same bytes between the same kind of memory, in one run.

Six spawned processes, each with UCX's default transports (:data:`.nixl.SETTINGS`
``"shm"``, set before NIXL is imported): two prompt peers, ``transfer_backend="nixl"``,
one with its pool on ``cuda:0``, one in host memory; a :class:`~.nixl.NixlDecoder` with
its pool on ``cuda:0`` linked to each; and a raw NIXL pair (:class:`~.nixl.RawNixl`)
over ``cuda:0`` buffers registered as VRAM. For each ``(B, K)`` — K scattered blocks of
B bytes — and round by round, interleaved, each contender timed in its own process:

* ``raw_read`` / ``raw_write``: bare NIXL agents configured as aiokv's moving the same
  blocks VRAM↔VRAM, one descriptor per block, the transfer built per round, posted and
  polled with aiokv's back-off (as the CPU raw contenders of ``bench transfer``);
* ``pull`` / ``push``: ``pull_blocks`` / ``push_blocks`` between the two ``cuda:0``
  pools, registered with NIXL as VRAM: NIXL moves device memory directly, nothing is
  staged; each op is checked to have moved all its bytes over NIXL, from NIXL-registered
  memory;
* ``pull_h`` / ``push_h``: the same with the peer's pool in host memory (DRAM↔VRAM in
  one NIXL transfer; from the second op of a row on under a lease — one one-sided
  transfer, no request — since the owner's cache is in host memory), for reference.

Every pull (aiokv's and the raw READ) into zeroed blocks is checked byte for byte
(digests) before the timed rounds. Ratios are ``t_raw / t_aiokv`` (read: ``pull`` vs
``raw_read``, write: ``push`` vs ``raw_write``); the goal (issue #10) is ≥ 0.9.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from .. import CacheDesc
from .. import DataType
from ._harness import KIB
from ._harness import MIB
from ._harness import PromptPeer
from ._harness import Report
from ._harness import gbps
from ._harness import interleave
from ._harness import median
from ._harness import run_loop
from ._harness import scattered
from ._harness import spawned_all
from .nixl import SETTINGS
from .nixl import NixlDecoder
from .nixl import RawNixl

__all__ = ["run_device_nixl_bench"]

POOL = 1 << 30
#: UCX's default transports (shared memory and cuda_ipc on one host); NIXL logs WARN.
ENV = SETTINGS["shm"]


def run_device_nixl_bench(grid: list[tuple[int, int]], meta: dict[str, Any], name: str) -> Report:
    """The NIXL mode of ``aiokv bench device`` over ``grid`` on ``cuda:0`` (``name``:
    the device's), NIXL installed and CUDA present (checked by the caller)."""
    report = Report("device", {**meta, "backend": "nixl"})
    top = max(b * k for b, k in grid)

    async def main() -> None:
        peers = [
            partial(PromptPeer, POOL, backend="nixl", env=ENV, device_type="cuda"),
            partial(PromptPeer, POOL, backend="nixl", env=ENV),
        ]
        async with (
            spawned_all(peers) as (dev_peer, host_peer),
            spawned_all([partial(RawNixl, ENV, 2 * top, "VRAM")]) as (raw,),
            spawned_all(
                [partial(NixlDecoder, ENV, p.port, POOL, "cuda") for p in (dev_peer, host_peer)]
            ) as (d_dev, d_host),
        ):
            rows = report.table("device_nixl", f"device caches over NIXL (VRAM) on {name}")
            sides = {"": (dev_peer, d_dev), "_h": (host_peer, d_host)}
            for block, count in grid:
                rows.append(await _row(block, count, sides, raw))

    run_loop(main)
    ratios = report.as_dict()["device_nixl"]
    report.summary(
        "nixl_summary",
        "aiokv over NIXL / raw NIXL, VRAM on both sides (t_raw / t_aiokv), worst row: "
        "read {read:.2f} write {write:.2f}; best row: read {best_read:.2f} write "
        "{best_write:.2f} (goal >= 0.9)",
        read=min(r["read_ratio"] for r in ratios),
        write=min(r["write_ratio"] for r in ratios),
        best_read=max(r["read_ratio"] for r in ratios),
        best_write=max(r["write_ratio"] for r in ratios),
    )
    return report


async def _row(
    block: int,
    count: int,
    sides: dict[str, tuple[PromptPeer, NixlDecoder]],
    raw: RawNixl,
) -> dict[str, Any]:
    nbytes = block * count
    srcs = scattered(count, seed=block + count)
    dsts = scattered(count, seed=block + count + 1)
    if not await raw.row(block, srcs, dsts):
        raise AssertionError("device benchmark: raw NIXL READ (VRAM) delivered wrong bytes")
    contenders: dict[str, Any] = {
        "raw_read": partial(raw.move, "READ"),
        "raw_write": partial(raw.move, "WRITE"),
    }
    for suffix, (peer, decoder) in sides.items():
        await peer.cache(CacheDesc(1, [2 * count, block], DataType.DT_UINT8))
        got, over_nixl = await decoder.setup(block, srcs, dsts)
        if not over_nixl:
            raise AssertionError(f"device benchmark: pull{suffix} did not move over NIXL")
        if got != await peer.digest(srcs):
            raise AssertionError(f"device benchmark: pull{suffix} delivered wrong bytes")
        contenders[f"pull{suffix}"] = partial(decoder.op, "pull")
        contenders[f"push{suffix}"] = partial(decoder.op, "push")
    times = await interleave(contenders, max(5, min(30, (1 << 30) // nbytes)))
    t = {k: median(v) for k, v in times.items()}
    row: dict[str, Any] = {"block_kib": block // KIB, "count": count, "mib": nbytes // MIB}
    for name in contenders:
        row[f"{name}_gbps"] = gbps(nbytes, t[name])
    for name in ("raw_read", "pull", "raw_write", "push"):
        row[f"{name}_ms"] = t[name] * 1e3
    row["read_ratio"] = t["raw_read"] / t["pull"]
    row["write_ratio"] = t["raw_write"] / t["push"]
    row["verified"] = True  # every pull above matched its source's digest
    return row
