"""Copy kernels: the bodies of copy jobs, run on a worker thread.

Host copies go through slices and index gathers/scatters (via a cache-sized staging
buffer); copies with an accelerator on either side run on a per-worker side stream, the
host side of index copies staged through a ring of pinned buffers so transfers overlap.
Staging buffers, rings and device contexts live in thread-local state and are reused
across jobs. A job never returns while a copy it queued may still write memory.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from ._device import DeviceContext
from ._device import host_empty
from ._device import is_accelerator
from ._plan import Planner
from ._plan import row_nbytes
from ._plan import stage_like

__all__ = [
    "DEFAULT_STAGING_BYTES",
    "Ring",
    "copy_blocks_job",
    "copy_cross",
    "copy_many_job",
    "worker_context",
]

# Index paths on the host gather into a staging buffer of at most this size, then
# scatter from it: small enough to stay in the last-level cache, large enough that the
# per-chunk op overhead is noise (measured: 4 MiB beats both 1 MiB and unchunked).
DEFAULT_STAGING_BYTES = 4 << 20

# index_copy_ on CPU copies element by element, so the widest element is fastest:
# measured ~2x faster as complex128 than as bf16/fp16, and int dtypes are slower than
# float ones. Values are only moved, never computed on, so any bit pattern survives.
_WIDE_DTYPES = (torch.complex128, torch.float64, torch.float32)


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


class _WorkerState(threading.local):
    """Per worker thread: staging buffers and device contexts, reused across jobs."""

    def __init__(self) -> None:
        self.stage = torch.empty(0, dtype=torch.uint8)
        self.contexts: dict[torch.device, DeviceContext] = {}
        self.rings: dict[torch.device, list[_Slot]] = {}


_state = _WorkerState()


def _host_stage(nbytes: int) -> torch.Tensor:
    if _state.stage.numel() < nbytes:
        _state.stage = torch.empty(nbytes, dtype=torch.uint8)
    return _state.stage


def worker_context(device: torch.device) -> DeviceContext:
    """This worker thread's :class:`DeviceContext` for ``device`` (made once, reused)."""
    ctx = _state.contexts.get(device)
    if ctx is None:
        ctx = _state.contexts[device] = DeviceContext(device)
    return ctx


def _needs_snapshot(src: torch.Tensor, dst: torch.Tensor, planner: Planner) -> tuple[bool, bool]:
    """``(snapshot, same)``: whether the copy must do every read before any write (the
    tensors may share memory and a block is both read and written), and whether they are
    one view. Runs once per tensor per call, so the common case makes few torch calls."""
    s0, d0 = src.data_ptr(), dst.data_ptr()
    if s0 == d0 and src.shape == dst.shape and src.stride() == dst.stride():
        return not planner.disjoint, True
    if src.is_contiguous() and dst.is_contiguous():
        return s0 < d0 + dst.nbytes and d0 < s0 + src.nbytes, False
    return _overlap(src, dst), False


def _copy_host(src: torch.Tensor, dst: torch.Tensor, planner: Planner, staging: int) -> None:
    """``dst[d] = src[s]`` for every planned pair, both tensors in host memory.

    Kept lean: it runs once per tensor per call, and a call may carry 64+ tensors.
    """
    snapshot, same = _needs_snapshot(src, dst, planner)
    if snapshot:
        plan = planner.snapshot()
        sw, dw = _wide_pair(src, dst)
        dw.index_copy_(0, plan.rest_dst, sw.index_select(0, plan.rest_src))
        return
    row_bytes = row_nbytes(src)
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


class Ring:
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


def copy_cross(
    src: torch.Tensor,
    dst: torch.Tensor,
    planner: Planner,
    ring: Ring,
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
    row_bytes = row_nbytes(src)
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
            part = stage_like(slot.buf, m, sv)
            sw, pw = _wide_pair(sv, part)
            torch.index_select(sw, 0, sidx[k : k + m], out=pw)
        else:
            part = sv.index_select(0, sidx[k : k + m])
        if plan.dst_start is not None:
            dv[plan.dst_start + k : plan.dst_start + k + m].copy_(part, non_blocking=True)
        elif dst_host:
            # Device→host: land in pinned memory; the host scatter runs once it arrived.
            slot = ring.next(m * row_bytes)
            stage = stage_like(slot.buf, m, dv)
            stage.copy_(part, non_blocking=True)
            slot.scatter = (dv, didx[k : k + m], stage)
        elif same_device:
            dv.index_copy_(0, didx[k : k + m], part)
        else:
            dv.index_copy_(0, didx[k : k + m], part.to(dst.device, non_blocking=True))
        if slot is not None:
            # The slot is busy until the copy just queued into or out of it has run.
            slot.event = ring.ctx.record()


def copy_blocks_job(
    src: list[torch.Tensor],
    dst: list[torch.Tensor],
    pairs: list[tuple[int, int]],
    buffers: int,
    staging: int,
) -> None:
    """The body of :meth:`CopyScheduler.copy_blocks`, on a worker thread.

    ``buffers`` pinned ring slots per accelerator, each ``staging`` bytes (also the host
    gather chunk).
    """
    planner = Planner(pairs)
    rings: dict[torch.device, Ring] = {}
    try:
        for s, d in zip(src, dst, strict=True):
            if s.is_cpu and d.is_cpu:
                _copy_host(s, d, planner, staging)
                continue
            ctx = worker_context(s.device if is_accelerator(s.device) else d.device)
            ring = rings.get(ctx.device)
            if ring is None:
                ring = rings[ctx.device] = Ring(ctx, buffers, staging)
            with ctx.stream():
                copy_cross(s, d, planner, ring, staging, s.is_cpu, d.is_cpu)
        for ring in rings.values():
            ring.drain()
    finally:
        # Even after an error, nothing queued may outlive the job: the caller may free
        # the memory as soon as the await returns.
        for ring in rings.values():
            ring.abandon()
            ring.ctx.synchronize()


def copy_many_job(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The body of :meth:`CopyScheduler.copy_many`, on a worker thread."""
    used: dict[torch.device, DeviceContext] = {}
    try:
        for s, d in pairs:
            if s.is_cpu and d.is_cpu:
                d.copy_(s)
                continue
            ctx = worker_context(s.device if is_accelerator(s.device) else d.device)
            used[ctx.device] = ctx
            with ctx.stream():
                d.copy_(s, non_blocking=True)
    finally:
        for ctx in used.values():
            ctx.synchronize()
