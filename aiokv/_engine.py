"""The engine: one thread per ``LLMDataDist`` running an event loop of its own.

It owns what must progress whatever the caller's thread is doing: the transport
(listener, links, the peer service), remote transfers, layer-wise sends and their
timers. A caller blocked in a model forward, ``time.sleep`` or a blocking synchronizer
stalls nobody else.

Callers reach it from any thread and any async backend:

* ``await engine.run(fn, *args)`` from a coroutine on any asyncio loop (uvloop and a
  notebook's included) or on trio (through anyio): ``fn(*args)`` runs as a task on the
  engine loop, and the caller's loop is woken once, thread-safely, when it ends.
  Cancelling the caller's await cancels the engine task and waits (shielded) until it
  has really ended: a cancelled operation is never still running once the caller sees
  its cancellation. If it had completed before the cancellation reached it, the caller
  gets its result, and the cancellation at its next checkpoint (:func:`redeliver`).
* ``await engine.finish(fn, *args)`` is ``run`` for work past a point of no return:
  never cancelled by the caller, who waits for its end (:func:`completing` is the same
  for a coroutine on the engine loop).
* ``await engine.run_sync(fn, *args)`` is ``run`` for a plain function that reads or
  changes engine-owned state without awaiting: it runs as one callback on the engine
  loop, no task (a hop at the cost of a bare thread hand-off). Cancelled before it ran,
  it does not run; once it ran, its outcome stands (a result, the cancellation at the
  caller's next checkpoint).
* ``engine.call(fn, *args)`` blocks a plain thread the same way (``aiokv.sync``).
* On the engine thread itself, ``run`` awaits ``fn(*args)`` directly.

``Portal`` is the way back: the engine runs a coroutine function on the loop of the
caller that captured it (an ``async def`` layer synchronizer waits on the caller's
events, which belong to the caller's loop), and a caller's blocking ``def`` on the
engine's synchronizer lane (:attr:`Engine.sync_lane`), never on the loop's default
executor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Coroutine
from collections.abc import Iterator
from contextvars import ContextVar
from functools import partial
from typing import Any
from typing import Final
from typing import Generic
from typing import ParamSpec
from typing import TypeVar

import anyio
import sniffio

from ._cancel import redeliver
from ._enums import LLMStatusCode
from ._errors import LLMException
from ._errors import warn
from ._threads import Lane

__all__ = [
    "SYNC_GRACE_S",
    "SYNC_THREADS",
    "Engine",
    "Portal",
    "blocking_caller",
    "checkpoint",
    "completing",
    "on_asyncio",
]

log = logging.getLogger("aiokv")

#: Threads of an engine's synchronizer lane: ``def`` layer synchronizers blocked at once
#: (more wait for a thread; nothing else of the engine waits on them).
SYNC_THREADS: Final = 32
#: How long an engine's end waits for synchronizer threads still blocked before it
#: abandons them (with a warning naming each): ``finalize`` never waits longer on them.
SYNC_GRACE_S: Final = 1.0
#: A blocking call waits in timed slices of this: a signal (Ctrl-C) that arrives just
#: before the thread blocks in an untimed wait is only handled once it wakes (CPython
#: runs Python signal handlers between bytecodes); a timed one handles it within this.
_SIGNAL_POLL_S: Final = 0.1

T = TypeVar("T")
P = ParamSpec("P")

#: ``engine`` is set on an engine thread (to its :class:`Engine`), for its whole life
_ENGINE_THREAD = threading.local()

#: True while an ``aiokv.sync`` face runs a plain method in its caller's thread
#: (:func:`blocking_caller`): a :class:`Portal` made then has no caller loop.
_BLOCKING_CALLER: ContextVar[bool] = ContextVar("aiokv_blocking_caller", default=False)


@contextlib.contextmanager
def blocking_caller() -> Iterator[None]:
    """Within it, the caller is a blocking ``aiokv.sync`` caller, whatever loop its
    thread may run (a Jupyter kernel's, a coroutine that calls a blocking helper): a
    :class:`Portal` made there runs coroutines on the engine loop, as for a thread with
    no loop. The caller's loop is no use to the engine: the blocking caller waits (e.g.
    in ``CacheTask.synchronize``) on that very thread, and the loop would never run
    them."""
    token = _BLOCKING_CALLER.set(True)
    try:
        yield
    finally:
        _BLOCKING_CALLER.reset(token)


def on_asyncio() -> bool:
    """Whether the running coroutine is on an asyncio loop (False: trio, or no loop)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    # A loop runs on this thread; sniffio's answer (the slower path) decides only when
    # another library claims the thread (trio-asyncio and the like).
    if sniffio.thread_local.name is None and sniffio.current_async_library_cvar.get() is None:
        return True
    try:
        return sniffio.current_async_library() == "asyncio"
    except sniffio.AsyncLibraryNotFoundError:
        return False


