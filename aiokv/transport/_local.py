"""In-memory transport: links between transports of ONE process, no sockets.

It keeps the contract of :mod:`aiokv.transport._base` (``tests/transport/test_contract.py``
runs the same suite over it and TCP); it serves tests and single-process set-ups.

* ``listen(host, port)`` files the transport in a process-wide table under exactly
  ``(host, port)`` (no wildcard addresses); port 0 picks an unused one from the ephemeral
  range. A taken address, or a ``connect`` to an address nobody listens on, is
  ``LLM_LINK_FAILED``, as with sockets. Both ends must hold the same secret, or neither.
* ``connect`` creates both ends of the link at once and reports them to the listener's
  ``on_link``, then the connector's; it never waits (but ``timeout <= 0`` is
  ``LLM_TIMEOUT``, as with TCP).
* A request runs the peer's handler in a task owned by the PEER transport (its ``aclose``
  ends it). Then the requester itself copies the bytes between its buffers and the granted
  ones, at most :data:`_CHUNK_BYTES` per loop step: the loop is never blocked for long, and
  a timeout, cancellation or broken link lands between two steps.
* However a request ends, the grant's ``done`` runs exactly once, and no byte moves
  after ``read`` / ``write`` returned or raised. On one event loop it runs before they
  return (a grant that arrives after the request was given up is released on arrival).
* The two ends may live on different event loops (each ``LLMDataDist`` has its own
  engine loop): everything one end does to the other (serving, waking, ``done``,
  ``on_link`` / ``on_link_lost``) is handed to the other end's loop thread-safely, so
  each transport's handler and callbacks still run on its own loop; only the bytes are
  copied by the requester's thread, between grant and ``done``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import itertools
import logging
import threading
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import Final

from .._enums import LLMStatusCode
from .._errors import LLMException
from ._base import AUTH_FAILED
from ._base import Grant
from ._base import Link
from ._base import Payload
from ._base import PeerInfo
from ._base import Transport
from ._base import auth_mismatch
from ._base import check_address
from ._base import check_connect_timeout
from ._base import check_grant
from ._base import check_probe_timeout
from ._base import check_request
from ._base import decode_reason
from ._base import flatten_views
from ._base import grant_reason
from ._base import handler_failed
from ._base import refusal

__all__ = ["LocalTransport"]

_log = logging.getLogger("aiokv.transport.local")
# reasons of a local close: the other end reads "closed by peer" (as over TCP)
_CLOSED = ("closed locally", "transport closed")
_S = LLMStatusCode
_CHUNK_BYTES: Final = 4 << 20  # copied per loop step
_SLICE_COST: Final = _CHUNK_BYTES >> 12  # one slice costs this much: ≤ 4096 slices per step
_EPHEMERAL: Final = range(49152, 65536)  # where port 0 picks from, round robin
_ports = itertools.cycle(_EPHEMERAL)
_listeners: dict[tuple[str, int], LocalTransport] = {}


def _free_port(host: str) -> int:
    """The next port of the ephemeral range that nobody listens on at ``host``."""
    for port in itertools.islice(_ports, _EPHEMERAL.stop - _EPHEMERAL.start):
        if (host, port) not in _listeners:
            return port
    raise LLMException(f"listen on {host}: no free port", status_code=_S.LLM_LINK_FAILED)


def _soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., object], *args: Any) -> None:
    """Run ``fn(*args)`` on ``loop``: now if it is the loop running here, else thread-safely
    as soon as it can (not at all if it is closed: its transport is gone)."""
    try:
        here = asyncio.get_running_loop()
    except RuntimeError:
        here = None
    if here is loop:
        fn(*args)
        return
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _release(done: Callable[[bool], None], ok: bool) -> None:
    try:
        done(ok)
    except Exception:
        _log.exception("Grant.done callback failed")


def _same_secret(a: bytes | None, b: bytes | None) -> bool:
    """Both ends hold the same secret, or neither holds one."""
    if a is None or b is None:
        return a is b
    return hmac.compare_digest(a, b)


class _Op:
    """One request in flight: the task asking the peer's handler, the answer, the outcome.

    ``loop`` is the requester's loop, ``peer_loop`` the server's; ``lock`` makes "the
    answer arrives" and "the requester gives up" exclusive, so the grant is released
    exactly once, on the server's loop.
    """

    __slots__ = (
        "commit",
        "done",
        "failed",
        "lock",
        "loop",
        "over",
        "peer_loop",
        "reason",
        "revoked",
        "status",
        "task",
        "total",
        "views",
        "waiter",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop, peer_loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.peer_loop = peer_loop
        self.lock = threading.Lock()
        self.waiter: asyncio.Future[None] = loop.create_future()
        self.task: asyncio.Task[None] | None = None
        self.status = _S.LLM_FAILED  # unless the handler answers
        self.reason = ""  # the server's reason for a refusal (sanitized)
        self.views: Sequence[memoryview] = []
        self.total = 0
        self.done: Callable[[bool], None] | None = None
        self.commit: Callable[[], Awaitable[LLMStatusCode]] | None = None  # Grant.commit
        self.over = False  # given up, failed or finished: the grant is released
        self.failed = False  # the link broke under it
        self.revoked: LLMStatusCode | None = None  # the server revoked the grant (abort)

    def answer(self, grant: object, name: str, *, writable: bool) -> None:
        """The peer's handler answered (called by the serving task, on ``peer_loop``)."""
        status, views, total = check_grant(grant, name, writable=writable)
        done = grant.done if isinstance(grant, Grant) else None
        reason = decode_reason(grant_reason(grant)) if status is not _S.LLM_SUCCESS else ""
        with self.lock:
            late = self.over
            if not late:
                self.status, self.views, self.total, self.done = status, views, total, done
                self.reason = reason
                if writable and isinstance(grant, Grant):
                    self.commit = grant.commit
        if late and done is not None:
            _release(done, False)  # nobody waits for it any more
        elif not late and status is LLMStatusCode.LLM_SUCCESS and isinstance(grant, Grant):
            grant.bind_abort(self.revoke)
        self.wake()

    def revoke(self, status: LLMStatusCode) -> None:
        """The server revokes its grant (``Grant.abort``, on ``peer_loop``): no copy step
        is running or starts once this holds the lock; ``done(False)`` runs now."""
        with self.lock:
            if self.over:
                return
            self.over, self.revoked = True, status
            done, self.done, self.views = self.done, None, []
        if done is not None:
            _release(done, False)
        self.wake()

    def settle(self) -> LLMStatusCode | None:
        """The requester's copy is complete: end the op as a success, unless the server
        revoked it first (then its code). Atomic with :meth:`revoke`."""
        with self.lock:
            if self.revoked is not None:
                return self.revoked
            self.over = True
            done, self.done, self.views = self.done, None, []
        if done is not None:
            _soon(self.peer_loop, _release, done, True)
        return None

    def wake(self, _: object = None) -> None:
        """Wake the requester (from either loop)."""
        _soon(self.loop, self._wake)

    def _wake(self) -> None:
        if not self.waiter.done():
            self.waiter.set_result(None)

    def end(self, ok: bool) -> None:
        """Release the grant (``done(ok)``, once, on the server's loop) and stop asking the
        handler. Idempotent."""
        with self.lock:
            self.over = True
            done, self.done, self.views = self.done, None, []
        if self.task is not None:
            _soon(self.peer_loop, self.task.cancel)
        if done is not None:
            _soon(self.peer_loop, _release, done, ok)
        self.wake()


