"""What a one-block pull costs with no thread hop: the same ``pull_blocks`` awaited on
the caller's loop (through the engine) and awaited ON the engine loop itself, where the
link's I/O runs, against the raw socket request/response of ``aiokv bench latency``.

``PYTHONPATH=. python scripts/pull_on_engine_loop.py [ROUNDS]`` (repository root): the
bench's spawned prompt peer and ``RawStream`` sender; per round, interleaved: the raw
exchange of the block's bytes, a 1-block pull from the caller's loop, and a 1-block pull
timed inside a coroutine that runs on the engine loop (the hop to get there is not
timed). 4 KiB and 64 KiB blocks of a one-tensor cache. Prints the median µs of each and
their ratio to raw: what a link driven from the caller's loop would leave of a pull
(issue #24, goal 1: ≤ 2× raw) — the request, both sides' protocol and the loops'
wake-ups, with no hop. Then, per way of awaiting, 1,000 pulls in a row and the CPU
they took per pull: this process (all its threads: the requester; ``getrusage``) and
the peer's process (Linux ``/proc``, in 10 ms ticks: ±10 µs per pull), beside the wall
time.
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time
from collections.abc import Awaitable
from collections.abc import Callable

from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import DataType
from aiokv import LLMDataDist
from aiokv._bench._harness import KIB
from aiokv._bench._harness import PEER_ID
from aiokv._bench._harness import PromptPeer
from aiokv._bench._harness import run_remote
from aiokv._bench._harness import spawned
from aiokv._bench.raw import RawStream

#: pulls in a row for the CPU figures
IN_A_ROW = 1000


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far."""
    if pid == os.getpid():
        use = resource.getrusage(resource.RUSAGE_SELF)
        return use.ru_utime + use.ru_stime
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _cpu_per_pull(
    pulls: Callable[[], Awaitable[None]], rounds: int, peer_pid: int
) -> tuple[float, float, float]:
    """``(wall, requester CPU, peer CPU)`` µs per pull of ``pulls()`` (``rounds`` pulls)."""
    me, peer = _cpu_s(os.getpid()), _cpu_s(peer_pid)
    start = time.perf_counter()
    await pulls()
    wall = time.perf_counter() - start
    me, peer = _cpu_s(os.getpid()) - me, _cpu_s(peer_pid) - peer
    return wall / rounds * 1e6, me / rounds * 1e6, peer / rounds * 1e6


def main(rounds: int) -> None:
    async def bench(peer: PromptPeer, decoder: LLMDataDist) -> None:
        cm = decoder.cache_manager
        engine = decoder._engine
        assert engine is not None
        key = BlocksCacheKey(PEER_ID, 0)
        async with spawned(lambda: RawStream(64 * KIB)) as raw:
            for block in (4 * KIB, 64 * KIB):
                desc = CacheDesc(1, [4, block], DataType.DT_UINT8)
                await peer.cache(desc)
                dst = await cm.allocate_blocks_cache(desc)

                async def timed_pull() -> float:
                    start = time.perf_counter()
                    await cm.pull_blocks(key, dst, [1], [2])  # noqa: B023
                    return time.perf_counter() - start

                t: dict[str, list[float]] = {"raw": [], "caller": [], "engine": []}
                for i in range(rounds + 5):  # the first 5: warm-up, not counted
                    start = time.perf_counter()
                    raw.receive(block)
                    raw_s = time.perf_counter() - start
                    caller_s = await timed_pull()
                    engine_s = await engine.run(timed_pull)
                    if i >= 5:
                        t["raw"].append(raw_s)
                        t["caller"].append(caller_s)
                        t["engine"].append(engine_s)

                async def in_a_row() -> None:
                    for _ in range(IN_A_ROW):
                        await cm.pull_blocks(key, dst, [1], [2])  # noqa: B023

                pid = peer.proc.pid
                assert pid is not None  # started
                cpu = {
                    "caller": await _cpu_per_pull(in_a_row, IN_A_ROW, pid),
                    "engine": await engine.run(_cpu_per_pull, in_a_row, IN_A_ROW, pid),
                }
                await cm.deallocate_blocks_cache(dst)
                m = {k: statistics.median(v) * 1e6 for k, v in t.items()}
                print(
                    f"{block // KIB:>2} KiB: raw {m['raw']:.0f} µs; pull from the caller's loop "
                    f"{m['caller']:.0f} µs ({m['caller'] / m['raw']:.1f}x); pull on the engine "
                    f"loop {m['engine']:.0f} µs ({m['engine'] / m['raw']:.1f}x)"
                )
                for way, (wall, me, other) in cpu.items():
                    print(
                        f"        {IN_A_ROW} pulls in a row, {way}'s loop: wall {wall:.0f} µs, CPU "
                        f"{me:.0f} µs here (the requester) + {other:.0f} µs the peer, per pull"
                    )

    run_remote(bench)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 400)
