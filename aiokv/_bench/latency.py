"""``aiokv bench latency``: what one small remote operation costs, and the engine hop.

Against the spawned prompt peer, interleaved round by round (medians of each):

* ``raw``: a raw socket request/response of the same bytes (9-byte request, blocking
  ``recv_into``) — the floor;
* ``pull``: a 1-block ``pull_blocks`` awaited from the caller's loop (through the
  engine where there is one), of a one-tensor cache, and of a 64-tensor cache (a
  32-layer model's K and V) moving the same 4 KiB in 64 pieces: what each tensor of a
  request costs;
* ``inline``: the same pull by a second decoder whose engine runs inline on this loop
  (``engine_thread=False``: no hop to a thread and back);
* ``sync``: the same call by an ``aiokv.sync`` decoder from a plain thread, timed
  there, after the interleaved rounds (skipped where ``aiokv.sync`` does not exist,
  e.g. on a commit from before the engine).

With ``backend="nixl"`` (``aiokv bench latency --backend nixl``), the table ``nixl``:
one block under a lease — one one-sided NIXL READ (``pull_blocks``) or WRITE
(``push_blocks``), no request — against a raw NIXL READ / WRITE of the same block with
the same descriptors (:class:`~.nixl.RawNixl`: build, post, wait, release), per UCX
setting (:data:`~.nixl.SETTINGS`), interleaved round by round; ``x``: aiokv / raw.

Then the engine hop alone (summary ``engine_hop``), interleaved: ``check_link_status``
(the caller's loop → the engine thread, a dictionary look-up there, and back) against a
bare hand-off of a callback to a plain thread running an event loop of the same kind
and back (the floor of any hop between two threads' loops on the machine), and the
inline decoder's ``check_link_status`` (the same look-up with no hop: one yield).

Run the same command on two commits to see what a change added per call.
"""

from __future__ import annotations

import asyncio
import importlib
import threading
import time
from typing import Any

from .. import BlocksCacheKey
from .. import CacheDesc
from .. import DataType
from .. import LLMDataDist
from ..transport import get_transport
from ._harness import DECODER_ID
from ._harness import KIB
from ._harness import PEER_ID
from ._harness import PromptPeer
from ._harness import Report
from ._harness import interleave
from ._harness import linked
from ._harness import median
from ._harness import participant_config
from ._harness import run_remote
from ._harness import spawned
from ._progress import steps
from .nixl import nixl_contenders
from .raw import RawStream

__all__ = ["run_latency_bench"]

#: (tensors, bytes of one block of one tensor) of each row
SHAPES = ((1, 4 * KIB), (1, 64 * KIB), (64, 64))
#: rounds of the engine hop per round of the pulls (a hop is ~100x cheaper)
HOPS = 10
#: bytes of the one block of each row of the ``nixl`` table
NIXL_BLOCKS = (4 * KIB, 64 * KIB)


class _Echo:
    """A plain thread running an event loop (uvloop where installed, as the engine's):
    :meth:`hand_off` schedules a callback there that wakes the caller's loop."""

    def __init__(self) -> None:
        try:
            import uvloop

            self._loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        except ImportError:
            self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()

    async def hand_off(self) -> None:
        """To the thread's loop and back."""
        here = asyncio.get_running_loop()
        back = here.create_future()

        def there() -> None:
            here.call_soon_threadsafe(back.set_result, None)

        self._loop.call_soon_threadsafe(there)
        await back

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