class _LocalLink(Link):
    """One end of an in-memory link; ``_other`` is the peer's end."""

    def __init__(self, transport: LocalTransport, peer: PeerInfo) -> None:
        self.local_cluster_id = transport.local_cluster_id
        self.peer = peer
        self._t = transport
        self._other = self
        self._ops: set[_Op] = set()  # requests started at this end
        self._broken = False

    def __repr__(self) -> str:
        state = "broken" if self._broken else "up"
        return f"<LocalLink {self.local_cluster_id}->{self.peer.cluster_id} {state}>"

    @property
    def broken(self) -> bool:
        return self._broken

    async def read(self, meta: bytes, into: Payload, *, timeout: float) -> None:
        await self._request("Link.read", meta, into, timeout, is_read=True)

    async def write(self, meta: bytes, src: Payload, *, timeout: float) -> None:
        await self._request("Link.write", meta, src, timeout, is_read=False)

    async def aclose(self) -> None:
        tasks = [op.task for end in (self, self._other) for op in end._ops if op.task]
        self._break("closed locally")
        current = asyncio.current_task()
        loop = asyncio.get_running_loop()  # the other end's tasks end on their own loop
        mine = [t for t in tasks if t is not current and not t.done() and t.get_loop() is loop]
        if mine:
            await asyncio.wait(mine)

    async def probe(self, timeout: float) -> bool:
        seconds = check_probe_timeout(timeout)
        if self._broken:
            return False
        loop = asyncio.get_running_loop()
        pong: asyncio.Future[None] = loop.create_future()

        def answer() -> None:  # on the peer's loop: it runs, so the peer is alive
            if not self._other._broken:
                _soon(loop, _resolve, pong)

        _soon(self._other._t._loop_or_raise(), answer)
        try:
            async with asyncio.timeout(seconds):
                await pong
        except TimeoutError:
            return False
        return not self._broken

    async def _request(
        self,
        name: str,
        meta: bytes,
        bufs: Payload,
        seconds: float,
        *,
        is_read: bool,
    ) -> None:
        views, total = flatten_views(name, bufs, writable=is_read)
        # Our cap, then the peer's (which would refuse it without asking its handler).
        check_request(
            name, meta, seconds, min(self._t.max_meta_bytes, self._other._t.max_meta_bytes)
        )
        if self._broken:
            raise self._lost(name)
        other = self._other
        op = _Op(asyncio.get_running_loop(), other._t._loop_or_raise())

        def serve() -> None:  # on the server's loop
            if op.over:
                return
            op.task = other._t._spawn(other._serve(op, meta, total, is_read), "aiokv-local-serve")
            op.task.add_done_callback(op.wake)  # even if serving failed without an answer

        self._ops.add(op)
        _soon(op.peer_loop, serve)
        ok = False
        try:
            async with asyncio.timeout(seconds):
                await op.waiter
                status = op.status
                if op.failed:
                    raise self._lost(name)
                if status is not _S.LLM_SUCCESS:
                    raise refusal(name, self.peer.cluster_id, status, op.reason)
                if op.revoked is not None:
                    raise self._revoked(name, op.revoked)
                if op.total != total:
                    raise LLMException(
                        f"{name}: cluster {self.peer.cluster_id} granted {op.total} bytes, "
                        f"not {total}",
                        status_code=_S.LLM_PARAM_INVALID,
                    )
                await self._copy(name, op, *((op.views, views) if is_read else (views, op.views)))
                if op.commit is not None:
                    await self._commit(name, op, op.commit)
                if (revoked := op.settle()) is not None:
                    raise self._revoked(name, revoked)
            ok = True
        except TimeoutError:
            raise LLMException(
                f"{name}: not done by cluster {self.peer.cluster_id} within {seconds:.3g} s",
                status_code=_S.LLM_TIMEOUT,
            ) from None
        finally:
            self._ops.discard(op)
            op.end(ok)

    async def _commit(
        self, name: str, op: _Op, commit: Callable[[], Awaitable[LLMStatusCode]]
    ) -> None:
        """Run the grant's commit on the server's loop; raise its failure code. Cancelled
        meanwhile, it waits for the commit to end (nothing lands after it raised)."""

        async def run() -> LLMStatusCode:
            try:
                return LLMStatusCode(await commit())
            except Exception:
                _log.exception("the commit of a write grant failed")
                return _S.LLM_FAILED

        waiter = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(run(), op.peer_loop))
        try:
            status = await asyncio.shield(waiter)
        except asyncio.CancelledError:
            # nothing of the write may land after this call raised: the commit ends first
            while not waiter.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(waiter)
            raise
        if status is not _S.LLM_SUCCESS:
            raise LLMException(
                f"{name}: cluster {self.peer.cluster_id} answered {status.name}",
                status_code=status,
            )

    async def _copy(
        self, name: str, op: _Op, src: Sequence[memoryview], dst: Sequence[memoryview]
    ) -> None:
        """Copy ``src`` into ``dst`` (equal totals, any split), yielding between steps."""
        si = so = di = do = 0
        budget = _CHUNK_BYTES
        while si < len(src):
            s, d = src[si], dst[di]
            n = min(len(s) - so, len(d) - do, budget)
            with op.lock:  # a revoke waits for this step; none starts after it
                if op.revoked is not None:
                    raise self._revoked(name, op.revoked)
                d[do : do + n] = s[so : so + n]
            so, do, budget = so + n, do + n, budget - n - _SLICE_COST
            if so == len(s):
                si, so = si + 1, 0
            if do == len(d):
                di, do = di + 1, 0
            if budget <= 0 and si < len(src):
                budget = _CHUNK_BYTES
                await asyncio.sleep(0)
                if op.failed:
                    raise self._lost(name)

    async def _serve(self, op: _Op, meta: bytes, size: int, is_read: bool) -> None:
        """Ask our handler about the peer's request ``op``; runs in a task of our transport."""
        name = "grant_read" if is_read else "grant_write"
        handler = self._t.handler
        grant: object
        try:
            if is_read:
                grant = await handler.grant_read(self.peer, meta)
            else:
                grant = await handler.grant_write(self.peer, meta, size)
        except LLMException as exc:
            grant = Grant(exc.status_code, reason=str(exc))
        except Exception as exc:
            _log.exception("%r: handler %s failed", self, name)
            grant = handler_failed(exc)
        op.answer(grant, name, writable=not is_read)

    def _revoked(self, name: str, status: LLMStatusCode) -> LLMException:
        return LLMException(
            f"{name}: cluster {self.peer.cluster_id} revoked its grant ({status.name})",
            status_code=status,
        )

    def _lost(self, name: str) -> LLMException:
        return LLMException(
            f"{name}: link to cluster {self.peer.cluster_id} is broken",
            status_code=_S.LLM_LINK_FAILED,
        )

    def _break(self, reason: str) -> None:
        """Break both ends: pending requests fail at once; each transport hears of its end."""
        if self._broken:
            return
        _log.debug("%r: %s", self, reason)
        ends = (self, self._other)
        self._why_broken = reason  # first: read from other threads once broken
        self._other._why_broken = "closed by peer" if reason.startswith(_CLOSED) else reason
        for end in ends:
            end._broken = True
        for end in ends:
            ops, end._ops = end._ops, set()
            for op in ops:
                op.failed = True
                op.end(False)
        for end in ends:
            _soon(end._t._loop_or_raise(), end._t._link_lost, end)


