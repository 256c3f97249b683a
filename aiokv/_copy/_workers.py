"""Worker thread pools and jobs whose outcome is handed back to the event loop.

A job is queued to a pool, runs on one of its threads, and its outcome resolves an
asyncio future through ONE ``loop.call_soon_threadsafe`` callback: the loop never
sleeps, polls or blocks on a worker. A job cancelled before it starts never runs; once
started it is never abandoned half-way, and one that then completes returns its result
(the cancellation comes again at the caller's next suspension).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import enum
import functools
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any
from typing import Generic
from typing import TypeVar

from .._cancel import redeliver

__all__ = ["WorkerPool"]

T = TypeVar("T")


class _JobState(enum.Enum):
    PENDING = enum.auto()
    RUNNING = enum.auto()
    CANCELLED = enum.auto()


class _Job(Generic[T]):
    """One unit of work: runs ``fn`` on a worker, resolves ``future`` on ``loop``.

    The lock makes "start" (worker) and "cancel before start" (loop) mutually exclusive:
    exactly one of them wins.
    """

    __slots__ = (
        "_fn",
        "_lock",
        "_state",
        "_waiter",
        "finished",
        "future",
        "left_queue",
        "loop",
        "outcome",
    )

    def __init__(self, fn: Callable[[], T], loop: asyncio.AbstractEventLoop) -> None:
        self._fn = fn
        self._lock = threading.Lock()
        self._state = _JobState.PENDING
        #: called once as it stops waiting: it starts, or is cancelled before it started
        self.left_queue: Callable[[], None] = _nothing
        self._waiter: asyncio.Future[None] | None = None
        self.finished = False
        # kept here too: a cancelled awaiter's future is done before the outcome arrives
        self.outcome: tuple[T] | BaseException | None = None
        self.loop = loop
        self.future: asyncio.Future[T] = loop.create_future()

    def execute(self) -> tuple[T] | BaseException | None:
        """Worker thread: run unless cancelled; ``(result,)``, the exception, or ``None``."""
        with self._lock:
            if self._state is _JobState.CANCELLED:
                return None
            self._state = _JobState.RUNNING
            self.left_queue()
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
        self.outcome = outcome
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
                self.left_queue()
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


class WorkerPool:
    """Worker threads fed by one FIFO queue, started on demand up to ``size``.

    :meth:`run` awaits one job. A new thread starts only when a job arrives and no
    thread is idle, so an unused pool costs no threads. Threads are named
    ``aiokv-<name>-<n>``, are not daemons, and exit after the jobs queued before
    :meth:`aclose` (or :meth:`stop_nowait`); a pool never closed is stopped at exit,
    once the application's other non-daemon threads have ended (:func:`_stop_live_pools`).
    Jobs may be submitted from any thread (asyncio loops on several threads): starting a
    thread, queueing a job and closing are one step each under a lock, so there are never
    more than ``size`` threads, and a job is either queued before the stop markers (it
    runs) or refused (``RuntimeError``).
    """

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.size = size
        self.threads: list[threading.Thread] = []
        """The threads started so far (never shrinks)."""
        self._queue: queue.SimpleQueue[_Job[Any] | _Stop] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()  # submit vs submit, submit vs close: one at a time
        self._waiting = 0  # jobs queued, neither started nor cancelled
        self._waiting_lock = threading.Lock()
        self._closed = False
        _live_pools.add(self)

    @property
    def queue_depth(self) -> int:
        """Jobs waiting for a thread now: queued, not started, not cancelled (a job
        cancelled while queued stays in the queue until a thread skips it)."""
        return self._waiting

    def _left_queue(self) -> None:
        with self._waiting_lock:
            self._waiting -= 1

    async def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn()`` on a worker thread and return its result.

        Cancelled before ``fn`` started, it never runs, and this raises the cancellation.
        Cancelled while it runs, this waits (shielded against further cancellation)
        until it has finished: ``fn`` never runs on after this returned. Then, if ``fn``
        returned, its result is returned (it happened) and the cancellation is
        delivered again at the task's next suspension (:func:`~aiokv._cancel.redeliver`);
        if ``fn`` raised, the cancellation is raised.

        Raises:
            RuntimeError: the pool is closed (``fn`` never runs), or ``fn`` raised
                ``StopIteration`` (chained as the cause).
            BaseException: whatever ``fn`` raised, unchanged.
        """
        job = _Job(fn, asyncio.get_running_loop())
        self._submit(job)
        try:
            return await job.future
        except asyncio.CancelledError as cancelled:
            if job.cancel_if_pending():
                raise
            await job.wait_finished()
            outcome = job.outcome
            if not isinstance(outcome, tuple):
                raise
            redeliver(cancelled)  # it completed: its result stands
            return outcome[0]

    async def aclose(self) -> None:
        """Let the queued jobs finish, then stop every thread and join it.

        The loop is not blocked: each thread reports its exit before it is joined.
        Jobs submitted once this has been called are refused (``RuntimeError``).
        """
        loop = asyncio.get_running_loop()
        exits: list[asyncio.Future[None]] = []
        with self._lock:
            self._closed = True
            for _ in self.threads:
                fut: asyncio.Future[None] = loop.create_future()
                exits.append(fut)
                self._queue.put(_Stop(functools.partial(_resolve_threadsafe, loop, fut)))
        pending = set(exits)
        while pending:
            _, pending = await asyncio.wait(pending, timeout=0.1)
            if pending and not any(t.is_alive() for t in self.threads):
                break  # stopped meanwhile by stop_nowait (interpreter exit): nobody reports
        for t in self.threads:
            t.join()  # each has already left its loop; this only reaps it

    def stop_nowait(self) -> None:
        """Tell every thread to exit after the queued jobs, without waiting (any thread);
        later jobs are refused."""
        with self._lock:
            self._closed = True
            for _ in self.threads:
                self._queue.put(_Stop())

    def _submit(self, job: _Job[Any]) -> None:
        """Queue ``job``, starting a thread for it when none is idle (up to ``size``).

        Raises:
            RuntimeError: the pool is closed (its threads were told to stop), or the
                thread could not start (the process is out of threads): nothing was
                queued, the job never runs.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the {self.name} copy workers are closed")
            if not self._idle.acquire(blocking=False) and len(self.threads) < self.size:
                t = threading.Thread(
                    target=self._work, name=f"aiokv-{self.name}-{len(self.threads)}", daemon=False
                )
                t.start()  # before the job is queued: a thread that fails to start leaves none
                self.threads.append(t)
            with self._waiting_lock:
                self._waiting += 1
            job.left_queue = self._left_queue
            self._queue.put(job)

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


_live_pools: weakref.WeakSet[WorkerPool] = weakref.WeakSet()


def _nothing() -> None:
    return None


def _stop_live_pools() -> None:
    """At interpreter exit, before threading joins the non-daemon threads: stop every
    live pool, once no other non-daemon thread (one the application started, which
    Python waits for and which may still copy: an ``aiokv.sync`` worker that outlives
    the main thread) can submit to it. With such threads alive, a non-daemon thread of
    aiokv's waits for them, then stops the pools (the interpreter then joins it too)."""
    if _users():
        try:
            threading.Thread(target=_stop_after_users, name="aiokv-exit", daemon=False).start()
            return
        except RuntimeError:  # no new thread this late (some Python versions): stop now
            pass
    _stop_pools()


def _users() -> list[threading.Thread]:
    """The non-daemon threads, other than the main thread, the caller and the pools'."""
    ours = {t for pool in list(_live_pools) for t in pool.threads}
    ours |= {threading.main_thread(), threading.current_thread()}
    return [t for t in threading.enumerate() if not t.daemon and t not in ours]


def _stop_after_users() -> None:
    while users := _users():  # those they start meanwhile too
        for t in users:
            t.join()
    _stop_pools()


def _stop_pools() -> None:
    for pool in list(_live_pools):
        pool.stop_nowait()


# Non-daemon workers of a scheduler that was never closed would keep the interpreter
# from exiting. threading's private pre-join hook (the one concurrent.futures uses) runs
# before non-daemon threads are joined; plain atexit would run too late.
getattr(threading, "_register_atexit", atexit.register)(_stop_live_pools)


def _resolve_threadsafe(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None]) -> None:
    def resolve() -> None:
        if not fut.done():
            fut.set_result(None)

    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(resolve)
