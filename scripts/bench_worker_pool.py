"""Worker pool: the package's pool against the alternative design, in one interleaved run.

Run it from the repository root on an otherwise quiet machine::

    python scripts/bench_worker_pool.py [--rounds 15] [--calls 200] [--jobs 2000]

Per event loop (asyncio, then uvloop when installed) and round, each contender awaits
``--calls`` sequential jobs, then ``--jobs`` concurrent ones; contenders take turns
within every round so machine noise hits them alike. Printed: the median latency of
one awaited job, the median throughput of many concurrent small jobs, and how many
threads each pool started (the sequential calls should reuse one). Contenders:

- ``run_in_executor``: a bare ``loop.run_in_executor(None, noop)``, the floor;
- ``custom``: the hand-rolled pool (a ``SimpleQueue``, a lock per job, wake-up by one
  ``call_soon_threadsafe``);
- ``executor``: a ``ThreadPoolExecutor`` whose job completion wakes the loop with one
  ``call_soon_threadsafe`` (no ``asyncio.wrap_future``).

Each pool runs a no-op (its own overhead) and a 1-block copy job (``copy_blocks_job``,
one 16 KiB block: what a small ``copy_blocks`` call costs), with 4 threads, the default
``swap_out_threads``. The threads column counts threads started by the sequential
warm-up calls (one is enough: each call waits for the previous one).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import statistics
import threading
import time
from collections.abc import Awaitable
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from typing import TypeVar

import torch

from aiokv._copy._kernels import DEFAULT_STAGING_BYTES
from aiokv._copy._kernels import copy_blocks_job
from aiokv._copy._workers import WorkerPool
from aiokv._copy._workers import _resolve_threadsafe

T = TypeVar("T")
THREADS = 4


class ExecutorPool:
    """``WorkerPool``'s contract (run, aclose, threads) on a ``ThreadPoolExecutor``.

    The design measured against the package's pool: the job's done-callback wakes the
    loop with one ``call_soon_threadsafe``; cancellation uses ``Future.cancel`` (a job
    not started never runs) and a shielded wait for a started one.
    """

    def __init__(self, name: str, size: int) -> None:
        self.threads: list[threading.Thread] = []
        started = self.threads.append
        self._executor = ThreadPoolExecutor(
            size, f"aiokv-{name}", initializer=lambda: started(threading.current_thread())
        )

    async def run(self, fn: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        woken: asyncio.Future[None] = loop.create_future()
        job = self._executor.submit(fn)
        job.add_done_callback(lambda _: _resolve_threadsafe(loop, woken))
        try:
            await woken
        except asyncio.CancelledError:
            if not job.cancel():  # started: wait for it, whatever else is cancelled
                done: asyncio.Future[None] = loop.create_future()
                job.add_done_callback(lambda _: _resolve_threadsafe(loop, done))
                while not done.done():
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.shield(done)
            raise
        try:
            return job.result()
        except StopIteration as exc:
            raise RuntimeError(f"job raised StopIteration: {exc!r}") from exc

    async def aclose(self) -> None:
        """Join the threads from a helper thread, so the loop is not blocked."""
        loop = asyncio.get_running_loop()
        joined: asyncio.Future[None] = loop.create_future()

        def join() -> None:
            self._executor.shutdown(wait=True)
            _resolve_threadsafe(loop, joined)

        joiner = threading.Thread(target=join)
        joiner.start()
        await joined
        joiner.join()


def _noop() -> None:
    return None


async def _latencies(run: Callable[[], Awaitable[Any]], calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        await run()
        out.append(time.perf_counter() - t0)
    return out


async def _throughput(run: Callable[[], Awaitable[Any]], jobs: int) -> float:
    t0 = time.perf_counter()
    await asyncio.gather(*(run() for _ in range(jobs)))
    return jobs / (time.perf_counter() - t0)


async def _bench(rounds: int, calls: int, jobs: int) -> None:
    loop = asyncio.get_running_loop()
    src = torch.ones(64, 8192, dtype=torch.bfloat16)  # 16 KiB blocks
    dst = torch.zeros_like(src)
    job = functools.partial(copy_blocks_job, [src], [dst], [(0, 1)], 4, DEFAULT_STAGING_BYTES)
    custom = WorkerPool("custom", THREADS)
    executor = ExecutorPool("executor", THREADS)
    contenders: dict[str, Callable[[], Awaitable[Any]]] = {
        "run_in_executor(None, noop)": lambda: loop.run_in_executor(None, _noop),
        "custom pool, noop": lambda: custom.run(_noop),
        "executor pool, noop": lambda: executor.run(_noop),
        "custom pool, 1-block copy": lambda: custom.run(job),
        "executor pool, 1-block copy": lambda: executor.run(job),
    }
    lat: dict[str, list[float]] = {k: [] for k in contenders}
    thr: dict[str, list[float]] = {k: [] for k in contenders}
    for run in contenders.values():  # warm up: threads started, caches filled
        await _latencies(run, calls)
    threads_after_sequential = {"custom": len(custom.threads), "executor": len(executor.threads)}
    for _ in range(rounds):
        for name, run in contenders.items():
            lat[name] += await _latencies(run, calls)
        for name, run in contenders.items():
            thr[name].append(await _throughput(run, jobs))
    base = statistics.median(lat["run_in_executor(None, noop)"])
    print(f"{'contender':30} {'median µs':>10} {'vs floor':>9} {'jobs/s':>9} {'threads':>8}")
    for name in contenders:
        med = statistics.median(lat[name])
        rate = statistics.median(thr[name])
        started = threads_after_sequential.get(name.split()[0], "-")
        print(f"{name:30} {med * 1e6:10.1f} {med / base:9.2f} {rate:9.0f} {started!s:>8}")
    await custom.aclose()
    await executor.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=200, help="sequential calls per round")
    parser.add_argument("--jobs", type=int, default=2000, help="concurrent jobs per round")
    args = parser.parse_args()
    gc.collect()
    gc.freeze()  # torch's import heap: keep full collections out of the timings
    loops: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {"asyncio": asyncio.new_event_loop}
    try:
        import uvloop

        loops["uvloop"] = uvloop.new_event_loop
    except ImportError:
        pass
    for name, factory in loops.items():
        print(f"\n== {name} ({args.rounds} rounds x {args.calls} calls, {args.jobs} jobs)")
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(_bench(args.rounds, args.calls, args.jobs))


if __name__ == "__main__":
    main()
