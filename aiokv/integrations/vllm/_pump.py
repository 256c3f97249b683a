"""``Pump``: an asyncio loop that vLLM's own thread runs, a few turns at a time.

The decode side's loads run on it (:class:`~._worker.WorkerSide`): vLLM's thread runs
it in each step's ``start_load_kv`` and ``get_transfer_results``, so a pull under a NIXL
lease is posted, polled and seen done on vLLM's thread (aiokv's leased move on the
caller's own loop), as vLLM's ``NixlConnector`` posts and polls its READs; a pull that
goes through aiokv's engine is awaited there, and its end wakes the pump. Between two
runs nothing on it moves, which is safe for a load: vLLM keeps stepping while a request
waits for its KV (or, aborted, for its load to end).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any
from typing import Final

__all__ = ["Pump", "loop_running"]

#: Turns of the loop in each run before it returns (or waits): a new load posts its
#: transfer in its second (its first step, then the yield before a leased move).
TURNS: Final = 3


def loop_running() -> bool:
    """Whether an asyncio loop runs on the calling thread (then it cannot run a pump)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class Pump:
    """A private asyncio loop and the tasks started on it. Runs from one thread at a
    time (a lock); not from a thread that runs an asyncio loop of its own."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = asyncio.new_event_loop()
        self._lock = threading.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self._ended = False  # a task ended during this run
        self._timer: asyncio.TimerHandle | None = None  # this run's wait, if it waits

    def __bool__(self) -> bool:
        """Whether tasks started on it have not ended."""
        return bool(self._tasks)

    def start(self, coro: Coroutine[Any, Any, None]) -> bool:
        """Start ``coro`` as a task (it runs at the next :meth:`run`); False (``coro``
        closed, never run) once the pump is closed."""
        loop = self._loop
        if loop is None:
            coro.close()
            return False
        task = loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return True

    def run(self, wait_s: float = 0.0) -> None:
        """Run the loop on the calling thread: the work that is ready (:data:`TURNS`
        turns), then, for ``wait_s`` > 0 unless a task ended meanwhile, until one ends
        or ``wait_s`` passed, blocked in the loop's selector (the GIL released).
        Nothing to do without tasks, or on a thread that runs an asyncio loop."""
        if not self._tasks or loop_running():
            return
        with self._lock:
            loop = self._loop
            if loop is None:
                return
            self._ended = False
            loop.call_soon(self._turn, loop, TURNS, wait_s)
            try:
                loop.run_forever()
            finally:
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None

    def _turn(self, loop: asyncio.AbstractEventLoop, left: int, wait_s: float) -> None:
        """One turn of :meth:`run` (a callback, so ``left`` turns take ``left`` loop
        iterations); the last stops the loop, or starts the wait."""
        if left > 1:
            loop.call_soon(self._turn, loop, left - 1, wait_s)
        elif wait_s > 0 and self._tasks and not self._ended:
            self._timer = loop.call_later(wait_s, loop.stop)
        else:
            loop.stop()

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._ended = True
        if self._timer is not None:  # waiting: a task ended, the run is over
            task.get_loop().stop()

    def close(self) -> None:
        """Cancel the tasks, run the loop until they ended, close it. Idempotent."""
        with self._lock:
            loop, self._loop = self._loop, None
            if loop is None:
                return
            tasks = set(self._tasks)
            for task in tasks:
                task.cancel()
            if tasks:
                loop.run_until_complete(asyncio.wait(tasks))
            loop.close()
