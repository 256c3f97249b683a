"""CopyScheduler: coalescing, byte-exact copies on every path, cancellation, threads.

Async tests run on asyncio and uvloop (``event_loop_policy`` in conftest.py) with loop
debug on; conftest fails any test whose loop was blocked.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import random
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aiokv._device import DeviceContext
from aiokv._scheduler import (
    CopyScheduler,
    SchedulerConfig,
    _copy_cross,
    _Planner,
    _Ring,
    coalesce,
)

CPU = torch.device("cpu")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def rand_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bytes seen as ``dtype``: NaN payloads and denormals included on purpose."""
    *lead, last = shape
    raw = torch.randint(0, 256, (*lead, last * dtype.itemsize), dtype=torch.uint8, generator=gen)
    return raw.view(dtype)


def expected(
    src: list[torch.Tensor], dst: list[torch.Tensor], pairs: list[tuple[int, int]]
) -> list[torch.Tensor]:
    """Reference result, one block at a time: reads all sources before any write."""
    out = [d.clone() for d in dst]
    for s, o in zip(src, out, strict=True):
        snap = s.clone()
        for a, b in pairs:
            o[b] = snap[a]
    return out


def assert_bytes_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


PAIR_KINDS = ["random", "contiguous", "dst_consecutive", "src_consecutive", "mixed"]


def make_pairs(kind: str, n: int, rows: int, rng: random.Random) -> list[tuple[int, int]]:
    if kind == "random":
        return list(zip(rng.sample(range(rows), n), rng.sample(range(rows), n), strict=True))
    if kind == "contiguous":
        return [(i, rows - n + i) for i in range(n)]
    if kind == "dst_consecutive":
        return list(zip(rng.sample(range(rows), n), range(3, 3 + n), strict=True))
    if kind == "src_consecutive":
        return list(zip(range(2, 2 + n), rng.sample(range(rows), n), strict=True))
    assert kind == "mixed"  # a few long runs plus scattered singles
    long_runs = [(i, i + 40) for i in range(0, 12)] + [(20 + i, 70 + i) for i in range(9)]
    singles = list(zip(rng.sample(range(30, 40), 5), rng.sample(range(0, 30), 5), strict=True))
    return long_runs + singles


# --------------------------------------------------------------------------- coalesce

pair_lists = st.lists(
    st.tuples(st.integers(0, 40), st.integers(0, 40))
    | st.integers(0, 30).map(lambda i: (i, i + 5)),
    max_size=60,
)


