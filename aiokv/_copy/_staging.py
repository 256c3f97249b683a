"""Staging: the bytes of a transfer that live in accelerator memory, through host buffers.

Transports move host memory. A transfer whose local bytes are on a device (a ``cuda``
or ``npu`` cache) is staged: :class:`Stager` copies them device→host into a host buffer
before they are sent (:meth:`Stager.gather`), or lends a host buffer to receive into
and copies it host→device afterwards (:meth:`Stager.reserve`, :meth:`Stager.scatter`).

* The copies run on a copy worker thread, on that thread's side stream of the device
  (after it waited for work queued on the device's current stream), and the worker —
  never the event loop — waits for them. Host buffers are pinned, so the copies are
  DMA at full speed.
* Many runs of one size (the blocks of a paged cache) are gathered with one
  ``index_select`` per tensor into device scratch and ONE device→host copy (scattered
  likewise with one host→device copy and ``index_copy_``); a few runs are copied
  directly.
* The host memory in use at once is bounded by :data:`STAGE_LIMIT` per ``Stager``; a
  caller waits for room (within its deadline). The budget (:class:`Budget`) is shared
  per link, the ``owner`` of a request: one owner holds at most
  ``limit // max(2, owners)`` bytes (one request more while it holds nothing), owners
  that wait are served in turn, and an owner's queued requests go with its link
  (:meth:`Stager.drop`): one peer that never reads cannot starve the others.
* Pipelining — the copy of part i+1 while part i is on the wire — comes from the
  caller running parts concurrently (:mod:`aiokv._remote._client`), each part at most
  :data:`PART_BYTES` bytes.

For tests on machines without an accelerator, ``AIOKV_TEST_STAGE_HOST=1`` in the
environment makes CPU caches take the staged path too (:func:`is_staged`); it changes
no result, only the route. It is a testing knob, not a setting.
"""

from __future__ import annotations

import asyncio
import collections
import os
from collections.abc import Hashable
from collections.abc import Iterator
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import Final

import numpy as np
import numpy.typing as npt
import torch

from .._enums import LLMStatusCode
from .._errors import LLMException
from .._layout import ByteLayout
from .._layout import tensor_bytes
from ._device import supports_pinning
from ._kernels import worker_context
from ._scheduler import CopyScheduler

__all__ = [
    "MAX_STAGED_BYTES",
    "PART_BYTES",
    "STAGE_LIMIT",
    "Budget",
    "Staged",
    "Stager",
    "is_staged",
]

#: Bytes of one part of a staged transfer (the unit the pipeline overlaps).
PART_BYTES: Final = 8 << 20
#: Most bytes one request into or out of staged memory may move (a peer's request for
#: more is refused, so that serving it needs no more host memory than this).
MAX_STAGED_BYTES: Final = 64 << 20
#: Host staging memory one ``Stager`` holds at once.
STAGE_LIMIT: Final = 4 * MAX_STAGED_BYTES

#: Runs below this many are copied one by one; above, gathered by row index.
_FEW_RUNS: Final = 8
#: Rows of an index gather must be at least this long (else per-run copies). Its index
#: costs 8 bytes a row: at this length as many bytes as it moves, where a copy per run
#: costs a Python call, two tensor views and a kernel launch per run (8,192 runs of 8
#: bytes on CPU: 80 ms run by run, 0.24 ms by index; scripts/bench_staging_rows.py).
_MIN_ROW: Final = 8

_STAGE_HOST: Final = os.environ.get("AIOKV_TEST_STAGE_HOST") == "1"


def is_staged(device: torch.device) -> bool:
    """Whether memory on ``device`` moves through host staging: every accelerator (and,
    under the ``AIOKV_TEST_STAGE_HOST=1`` testing knob, the CPU too)."""
    return device.type != "cpu" or _STAGE_HOST


@dataclass(slots=True, eq=False)
class Staged:
    """A host buffer lent by a :class:`Stager`; :meth:`release` gives it back (once).

    Attributes:
        host: the ``uint8`` host tensor (pinned where the device allows).
        view: a writable memoryview of all of ``host``, for a transport.
    """

    host: torch.Tensor
    view: memoryview
    _budget: Budget | None = field(repr=False)
    _owner: Hashable = field(repr=False, default=None)

    def release(self) -> None:
        """Return the buffer's room to its stager; idempotent. The transport must be done
        with :attr:`view` (a grant's ``done`` ran, or the request returned)."""
        budget, self._budget = self._budget, None
        if budget is not None:
            budget.give(self._owner, self.host.numel())