async def checkpoint() -> None:
    """Yield to the running loop once (asyncio or trio): a scheduling and cancellation
    point for an operation that otherwise completes without suspending."""
    if on_asyncio():
        await asyncio.sleep(0)
    else:
        await anyio.lowlevel.checkpoint()


async def completing(aw: Awaitable[T]) -> T:
    """Await ``aw`` (on an asyncio loop) to its end even if the caller is cancelled
    meanwhile: for work that must not be cut short once started (what it does cannot be
    undone, or must not be left half done).

    Its outcome is the caller's: a result is returned, an error raised, also after a
    cancellation, which is then delivered again at the caller's next checkpoint
    (:func:`redeliver`)."""
    fut = asyncio.ensure_future(aw)
    caught: asyncio.CancelledError | None = None
    while not fut.done():
        try:
            await asyncio.wait((fut,))  # cancelling the waiter leaves ``fut`` running
        except asyncio.CancelledError as exc:
            caught = exc
    if caught is not None:
        redeliver(caught)
    return fut.result()


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


class _Outcome(Generic[T]):
    """What a caller on another thread awaits of the engine: ``notify`` is called exactly
    once, from the engine thread, as the work's last step; ``outcome`` is set before."""

    __slots__ = ("_notify", "outcome")

    def __init__(self, notify: Callable[[], None]) -> None:
        self._notify = notify
        self.outcome: tuple[T] | BaseException | None = None

    @staticmethod
    def _submit(engine: Engine, callback: Callable[[], None]) -> None:
        """Schedule ``callback()`` on ``engine``'s loop (what starts the work).

        Raises:
            LLMException: ``LLM_FAILED``, the engine has ended.
        """
        try:
            engine.submit(callback)
        except RuntimeError:  # the engine loop is closed
            raise _stopped() from None

    def _settle(self, outcome: tuple[T] | BaseException) -> None:
        """The engine thread: the work ended with ``outcome``; wake the caller, last."""
        self.outcome = outcome
        self._notify()

    @property
    def completed(self) -> bool:
        """Whether the work has ended with a result (not an error, not cancelled)."""
        return isinstance(self.outcome, tuple)

    def result(self) -> T:
        """The work's result; its exception re-raised (cancellation by the engine's own
        shutdown as ``LLMException(LLM_FAILED)``)."""
        assert self.outcome is not None
        return _result(self.outcome)


class _Call(_Outcome[T]):
    """One coroutine run on the engine loop for a caller on another thread: ``notify``
    follows the task's end, whether it finished, failed or was cancelled."""

    __slots__ = ("_args", "_cancelled", "_ended", "_fn", "_loop", "_task")

    def __init__(
        self,
        engine: Engine,
        fn: Callable[..., Awaitable[T]],
        args: tuple[Any, ...],
        notify: Callable[[], None],
        *,
        submit: bool = True,
    ) -> None:
        super().__init__(notify)
        self._loop = engine.loop
        self._fn = fn
        self._args = args
        self._task: asyncio.Task[None] | None = None
        self._cancelled = False
        self._ended = False
        if submit:  # else the caller does (its cancel may then come before the start)
            self.submit(engine)

    def submit(self, engine: Engine) -> None:
        """Start it on ``engine`` (once).

        Raises:
            LLMException: ``LLM_FAILED``, the engine has ended.
        """
        self._submit(engine, self._start)

    def _start(self) -> None:
        if self._cancelled:
            self._end(asyncio.CancelledError())
            return
        self._task = self._loop.create_task(self._body())
        # The body reports its own end (no extra loop iteration for a done callback);
        # this covers a task cancelled before its body ever ran.
        self._task.add_done_callback(self._done)

    async def _body(self) -> None:
        outcome: tuple[T] | BaseException
        try:
            outcome = (await self._fn(*self._args),)
        except asyncio.CancelledError:
            self._end(asyncio.CancelledError())
            raise
        except BaseException as exc:  # handed to the caller, whatever it is
            outcome = exc
        self._end(outcome)

    def _done(self, task: asyncio.Task[None]) -> None:
        if not self._ended:
            self._end(asyncio.CancelledError())

    def _end(self, outcome: tuple[T] | BaseException) -> None:
        self._ended = True
        self._fn = self._args = None  # type: ignore[assignment]  # drop references
        self._settle(outcome)

    def cancel(self) -> None:
        """Any thread: cancel the engine task (or keep it from starting)."""
        with contextlib.suppress(RuntimeError):  # loop closed: the call has ended
            self._loop.call_soon_threadsafe(self._cancel)

    def _cancel(self) -> None:
        self._cancelled = True
        if self._task is not None:
            self._task.cancel()
        elif not self._ended:  # never submitted: a submitted start ran before this (FIFO)
            self._end(asyncio.CancelledError())


