"""``Lane``: a bounded pool of daemon threads for ONE purpose of an engine.

The engine never runs blocking work on its loop's default executor: each purpose has a
lane of its own, so one purpose filling its threads cannot delay another
(docs/design.md, "Threads and who owns them"):

* the ``def`` layer synchronizers (and the hop to an ``async def`` one on trio), owned
  by the :class:`~aiokv._engine.Engine`: user code that may block for as long as the
  model takes, or forever;
* NIXL transfer waits (and the agent's creation), owned by the NIXL transport.

(Staging copies run on the copy scheduler's own ``stage`` pool, :mod:`aiokv._copy`.)

Rules: a job whose waiter is cancelled (or times out) before a thread picked it up
never runs; a job that started runs to its end on its thread (Python cannot stop a
thread), and a caller that does not wait for it abandons it. Threads are daemons and
are never joined at interpreter exit, so a job that never returns cannot hang exit;
:meth:`Lane.close` waits for running jobs for a bounded time only and names the ones it
abandons.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import threading
import time
from collections.abc import Callable
from typing import Any
from typing import Final
from typing import TypeVar

__all__ = ["Lane", "on_loop", "on_loop_ran", "seen_out"]

T = TypeVar("T")

#: Marks the end of the queue for one thread.
_STOP: Final = None


class _Job:
    __slots__ = ("fn", "future", "label")

    def __init__(self, fn: Callable[[], Any], label: str) -> None:
        self.fn = fn
        self.label = label
        self.future: concurrent.futures.Future[Any] = concurrent.futures.Future()


class Lane:
    """Up to ``size`` daemon threads named ``<name>-<n>``, started on demand, fed by
    one FIFO queue. Usable from any thread.

    Args:
        name: the threads' name prefix (``aiokv-sync``).
        size: most threads at once; more jobs wait in the queue for one.
    """

    def __init__(self, name: str, size: int) -> None:
        if size < 1:
            raise ValueError(f"Lane {name}: size={size} must be >= 1")
        self.name = name
        self.size = size
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0  # threads waiting on the queue
        self._running: dict[threading.Thread, str] = {}  # thread -> label of its job
        self._closed = False

    @property
    def threads(self) -> int:
        """Threads started so far (alive or not)."""
        return len(self._threads)

    def running(self) -> list[str]:
        """Labels of the jobs running now."""
        with self._lock:
            return list(self._running.values())

    def submit(self, fn: Callable[[], T], label: str = "") -> concurrent.futures.Future[T]:
        """Queue ``fn()``; its future. ``future.cancel()`` succeeds (and ``fn`` never runs)
        exactly when no thread has picked the job up yet.

        Raises:
            RuntimeError: the lane is closed, or its new thread could not start (the
                process is out of threads): nothing was queued, ``fn`` never runs.
        """
        job = _Job(fn, label or getattr(fn, "__qualname__", repr(fn)))
        with self._lock:
            if self._closed:
                raise RuntimeError(f"lane {self.name} is closed")
            if self._idle:
                self._idle -= 1
            elif len(self._threads) < self.size:
                t = threading.Thread(
                    target=self._work, name=f"{self.name}-{len(self._threads)}", daemon=True
                )
                t.start()  # before the job is queued: a thread that fails to start leaves none
                self._threads.append(t)
            self._queue.put(job)
        return job.future

    def relabel(self, label: str) -> None:
        """From a job running on this lane: name it ``label`` from now on (a job that
        makes several calls of user code names the one it is in)."""
        with self._lock:
            me = threading.current_thread()
            if me in self._running:
                self._running[me] = label

    async def run(self, fn: Callable[[], T], label: str = "") -> T:
        """Await ``fn()`` run on a thread of the lane.

        Cancelled before a thread picked it up, ``fn`` never runs; cancelled while it
        runs, this raises at once and the job runs on, abandoned (its outcome dropped).
        """
        return await asyncio.wrap_future(self.submit(fn, label))

    def close(self, grace: float) -> list[str]:
        """Stop the lane: queued jobs are cancelled (never run), threads exit after their
        job; wait up to ``grace`` seconds for them (blocking the caller). Returns the
        labels of the jobs still running then, whose threads are abandoned. Idempotent.
        """
        with self._lock:
            if not self._closed:
                self._closed = True
                while True:
                    try:
                        job = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if job is not None:
                        job.future.cancel()
                for _ in self._threads:
                    self._queue.put(_STOP)
            threads = list(self._threads)
        end = time.monotonic() + grace
        for t in threads:
            t.join(max(0.0, end - time.monotonic()))
        return self.running()

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._lock:
                if self._closed or not job.future.set_running_or_notify_cancel():
                    job.future.cancel()  # closed meanwhile: it never runs
                    self._idle += 1
                    continue
                self._running[me] = job.label
            try:
                result = job.fn()
            except BaseException as exc:
                job.future.set_exception(exc)
            else:
                job.future.set_result(result)
            finally:
                with self._lock:
                    del self._running[me]
                    self._idle += 1
            del job  # drop what the job referenced before blocking again


def on_loop(loop: asyncio.AbstractEventLoop | None, fn: Callable[..., object], *args: Any) -> None:
    """``fn(*args)`` on ``loop``, the owner of what it changes (None: the caller's own):
    at once when called there, else scheduled thread-safely; dropped once ``loop`` has
    closed (what it owned is gone with it)."""
    try:
        here = loop is None or asyncio.get_running_loop() is loop
    except RuntimeError:
        here = False
    if here:
        fn(*args)
    elif loop is not None:
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(fn, *args)


#: How long :func:`on_loop_ran` waits for a loop to run what it was given: a live loop
#: runs it within milliseconds; one that closed meanwhile drops it, never to run.
_RAN_WAIT_S: Final = 5.0


async def on_loop_ran(
    loop: asyncio.AbstractEventLoop | None, fn: Callable[..., object], *args: Any
) -> None:
    """:func:`on_loop`, then wait until ``fn(*args)`` has run on ``loop`` (at once when
    awaited there, or when ``loop`` is None): its effects are visible to the caller when
    this returns. Bounded by ``_RAN_WAIT_S`` for a loop that closes before running it;
    cancelling the wait does not unschedule ``fn``."""
    if loop is None or asyncio.get_running_loop() is loop:
        fn(*args)
        return
    ran: concurrent.futures.Future[None] = concurrent.futures.Future()

    def run() -> None:
        try:
            fn(*args)
        finally:
            ran.set_result(None)

    try:
        loop.call_soon_threadsafe(run)
    except RuntimeError:  # closed: what it owned is gone with it
        return
    await asyncio.wait([asyncio.wrap_future(ran)], timeout=_RAN_WAIT_S)


async def seen_out(job: concurrent.futures.Future[T], stop: Callable[[], None]) -> T:
    """The result of ``job`` (a :meth:`Lane.submit`); awaited to its end. Cancelled
    meanwhile: ``stop()`` (which must make a running job return soon), ``job`` cancelled
    if no thread took it yet (it then never runs), and the cancellation re-raised once no
    thread runs it: whatever the job used is free again when this raises."""
    fut = asyncio.wrap_future(job)
    cancelled = False
    while not fut.done():
        try:
            await asyncio.wait([fut])
        except asyncio.CancelledError:
            cancelled = True
            stop()
            if job.cancel():
                break
    if cancelled:
        raise asyncio.CancelledError
    return fut.result()