class Stager:
    """Host staging of device-resident transfer bytes, bounded by ``limit`` bytes.

    Use it from one event loop (the engine's); the copies run as jobs of ``scheduler``'s
    staging pool. ``owner`` (any hashable; aiokv passes the link's
    :class:`~aiokv.transport.PeerInfo`) names whose request it is, for the fair share
    of :class:`Budget`; :meth:`drop` fails an owner's queued requests when it goes.

    Args:
        scheduler: the copy scheduler whose workers issue and wait for the copies.
        limit: host bytes lent at once (default :data:`STAGE_LIMIT`); a request over it
            is refused, others wait.
    """

    def __init__(self, scheduler: CopyScheduler, limit: int | None = None) -> None:
        self._scheduler = scheduler
        self.budget = Budget(STAGE_LIMIT if limit is None else limit)

    @property
    def in_use(self) -> int:
        """Host bytes lent right now."""
        return self.budget.limit - self.budget.free

    def drop(self, owner: Hashable) -> None:
        """``owner``'s link went: its queued requests fail with ``LLM_LINK_FAILED`` now
        (what it holds comes back as its grants end)."""
        self.budget.drop(owner)

    async def gather(
        self,
        buffers: Sequence[torch.Tensor],
        layout: ByteLayout,
        timeout: float,
        owner: Hashable = None,
    ) -> Staged:
        """The bytes ``layout`` names of each flat ``uint8`` buffer (all on one device),
        in wire order, copied into a host buffer.

        Raises:
            LLMException: ``LLM_PARAM_INVALID`` over the limit; ``LLM_TIMEOUT`` when no
                room came within ``timeout`` seconds; ``LLM_LINK_FAILED`` when
                ``owner`` was dropped while it waited.
            Exception: whatever torch raised in the worker.
        """
        device = buffers[0].device
        nbytes = layout.total(len(buffers))
        await self.budget.take(owner, nbytes, timeout)
        try:
            host = await self._scheduler.stage(lambda: _gather(buffers, layout, device))
        except BaseException:
            self.budget.give(owner, nbytes)
            raise
        return Staged(host, tensor_bytes(host), self.budget, owner)

    async def reserve(
        self,
        nbytes: int,
        device: torch.device,
        timeout: float,
        owner: Hashable = None,
    ) -> Staged:
        """An uninitialised host buffer of ``nbytes`` to receive bytes bound for ``device``.

        Raises:
            LLMException: as :meth:`gather`.
        """
        await self.budget.take(owner, nbytes, timeout)
        try:
            host = await self._scheduler.stage(lambda: _host(nbytes, device))
        except BaseException:
            self.budget.give(owner, nbytes)
            raise
        return Staged(host, tensor_bytes(host), self.budget, owner)

    async def scatter(
        self, staged: Staged, buffers: Sequence[torch.Tensor], layout: ByteLayout
    ) -> None:
        """Copy ``staged`` (wire order) into the bytes ``layout`` names of each buffer;
        returns once the bytes are in device memory. Cancelled while the copy runs, it
        still waits for the copy to end (so the buffers are not written afterwards).

        Raises:
            Exception: whatever torch raised in the worker.
        """
        device = buffers[0].device
        await self._scheduler.stage(lambda: _scatter(staged.host, buffers, layout, device))

    async def settle(self, device: torch.device) -> None:
        """Return once work already queued on ``device``'s current stream has finished
        (waited for on a copy worker, as the staging copies wait for it): what device
        memory moved by address (NIXL) needs first. Lends nothing. When that stream is
        idle already (an event recorded on it has completed: checked here, without
        waiting), there is nothing to wait for and no worker is involved."""
        if _idle(device):
            return

        def wait() -> None:
            ctx = worker_context(device)
            with ctx.stream():
                pass
            ctx.synchronize()

        await self._scheduler.stage(wait)


@dataclass(slots=True, eq=False)
class _Claim:
    """One request for room: queued until granted, withdrawn, or dropped."""

    owner: Hashable
    nbytes: int
    fut: asyncio.Future[None]
    queued: bool = True
    granted: bool = False