class _SyncCall(_Outcome[T]):
    """One plain function ``fn()`` called on the engine loop, as one callback, for a
    caller on another thread (:meth:`Engine.run_sync`): ``notify`` follows the call, or
    its skipping (cancelled before it ran)."""

    __slots__ = ("_fn", "_skip")

    def __init__(self, engine: Engine, fn: Callable[[], T], notify: Callable[[], None]) -> None:
        super().__init__(notify)
        self._fn: Callable[[], T] | None = fn
        self._skip = False
        self._submit(engine, self._body)

    def _body(self) -> None:
        fn, self._fn = self._fn, None  # drop the reference
        self._settle(asyncio.CancelledError() if self._skip or fn is None else _called(fn))

    def cancel(self) -> None:
        """The caller's thread: skip the function unless it has started (a callback
        cannot be stopped once it runs; its outcome then stands)."""
        self._skip = True


def _called(fn: Callable[[], T]) -> tuple[T] | BaseException:
    """``fn()``'s result (in a 1-tuple), or what it raised, whatever it is."""
    try:
        return (fn(),)
    except BaseException as exc:  # handed to the caller
        return exc


def _result(outcome: tuple[T] | BaseException) -> T:
    """A call's result; its exception re-raised (a cancellation on the engine's side, by
    its own shutdown, as ``LLMException(LLM_FAILED)``)."""
    if isinstance(outcome, asyncio.CancelledError):
        raise _stopped()
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome[0]


def _stopped() -> LLMException:
    return LLMException(
        "the LLMDataDist was finalized while this ran", status_code=LLMStatusCode.LLM_FAILED
    )