def expand(runs: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    return [(s + k, d + k) for s, d, n in runs for k in range(n)]


@settings(max_examples=300, deadline=None)
@given(pairs=pair_lists, seed=st.integers(0, 2**16))
def test_coalesce_reconstructs_pairs_exactly(pairs: list[tuple[int, int]], seed: int) -> None:
    runs = coalesce(pairs)
    assert sorted(expand(runs)) == sorted(pairs)
    assert all(n >= 1 for _, _, n in runs)
    assert [(s, d) for s, d, _ in runs] == sorted((s, d) for s, d, _ in runs)
    shuffled = list(pairs)
    random.Random(seed).shuffle(shuffled)
    assert coalesce(shuffled) == runs
    for (s0, d0, n0), (s1, d1, _) in itertools.pairwise(runs):
        assert (s1, d1) != (s0 + n0, d0 + n0), "adjacent runs should have merged"


def test_coalesce_examples() -> None:
    assert coalesce([]) == []
    assert coalesce([(5, 9), (3, 7), (4, 8)]) == [(3, 7, 3)]
    # a duplicate stays a separate entry and never extends a run twice
    assert coalesce([(1, 2), (2, 3), (2, 3)]) == [(1, 2, 2), (2, 3, 1)]
    # consecutive on one side only is not a run
    assert coalesce([(0, 0), (1, 5)]) == [(0, 0, 1), (1, 5, 1)]
    big = 1 << 40  # beyond the packed-key fast path
    assert coalesce(iter([(big + 1, 2), (big, 1)])) == [(big, 1, 2)]


# --------------------------------------------------------------------------- copy_blocks


@pytest.fixture
async def sched() -> AsyncIterator[CopyScheduler]:
    s = CopyScheduler(CPU)
    yield s
    await s.aclose()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", PAIR_KINDS)
async def test_copy_blocks_exact(sched: CopyScheduler, dtype: torch.dtype, kind: str) -> None:
    gen = torch.Generator().manual_seed(1)
    rows = 96
    # per-tensor block shapes differ: 16 KiB rows (runs become slices) and tiny rows
    shapes = [(rows, 2, 4096 // dtype.itemsize), (rows, 3, 5), (rows, 16 // dtype.itemsize)]
    src = [rand_tensor(s, dtype, gen) for s in shapes]
    dst = [rand_tensor(s, dtype, gen) for s in shapes]
    pairs = make_pairs(kind, 24, rows, random.Random(2))
    want = expected(src, dst, pairs)
    src_before = [s.clone() for s in src]
    await sched.copy_blocks(src, dst, pairs)
    for d, w in zip(dst, want, strict=True):
        assert_bytes_equal(d, w)  # copied blocks match, untouched blocks unchanged
    for s, b in zip(src, src_before, strict=True):
        assert_bytes_equal(s, b)


@pytest.mark.parametrize("staging", [1, 3 * 1024, 1 << 20])
async def test_copy_blocks_chunked_staging(staging: int) -> None:
    gen = torch.Generator().manual_seed(3)
    src = [rand_tensor((64, 4, 32), torch.bfloat16, gen) for _ in range(4)]
    dst = [rand_tensor((80, 4, 32), torch.bfloat16, gen) for _ in range(4)]
    rng = random.Random(4)
    pairs = list(zip(rng.sample(range(64), 50), rng.sample(range(80), 50), strict=True))
    want = expected(src, dst, pairs)
    s = CopyScheduler(CPU, SchedulerConfig(staging_bytes=staging))
    try:
        await s.copy_blocks(src, dst, pairs)
    finally:
        await s.aclose()
    for d, w in zip(dst, want, strict=True):
        assert_bytes_equal(d, w)


async def test_copy_blocks_byte_rows_and_odd_layouts(sched: CopyScheduler) -> None:
    """uint8 row views (what Cache.rows() hands over), 1-D and non-contiguous tensors."""
    gen = torch.Generator().manual_seed(5)
    base = rand_tensor((40, 3, 8), torch.float16, gen)
    src = [
        rand_tensor((40, 256), torch.uint8, gen),
        rand_tensor((40,), torch.float32, gen),
        base.transpose(1, 2),  # dim 0 is still blocks, but rows are not contiguous
        rand_tensor((40, 1000), torch.uint8, gen)[:, 3:515],  # misaligned rows
    ]
    dst = [torch.zeros_like(s) for s in src]
    rng = random.Random(6)
    pairs = list(zip(rng.sample(range(40), 30), rng.sample(range(40), 30), strict=True))
    want = expected(src, dst, pairs)
    await sched.copy_blocks(src, dst, pairs)
    for d, w in zip(dst, want, strict=True):
        assert_bytes_equal(d, w)


WITHIN_ONE_TENSOR = {
    # copy-on-write forks: 0..9 -> 20..29 (a slice) and scattered singles
    "disjoint": [(i, 20 + i) for i in range(10)] + [(40, 50), (41, 60), (40, 61)],
    "dst_consecutive": [(50, 3), (45, 4), (60, 5), (41, 6)],
    "src_consecutive": [(3, 50), (4, 45), (5, 60), (6, 41)],
    "chained": [(i, i + 1) for i in range(30)],  # a destination is also a source
}


@pytest.mark.parametrize("kind", list(WITHIN_ONE_TENSOR))
async def test_copy_blocks_within_one_tensor(sched: CopyScheduler, kind: str) -> None:
    """Same tensor as source and destination: every read happens before any write."""
    gen = torch.Generator().manual_seed(7)
    t = rand_tensor((64, 2048), torch.bfloat16, gen)
    pairs = WITHIN_ONE_TENSOR[kind]
    want = expected([t], [t], pairs)
    await sched.copy_blocks([t], [t], pairs)
    assert_bytes_equal(t, want[0])


@pytest.mark.parametrize(("src_host", "dst_host"), [(True, False), (False, True), (False, False)])
@pytest.mark.parametrize("kind", PAIR_KINDS)
def test_accelerator_path_logic_on_cpu(src_host: bool, dst_host: bool, kind: str) -> None:
    """Every branch of the host<->device path (pinned ring slots, owed host scatters,
    gathers, chunking) driven with CPU tensors, so it is checked without a GPU."""
    gen = torch.Generator().manual_seed(12)
    rows = 96
    shapes = [(rows, 2, 4096), (rows, 3, 5)]  # 16 KiB rows (slices) and odd tiny rows
    src = [rand_tensor(sh, torch.bfloat16, gen) for sh in shapes]
    dst = [rand_tensor(sh, torch.bfloat16, gen) for sh in shapes]
    pairs = make_pairs(kind, 24, rows, random.Random(13))
    want = expected(src, dst, pairs)
    ring = _Ring(DeviceContext(CPU), 2, 1024)  # 2 slots: chunks cycle through them
    planner = _Planner(pairs)
    for s, d in zip(src, dst, strict=True):
        _copy_cross(s, d, planner, ring, 40 * 1024, src_host, dst_host)
    ring.drain()
    for d, w in zip(dst, want, strict=True):
        assert_bytes_equal(d, w)


@pytest.mark.parametrize("kind", list(WITHIN_ONE_TENSOR))
def test_accelerator_path_within_one_tensor_on_cpu(kind: str) -> None:
    gen = torch.Generator().manual_seed(14)
    t = rand_tensor((64, 2048), torch.bfloat16, gen)
    pairs = WITHIN_ONE_TENSOR[kind]
    want = expected([t], [t], pairs)
    ring = _Ring(DeviceContext(CPU), 2, 1024)
    _copy_cross(t, t, _Planner(pairs), ring, 8192, False, False)
    ring.drain()
    assert_bytes_equal(t, want[0])


async def test_copy_blocks_empty_and_mismatch(sched: CopyScheduler) -> None:
    t = torch.zeros(4, 4)
    await sched.copy_blocks([t], [t.clone()], [])
    await sched.copy_blocks([], [], [(0, 1)])
    with pytest.raises(ValueError, match="source"):
        await sched.copy_blocks([t], [], [(0, 1)])


async def test_copy_blocks_error_propagates(sched: CopyScheduler) -> None:
    src, dst = torch.zeros(4, 8), torch.zeros(4, 8)
    with pytest.raises((IndexError, RuntimeError)):
        await sched.copy_blocks([src], [dst], [(0, 1), (9, 2)])
    await sched.copy_blocks([src + 1], [dst], [(0, 1)])  # still usable
    assert dst[1].eq(1).all()


# --------------------------------------------------------------------------- copy_many, call


async def test_copy_many_exact(sched: CopyScheduler) -> None:
    gen = torch.Generator().manual_seed(8)
    src = rand_tensor((4096,), torch.uint8, gen)
    dst = rand_tensor((4096,), torch.uint8, gen)
    want = dst.clone()
    spans = [(0, 100, 50), (1000, 0, 999), (3000, 3001, 1000), (17, 2500, 1)]
    for s, d, n in spans:
        want[d : d + n] = src[s : s + n]
    await sched.copy_many([(src[s : s + n], dst[d : d + n]) for s, d, n in spans])
    assert_bytes_equal(dst, want)
    await sched.copy_many([])


async def test_call_returns_and_raises(sched: CopyScheduler) -> None:
    assert await sched.call(lambda: 41 + 1) == 42
    name = await sched.call(lambda: threading.current_thread().name)
    assert name.startswith("aiokv-swap-out-")
    err = KeyError("boom")

    def fail() -> None:
        raise err

    with pytest.raises(KeyError) as info:
        await sched.call(fail)
    assert info.value is err  # the original exception, not a wrapper
    assert await sched.call(lambda: "ok") == "ok"
    with pytest.raises(RuntimeError, match="StopIteration"):
        await sched.call(lambda: next(iter(())))


async def test_many_concurrent_calls_use_few_threads() -> None:
    s = CopyScheduler(CPU, SchedulerConfig(swap_out_threads=2))
    try:
        results = await asyncio.gather(*(s.call(functools.partial(pow, i, 2)) for i in range(300)))
        assert results == [i * i for i in range(300)]
        assert 1 <= len(s.threads) <= 2
    finally:
        await s.aclose()


# --------------------------------------------------------------------------- cancellation


class Gate:
    """A job body that reports its start to the loop and blocks until released."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.started = asyncio.Event()
        self.release = threading.Event()
        self.finished = False

    def __call__(self) -> str:
        self.loop.call_soon_threadsafe(self.started.set)
        self.release.wait()
        self.finished = True
        return "done"


async def test_cancel_while_running_waits_for_the_job() -> None:
    s = CopyScheduler(CPU, SchedulerConfig(swap_out_threads=1))
    try:
        gate = Gate()
        task = asyncio.ensure_future(s.call(gate))
        await gate.started.wait()
        task.cancel()
        for _ in range(20):  # let the loop deliver the cancellation, twice over
            await asyncio.sleep(0)
        task.cancel()  # a second cancel is shielded as well
        for _ in range(20):
            await asyncio.sleep(0)
        assert not task.done(), "returned while the worker was still running"
        gate.release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert gate.finished
        assert await s.call(lambda: 7) == 7  # the scheduler still works
    finally:
        await s.aclose()


async def test_cancel_before_start_never_runs() -> None:
    s = CopyScheduler(CPU, SchedulerConfig(swap_out_threads=1))
    try:
        gate = Gate()
        blocker = asyncio.ensure_future(s.call(gate))
        await gate.started.wait()  # the only worker is busy
        ran: list[bool] = []
        queued = asyncio.ensure_future(s.call(lambda: ran.append(True)))
        src, dst = torch.ones(8, 64), torch.zeros(8, 64)
        copy = asyncio.ensure_future(s.copy_blocks([src], [dst], [(0, 0), (5, 3)]))
        await asyncio.sleep(0)  # both are submitted and waiting in the queue
        queued.cancel()
        copy.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        with pytest.raises(asyncio.CancelledError):
            await copy
        gate.release.set()
        assert await blocker == "done"
        await s.call(lambda: None)  # FIFO on one thread: everything before it is over
        assert ran == []
        assert dst.eq(0).all()
    finally:
        await s.aclose()


async def test_cancel_large_copy_never_writes_after_return() -> None:
    """Cancel a ~256 MiB copy right as it starts: dst is all old or all new at the
    moment CancelledError arrives, and no byte changes afterwards."""
    s = CopyScheduler(CPU, SchedulerConfig(swap_out_threads=1))
    try:
        rows, width = 1024, 32 * 1024  # 4 tensors x 1024 blocks x 64 KiB
        src = [torch.full((rows, width), i + 1, dtype=torch.int16) for i in range(2)]
        dst = [torch.zeros(rows, width, dtype=torch.int16) for _ in range(2)]
        pairs = [(i, rows - 1 - i) for i in range(rows)]  # reversed: the index path
        gate = Gate()
        blocker = asyncio.ensure_future(s.call(gate))
        await gate.started.wait()
        copy = asyncio.ensure_future(s.copy_blocks(src, dst, pairs))
        await asyncio.sleep(0)
        gate.release.set()
        await blocker  # the worker moves straight on to the copy
        copy.cancel()
        with pytest.raises(asyncio.CancelledError):
            await copy
        at_return = [d[:, :8].clone() for d in dst]
        for i, d in enumerate(at_return):
            assert bool(d.eq(i + 1).all()) or bool(d.eq(0).all()), "half-written at return"
        await s.call(lambda: None)
        for d, snap in zip(dst, at_return, strict=True):
            assert torch.equal(d[:, :8], snap), "written after the call returned"
        await s.copy_blocks(src, dst, pairs[:4])  # still works
        assert dst[0][rows - 1].eq(1).all()
    finally:
        await s.aclose()


# --------------------------------------------------------------------------- loop, threads


async def test_large_copy_never_blocks_the_loop(
    sched: CopyScheduler, caplog: pytest.LogCaptureFixture
) -> None:
    loop = asyncio.get_running_loop()
    loop.set_debug(True)
    loop.slow_callback_duration = 0.05
    caplog.set_level(logging.WARNING, logger="asyncio")
    rows, width = 2048, 16 * 1024

    def make(value: int) -> list[torch.Tensor]:
        return [torch.full((rows, width), value, dtype=torch.uint8) for _ in range(4)]

    # even building 256 MiB of test tensors would block the loop: do it on a worker
    src, dst = await sched.call(lambda: make(1)), await sched.call(lambda: make(0))
    rng = random.Random(9)
    pairs = list(zip(rng.sample(range(rows), rows), range(rows), strict=True))
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    tick_task = asyncio.ensure_future(ticker())
    await sched.copy_blocks(src, dst, pairs)
    await sched.copy_blocks(src, dst, [(i, i) for i in range(rows)])
    await sched.copy_many([(s, d) for s, d in zip(src, dst, strict=True)])
    tick_task.cancel()
    assert await sched.call(lambda: all(bool(d.eq(1).all()) for d in dst))
    assert ticks > 1, "the loop made no progress while the copy ran"
    slow = [r.getMessage() for r in caplog.records if "Executing" in r.getMessage()]
    assert not slow

    def free() -> None:
        src.clear()
        dst.clear()

    await sched.call(free)  # freeing 256 MiB is also work for a worker


async def test_aclose_joins_threads_and_rejects_calls() -> None:
    before = set(threading.enumerate())
    s = CopyScheduler(CPU, SchedulerConfig(swap_out_threads=3))
    gates = [Gate() for _ in range(3)]
    tasks = [asyncio.ensure_future(s.call(g)) for g in gates]
    for g in gates:
        await g.started.wait()
    assert {t.name for t in s.threads} == {f"aiokv-swap-out-{i}" for i in range(3)}
    assert all(not t.daemon for t in s.threads)
    queued = asyncio.ensure_future(s.call(lambda: "queued"))
    await asyncio.sleep(0)
    closing = asyncio.ensure_future(s.aclose())
    await asyncio.sleep(0)
    for g in gates:
        g.release.set()
    await closing
    assert [await t for t in tasks] == ["done"] * 3
    assert await queued == "queued"  # queued work finishes before the threads stop
    assert not any(t.is_alive() for t in s.threads)
    assert set(threading.enumerate()) == before
    assert s.closed
    with pytest.raises(RuntimeError, match="closed"):
        await s.call(lambda: None)
    with pytest.raises(RuntimeError, match="closed"):
        await s.copy_blocks([torch.zeros(1)], [torch.zeros(1)], [(0, 0)])
    with pytest.raises(RuntimeError, match="closed"):
        await s.copy_many([])
    await s.aclose()  # idempotent


async def test_threads_start_on_demand() -> None:
    s = CopyScheduler(CPU)
    assert s.threads == []
    await s.call(lambda: None)
    await s.call(lambda: None)
    assert len(s.threads) == 1  # an idle thread is reused
    await s.aclose()


def test_unclosed_scheduler_does_not_hang_exit() -> None:
    code = (
        "import asyncio, torch\n"
        "from aiokv._scheduler import CopyScheduler\n"
        "s = CopyScheduler(torch.device('cpu'))\n"
        "print(asyncio.run(s.call(lambda: 'ran')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ran"


async def test_dropped_scheduler_stops_its_threads() -> None:
    s = CopyScheduler(CPU)
    await s.call(lambda: None)
    threads = s.threads
    del s
    for t in threads:
        t.join(timeout=10)  # the finalizer told it to stop; join is the proof
        assert not t.is_alive()


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="swap_out_threads"):
        SchedulerConfig(swap_out_threads=0)
    with pytest.raises(TypeError, match="staging_bytes"):
        SchedulerConfig(staging_bytes=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        CopyScheduler("cpu")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- accelerators

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@needs_cuda
@pytest.mark.parametrize("direction", ["h2d", "d2h", "d2d"])
@pytest.mark.parametrize("kind", PAIR_KINDS)
async def test_copy_blocks_cuda(direction: str, kind: str) -> None:
    dev = torch.device("cuda", 0)
    gen = torch.Generator().manual_seed(10)
    rows = 96
    src_h = [rand_tensor((rows, 4, 2048), torch.bfloat16, gen) for _ in range(3)]
    dst_h = [rand_tensor((rows, 4, 2048), torch.bfloat16, gen) for _ in range(3)]
    pairs = make_pairs(kind, 24, rows, random.Random(11))
    want = expected(src_h, dst_h, pairs)
    on: Callable[[torch.Tensor, bool], torch.Tensor] = lambda t, d: t.to(dev) if d else t  # noqa: E731
    src = [on(t, direction in ("d2h", "d2d")) for t in src_h]
    dst = [on(t, direction in ("h2d", "d2d")) for t in dst_h]
    s = CopyScheduler(dev, SchedulerConfig(staging_bytes=64 * 1024))
    try:
        await s.copy_blocks(src, dst, pairs)
        await s.copy_many([(src[0][:2], dst[1][5:7])])
    finally:
        await s.aclose()
    want[1][5:7] = src_h[0][:2]
    for d, w in zip(dst, want, strict=True):
        assert_bytes_equal(d.cpu(), w)