class Budget:
    """``limit`` bytes lent to owners (links), fairly: the staging byte budget.

    Bookkeeping is synchronous; only :meth:`take` awaits. The rules:

    * An owner may hold at most its share, ``limit // max(2, active owners)`` (owners
      holding or waiting), except that one holding nothing may always take one request
      (up to ``limit``). So one owner never holds more than half while another waits.
    * Waiting owners are served in turn (round-robin), each owner's requests in order.
      The first owner in turn that is within its share waits for room; owners behind
      it do not overtake it (a big request is not starved by small ones); owners over
      their share are passed over.
    * Exact: ``free + held == limit`` after any interleaving of grants, releases,
      cancellations, timeouts and :meth:`drop` — a claim granted in the same loop turn
      as its waiter gave up is given back, one that was not is withdrawn.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.free = limit
        self.held: dict[Hashable, int] = {}  # owner -> bytes it holds (> 0)
        self._queues: dict[Hashable, collections.deque[_Claim]] = {}  # in turn order

    @property
    def waiting(self) -> int:
        """Requests queued now (some may be withdrawn already, not yet removed)."""
        return sum(map(len, self._queues.values()))

    def share(self) -> int:
        """The most one owner holds while others are active."""
        return self.limit // max(2, len(self.held.keys() | self._queues.keys()))

    async def take(self, owner: Hashable, nbytes: int, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) until ``owner`` may hold ``nbytes`` more,
        and count them as its own (:meth:`give` returns them).

        Raises:
            LLMException: ``LLM_PARAM_INVALID`` over the limit (nothing waits),
                ``LLM_TIMEOUT`` past the timeout, ``LLM_LINK_FAILED`` when ``owner``
                was dropped meanwhile. Cancelled, nothing is held.
        """
        if nbytes > self.limit:
            raise LLMException(
                f"staging {nbytes} bytes exceeds the staging limit of {self.limit}",
                status_code=LLMStatusCode.LLM_PARAM_INVALID,
            )
        if not self._queues and nbytes <= self.free and self._within(owner, nbytes):
            self._grant(owner, nbytes)
            return
        claim = _Claim(owner, nbytes, asyncio.get_running_loop().create_future())
        self._queues.setdefault(owner, collections.deque()).append(claim)
        self._dispatch()
        if claim.granted:
            return
        try:
            async with asyncio.timeout(timeout):
                await claim.fut
        except BaseException as exc:
            if claim.granted:
                self.give(owner, nbytes)  # the room came in the turn we gave up
            elif claim.queued:
                self._withdraw(claim)
            if isinstance(exc, TimeoutError):
                raise LLMException(
                    f"no host staging room for {nbytes} bytes within {timeout:.3g} s",
                    status_code=LLMStatusCode.LLM_TIMEOUT,
                ) from None
            raise

    def give(self, owner: Hashable, nbytes: int) -> None:
        """``owner`` returns ``nbytes`` it held; waiting owners are served."""
        left = self.held.get(owner, 0) - nbytes
        if left < 0 or nbytes < 0:
            raise RuntimeError(f"staging budget: {owner!r} returns more than it holds")
        if not nbytes:
            return  # an empty grant held nothing (see _grant)
        if left:
            self.held[owner] = left
        else:
            del self.held[owner]
        self.free += nbytes
        self._dispatch()

    def drop(self, owner: Hashable) -> None:
        """Fail ``owner``'s queued claims with ``LLM_LINK_FAILED`` (only claims made
        under this very object: an equal owner of a newer link keeps its own)."""
        queue = self._queues.get(owner)
        if queue is None:
            return
        mine = [c for c in queue if c.owner is owner]
        for claim in mine:
            claim.queued = False
            if not claim.fut.done():
                claim.fut.set_exception(
                    LLMException(
                        "staging: the link went while its request waited for room",
                        status_code=LLMStatusCode.LLM_LINK_FAILED,
                    )
                )
        rest = [c for c in queue if c.owner is not owner]
        if rest:
            self._queues[owner] = collections.deque(rest)
        else:
            del self._queues[owner]
        self._dispatch()

    def _within(self, owner: Hashable, nbytes: int) -> bool:
        held = self.held.get(owner, 0)
        return not held or held + nbytes <= self.share()

    def _grant(self, owner: Hashable, nbytes: int) -> None:
        if not nbytes:
            return  # nothing held: no entry, else its owner counts as active and two
            # empty grants would share (and both delete) one entry
        self.free -= nbytes
        self.held[owner] = self.held.get(owner, 0) + nbytes

    def _withdraw(self, claim: _Claim) -> None:
        claim.queued = False
        queue = self._queues[claim.owner]
        queue.remove(claim)
        if not queue:
            del self._queues[claim.owner]
        self._dispatch()  # a request behind it, or an owner whose share grew, may fit

    def _dispatch(self) -> None:
        """Grant what the rules allow now, in turn order (see the class docstring)."""
        while self._queues:
            for owner, queue in self._queues.items():
                while queue and queue[0].fut.done():  # its waiter gave up this turn
                    queue.popleft().queued = False
                if not queue:
                    del self._queues[owner]
                    break  # the ring changed: start over
                claim = queue[0]
                if not self._within(owner, claim.nbytes):
                    continue  # over its share: the others go first
                if claim.nbytes > self.free:
                    return  # its turn: it waits for room, nobody overtakes it
                queue.popleft()
                claim.queued = False
                claim.granted = True
                self._grant(owner, claim.nbytes)
                claim.fut.set_result(None)
                del self._queues[owner]
                if queue:
                    self._queues[owner] = queue  # to the back of the turn
                break
            else:
                return  # every waiting owner is over its share