class Engine:
    """An event loop on a thread of its own (uvloop when installed), or (``loop`` given)
    the caller's own running asyncio loop: an *inline* engine, no thread.

    An inline engine runs everything an engine owns on the caller's loop, so an
    operation awaited there runs directly, with no hop to another thread and back; the
    price is that whatever blocks that loop (a model forward, ``time.sleep``) stalls the
    listener, the links and the peer service too. Its loop must keep running until
    :meth:`close_soon`'s final task has ended; other threads and loops reach it as they
    reach an engine thread. Every :meth:`run` and :meth:`run_sync` awaited on it yields
    to the loop once before it starts, as the hop to an engine thread did: a loop of
    operations that complete without waiting (a leased pull over shared memory) still
    lets the loop's other tasks run, and a caller cancelled there never starts one.

    Args:
        name: the thread's name (an inline engine's, in its messages).
        loop: the running asyncio loop of the calling thread, for an inline engine.
    """

    def __init__(self, name: str, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.name = name
        self.inline = loop is not None
        #: (inline) its loop stopped before its end ran: :meth:`abandon`
        self.abandoned = False
        self._loop = loop if loop is not None else _new_loop()
        self._on_exit: list[Callable[[], None]] = []  # called by the thread as it ends
        self._exit_lock = threading.Lock()
        self._exited = False
        self._closing = False  # close_soon was called: its first call's task owns the end
        self._sealed = False  # no more submissions: the loop is about to close
        self._last: asyncio.Task[None] | None = None
        #: where blocking user code runs (``def`` layer synchronizers): daemon threads,
        #: abandoned after :data:`SYNC_GRACE_S` at the end, never joined at exit
        self.sync_lane = Lane("aiokv-sync", SYNC_THREADS)
        if loop is not None:
            self._thread = threading.current_thread()
            return
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        _ENGINE_THREAD.engine = self
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            # Whatever still runs was abandoned by its caller: cancel it and let it unwind.
            self._cancel_all()
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._close_sync_lane()
            # nothing of aiokv's blocks on it (each purpose has its lane); it only serves
            # the loop itself (e.g. getaddrinfo without uvloop)
            self._loop.run_until_complete(self._loop.shutdown_default_executor())
            # calls that reached the loop meanwhile: let them start, then end them too
            with self._exit_lock:
                self._sealed = True
            self._loop.run_until_complete(asyncio.sleep(0))
            self._cancel_all()
            self._loop.close()
            with self._exit_lock:
                self._exited = True
            for notify in self._on_exit:
                notify()

    def _close_sync_lane(self) -> None:
        """Cancel queued synchronizer jobs; wait up to :data:`SYNC_GRACE_S` for those
        running (their transfers were cancelled), then abandon them, naming each."""
        for label in self.sync_lane.close(SYNC_GRACE_S):
            msg = (
                f"{self.name}: the layer synchronizer {label} did not return within "
                f"{SYNC_GRACE_S:g} s of the end; its thread is abandoned (a daemon thread: "
                "it does not keep the process from exiting)"
            )
            warn(msg, RuntimeWarning)
            log.warning("%s", msg)  # for applications that collect logs, not warnings

    def submit(self, callback: Callable[[], None]) -> None:
        """Any thread: schedule ``callback()`` on the engine loop.

        Raises:
            RuntimeError: the loop is closed or closing (the callback would never run).
        """
        with self._exit_lock:
            if self._sealed:
                raise RuntimeError("the engine loop is closed")
            self._loop.call_soon_threadsafe(callback)

    def _cancel_all(self) -> None:
        while tasks := asyncio.all_tasks(self._loop):
            for task in tasks:
                task.cancel()
            self._loop.run_until_complete(asyncio.wait(tasks))

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The engine's loop (only ever run on the engine thread)."""
        return self._loop

    @property
    def thread(self) -> threading.Thread:
        """The engine thread (an inline engine's: the thread that runs its loop)."""
        return self._thread

    def on_engine(self) -> bool:
        """Whether the caller runs on the engine loop: on the engine thread, or (inline)
        in a coroutine of the loop it was given."""
        if self.inline:
            return asyncio._get_running_loop() is self._loop
        return threading.get_ident() == self._thread.ident

    def join(self) -> None:
        """Block until the engine has ended (after :meth:`close_soon` or :meth:`stop`):
        the thread joined, or (inline) its final task done, from another thread. An
        inline engine whose loop is no longer running cannot end its work: its state is
        dropped as it is (see :meth:`abandon`)."""
        if not self.inline:
            self._thread.join()
            return
        ended = threading.Event()
        self._notify_on_exit(ended.set)
        while not ended.wait(0.05):
            if self._loop.is_closed() or not self._loop.is_running():
                self.abandon()
                return

    def abandon(self) -> None:
        """(inline) The loop stopped before the engine's end ran: nothing of it can run
        any more. Close the synchronizer lane (as the end does) and report the end."""
        if self._exited:
            return
        self.abandoned = True
        log.warning(
            "%s: its event loop stopped before finalize() had ended; links and listener "
            "were not closed in order",
            self.name,
        )
        self._close_sync_lane()
        self._exit()

    def _exit(self) -> None:
        with self._exit_lock:
            self._sealed = True
            self._exited = True
            notify, self._on_exit = self._on_exit, []
        for fn in notify:
            fn()

    async def run(self, fn: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs) -> T:
        """Await ``fn(*args, **kwargs)`` run on the engine loop, from any async backend.

        Raises what ``fn`` raises. Cancelled, it cancels the engine task and returns (by
        raising the cancellation) only once that task has ended.
        """
        if kwargs:
            return await self._run(_with_kwargs(fn, kwargs), args)
        return await self._run(fn, args)

    async def _run(self, fn: Callable[..., Awaitable[T]], args: tuple[Any, ...]) -> T:
        if self.on_engine():
            if self.inline:
                await asyncio.sleep(0)  # what the hop was: a scheduling point (see the class)
            return await fn(*args)
        calls: list[_Call[T]] = []

        def start(notify: Callable[[], None]) -> None:
            calls.append(_Call(self, fn, args, notify))

        await _until_notified(
            start, lambda: calls[0].cancel(), completed=lambda: calls[0].completed
        )
        return calls[0].result()

    async def run_sync(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Await ``fn(*args, **kwargs)`` called on the engine loop as one callback (no
        task), from any async backend: for a plain function over engine-owned state.

        Raises what ``fn`` raises. Cancelled before the callback ran, it never runs and
        the cancellation is raised; once it ran, its outcome is the caller's (a result
        returned, the cancellation then delivered at the next checkpoint).
        """
        if self.on_engine():
            if self.inline:
                await asyncio.sleep(0)  # what the hop was: a scheduling point (see the class)
            return fn(*args, **kwargs)
        bound = partial(fn, *args, **kwargs) if args or kwargs else fn
        calls: list[_SyncCall[T]] = []

        def start(notify: Callable[[], None]) -> None:
            calls.append(_SyncCall(self, bound, notify))

        await _until_notified(
            start, lambda: calls[0].cancel(), completed=lambda: calls[0].completed
        )
        return calls[0].result()

    async def finish(self, fn: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run ``fn(*args, **kwargs)`` on the engine to its end, from any async backend:
        for work past a point of no return (the operation's effect is visible already,
        e.g. a released cache whose leases must end). The caller's cancellation neither
        stops it nor is raised before it ended; its outcome is the caller's (a result
        returned, an error raised), the cancellation then delivered at the caller's next
        checkpoint (:func:`redeliver`)."""
        call: Callable[..., Awaitable[T]] = _with_kwargs(fn, kwargs) if kwargs else fn
        if self.on_engine():
            return await completing(call(*args))
        calls: list[_Call[T]] = []

        def start(notify: Callable[[], None]) -> None:
            calls.append(_Call(self, call, args, notify))

        await _until_notified(start, lambda: None, completed=lambda: True)
        return calls[0].result()

    def call(self, fn: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs) -> T:
        """Block the calling thread on ``fn(*args, **kwargs)`` run on the engine loop.

        An interrupt (``KeyboardInterrupt``) cancels the engine task, waits for it and
        is re-raised; if the operation had completed before the cancellation reached it,
        its effects stand (as for an interrupt just after the call returned) and a note
        on the exception says so.

        Raises:
            RuntimeError: called on the engine thread (it would wait for itself), or on
                another engine's (it would stall that engine's loop, and every peer it
                serves, until the call ended: maybe the very peer the call waits for).
        """
        if self.on_engine() or (self.inline and threading.get_ident() == self._thread.ident):
            raise RuntimeError(
                "a blocking aiokv.sync call on the engine thread (e.g. from an async "
                "synchronizer) would deadlock; there, use the async aiokv method (a "
                "coroutine) instead"
            )
        other: Engine | None = getattr(_ENGINE_THREAD, "engine", None)
        if other is not None:
            raise RuntimeError(
                f"a blocking aiokv.sync call on the engine thread of {other.name} (e.g. from "
                "an async synchronizer) would block its loop, and every peer it serves, "
                f"while {self.name} works; there, use the async aiokv method (a coroutine) "
                "instead"
            )
        ended = threading.Event()
        fn = _with_kwargs(fn, kwargs) if kwargs else fn
        call = _Call(self, fn, args, ended.set, submit=False)
        try:
            call.submit(self)  # an interrupt may come in it, the start scheduled or not
            while not ended.wait(_SIGNAL_POLL_S):
                pass
        except BaseException as exc:
            sent = False
            while True:  # its real end, however often interrupted (the cancel's sending too)
                try:
                    if not sent:
                        call.cancel()  # sent twice if interrupted in it: harmless
                        sent = True
                    if ended.is_set() or self._loop.is_closed():
                        break
                    ended.wait(_SIGNAL_POLL_S)
                except BaseException:  # an interrupt: wait on
                    continue
            if call.completed:
                exc.add_note(f"aiokv: {_name(fn)} had completed; its effects stand")
            raise
        return call.result()

    def stop(self) -> None:
        """Stop the loop (cancelling what still runs on it) and join the thread.

        Blocks the calling thread (any but the engine's) until then; idempotent.
        Not for an inline engine (:meth:`aclose`).
        """
        if self.on_engine() or self.inline:
            raise RuntimeError("Engine.stop: called on the engine thread")
        with contextlib.suppress(RuntimeError):  # already closed
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()

    def close_soon(self, last: Callable[[], Awaitable[None]]) -> None:
        """Run ``last()`` as the engine's final task, then stop the loop: the thread
        then ends on its own (see :meth:`wait_ended`). From any thread, without
        blocking or awaiting, so no cancellation of the caller can prevent it.
        Idempotent: only the first call's ``last`` runs; after the loop has closed it
        does nothing. An exception from ``last`` is logged; the loop stops anyway.
        """
        with self._exit_lock:
            if self._closing or self._exited:
                return
            self._closing = True
        with contextlib.suppress(RuntimeError):  # closed meanwhile by stop(): ended
            self._loop.call_soon_threadsafe(self._start_last, last)

    def _start_last(self, last: Callable[[], Awaitable[None]]) -> None:
        async def run_then_stop() -> None:
            try:
                await last()
            except BaseException:
                log.exception("engine %s: the final task failed", self.name)
            finally:
                if self.inline:
                    await self._end_inline()
                else:
                    self._loop.stop()

        self._last = self._loop.create_task(run_then_stop())  # referenced until it ends

    async def _end_inline(self) -> None:
        """(inline) What the engine thread does as it leaves its loop, less closing the
        loop (the caller's): the synchronizer lane closed (a blocked synchronizer waited
        for on a thread, not on the loop), then the end reported. What the final task ended
        (links, listener, tasks of the manager) is not on the loop any more."""
        with self._exit_lock:
            if self._sealed:
                return
            self._sealed = True
        if self.sync_lane.running():  # blocked synchronizers: wait on a thread of its own
            closer = Lane(f"{self.name}-end", 1)
            try:
                await closer.run(self._close_sync_lane, "closing the synchronizer lane")
            finally:
                closer.close(0)
        else:
            self._close_sync_lane()  # nothing runs: closes at once
        self._exit()

    @property
    def ended(self) -> bool:
        """Whether the engine thread has finished (its loop closed)."""
        return self._exited

    def _notify_on_exit(self, notify: Callable[[], None]) -> None:
        """Call ``notify()`` (from the engine thread) once it has left its loop; at once
        if it already has."""
        with self._exit_lock:
            if self._exited:
                notify()
                return
            self._on_exit.append(notify)

    async def wait_ended(self) -> None:
        """Wait, from a coroutine on any backend and without blocking its loop, until
        the engine thread has ended (after :meth:`close_soon` or :meth:`stop`), then
        join it. Cancellable: a cancelled caller stops waiting, the engine does not
        stop ending."""
        if self.on_engine() and not self.inline:
            raise RuntimeError("Engine.wait_ended: called on the engine thread")

        await _until_notified(self._notify_on_exit, lambda: None, shield=False)
        if not self.inline:
            self._thread.join()  # it has left its loop: this only reaps it

    async def aclose(self) -> None:
        """:meth:`stop` from a coroutine on any backend, without blocking its loop (and
        without a helper thread: the engine thread reports its own end). Not
        cancellable: a cancelled caller still waits for the thread to end."""
        if self.inline:
            await completing(self._end_inline())
            if not self._exited:  # another call is ending it: wait for that
                await _until_notified(self._notify_on_exit, lambda: None)
            return
        if self.on_engine():
            raise RuntimeError("Engine.aclose: called on the engine thread")
        if self._thread.is_alive():

            def start(notify: Callable[[], None]) -> None:
                self._notify_on_exit(notify)
                with contextlib.suppress(RuntimeError):  # already stopping
                    self._loop.call_soon_threadsafe(self._loop.stop)

            await _until_notified(start, lambda: None)
        self._thread.join()


class _Wake:
    """An asyncio caller's side of a hop: :meth:`notify` (any thread, once) wakes the
    current :attr:`waiter` and sets :attr:`ended`.

    The notifying thread does nothing after scheduling the wake-up: whatever it ran next
    would hold the GIL while the caller's thread wakes, on the caller's critical path (a
    ``contextlib.suppress`` exited there was measurable: docs/benchmarks.md, "Nothing on
    the engine thread after the wake-up").
    """

    __slots__ = ("ended", "loop", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.ended = False
        self.waiter: asyncio.Future[None] = loop.create_future()

    def notify(self) -> None:
        """Any thread: wake the caller (nothing if its loop is closed)."""
        try:  # noqa: SIM105  (not contextlib.suppress: see the class docstring)
            self.loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the caller's loop is gone
            pass

    def _wake(self) -> None:  # on the caller's loop
        self.ended = True
        if not self.waiter.done():
            self.waiter.set_result(None)


async def _until_notified(
    start: Callable[[Callable[[], None]], None],
    cancel: Callable[[], None],
    *,
    shield: bool = True,
    completed: Callable[[], bool] = lambda: False,
) -> None:
    """Start something that calls ``notify()`` once, from any thread, when it has ended;
    wait for that without blocking the running loop (asyncio or trio). Cancelled, call
    ``cancel()`` and (``shield``) still wait for the end; then, if it ``completed``
    anyway (it ended before the cancellation reached it), return normally — the
    cancellation comes again at the caller's next checkpoint (:func:`redeliver`; trio
    and anyio scopes by themselves) — else re-raise."""
    if on_asyncio():
        wake = _Wake(asyncio.get_running_loop())
        start(wake.notify)
        try:
            await wake.waiter
        except asyncio.CancelledError as exc:
            cancel()
            caught: asyncio.CancelledError | None = None
            # shielded: wait for the real end, however often cancelled
            while shield and not wake.ended:
                wake.waiter = wake.loop.create_future()
                try:
                    await wake.waiter
                except asyncio.CancelledError as again:
                    caught = again
            if not (shield and completed()):
                raise
            redeliver(caught or exc)
        return
    event = anyio.Event()
    soon = _threadsafe_caller()
    start(lambda: soon(event.set))
    try:
        await event.wait()
    except anyio.get_cancelled_exc_class():
        cancel()
        if not shield:
            raise
        with anyio.CancelScope(shield=True):
            await event.wait()
        if not completed():
            raise
        # trio's cancellation is level-triggered: the next checkpoint raises it again


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def _with_kwargs(
    fn: Callable[..., Awaitable[T]], kwargs: dict[str, Any]
) -> Callable[..., Awaitable[T]]:
    def bound(*args: Any) -> Awaitable[T]:
        return fn(*args, **kwargs)

    return bound


def _threadsafe_caller() -> Callable[[Callable[[], None]], None]:
    """A function that schedules a callback on the CURRENT loop from any thread."""
    lib = sniffio.current_async_library()
    if lib == "trio":
        import trio

        token = trio.lowlevel.current_trio_token()

        def on_trio(fn: Callable[[], None]) -> None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(fn)

        return on_trio
    raise RuntimeError(f"aiokv supports asyncio and trio, not {lib}")


class Portal:
    """Runs the caller's code from the engine: coroutine functions on the loop that
    created this portal, blocking functions on ``lane``.

    Created on the caller's side (an asyncio loop or trio); without a running loop, or
    for a blocking ``aiokv.sync`` caller (:func:`blocking_caller`, whether or not its
    thread runs a loop), coroutines run on the engine loop itself.

    Args:
        lane: where blocking functions run (the engine's :attr:`Engine.sync_lane`).
    """

    def __init__(self, lane: Lane) -> None:
        self._lane = lane
        self._loop: asyncio.AbstractEventLoop | None = None
        self._trio: Any = None
        if _BLOCKING_CALLER.get():
            return
        try:
            lib = sniffio.current_async_library()
        except sniffio.AsyncLibraryNotFoundError:
            return
        if lib == "asyncio":
            self._loop = asyncio.get_running_loop()
        elif lib == "trio":
            import trio

            self._trio = trio.lowlevel.current_trio_token()

    async def run(self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
        """On the engine loop: await ``fn(*args)`` run on the portal's loop."""
        if self._loop is not None:
            if self._loop is asyncio.get_running_loop():
                return await fn(*args)
            if self._loop.is_closed():
                raise LLMException(
                    "an async synchronizer runs on the event loop that called "
                    "transfer_cache_async, which has closed: keep that loop running until "
                    "the CacheTask ends, or pass a plain def synchronizer",
                    status_code=LLMStatusCode.LLM_FAILED,
                )
            return await asyncio.wrap_future(
                asyncio.run_coroutine_threadsafe(fn(*args), self._loop)
            )
        if self._trio is not None:
            import trio

            token = self._trio
            return await self.call(lambda: trio.from_thread.run(fn, *args, trio_token=token))
        return await fn(*args)

    @property
    def lane(self) -> Lane:
        """Where this portal's blocking functions run."""
        return self._lane

    async def call(self, fn: Callable[[], T], label: str = "") -> T:
        """On the engine loop: await ``fn()`` run on the portal's lane (``label`` names
        it in a warning if it is still running at the engine's end). Cancelled before a
        thread took it, ``fn`` never runs; cancelled while it runs, it is abandoned."""
        return await self._lane.run(fn, label)
