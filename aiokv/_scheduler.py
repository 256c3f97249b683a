"""Copy jobs on dedicated worker threads, awaited from the event loop without blocking it.

A call (``copy_blocks``, ``copy_many``, ``call``) becomes ONE job: it is queued to a worker
pool, runs there, and its result is handed back with ``loop.call_soon_threadsafe``. The
loop never sleeps, polls or waits on a device.

Pools follow llm_datadist: device→host and host→host copies (and :meth:`CopyScheduler.call`)
on a pool of ``swap_out_threads``; host→device and device→device copies on
``d2d_threads`` (one) thread, host→device staged through a ring of ``swap_in_buffers``
pinned buffers. Threads start on demand, are named ``aiokv-<pool>-<n>``, and are joined
by :meth:`CopyScheduler.aclose`.

Cancellation: a job cancelled before it starts never runs; once started it is never
abandoned half-way: the awaiting task waits (shielded) for it to finish, then
``CancelledError`` propagates. So no worker writes caller memory after the await returned.

Block copies are planned on the worker: pairs are coalesced into runs that are
consecutive in both source and destination; long runs are single slice copies, the rest
are index gathers/scatters with index tensors built once and reused for every tensor.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import enum
import functools
import itertools
import queue
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np
import numpy.typing as npt
import torch

from ._device import DeviceContext, host_empty, is_accelerator

__all__ = ["CopyScheduler", "Run", "SchedulerConfig", "coalesce"]

T = TypeVar("T")
Run = tuple[int, int, int]
"""``(src_start, dst_start, count)`` in rows of dim 0 (blocks)."""

_I64 = npt.NDArray[np.int64]
_NO_INDEX = torch.empty(0, dtype=torch.int64)

# A run at least this long (bytes per tensor) is copied as one slice; shorter runs go
# through the index path. Measured on CPU: a slice copy costs ~3-5 µs of framework time,
# while moving a block through index_select + index_copy_ costs ~0.03 ns/B more than a
# straight memcpy, so slices win above roughly 100-150 KiB.
_SLICE_MIN_BYTES = 128 << 10

# Index paths on the host gather into a staging buffer of at most this size, then
# scatter from it: small enough to stay in the last-level cache, large enough that the
# per-chunk op overhead is noise (measured: 4 MiB beats both 1 MiB and unchunked).
_DEFAULT_STAGING_BYTES = 4 << 20

# index_copy_ on CPU copies element by element, so the widest element is fastest:
# measured ~2x faster as complex128 than as bf16/fp16, and int dtypes are slower than
# float ones. Values are only moved, never computed on, so any bit pattern survives.
_WIDE_DTYPES = (torch.complex128, torch.float64, torch.float32)


# --------------------------------------------------------------------------- planning


def _sorted_runs(pairs: Iterable[tuple[int, int]]) -> tuple[_I64, _I64, _I64, _I64]:
    """Pairs sorted by ``(src, dst)`` and their maximal runs.

    Returns ``(src, dst, starts, lengths)``: sorted source and destination indices, and
    for each run (consecutive in both) its offset into them and its length. Vectorised,
    ~0.2 µs per pair; the few numpy calls dominate for small inputs.
    """
    seq = pairs if isinstance(pairs, Sequence) else list(pairs)
    n = len(seq)
    flat = np.fromiter(itertools.chain.from_iterable(seq), dtype=np.int64, count=2 * n)
    s, d = flat[0::2], flat[1::2]
    if n and not (flat >> 31).any():
        # One sort of a packed key is ~10x faster than lexsort, and a pair continues a
        # run exactly when its key is one more in both halves.
        key = (s << 32) | d
        key.sort()
        src, dst = key >> 32, key & 0xFFFFFFFF
        brk = np.flatnonzero(np.diff(key) != (1 << 32) + 1)
    else:
        order = np.lexsort((d, s))
        src, dst = s[order], d[order]
        brk = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1))
    starts = np.zeros(len(brk) + 1 if n else 0, dtype=np.int64)
    starts[1:] = brk + 1
    lengths = np.diff(starts, append=n)
    return src, dst, starts, lengths


def _as_runs(src_starts: _I64, dst_starts: _I64, lengths: _I64) -> list[Run]:
    return list(zip(src_starts.tolist(), dst_starts.tolist(), lengths.tolist(), strict=True))


def coalesce(pairs: Iterable[tuple[int, int]]) -> list[Run]:
    """Group ``(src, dst)`` block pairs into runs consecutive in both source and destination.

    The result is sorted by source (then destination) and does not depend on the input
    order. Expanding every run ``(s, d, n)`` into ``(s + k, d + k)`` for ``k < n`` gives
    back exactly the input multiset: a duplicated pair stays a separate entry.
    """
    src, dst, starts, lengths = _sorted_runs(pairs)
    return _as_runs(src[starts], dst[starts], lengths)


@dataclass(slots=True)
class _Plan:
    """How to copy one call's pairs for tensors of one row size.

    ``slices`` are copied one slice each; the remaining pairs are ``rest_src`` →
    ``rest_dst`` (sorted by destination). When the remaining destinations (or sources)
    are one consecutive range, ``dst_start`` (or ``src_start``) is set and that side is a
    plain slice, which saves a pass over the data.
    """

    slices: list[Run]
    rest_src: torch.Tensor = field(default_factory=lambda: _NO_INDEX)
    rest_dst: torch.Tensor = field(default_factory=lambda: _NO_INDEX)
    src_start: int | None = None
    dst_start: int | None = None
    _on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    _chunks: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)

    @property
    def rest_count(self) -> int:
        return self.rest_src.shape[0]

    def rest_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rest_src, rest_dst)`` on ``device``, copied there once per call."""
        if device.type == "cpu":
            return self.rest_src, self.rest_dst
        if device not in self._on_device:
            self._on_device[device] = (self.rest_src.to(device), self.rest_dst.to(device))
        return self._on_device[device]

    def chunks(self, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(rest_src, rest_dst)`` cut into pieces of ``rows``, cut once per call."""
        cut = self._chunks.get(rows)
        if cut is None:
            pieces = range(0, self.rest_count, rows)
            cut = self._chunks[rows] = [
                (self.rest_src[k : k + rows], self.rest_dst[k : k + rows]) for k in pieces
            ]
        return cut


def _consecutive(sorted_idx: _I64) -> bool:
    """Whether a sorted index array is ``k, k+1, ..., k+n-1``."""
    n = len(sorted_idx)
    return bool(sorted_idx[-1] - sorted_idx[0] == n - 1 and (np.diff(sorted_idx) == 1).all())


def _make_plan(src: _I64, dst: _I64, starts: _I64, lengths: _I64, min_run: int) -> _Plan:
    """Plan from sorted pairs and their runs; runs of ``>= min_run`` rows become slices."""
    long = lengths >= min_run
    n_long = int(np.count_nonzero(long))
    if n_long == len(lengths):
        return _Plan(_as_runs(src[starts], dst[starts], lengths))
    slices: list[Run] = []
    rs, rd = src, dst
    if n_long:
        ls = starts[long]
        slices = _as_runs(src[ls], dst[ls], lengths[long])
        keep = np.repeat(~long, lengths)
        rs, rd = src[keep], dst[keep]
    order = np.argsort(rd, kind="stable")
    rs, rd = rs[order], rd[order]
    plan = _Plan(slices, torch.from_numpy(rs), torch.from_numpy(rd))
    if _consecutive(rd):
        plan.dst_start = int(rd[0])
    elif _consecutive(np.sort(rs)):
        by_src = np.argsort(rs, kind="stable")
        plan.src_start = int(rs[by_src[0]])
        plan.rest_src = torch.from_numpy(rs[by_src])
        plan.rest_dst = torch.from_numpy(rd[by_src])
    return plan


class _Planner:
    """Plans for one call, one per row size (tensors of a call may differ in block size)."""

    __slots__ = (
        "_disjoint",
        "_dst",
        "_lengths",
        "_plans",
        "_snapshot",
        "_src",
        "_stages",
        "_starts",
    )

    def __init__(self, pairs: Sequence[tuple[int, int]]) -> None:
        self._src, self._dst, self._starts, self._lengths = _sorted_runs(pairs)
        self._plans: dict[int, _Plan] = {}
        self._snapshot: _Plan | None = None
        self._stages: dict[tuple[Any, ...], torch.Tensor] = {}
        self._disjoint: bool | None = None

    @property
    def disjoint(self) -> bool:
        """Whether no block is both a source and a destination."""
        if self._disjoint is None:
            self._disjoint = not np.intersect1d(self._src, self._dst).size
        return self._disjoint

    def for_rows(self, row_bytes: int) -> _Plan:
        """The plan for tensors whose blocks are ``row_bytes`` long."""
        plan = self._plans.get(row_bytes)
        if plan is None:
            min_run = max(1, -(-_SLICE_MIN_BYTES // max(row_bytes, 1)))
            plan = self._plans[row_bytes] = _make_plan(
                self._src, self._dst, self._starts, self._lengths, min_run
            )
        return plan

    def stage(self, buf: torch.Tensor, rows: int, like: torch.Tensor) -> torch.Tensor:
        """:func:`_stage_like`, memoized for the call (tensors of a call share layouts)."""
        key = (buf.data_ptr(), rows, like.dtype, like.shape[1:])
        view = self._stages.get(key)
        if view is None:
            view = self._stages[key] = _stage_like(buf, rows, like)
        return view

    def snapshot(self) -> _Plan:
        """All pairs through the index path: every read happens before any write."""
        if self._snapshot is None:
            src, dst = torch.from_numpy(self._src), torch.from_numpy(self._dst)
            self._snapshot = _Plan([], src, dst)
        return self._snapshot


# --------------------------------------------------------------------------- copy kernels


def _row_bytes(t: torch.Tensor) -> int:
    rows = t.shape[0]
    return t.nbytes // rows if rows else 0


def _wide_pair(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` and ``b`` reinterpreted as the widest dtype both can be viewed as, else as is.

    Only the last dimension changes size, so dim 0 still indexes blocks.
    """
    if a.dim() < 2:  # viewing a 1-D tensor would change what dim 0 counts
        return a, b
    for wide in _WIDE_DTYPES:
        if wide is a.dtype:
            break
        try:
            return a.view(wide), b.view(wide)
        except RuntimeError:  # odd row size or alignment: try a narrower element
            continue
    return a, b


def _end(t: torch.Tensor, start: int) -> int:
    """One past the last byte ``t`` can touch."""
    if t.is_contiguous():
        return start + t.nbytes
    if t.numel() == 0:
        return start
    extent = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    return start + (extent + 1) * t.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (on one device) may share bytes."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1, b1 = _end(a, a0), _end(b, b0)
    return a0 < b1 and b0 < a1 and a0 < a1 and b0 < b1


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same memory seen the same way (block i is block i)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


class _WorkerState(threading.local):
    """Per worker thread: staging buffers and device contexts, reused across jobs."""

    def __init__(self) -> None:
        self.stage = torch.empty(0, dtype=torch.uint8)
        self.contexts: dict[torch.device, DeviceContext] = {}
        self.rings: dict[torch.device, list[_Slot]] = {}


_state = _WorkerState()


def _stage_like(buf: torch.Tensor, rows: int, like: torch.Tensor) -> torch.Tensor:
    """A contiguous ``[rows, *like.shape[1:]]`` view of ``like.dtype`` on byte buffer ``buf``."""
    nbytes = rows * _row_bytes(like)
    return buf[:nbytes].view(like.dtype).view(rows, *like.shape[1:])


def _host_stage(nbytes: int) -> torch.Tensor:
    if _state.stage.numel() < nbytes:
        _state.stage = torch.empty(nbytes, dtype=torch.uint8)
    return _state.stage


def _context(device: torch.device) -> DeviceContext:
    ctx = _state.contexts.get(device)
    if ctx is None:
        ctx = _state.contexts[device] = DeviceContext(device)
    return ctx


def _needs_snapshot(src: torch.Tensor, dst: torch.Tensor, planner: _Planner) -> tuple[bool, bool]:
    """``(snapshot, same)``: whether the copy must do every read before any write (the
    tensors may share memory and a block is both read and written), and whether they are
    one view. Runs once per tensor per call, so the common case makes few torch calls."""
    s0, d0 = src.data_ptr(), dst.data_ptr()
    if s0 == d0 and src.shape == dst.shape and src.stride() == dst.stride():
        return not planner.disjoint, True
    if src.is_contiguous() and dst.is_contiguous():
        return s0 < d0 + dst.nbytes and d0 < s0 + src.nbytes, False
    return _overlap(src, dst), False


def _copy_host(src: torch.Tensor, dst: torch.Tensor, planner: _Planner, staging: int) -> None:
    """``dst[d] = src[s]`` for every planned pair, both tensors in host memory.

    Kept lean: it runs once per tensor per call, and a call may carry 64+ tensors.
    """
    snapshot, same = _needs_snapshot(src, dst, planner)
    if snapshot:
        plan = planner.snapshot()
        sw, dw = _wide_pair(src, dst)
        dw.index_copy_(0, plan.rest_dst, sw.index_select(0, plan.rest_src))
        return
    row_bytes = _row_bytes(src)
    plan = planner.for_rows(row_bytes)
    for s, d, n in plan.slices:
        dst[d : d + n].copy_(src[s : s + n])
    n_rest = plan.rest_count
    if n_rest == 0:
        return
    sw, dw = _wide_pair(src, dst)
    # Within one tensor torch refuses an `out=` or source that is a view of the tensor
    # being written, even for disjoint rows, so that case goes through staging.
    if plan.dst_start is not None and not same:
        torch.index_select(sw, 0, plan.rest_src, out=dw[plan.dst_start : plan.dst_start + n_rest])
    elif plan.src_start is not None and not same:
        dw.index_copy_(0, plan.rest_dst, sw[plan.src_start : plan.src_start + n_rest])
    else:
        rows = max(1, staging // max(row_bytes, 1))
        buf = _host_stage(min(rows, n_rest) * row_bytes)
        for sidx, didx in plan.chunks(rows):
            stage = planner.stage(buf, len(sidx), sw)
            torch.index_select(sw, 0, sidx, out=stage)
            dw.index_copy_(0, didx, stage)


@dataclass(slots=True)
class _Slot:
    """One pinned host staging buffer and what must happen before it can be reused."""

    buf: torch.Tensor
    event: torch.Event | None = None
    # Device→host: the host-side scatter still owed once ``event`` has completed.
    scatter: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def settle(self) -> None:
        """Wait (on this worker thread) until the slot is free, doing any owed scatter."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        if self.scatter is not None:
            dst, idx, stage = self.scatter
            self.scatter = None
            dw, sw = _wide_pair(dst, stage)
            dw.index_copy_(0, idx, sw)


class _Ring:
    """Round-robin over one worker's pinned staging slots for one accelerator.

    Slots persist in the worker's state across jobs; a slot is settled (its queued copy
    finished, its owed scatter done) before reuse and by :meth:`drain` at job end.
    """

    __slots__ = ("_i", "_slots", "ctx")

    def __init__(self, ctx: DeviceContext, count: int, nbytes: int) -> None:
        self.ctx = ctx
        self._slots = _state.rings.setdefault(ctx.device, [])
        while len(self._slots) < count:
            self._slots.append(_Slot(host_empty(nbytes, ctx.device, pin=True)))
        self._i = 0

    def next(self, nbytes: int) -> _Slot:
        slot = self._slots[self._i % len(self._slots)]
        self._i += 1
        slot.settle()
        if slot.buf.numel() < nbytes:
            slot.buf = host_empty(nbytes, self.ctx.device, pin=True)
        return slot

    def drain(self) -> None:
        """Finish every slot: wait for its copy and do its owed host scatter."""
        for slot in self._slots:
            slot.settle()

    def abandon(self) -> None:
        """After a failed job: wait for queued copies, forget owed scatters.

        No slot may write into a failed call's memory once the call has returned.
        """
        for slot in self._slots:
            slot.scatter = None
            slot.settle()


def _copy_cross(
    src: torch.Tensor,
    dst: torch.Tensor,
    planner: _Planner,
    ring: _Ring,
    staging: int,
    src_host: bool,
    dst_host: bool,
) -> None:
    """``dst[d] = src[s]`` for every planned pair where at least one side is an accelerator.

    Must run under ``ring.ctx.stream()``; the caller drains the ring and synchronizes the
    context before the job ends. The host side of an index copy goes through pinned ring
    slots so transfers are async and overlap the host gather/scatter of other chunks.
    ``src_host`` / ``dst_host`` say which sides are host memory (passed in so tests can
    drive every branch with CPU tensors).
    """
    sv, dv = src, dst
    row_bytes = _row_bytes(src)
    same_device = src.device == dst.device
    snapshot, same = _needs_snapshot(src, dst, planner) if same_device else (False, False)
    plan = planner.snapshot() if snapshot else planner.for_rows(row_bytes)
    for s, d, n in plan.slices:
        dv[d : d + n].copy_(sv[s : s + n], non_blocking=True)
    n_rest = plan.rest_count
    if n_rest == 0:
        return
    sidx, _ = plan.rest_on(src.device)
    _, didx = plan.rest_on(dst.device)
    rows = n_rest if snapshot else max(1, staging // max(row_bytes, 1))
    for k in range(0, n_rest, rows):
        m = min(rows, n_rest - k)
        slot: _Slot | None = None
        if plan.src_start is not None and not same:
            part = sv[plan.src_start + k : plan.src_start + k + m]
        elif src_host:
            # Host→device: gather on the host straight into pinned memory.
            slot = ring.next(m * row_bytes)
            part = _stage_like(slot.buf, m, sv)
            sw, pw = _wide_pair(sv, part)
            torch.index_select(sw, 0, sidx[k : k + m], out=pw)
        else:
            part = sv.index_select(0, sidx[k : k + m])
        if plan.dst_start is not None:
            dv[plan.dst_start + k : plan.dst_start + k + m].copy_(part, non_blocking=True)
        elif dst_host:
            # Device→host: land in pinned memory; the host scatter runs once it arrived.
            slot = ring.next(m * row_bytes)
            stage = _stage_like(slot.buf, m, dv)
            stage.copy_(part, non_blocking=True)
            slot.scatter = (dv, didx[k : k + m], stage)
        elif same_device:
            dv.index_copy_(0, didx[k : k + m], part)
        else:
            dv.index_copy_(0, didx[k : k + m], part.to(dst.device, non_blocking=True))
        if slot is not None:
            # The slot is busy until the copy just queued into or out of it has run.
            slot.event = ring.ctx.record()


def _copy_blocks_job(
    src: list[torch.Tensor],
    dst: list[torch.Tensor],
    pairs: list[tuple[int, int]],
    config: SchedulerConfig,
) -> None:
    """The body of :meth:`CopyScheduler.copy_blocks`, on a worker thread."""
    planner = _Planner(pairs)
    rings: dict[torch.device, _Ring] = {}
    try:
        for s, d in zip(src, dst, strict=True):
            if s.is_cpu and d.is_cpu:
                _copy_host(s, d, planner, config.staging_bytes)
                continue
            ctx = _context(s.device if is_accelerator(s.device) else d.device)
            ring = rings.get(ctx.device)
            if ring is None:
                ring = rings[ctx.device] = _Ring(ctx, config.swap_in_buffers, config.staging_bytes)
            with ctx.stream():
                _copy_cross(s, d, planner, ring, config.staging_bytes, s.is_cpu, d.is_cpu)
        for ring in rings.values():
            ring.drain()
    finally:
        # Even after an error, nothing queued may outlive the job: the caller may free
        # the memory as soon as the await returns.
        for ring in rings.values():
            ring.abandon()
            ring.ctx.synchronize()


def _copy_many_job(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The body of :meth:`CopyScheduler.copy_many`, on a worker thread."""
    used: dict[torch.device, DeviceContext] = {}
    try:
        for s, d in pairs:
            if s.is_cpu and d.is_cpu:
                d.copy_(s)
                continue
            ctx = _context(s.device if is_accelerator(s.device) else d.device)
            used[ctx.device] = ctx
            with ctx.stream():
                d.copy_(s, non_blocking=True)
    finally:
        for ctx in used.values():
            ctx.synchronize()


# --------------------------------------------------------------------------- jobs and pools


class _JobState(enum.Enum):
    PENDING = enum.auto()
    RUNNING = enum.auto()
    CANCELLED = enum.auto()


class _Job(Generic[T]):
    """One unit of work: runs ``fn`` on a worker, resolves ``future`` on ``loop``.

    The lock makes "start" (worker) and "cancel before start" (loop) mutually exclusive:
    exactly one of them wins.
    """

    __slots__ = ("_fn", "_lock", "_state", "_waiter", "finished", "future", "loop")

    def __init__(self, fn: Callable[[], T], loop: asyncio.AbstractEventLoop) -> None:
        self._fn = fn
        self._lock = threading.Lock()
        self._state = _JobState.PENDING
        self._waiter: asyncio.Future[None] | None = None
        self.finished = False
        self.loop = loop
        self.future: asyncio.Future[T] = loop.create_future()

    def execute(self) -> tuple[T] | BaseException | None:
        """Worker thread: run unless cancelled; ``(result,)``, the exception, or ``None``."""
        with self._lock:
            if self._state is _JobState.CANCELLED:
                return None
            self._state = _JobState.RUNNING
        try:
            return (self._fn(),)
        except StopIteration as exc:
            # A future cannot hold StopIteration; wrap it as asyncio does for coroutines.
            err = RuntimeError(f"job raised StopIteration: {exc!r}")
            err.__cause__ = exc
            return err
        except BaseException as exc:
            return exc

    def report(self, outcome: tuple[T] | BaseException) -> None:
        """Worker thread: hand the outcome to the loop."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            self.loop.call_soon_threadsafe(self._finish, outcome)

    def _finish(self, outcome: tuple[T] | BaseException) -> None:
        self.finished = True
        if not self.future.done():
            if isinstance(outcome, BaseException):
                self.future.set_exception(outcome)
            else:
                self.future.set_result(outcome[0])
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def cancel_if_pending(self) -> bool:
        """Loop thread: stop the job from ever running, if it has not started."""
        with self._lock:
            if self._state is _JobState.PENDING:
                self._state = _JobState.CANCELLED
                return True
            return False

    async def wait_finished(self) -> None:
        """Loop thread: wait for a started job to finish, ignoring further cancellation."""
        if self.finished:
            return
        self._waiter = waiter = self.loop.create_future()
        while not waiter.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(waiter)


class _Stop:
    """Sentinel telling one worker to exit; ``notify`` (if set) runs as it leaves."""

    __slots__ = ("notify",)

    def __init__(self, notify: Callable[[], None] | None = None) -> None:
        self.notify = notify


class _Pool:
    """Worker threads fed by one FIFO queue, started on demand up to ``size``.

    As in ``concurrent.futures.ThreadPoolExecutor``, a new thread starts only when a
    job arrives and no thread is idle, so an unused pool costs no threads.
    """

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.size = size
        self.threads: list[threading.Thread] = []
        self._queue: queue.SimpleQueue[_Job[Any] | _Stop] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        _live_pools.add(self)

    def submit(self, job: _Job[Any]) -> None:
        self._queue.put(job)
        if self._idle.acquire(blocking=False):
            return
        if len(self.threads) < self.size:
            t = threading.Thread(
                target=self._work, name=f"aiokv-{self.name}-{len(self.threads)}", daemon=False
            )
            t.start()
            self.threads.append(t)

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if isinstance(item, _Stop):
                if item.notify is not None:
                    item.notify()
                return
            outcome = item.execute()
            # Idle before the loop hears back, so the loop's next submit reuses this thread.
            self._idle.release()
            if outcome is not None:
                item.report(outcome)
            del item, outcome  # drop what the job referenced before blocking again

    def stop_one(self, notify: Callable[[], None] | None = None) -> None:
        """Queue a sentinel (behind any queued jobs) that stops one thread."""
        self._queue.put(_Stop(notify))

    def stop(self) -> None:
        """Queue one stop sentinel per thread started."""
        for _ in self.threads:
            self.stop_one()


_live_pools: weakref.WeakSet[_Pool] = weakref.WeakSet()


def _stop_live_pools() -> None:
    for pool in list(_live_pools):
        pool.stop()


# Non-daemon workers of a scheduler that was never closed would keep the interpreter
# from exiting. threading's private pre-join hook (the one concurrent.futures uses) runs
# before non-daemon threads are joined; plain atexit would run too late.
getattr(threading, "_register_atexit", atexit.register)(_stop_live_pools)


def _stop_pools(pools: tuple[_Pool, ...]) -> None:
    for pool in pools:
        pool.stop()


# --------------------------------------------------------------------------- public


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Thread and buffer sizes of a :class:`CopyScheduler` (defaults as llm_datadist).

    Attributes:
        swap_out_threads: threads for device→host and host→host copies and ``call``.
        swap_in_buffers: pinned host staging slots per worker and accelerator; host→device
            (and device→host) index copies cycle through them so transfers overlap.
        d2d_threads: threads for host→device and device→device copies.
        staging_bytes: size of one staging slot / host gather chunk.
    """

    swap_out_threads: int = 4
    swap_in_buffers: int = 4
    d2d_threads: int = 1
    staging_bytes: int = _DEFAULT_STAGING_BYTES

    def __post_init__(self) -> None:
        for name in ("swap_out_threads", "swap_in_buffers", "d2d_threads", "staging_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"SchedulerConfig: {name} must be int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"SchedulerConfig: {name}={value} must be >= 1")


class CopyScheduler:
    """Runs copy jobs for one device on worker threads; every method is awaited.

    Each call is one job. If the awaiting task is cancelled before the job starts, it
    never runs; if cancelled while it runs, the await still waits for it to finish and
    then raises ``CancelledError``, so no worker touches the caller's memory after the
    call returned. Exceptions raised by a job propagate unchanged (callers map them).

    Args:
        device: the device this scheduler serves (``cpu``, ``cuda:N`` or ``npu:N``).
        config: thread and buffer sizes.
    """

    def __init__(self, device: torch.device, config: SchedulerConfig = SchedulerConfig()) -> None:
        if not isinstance(device, torch.device):
            raise TypeError(f"CopyScheduler: device must be torch.device, got {type(device)}")
        if not isinstance(config, SchedulerConfig):
            raise TypeError(f"CopyScheduler: config must be SchedulerConfig, got {type(config)}")
        self.device = device
        self.config = config
        self._swap_out = _Pool("swap-out", config.swap_out_threads)
        self._d2d = _Pool("d2d", config.d2d_threads)
        self._closed = False
        self._finalizer = weakref.finalize(self, _stop_pools, (self._swap_out, self._d2d))

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` has been called."""
        return self._closed

    @property
    def threads(self) -> list[threading.Thread]:
        """The worker threads started so far."""
        return [*self._swap_out.threads, *self._d2d.threads]

    async def copy_blocks(
        self,
        src: Sequence[torch.Tensor],
        dst: Sequence[torch.Tensor],
        pairs: Sequence[tuple[int, int]],
    ) -> None:
        """``dst[i][d] = src[i][s]`` for every tensor index ``i`` and pair ``(s, d)``.

        Dim 0 of every tensor indexes blocks; ``src[i]`` and ``dst[i]`` must have the same
        per-block shape and dtype (validated by the caller). All tensors and pairs are one
        job. If a destination block appears in two pairs, which source wins is unspecified.
        When ``src[i]`` and ``dst[i]`` share memory, all reads happen before any write.

        Raises:
            RuntimeError: the scheduler is closed.
            Exception: whatever torch raised in the worker, unchanged.
        """
        self._check_open()
        src_l, dst_l, pairs_l = list(src), list(dst), list(pairs)
        if len(src_l) != len(dst_l):
            raise ValueError(f"copy_blocks: {len(src_l)} source vs {len(dst_l)} destination")
        if not pairs_l or not src_l:
            return
        pool = self._d2d if is_accelerator(dst_l[0].device) else self._swap_out
        job = functools.partial(_copy_blocks_job, src_l, dst_l, pairs_l, self.config)
        await self._run(pool, job)

    async def copy_many(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """``dst.copy_(src)`` for every ``(src, dst)`` in order, as one job.

        Raises:
            RuntimeError: the scheduler is closed.
            Exception: whatever torch raised in the worker, unchanged.
        """
        self._check_open()
        pairs_l = list(pairs)
        if not pairs_l:
            return
        to_device = any(is_accelerator(d.device) for _, d in pairs_l)
        job = functools.partial(_copy_many_job, pairs_l)
        await self._run(self._d2d if to_device else self._swap_out, job)

    async def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn()`` on a worker thread and return its result (same cancellation rules).

        Raises:
            RuntimeError: the scheduler is closed (or ``fn`` raised ``StopIteration``,
                which a future cannot carry; it is chained as the cause).
            Exception: whatever ``fn`` raised, unchanged.
        """
        self._check_open()
        return await self._run(self._swap_out, fn)

    async def aclose(self) -> None:
        """Let queued jobs finish, stop every worker thread and join it. Idempotent.

        Later calls to any other method raise ``RuntimeError``.
        """
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        loop = asyncio.get_running_loop()
        exits: list[asyncio.Future[None]] = []
        for pool in (self._swap_out, self._d2d):
            for _ in pool.threads:
                fut: asyncio.Future[None] = loop.create_future()
                exits.append(fut)
                pool.stop_one(functools.partial(_resolve_threadsafe, loop, fut))
        await asyncio.gather(*exits)
        for t in self.threads:
            t.join()  # each has already left its loop; this only reaps it

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("CopyScheduler is closed")

    async def _run(self, pool: _Pool, fn: Callable[[], T]) -> T:
        job = _Job(fn, asyncio.get_running_loop())
        pool.submit(job)
        try:
            return await job.future
        except asyncio.CancelledError:
            if not job.cancel_if_pending():
                await job.wait_finished()
            raise


def _resolve_threadsafe(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None]) -> None:
    def resolve() -> None:
        if not fut.done():
            fut.set_result(None)

    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(resolve)
