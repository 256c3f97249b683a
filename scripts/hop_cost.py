"""What the engine hop adds to a bare thread hand-off, in one process.

``PYTHONPATH=. python scripts/hop_cost.py [ROUNDS]`` (repository root; or
``PYTHONPATH=<checkout>`` to measure another commit's engine with this script). On a
uvloop caller loop, interleaved ``ROUNDS`` times (the first 500 not counted): the bare
hand-off of ``aiokv bench latency`` (a callback to a plain thread running a uvloop loop,
and back), ``Engine.run_sync`` of a no-op function (one callback on the engine loop) and
``Engine.run`` of a no-op coroutine (a task there). Prints each one's median µs and what
the two hops add to the bare hand-off of the same rounds: the engine's own cost per hop,
with no transport, no argument checks and no other process.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Awaitable
from collections.abc import Callable

import uvloop

from aiokv._bench.latency import _Echo
from aiokv._engine import Engine

WARMUP = 500


def _noop() -> None:
    return None


async def _anoop() -> None:
    return None


async def _main(rounds: int) -> None:
    engine, echo = Engine("hop-cost"), _Echo()
    try:
        ways: dict[str, Callable[[], Awaitable[None]]] = {
            "bare hand-off": echo.hand_off,
            "run_sync": lambda: engine.run_sync(_noop),
            "run": lambda: engine.run(_anoop),
        }
        times: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(rounds + WARMUP):
            for name, way in ways.items():
                start = time.perf_counter()
                await way()
                times[name].append(time.perf_counter() - start)
    finally:
        echo.stop()
        await engine.aclose()
    us = {name: statistics.median(t[WARMUP:]) * 1e6 for name, t in times.items()}
    bare, sync, task = us["bare hand-off"], us["run_sync"], us["run"]
    print(
        f"bare hand-off {bare:.1f} µs; run_sync {sync:.1f} (+{sync - bare:.1f}); "
        f"run {task:.1f} (+{task - bare:.1f}); {rounds} rounds"
    )


if __name__ == "__main__":
    uvloop.run(_main(int(sys.argv[1]) if len(sys.argv) > 1 else 8000))
