"""``CopyScheduler``: the copy engine's façade, one awaited job per call.

A call (``copy_blocks``, ``copy_many``, ``call``) becomes ONE job on a worker pool
(:mod:`._workers`) running a copy kernel (:mod:`._kernels`); the loop never sleeps,
polls or waits on a device. Pools follow llm_datadist: device→host and host→host copies
(and :meth:`CopyScheduler.call`) on ``swap_out_threads`` threads; host→device and
device→device copies on ``d2d_threads`` (one) thread, host→device staged through a ring
of ``swap_in_buffers`` pinned buffers; the copies that stage transfer bytes
(:meth:`CopyScheduler.stage`, for :mod:`._staging`) on a pool of their own, so that a
long local copy never delays a transfer past its deadline. Threads start on demand,
are named ``aiokv-<pool>-<n>``, and are joined by :meth:`CopyScheduler.aclose`.

Cancellation: a job cancelled before it starts never runs; once started it is never
abandoned half-way: the awaiting task waits (shielded) for it to finish, so no worker
writes caller memory after the await returned. A job that then completed returns its
result (the cancellation comes again at the next suspension); one that failed raises
``CancelledError``.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import weakref
from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from .._stats import CopyStats
from .._stats import OpCounter
from ._device import is_accelerator
from ._kernels import DEFAULT_STAGING_BYTES
from ._kernels import copy_blocks_job
from ._kernels import copy_many_job
from ._workers import WorkerPool

__all__ = ["CopyScheduler", "SchedulerConfig"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Thread and buffer sizes of a :class:`CopyScheduler` (defaults as llm_datadist).

    Attributes:
        swap_out_threads: threads for device→host and host→host copies and ``call``;
            as many again for the staging copies of transfers (``stage``).
        swap_in_buffers: pinned host staging slots per worker and accelerator; host→device
            (and device→host) index copies cycle through them so transfers overlap.
        d2d_threads: threads for host→device and device→device copies.
        staging_bytes: size of one staging slot / host gather chunk.
    """

    swap_out_threads: int = 4
    swap_in_buffers: int = 4
    d2d_threads: int = 1
    staging_bytes: int = DEFAULT_STAGING_BYTES

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
    never runs; if cancelled while it runs, the await still waits for it to finish, so
    no worker touches the caller's memory after the call returned, and then returns the
    job's result (it happened; the cancellation comes again at the next suspension) or,
    if the job failed, raises ``CancelledError``. Exceptions raised by a job propagate
    unchanged (callers map them).

    Args:
        device: the device this scheduler serves (``cpu``, ``cuda:N`` or ``npu:N``).
        config: thread and buffer sizes.
        jobs: counts its jobs (:meth:`statistics`); a fresh one when not given.
        inline: counts the small host copies its owner does inline (``record`` them
            with ``inline.measure``); a fresh one when not given.
    """

    def __init__(
        self,
        device: torch.device,
        config: SchedulerConfig = SchedulerConfig(),
        *,
        jobs: OpCounter | None = None,
        inline: OpCounter | None = None,
    ) -> None:
        if not isinstance(device, torch.device):
            raise TypeError(f"CopyScheduler: device must be torch.device, got {type(device)}")
        if not isinstance(config, SchedulerConfig):
            raise TypeError(f"CopyScheduler: config must be SchedulerConfig, got {type(config)}")
        self.device = device
        self.config = config
        self._swap_out = WorkerPool("swap-out", config.swap_out_threads)
        self._d2d = WorkerPool("d2d", config.d2d_threads)
        self._stage = WorkerPool("stage", config.swap_out_threads)
        self._closed = False
        self.jobs = jobs if jobs is not None else OpCounter()
        self.inline = inline if inline is not None else OpCounter()
        # Dropped without aclose(): tell the threads to exit (they are not joined).
        self._finalizer = weakref.finalize(
            self, _stop_nowait, (self._swap_out, self._d2d, self._stage)
        )

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` has been called."""
        return self._closed

    @property
    def threads(self) -> list[threading.Thread]:
        """The worker threads started so far."""
        return [*self._swap_out.threads, *self._d2d.threads, *self._stage.threads]

    def statistics(self) -> CopyStats:
        """Jobs run (bytes copied, failures, latency), inline copies, the queue now."""
        return CopyStats(
            jobs=self.jobs.snapshot(),
            inline=self.inline.snapshot(),
            queue_depth=sum(p.queue_depth for p in (self._swap_out, self._d2d, self._stage)),
            threads=len(self.threads),
        )

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
        cfg = self.config
        job = functools.partial(
            copy_blocks_job, src_l, dst_l, pairs_l, cfg.swap_in_buffers, cfg.staging_bytes
        )
        with self.jobs.measure(len(pairs_l) * sum(_block_bytes(t) for t in dst_l)):
            await pool.run(job)

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
        job = functools.partial(copy_many_job, pairs_l)
        with self.jobs.measure(sum(d.nbytes for _, d in pairs_l)):
            await (self._d2d if to_device else self._swap_out).run(job)

    async def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn()`` on a worker thread and return its result (same cancellation rules).

        Raises:
            RuntimeError: the scheduler is closed (or ``fn`` raised ``StopIteration``,
                which a future cannot carry; it is chained as the cause).
            Exception: whatever ``fn`` raised, unchanged.
        """
        self._check_open()
        with self.jobs.measure(0):
            return await self._swap_out.run(fn)

    async def stage(self, fn: Callable[[], T]) -> T:
        """As :meth:`call`, on the staging pool: the copies that move a transfer's bytes
        between device and host staging memory (their own threads: local copies and
        ``call`` jobs never delay them, nor they those).

        Raises:
            RuntimeError: as :meth:`call`.
            Exception: whatever ``fn`` raised, unchanged.
        """
        self._check_open()
        with self.jobs.measure(0):
            return await self._stage.run(fn)

    async def aclose(self) -> None:
        """Let queued jobs finish, stop every worker thread and join it. Idempotent.

        Later calls to any other method raise ``RuntimeError``.
        """
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        await asyncio.gather(self._swap_out.aclose(), self._d2d.aclose(), self._stage.aclose())

    def stop_nowait(self) -> None:
        """Close without waiting (any thread, no loop needed): the worker threads exit
        after their queued jobs and are not joined. For an owner whose event loop is
        gone (:meth:`aclose` needs one). Idempotent."""
        self._closed = True
        self._finalizer()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("CopyScheduler is closed")


def _block_bytes(t: torch.Tensor) -> int:
    """Bytes of one block (one index of dim 0) of ``t``."""
    return t.nbytes // t.shape[0] if t.dim() and t.shape[0] else 0


def _stop_nowait(pools: tuple[WorkerPool, ...]) -> None:
    for pool in pools:
        pool.stop_nowait()