def _idle(device: torch.device) -> bool:
    """Whether ``device``'s current stream has finished everything queued on it so far
    (a non-blocking query of an event recorded on it; False where that cannot be asked)."""
    if device.type == "cpu":
        return True
    try:
        event = torch.Event(device)
        event.record(torch.accelerator.current_stream(device))
        return bool(event.query())
    except (RuntimeError, ValueError):
        return False


# ---- the copy jobs (on a worker thread) ---------------------------------------------------


def _host(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=supports_pinning(device))


def _rows(layout: ByteLayout) -> tuple[int, npt.NDArray[np.int64]] | None:
    """``(row bytes, row indices)`` covering the layout's runs, when there are many runs
    and a common row length of at least :data:`_MIN_ROW` bytes; else None."""
    if layout.runs <= _FEW_RUNS:
        return None
    starts = np.asarray(layout.starts, dtype=np.int64)
    ends = np.asarray(layout.ends, dtype=np.int64)
    unit = int(np.gcd.reduce(np.concatenate((starts, ends))))
    if unit < _MIN_ROW:
        return None
    counts = (ends - starts) // unit
    before = np.concatenate(([0], np.cumsum(counts)[:-1]))
    idx = np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(starts // unit - before, counts)
    return unit, idx


def _as_rows(buf: torch.Tensor, unit: int) -> torch.Tensor:
    return buf[: buf.numel() // unit * unit].view(-1, unit)


def _runs(
    host: torch.Tensor, buffers: Sequence[torch.Tensor], layout: ByteLayout
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(run of a buffer, its place in host)`` for each run, in wire order."""
    bounds = list(layout.bounds())  # (few runs, or rows under _MIN_ROW: see _rows)
    pos = 0
    for buf in buffers:
        for a, b in bounds:
            yield buf[a:b], host[pos : pos + b - a]
            pos += b - a


def _gather(
    buffers: Sequence[torch.Tensor], layout: ByteLayout, device: torch.device
) -> torch.Tensor:
    host = _host(layout.per_buffer * len(buffers), device)
    _copy(host, buffers, layout, device, to_host=True)
    return host


def _scatter(
    host: torch.Tensor, buffers: Sequence[torch.Tensor], layout: ByteLayout, device: torch.device
) -> None:
    _copy(host, buffers, layout, device, to_host=False)


def _copy(
    host: torch.Tensor,
    buffers: Sequence[torch.Tensor],
    layout: ByteLayout,
    device: torch.device,
    *,
    to_host: bool,
) -> None:
    """Copy the layout's bytes of ``buffers`` into ``host`` (``to_host``, in wire order)
    or back, on the device's worker stream, and wait for it: run by run, or (many runs
    of one row length, see :func:`_rows`) one indexed copy per buffer."""
    ctx = worker_context(device)
    with ctx.stream():
        rows = _rows(layout)
        if rows is None:
            for dev, part in _runs(host, buffers, layout):
                dst, src = (part, dev) if to_host else (dev, part)
                dst.copy_(src, non_blocking=True)
        else:
            unit, idx = rows
            index = torch.from_numpy(idx).to(device)
            rows_copy = _gather_rows if to_host else _scatter_rows
            rows_copy(host, buffers, layout.per_buffer, unit, index)
    ctx.synchronize()


def _gather_rows(
    host: torch.Tensor, buffers: Sequence[torch.Tensor], per: int, unit: int, index: torch.Tensor
) -> None:
    """Rows ``index`` of each buffer into its ``per`` bytes of ``host`` (on a device,
    through a device buffer: one device-to-host copy)."""
    device = index.device  # the copy's
    out = host if device.type == "cpu" else torch.empty_like(host, device=device)
    for i, buf in enumerate(buffers):
        dst = out[i * per : (i + 1) * per].view(-1, unit)
        torch.index_select(_as_rows(buf, unit), 0, index, out=dst)
    if out is not host:
        host.copy_(out, non_blocking=True)


def _scatter_rows(
    host: torch.Tensor, buffers: Sequence[torch.Tensor], per: int, unit: int, index: torch.Tensor
) -> None:
    """Each buffer's ``per`` bytes of ``host`` into its rows ``index`` (one host-to-device
    copy first)."""
    src = host.to(index.device, non_blocking=True)
    for i, buf in enumerate(buffers):
        part = src[i * per : (i + 1) * per].view(-1, unit)
        _as_rows(buf, unit).index_copy_(0, index, part)