class LocalTransport(Transport):
    """Links to transports of the same process; see the module docstring."""

    def _init_state(self) -> None:
        self._addresses: list[tuple[str, int]] = []
        self._links: dict[_LocalLink, None] = {}  # insertion-ordered set

    async def listen(self, host: str, port: int) -> tuple[str, int]:
        check_address("listen", host, port)
        self._bind_loop("listen")
        address = (host, port or _free_port(host))
        if address in _listeners:
            raise LLMException(
                f"listen on {host}:{port}: address in use", status_code=_S.LLM_LINK_FAILED
            )
        _listeners[address] = self
        self._addresses.append(address)
        return address

    async def unlisten(self, address: tuple[str, int]) -> None:
        if address in self._addresses:
            self._addresses.remove(address)
            if _listeners.get(address) is self:
                del _listeners[address]

    async def connect(self, host: str, port: int, *, timeout: float) -> Link:
        check_address("connect", host, port)
        check_connect_timeout("connect", timeout)
        self._bind_loop("connect")
        where = f"connect to {host}:{port}"
        if not timeout > 0:  # as TCP: no time left is a timeout, whoever listens
            raise LLMException(
                f"{where}: timed out after {timeout:.3g} s", status_code=_S.LLM_TIMEOUT
            )
        server = _listeners.get((host, port))
        if server is None:
            raise LLMException(f"{where}: connection refused", status_code=_S.LLM_LINK_FAILED)
        if not _same_secret(self.secret, server.secret):
            why = auth_mismatch(self.secret is not None, server.secret is not None)
            _log.warning(
                "refused a link from cluster %d: authentication failed (%s)",
                self.local_cluster_id,
                why,
            )
            raise LLMException(
                f"{where}: authentication failed: {why}",
                status_code=_S.LLM_LINK_FAILED,
                context=AUTH_FAILED,
            )
        mine = _LocalLink(self, PeerInfo(server.local_cluster_id, (host, port)))
        mine.initiator = True
        theirs = _LocalLink(server, PeerInfo(self.local_cluster_id, (host, _free_port(host))))
        mine._other, theirs._other = theirs, mine
        server_loop = server._loop_or_raise()
        if server_loop is asyncio.get_running_loop():
            server._adopt(theirs)
        else:  # the listener files its end on its own loop; like TCP, before we return
            adopted: concurrent.futures.Future[None] = concurrent.futures.Future()

            def adopt() -> None:
                server._adopt(theirs)
                # the connect may have given up (timed out, cancelled): then the future
                # is cancelled, and ``mine`` broke (``theirs`` is lost right after this)
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    adopted.set_result(None)

            _soon(server_loop, adopt)
            try:
                async with asyncio.timeout(timeout):
                    await asyncio.wrap_future(adopted)
            except TimeoutError:
                mine._break("the listener did not file the link in time")
                raise LLMException(
                    f"{where}: timed out after {timeout:.3g} s", status_code=_S.LLM_TIMEOUT
                ) from None
            except asyncio.CancelledError:  # no half link: the listener's end ends too
                mine._break("closed locally")
                raise
        self._adopt(mine)
        return mine

    def links(self) -> list[Link]:
        return list(self._links)

    async def aclose(self) -> None:
        self._closed = True
        for address in self._addresses:
            if _listeners.get(address) is self:
                del _listeners[address]
        self._addresses.clear()
        for link in list(self._links):
            link._break("transport closed")
        await self._end_tasks()

    def _adopt(self, link: _LocalLink) -> None:
        self._links[link] = None
        self._notify(self.on_link, link)

    def _link_lost(self, link: _LocalLink) -> None:
        if self._links.pop(link, False) is None:
            self._notify(self.on_link_lost, link)
