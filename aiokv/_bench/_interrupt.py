"""Ctrl-C for the ``aiokv`` command: the command ends within a second, its child
processes quiet and reaped.

A terminal sends SIGINT to the whole process group: the command and every process it
spawned. Two rules make that clean:

* children never see SIGINT: :func:`sigint_blocked` is held while a child is started, so
  it is born with SIGINT blocked (a signal mask survives ``fork`` and ``exec``) and no
  ``KeyboardInterrupt`` traceback can come out of it, not even while it imports torch;
  the parent ends it;
* the parent, under :func:`interruptible`, answers the first SIGINT by sending SIGTERM to
  every live child (they die at once, silently), then raising ``KeyboardInterrupt`` so
  that its own ``finally`` blocks run. If the process is still there ``grace`` seconds
  later (a thread waiting on something that will not come), a watchdog kills what is
  left of the children, reaps them, and ends the process with status 130. A second
  SIGINT does that at once.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing import resource_tracker
from types import FrameType

__all__ = ["EXIT_INTERRUPTED", "Interrupt", "interruptible", "reap_children", "sigint_blocked"]

#: The exit status after Ctrl-C (128 + SIGINT), as shells report it.
EXIT_INTERRUPTED = 128 + signal.SIGINT


@contextlib.contextmanager
def sigint_blocked() -> Iterator[None]:
    """Block SIGINT in the calling thread for the block.

    A process started meanwhile inherits the mask and keeps it across ``exec``: it never
    receives SIGINT (its parent stops it). A SIGINT that arrives for this thread
    meanwhile is delivered when the block ends. ``multiprocessing``'s resource tracker
    is started first: starting it unblocks SIGINT in the thread that starts it.
    """
    resource_tracker.ensure_running()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def reap_children(timeout: float) -> None:
    """SIGTERM every live ``multiprocessing`` child, wait up to ``timeout`` seconds for
    them, SIGKILL and reap those left."""
    children = mp.active_children()
    for p in children:
        with contextlib.suppress(OSError, ValueError):
            p.terminate()
    deadline = time.monotonic() + timeout
    for p in children:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in children:
        if p.is_alive():
            with contextlib.suppress(OSError, ValueError):
                p.kill()
            p.join(1)


@dataclass(slots=True)
class Interrupt:
    """What :func:`interruptible` saw: ``interrupted`` once SIGINT arrived."""

    grace: float
    interrupted: bool = False

    def _exit_now(self) -> None:
        reap_children(0.2)
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.write("aiokv: interrupted (stopped waiting for cleanup)\n")
            sys.stderr.flush()
        os._exit(EXIT_INTERRUPTED)

    def _watchdog(self) -> None:
        time.sleep(self.grace)
        self._exit_now()  # still here: something the unwinding waits for will not come

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        if self.interrupted:
            self._exit_now()
        self.interrupted = True
        for p in mp.active_children():
            with contextlib.suppress(OSError, ValueError):
                p.terminate()
        threading.Thread(target=self._watchdog, name="aiokv-interrupt", daemon=True).start()
        raise KeyboardInterrupt


@contextlib.contextmanager
def interruptible(grace: float = 0.6) -> Iterator[Interrupt]:
    """Handle SIGINT as the module describes, for the block (main thread only;
    elsewhere the block runs unchanged).

    The watchdog armed by a SIGINT outlives the block: it also bounds the interpreter's
    exit (the threads it joins).
    """
    state = Interrupt(grace)
    if threading.current_thread() is not threading.main_thread():
        yield state
        return
    previous = signal.signal(signal.SIGINT, state._on_sigint)
    try:
        yield state
    finally:
        signal.signal(signal.SIGINT, previous)
        if state.interrupted:
            reap_children(0.2)