async def _hop(report: Report, decoder: LLMDataDist, inline: LLMDataDist, rounds: int) -> None:
    """Add the ``engine_hop`` summary: ``check_link_status`` vs a bare thread hand-off,
    and ``inline``'s (no hop)."""
    echo = _Echo()
    try:
        contenders = {
            "thread": echo.hand_off,
            "hop": lambda: decoder.check_link_status(PEER_ID),
            "inline": lambda: inline.check_link_status(PEER_ID),
        }
        times = await interleave(contenders, rounds, warmup=50)
    finally:
        echo.stop()
    us = {k: sorted(v) for k, v in times.items()}
    report.summary(
        "engine_hop",
        "engine hop (check_link_status): median {hop_us:.1f} µs (p90 {hop_p90_us:.1f}); a bare "
        "hand-off to another thread's loop and back: median {thread_us:.1f} µs (p90 "
        "{thread_p90_us:.1f}); inline (no hop): median {inline_us:.1f} µs; {rounds} rounds",
        inline_us=median(us["inline"]) * 1e6,
        hop_us=median(us["hop"]) * 1e6,
        hop_p90_us=us["hop"][len(us["hop"]) * 9 // 10] * 1e6,
        thread_us=median(us["thread"]) * 1e6,
        thread_p90_us=us["thread"][len(us["thread"]) * 9 // 10] * 1e6,
        rounds=rounds,
    )


async def _nixl(report: Report, rounds: int) -> None:
    """Add the ``nixl`` table: a leased one-block pull / push over NIXL vs raw NIXL.

    Raises:
        AssertionError: a pull delivered wrong bytes or did not move over NIXL.
    """
    rows = report.table(
        "nixl",
        "one block under a lease over NIXL (one-sided READ / WRITE) vs raw NIXL, per UCX "
        "setting (median µs; x = aiokv / raw)",
    )
    top = max(NIXL_BLOCKS)
    async with nixl_contenders(16 * top, 4 * top) as nixl:
        with steps("latency over NIXL", len(NIXL_BLOCKS)) as part:
            for block in NIXL_BLOCKS:
                with part.step(f"latency over NIXL, {block // KIB} KiB"):
                    await nixl.row(block, [1], [0])
                    times = await interleave(nixl.contenders(), rounds, warmup=5)
                t = {k: median(v) * 1e6 for k, v in times.items()}
                for ucx in nixl.sides:
                    pull, read = t[f"{ucx}_pull"], t[f"{ucx}_raw_read"]
                    push, write = t[f"{ucx}_push"], t[f"{ucx}_raw_write"]
                    rows.append(
                        {
                            "block_kib": block // KIB,
                            "ucx": ucx,
                            "raw_read_us": read,
                            "pull_us": pull,
                            "pull_x": pull / read,
                            "raw_write_us": write,
                            "push_us": push,
                            "push_x": push / write,
                        }
                    )


def _sync_pulls(port: int, tensors: int, block: int, rounds: int) -> list[float] | None:
    """Seconds of each of ``rounds`` 1-block pulls by an ``aiokv.sync`` decoder of its
    own, called from this (plain) thread; None where ``aiokv.sync`` does not exist."""
    try:
        sync: Any = importlib.import_module("aiokv.sync")
    except ImportError:
        return None
    dd = sync.LLMDataDist(sync.LLMRole.DECODER, DECODER_ID + 1)
    dd.init(participant_config(64 << 20))
    try:
        info = sync.LLMClusterInfo(
            remote_cluster_id=PEER_ID,
            local_ip_info=[("127.0.0.1", 0)],
            remote_ip_info=[("127.0.0.1", port)],
        )
        code, codes = dd.link_clusters([info])
        if code != sync.LLMStatusCode.LLM_SUCCESS:
            raise RuntimeError(f"link to the prompt peer failed: {code.name} {codes}")
        cm = dd.cache_manager
        dst = cm.allocate_blocks_cache(CacheDesc(tensors, [4, block], DataType.DT_UINT8))
        key = BlocksCacheKey(PEER_ID, 0)
        times = []
        for r in range(5 + rounds):
            t0 = time.perf_counter()
            cm.pull_blocks(key, dst, [1], [2])
            if r >= 5:
                times.append(time.perf_counter() - t0)
        return times
    finally:
        dd.finalize()


def run_latency_bench(*, quick: bool = False, backend: str = "tcp") -> Report:
    """``aiokv bench latency``: raw request/response vs 1-block pulls, async and blocking.

    Args:
        quick: 30 rounds instead of 300.
        backend: ``"nixl"``: also one leased block over NIXL vs raw NIXL (the ``nixl``
            table; eight more processes).

    Raises:
        LLMException: ``backend="nixl"`` without NIXL installed
            (``LLM_FEATURE_NOT_ENABLED``, naming ``pip install 'aiokv[nixl]'``).
    """
    if backend == "nixl":
        get_transport("nixl")  # NIXL missing: fail now, with the install hint
    rounds = 30 if quick else 300
    report = Report("latency", {"rounds": rounds, "backend": backend})
    rows = report.table(
        "latency",
        "one block: raw socket request/response vs pull_blocks (median µs; added = - raw)",
    )

    async def main(peer: PromptPeer, decoder: LLMDataDist) -> None:
        cm = decoder.cache_manager
        async with (
            spawned(lambda: RawStream(max(n * b for n, b in SHAPES))) as raw,
            linked(peer, DECODER_ID + 2, 64 << 20, engine_thread=False) as inline,
        ):
            icm = inline.cache_manager
            with steps("latency", len(SHAPES)) as part:
                for tensors, per_tensor in SHAPES:
                    block = tensors * per_tensor
                    with part.step(f"latency {tensors} x {per_tensor} B"):
                        desc = CacheDesc(tensors, [4, per_tensor], DataType.DT_UINT8)
                        await peer.cache(desc)
                        dst = await cm.allocate_blocks_cache(desc)
                        idst = await icm.allocate_blocks_cache(desc)
                        key = BlocksCacheKey(PEER_ID, 0)
                        contenders: dict[str, Any] = {
                            "raw": lambda block=block: raw.receive(block),
                            "pull": lambda dst=dst, key=key: cm.pull_blocks(key, dst, [1], [2]),
                            "inline": lambda d=idst, key=key: icm.pull_blocks(key, d, [1], [2]),
                        }
                        times = await interleave(contenders, rounds, warmup=5)
                        await cm.deallocate_blocks_cache(dst)
                        await icm.deallocate_blocks_cache(idst)
                        t = {k: median(v) * 1e6 for k, v in times.items()}
                        row = {
                            "block_kib": block // KIB,
                            "tensors": tensors,
                            "raw_us": t["raw"],
                            "pull_us": t["pull"],
                            "pull_added_us": t["pull"] - t["raw"],
                            "inline_us": t["inline"],
                            "inline_added_us": t["inline"] - t["raw"],
                        }
                        sync = await asyncio.to_thread(
                            _sync_pulls, peer.port, tensors, per_tensor, rounds
                        )
                        if sync is not None:
                            row["sync_us"] = median(sync) * 1e6
                            row["sync_over_async_us"] = row["sync_us"] - t["pull"]
                        rows.append(row)
            await _hop(report, decoder, inline, HOPS * rounds)
        if backend == "nixl":
            await _nixl(report, rounds)

    run_remote(main)
    return report
