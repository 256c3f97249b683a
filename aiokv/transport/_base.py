"""The transport interface: links that move raw bytes on request, knowing nothing of caches.

A :class:`Transport` listens and connects; every connection is a symmetric
:class:`Link` on which either side may :meth:`~Link.read` (pull) or
:meth:`~Link.write` (push). The side asked to serve a request consults its
:class:`RequestHandler` — the cache layer — which answers with a :class:`Grant`: the
flat byte buffers to send from or receive into. Requests are untrusted: the handler
checks ``meta`` against what it registered; the transport guarantees it never touches
memory outside the granted buffers.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import math
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Coroutine
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import Final
from typing import Generic
from typing import Protocol
from typing import Self
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from .._enums import LLMStatusCode
from .._errors import LLMException
from .._errors import code_of_failure
from .._layout import LayoutViews

__all__ = [
    "BY_ADDRESS",
    "DIRECT_REFUSED",
    "ONE_SIDED",
    "ByAddress",
    "Capability",
    "DeviceRuns",
    "DirectCheck",
    "Grant",
    "Link",
    "LinkCallback",
    "OneSided",
    "Payload",
    "PeerInfo",
    "RequestHandler",
    "Transport",
]

_log = logging.getLogger("aiokv.transport")

#: Most bytes of a refusal's reason (:attr:`Grant.reason`) that travel to the requester;
#: a longer one is cut (at a UTF-8 character boundary) by the sender, and a receiver
#: treats more as a protocol violation. The reason is untrusted text from the peer.
REASON_CAP: Final = 512
#: ``LLMException.context`` of a ``connect`` that failed authentication (``link_secret``).
AUTH_FAILED: Final = {"authenticated": False}
#: ``LLMException.context`` of a ``read`` / ``write`` of :class:`DeviceRuns` that the
#: peer answered with a grant this link cannot move by address (it would need DATA
#: frames, which device memory cannot take): nothing moved and the peer let go; the
#: caller may retry through host staging.
DIRECT_REFUSED: Final = {"direct": False}


@dataclass(frozen=True, slots=True)
class DeviceRuns:
    """Accelerator memory named by address, for a link that moves it without host
    staging (:meth:`Link.addressable`): the request buffers of a ``read`` / ``write``,
    or the memory of a :class:`Grant` (its ``device``).

    Attributes:
        device: the memory's device, as torch names it (``"cuda:0"``).
        runs: ``(address, length)`` rows, ``uint64``, shape ``(n, 2)``, wire order;
            every length > 0.
    """

    device: str
    runs: npt.NDArray[np.uint64]

    @property
    def total(self) -> int:
        """Bytes over all runs."""
        return int(self.runs[:, 1].sum()) if self.runs.size else 0


#: What a link moves on this side of a request: host views, or device memory by address.
Payload = Sequence[memoryview] | DeviceRuns

#: ``direct(device, addr, nbytes)``: whether a grant may name ``[addr, addr + nbytes)``
#: of ``device`` memory by address (:attr:`Grant.device`) for the request being served.
DirectCheck = Callable[[str, int, int], bool]


T = TypeVar("T")


class Capability(Generic[T]):
    """The typed key of an optional capability of a link (:meth:`Link.extra`), in the
    manner of anyio's typed attributes: ``link.extra(ONE_SIDED)`` is a :class:`OneSided`
    or None. Keys compare by identity."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<link capability {self.name}>"


class ByAddress(Protocol):
    """A link that moves memory by address (no host staging): :data:`BY_ADDRESS`."""

    def addressable(self, device: str, addr: int, nbytes: int) -> bool:
        """Whether ``[addr, addr + nbytes)`` of ``device`` memory (``"cuda:0"``,
        ``"cpu"``) moves by address on this link now; see :meth:`Link.addressable`."""
        ...


class OneSided(Protocol):
    """A link with one-sided transfers (no request, no grant): :data:`ONE_SIDED`."""

    def publish(self) -> None:
        """Make sure the peer can reach this side's memory as it is registered now
        (e.g. resend memory metadata if registrations changed since it was last sent).
        Frames of one link arrive in order, so whatever this side sends after it may
        name that memory."""
        ...

    def lend(self) -> Callable[[], None]:
        """This side's memory is lent to the peer for :meth:`move_at`: keep whatever the
        peer's one-sided transfers need of this side going (progress, with back-off)
        until the returned function is called (idempotent)."""
        ...

    async def move_at(
        self, write: bool, local: Payload, remote: DeviceRuns, *, timeout: float
    ) -> None:
        """Read the peer's memory ``remote`` (by address; ``remote.device`` names where
        it lives on the peer: ``"cpu"``, ``"cuda:N"``) into ``local``, or write
        ``local`` into it (``write``), in wire order. No request and no grant: the
        peer's code is not involved, so the caller must know that the peer lent that
        memory (a lease, :mod:`aiokv._remote._leases`). Once this returns or raises,
        the transfer is over.

        Raises:
            LLMException: ``LLM_FEATURE_NOT_ENABLED`` when ``local`` or ``remote`` is not
                memory the link can move by address (nothing moved);
                ``LLM_PARAM_INVALID`` when the lengths differ; ``LLM_TIMEOUT`` past
                ``timeout`` seconds; ``LLM_FAILED`` / ``LLM_LINK_FAILED`` when the
                transfer failed.
        """
        ...


#: The capability of a link that moves memory by address (:meth:`Link.addressable`).
BY_ADDRESS: Final[Capability[ByAddress]] = Capability("by address")
#: The capability of a link with one-sided transfers (:meth:`Link.move_at`).
ONE_SIDED: Final[Capability[OneSided]] = Capability("one-sided")


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """Who is on the other end of a link.

    Attributes:
        cluster_id: the remote side's cluster id, as it announced in the handshake.
        address: the remote socket address ``(host, port)``.
    """

    cluster_id: int
    address: tuple[str, int]


@dataclass(slots=True)
class Grant:
    """The local side's answer to a peer's request.

    Attributes:
        status: ``LLM_SUCCESS`` to serve the request; any other code refuses it and is
            raised on the requesting side.
        buffers: flat byte buffers (format ``'B'``), in wire order; empty unless
            ``status`` is ``LLM_SUCCESS``. For a write grant they must be writable.
        reason: why a refusal refuses, for a person (e.g. ``"block sizes differ (4096
            vs 8192 bytes)"``); sent to the requester with the code (at most
            :data:`REASON_CAP` bytes of it) and put in its ``LLMException``'s message.
            Ignored on success.
        done: called exactly once when the I/O on ``buffers`` is over, on the event
            loop, with ``True`` only when the whole payload moved: for a read grant, when
            the reader confirmed receipt of every byte; for a write grant, when every
            byte landed in ``buffers``. Called with ``False`` when the request is
            refused by the transport (e.g. size mismatch), cancelled by the peer,
            revoked (:meth:`abort`), or the link breaks. After it is called the
            transport no longer touches ``buffers``. It must not raise or block.
        commit: for a write grant only, optional: awaited on the event loop once every
            byte landed in ``buffers`` and before the writer is told anything; the
            writer's operation ends with the code it returns (``LLM_SUCCESS``: landed),
            and ``done`` runs after it (with ``True`` only on ``LLM_SUCCESS``). It lets
            the handler move the bytes on (staged device memory: host→device) before
            the push counts as landed. It must not take long; if it raises, the writer
            gets ``LLM_FAILED``. The grant may be revoked, cancelled or lose its link
            while it runs (``done(False)`` may then run before it returns).
        device: instead of ``buffers`` (which stay empty), device memory by address; only
            for a request whose handler call received ``direct``, and only memory that
            ``direct`` accepted. The transport moves it by address or refuses the
            request (``LLM_FAILED``); it never sends or receives it as socket payload.
            ``commit`` is not used with it (the bytes land where they belong).

    Revoking: the handler may end a grant early with :meth:`abort` (its memory is
    going away, or the grant outlived its deadline). The transport binds the means
    (:meth:`bind_abort`) when it starts serving the grant.
    """

    status: LLMStatusCode
    buffers: Sequence[memoryview] = field(default_factory=list)
    done: Callable[[bool], None] | None = None
    commit: Callable[[], Awaitable[LLMStatusCode]] | None = None
    reason: str = ""
    device: DeviceRuns | None = None
    _abort: Callable[[LLMStatusCode], None] | None = field(default=None, repr=False)
    _aborted: LLMStatusCode | None = field(default=None, repr=False)

    def abort(self, status: LLMStatusCode = LLMStatusCode.LLM_FAILED) -> None:
        """Revoke the grant: when this returns, the transport no longer touches
        ``buffers`` and ``done(False)`` has run (unless ``done`` had run already, then
        this is a no-op). The peer's operation fails with ``status``: a reader still
        receiving is told its read failed (bytes it already received are unspecified),
        a writer's further bytes are dropped and its write fails.

        Call it on the transport's event loop (where ``done`` runs). Idempotent.
        """
        if self._aborted is not None:
            return
        self._aborted = status
        fn, self._abort = self._abort, None
        if fn is not None:
            fn(status)

    def bind_abort(self, fn: Callable[[LLMStatusCode], None]) -> None:
        """For transports: how to revoke this grant while it is served (see :meth:`abort`).

        ``fn(status)`` must stop all I/O on ``buffers`` before it returns, fail the
        peer's operation with ``status``, and call ``done(False)`` unless ``done`` ran.
        Bound once the grant is accepted; if :meth:`abort` was called earlier, ``fn``
        runs at once.
        """
        if self._aborted is not None:
            fn(self._aborted)
        else:
            self._abort = fn


class RequestHandler(Protocol):
    """Serves a peer's requests; implemented by the cache layer, runs on the event loop.

    ``direct`` (keyword-only, declared here) is the one piece of context a transport
    may add to a request: a transport that moves device memory by address (an RDMA
    transport with memory registered on a ``cuda`` device) passes a
    :data:`DirectCheck` with a request it could serve from such memory; then, and only
    for memory ``direct`` accepts, the handler may answer with a :attr:`Grant.device`
    grant instead of host buffers. It is passed only then (never by a transport that
    has no device memory registered), so a handler that never registers any may leave
    it out at run time; type checkers want it declared.
    """

    async def grant_read(
        self, peer: PeerInfo, meta: bytes, *, direct: DirectCheck | None = None
    ) -> Grant:
        """The peer wants to READ (pull) from us: return the buffers to send.

        ``meta`` is the requester's opaque request (the layer above encodes it), at most
        ``max_meta_bytes`` long; it is untrusted.
        """
        ...

    async def grant_write(
        self, peer: PeerInfo, meta: bytes, nbytes: int, *, direct: DirectCheck | None = None
    ) -> Grant:
        """The peer wants to WRITE (push) ``nbytes`` into us: return buffers totalling it.

        A grant whose buffers do not total ``nbytes`` is answered ``LLM_PARAM_INVALID``.
        """
        ...


class ImmediateHandler(RequestHandler, Protocol):
    """A :class:`RequestHandler` that can often answer without waiting (the cache
    layer: a grant of host memory is lookups and checks only). A TCP link asks
    :meth:`grant_now` first, right where it reads the request, and awaits
    ``grant_read`` / ``grant_write`` in a task of its own only when it returns None:
    no task and no wake-up per request served at once."""

    def grant_now(
        self, peer: PeerInfo, meta: bytes, nbytes: int, *, write: bool, direct: DirectCheck | None
    ) -> Grant | None:
        """The answer ``grant_write`` (``write``) or ``grant_read`` would give, when it
        needs no waiting; else None, having done nothing (no pin, no count, no side
        effect), and the link awaits that method instead. ``nbytes``: the payload the
        request names (to push, or to read), so that a request of another size than
        its grant is refused before anything is done for it. Raises as they do."""
        ...


#: ``on_link`` / ``on_link_lost`` callback: called on the event loop with the link.
LinkCallback = Callable[["Link"], None]


class Link(abc.ABC):
    """One connection between two transports; symmetric: either side may read or write.

    Several operations may be in flight on a link at once; their bytes never mix.
    Every operation raises ``LLMException``: the peer's code when it refuses,
    ``LLM_PARAM_INVALID`` for a size mismatch or bad ``meta``, ``LLM_TIMEOUT`` past its
    ``timeout`` (seconds), ``LLM_LINK_FAILED`` when the link is or becomes broken.
    ``TypeError`` / ``ValueError`` for arguments of the wrong type or range.
    Cancelling an operation (``task.cancel()``, an enclosing ``asyncio.timeout``) fails
    only that operation; the link stays usable and the peer is told to let go.

    ``timeout`` is an argument rather than left to an enclosing scope because expiry is
    part of the protocol: it must map to ``LLM_TIMEOUT`` and release the peer's grant.
    """

    local_cluster_id: int
    peer: PeerInfo
    #: True on the end :meth:`Transport.connect` returned (this side opened the link),
    #: False on the accepting end. ``on_link`` reports both; the opener checks the
    #: peer's cluster id before it uses the link.
    initiator: bool = False

    @property
    @abc.abstractmethod
    def broken(self) -> bool:
        """True once the link can no longer carry requests (closed, reset, protocol error)."""

    #: set by a link that breaks (see :attr:`why_broken`)
    _why_broken: str = ""

    @property
    def why_broken(self) -> str:
        """Why the link broke, for a person (e.g. ``"connection lost: EOF"``,
        ``"closed by peer"``, ``"closed by peer with an error: <its reason>"``); ``""``
        while it is up, or where the link does not say."""
        return self._why_broken

    def extra(self, capability: Capability[T]) -> T | None:
        """The link's optional ``capability`` as it stands now (e.g. ``link.extra(ONE_SIDED)``:
        a :class:`OneSided`), or None where the link has none now. Every capability is
        optional: a link that moves bytes over its socket only has none (this default).
        A capability may come later in a link's life (a peer's metadata arriving) or
        go (the link breaking): ask again rather than keep the answer."""
        return None

    def addressable(self, device: str, addr: int, nbytes: int) -> bool:
        """Whether ``[addr, addr + nbytes)`` of accelerator memory on ``device``
        (``"cuda:0"``) can be passed to :meth:`read` / :meth:`write` as
        :class:`DeviceRuns` now: moved by address, without host staging (the link's
        :data:`BY_ADDRESS` capability; without it: False, as on every link that moves
        bytes over its socket only). (For ``"cpu"``: whether that host memory moves by
        address on this link, as :meth:`move_at` needs of ``local`` memory and a lease
        of the peer's.)

        Even when True, the peer may grant memory this link cannot reach by address:
        the operation then raises ``LLMException`` with :data:`DIRECT_REFUSED` as its
        context, having moved nothing, and the caller stages instead.
        """
        by_address = self.extra(BY_ADDRESS)
        return by_address is not None and by_address.addressable(device, addr, nbytes)

    @property
    def one_sided(self) -> bool:
        """Whether :meth:`move_at` works on this link now: whether it has the
        :data:`ONE_SIDED` capability (an RDMA transport, once it can reach the peer's memory)."""
        return self.extra(ONE_SIDED) is not None

    def publish(self) -> None:
        """:meth:`OneSided.publish` where the link is :attr:`one_sided`; else nothing."""
        one_sided = self.extra(ONE_SIDED)
        if one_sided is not None:
            one_sided.publish()

    def lend(self) -> Callable[[], None]:
        """:meth:`OneSided.lend` where the link is :attr:`one_sided`; else nothing is
        needed (the release returned does nothing)."""
        one_sided = self.extra(ONE_SIDED)
        return _nothing if one_sided is None else one_sided.lend()

    async def move_at(
        self, write: bool, local: Payload, remote: DeviceRuns, *, timeout: float
    ) -> None:
        """:meth:`OneSided.move_at` of the link's :data:`ONE_SIDED` capability.

        Raises:
            LLMException: ``LLM_FEATURE_NOT_ENABLED`` when the link is not
                :attr:`one_sided` (nothing moved); otherwise as :meth:`OneSided.move_at`.
        """
        one_sided = self.extra(ONE_SIDED)
        if one_sided is None:
            raise LLMException(
                "this link has no one-sided transfers",
                status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
            )
        await one_sided.move_at(write, local, remote, timeout=timeout)

    @abc.abstractmethod
    async def read(self, meta: bytes, into: Payload, *, timeout: float) -> None:
        """Pull the payload described by ``meta`` (opaque bytes, at most
        ``max_meta_bytes``) from the peer straight into ``into`` (:class:`DeviceRuns`
        only where :meth:`addressable`; elsewhere ``LLM_PARAM_INVALID``).

        The total length of ``into`` must equal what the peer grants, otherwise
        ``LLM_PARAM_INVALID`` and the peer reports nothing done. Once this returns or
        raises, no more bytes are written into ``into``; on failure its content is
        unspecified.
        """

    @abc.abstractmethod
    async def write(self, meta: bytes, src: Payload, *, timeout: float) -> None:
        """Push ``src`` to the peer into the buffers it grants for ``meta``
        (:class:`DeviceRuns` as for :meth:`read`).

        Two-phase: no payload is sent before the peer grants the request. Returns once
        the peer confirms that every byte landed. Once this returns or raises, ``src`` is
        no longer read. A write that raises may still have landed whole (the peer's
        ``done(True)``) when its deadline or the link ran out just as the confirmation
        was on its way (a read's grant, by contrast, gets ``done(True)`` only if it returned).

        Cancelled or timed out, a write whose payload had started to move returns (or
        raises) only once the peer confirmed that no byte of it lands any more: after
        that the destination is never written again, though it may hold part of the
        payload. The wait for that confirmation is shielded and bounded (TCP: the
        write's remaining time, at least 0.5 s and at most 5 s); a peer that does not
        confirm in time loses the link (``LLM_LINK_FAILED`` for everything pending),
        and only then may bytes already on the wire still land when that peer resumes.
        A link that breaks ends the wait at once, with the same caveat.
        """

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Close the link; pending operations on both sides fail with ``LLM_LINK_FAILED``."""

    @abc.abstractmethod
    async def probe(self, timeout: float) -> bool:
        """Whether the peer answers a liveness probe within ``timeout`` seconds (> 0).

        True only if the peer's side of the link is running and answered (its transport
        serves the link); False if it did not in time or the link is or becomes broken.
        Never raises for a dead peer, never breaks the link, moves no payload; several
        probes may run at once. Cancelled, it just stops waiting.

        Raises:
            TypeError / ValueError: ``timeout`` not a positive finite number.
        """


def _nothing() -> None:
    return


def check_probe_timeout(timeout: object) -> float:
    """``timeout`` of :meth:`Link.probe`, checked: a positive finite number of seconds.

    Raises:
        TypeError / ValueError: otherwise.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise TypeError(f"timeout must be a number of seconds, got {type(timeout).__name__}")
    if not 0 < timeout < float("inf"):
        raise ValueError(f"timeout must be > 0 and finite, got {timeout}")
    return float(timeout)


class Transport(abc.ABC):
    """Listens, connects and owns every link and background task it creates.

    Also an async context manager: leaving it calls :meth:`aclose`.

    Args:
        local_cluster_id: this side's cluster id, announced in the handshake.
        handler: serves the peers' requests.
        secret: if set, both sides must hold the same secret (mutual
            challenge-response; the secret never travels).
        max_meta_bytes: cap on the encoded ``meta`` of one request, both ways.
        on_link: called with every link established, incoming or outgoing.
        on_link_lost: called once with every link that broke or was closed.
        handshake_timeout: seconds an incoming connection gets to complete the link
            handshake before it is dropped (a finite number > 0). The ``local``
            transport has no network handshake and nothing to time out.
    """

    def __init__(
        self,
        local_cluster_id: int,
        handler: RequestHandler,
        *,
        secret: bytes | None = None,
        max_meta_bytes: int = 1 << 20,
        on_link: LinkCallback | None = None,
        on_link_lost: LinkCallback | None = None,
        handshake_timeout: float = 10.0,
    ) -> None:
        if isinstance(local_cluster_id, bool) or not isinstance(local_cluster_id, int):
            raise TypeError("local_cluster_id must be int")
        if not 0 <= local_cluster_id < 2**64:
            raise ValueError(f"local_cluster_id={local_cluster_id} is out of range [0, 2**64)")
        if secret is not None and not isinstance(secret, bytes | bytearray):
            raise TypeError("secret must be bytes or None")
        if isinstance(max_meta_bytes, bool) or not isinstance(max_meta_bytes, int):
            raise TypeError("max_meta_bytes must be int")
        if not 2 <= max_meta_bytes < 2**32:
            raise ValueError(f"max_meta_bytes={max_meta_bytes} is out of range [2, 2**32)")
        if isinstance(handshake_timeout, bool) or not isinstance(handshake_timeout, int | float):
            raise TypeError("handshake_timeout must be a number of seconds")
        if not (math.isfinite(handshake_timeout) and handshake_timeout > 0):
            raise ValueError(f"handshake_timeout={handshake_timeout} must be finite and > 0")
        self.local_cluster_id = local_cluster_id
        self.handler = handler
        self.handshake_timeout = float(handshake_timeout)
        self.secret = bytes(secret) if secret is not None else None
        self.max_meta_bytes = max_meta_bytes
        self.on_link = on_link
        self.on_link_lost = on_link_lost
        self._loop: asyncio.AbstractEventLoop | None = None  # bound by the first listen/connect
        self._closed = False
        self._tasks: set[asyncio.Task[None]] = set()  # every task it started
        self._init_state()

    def _init_state(self) -> None:  # noqa: B027
        """Set up a backend's own state that no argument decides (its links, listeners,
        caches): called last by :meth:`__init__`, so that a backend whose arguments are
        its base's needs no constructor of its own. The default does nothing."""

    @abc.abstractmethod
    async def listen(self, host: str, port: int) -> tuple[str, int]:
        """Accept links on ``host:port`` (port 0 picks a free one); returns the bound address.

        Raises:
            TypeError / ValueError: ``host`` not a string, ``port`` not an int in
                ``0..65535``.
            LLMException: ``LLM_LINK_FAILED`` when the address cannot be bound.
        """

    @abc.abstractmethod
    async def unlisten(self, address: tuple[str, int]) -> None:
        """Stop accepting links on ``address`` (as :meth:`listen` returned it).

        Links already made stay up. No-op when nothing listens there.
        """

    @abc.abstractmethod
    async def connect(self, host: str, port: int, *, timeout: float) -> Link:
        """Open a link to a listening transport, handshake included, within ``timeout`` s.

        Raises:
            TypeError / ValueError: ``host`` / ``port`` as for :meth:`listen`;
                ``timeout`` not a finite number (``<= 0`` means no time left:
                ``LLM_TIMEOUT``).
            LLMException: ``LLM_LINK_FAILED`` when refused, reset or authentication
                fails; ``LLM_TIMEOUT`` past ``timeout``.
        """

    @abc.abstractmethod
    def links(self) -> list[Link]:
        """The live links, incoming and outgoing."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Close the listener and every link; pending operations fail with ``LLM_LINK_FAILED``.

        Returns once every background task of the transport has finished.
        """

    # ---- memory the layer above owns ------------------------------------------------------
    def register_memory(self, addr: int, nbytes: int, *, device: str = "cpu") -> None:  # noqa: B027
        """Tell the transport that ``[addr, addr + nbytes)`` on ``device`` (``"cpu"``,
        ``"cuda:0"``, ...) will hold grants and request buffers until
        :meth:`deregister_memory`: a transport that moves bytes by address (RDMA)
        registers it once with its engine. The default does nothing.

        Called by the owner of the memory (a pool when reserved, a user cache when
        registered), from any thread; registering the same range again is counted.
        Buffers outside registered memory still move, by the transport's plain path.
        """

    def deregister_memory(self, addr: int, nbytes: int, *, device: str = "cpu") -> None:  # noqa: B027
        """Undo one :meth:`register_memory` of the same range and device (one the
        transport could not use included: each call undoes exactly one); the owner calls
        it only once no grant or request uses the range any more. The default does
        nothing."""

    def outlived(self, addr: int, nbytes: int, *, device: str = "cpu") -> bool:
        """Whether a transfer this transport could not stop may still write into (or
        read) ``[addr, addr + nbytes)`` of ``device``: its owner must never hand that
        memory out again. False unless a transport whose transfers may outlive their
        operation says so (docs/design.md, "Ending an operation"); any thread."""
        return False

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # ---- what every implementation needs: one loop, owned tasks --------------------------
    def _bind_loop(self, op: str) -> asyncio.AbstractEventLoop:
        """The running loop, which this transport is bound to from its first call on.

        Raises:
            LLMException: ``LLM_LINK_FAILED`` once closed.
            RuntimeError: called from another loop.
        """
        if self._closed:
            raise LLMException(
                f"{op}: transport is closed", status_code=LLMStatusCode.LLM_LINK_FAILED
            )
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError(
                f"{op}: transport is bound to another event loop; a transport and its "
                "links belong to the loop of its first listen/connect: use them there "
                "(LLMDataDist runs its transport on its engine loop for you)"
            )
        return loop

    def _loop_or_raise(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("transport has no event loop yet")
        return self._loop

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Start a task on this transport's loop, owned (and ended by) :meth:`_end_tasks`."""
        task = self._loop_or_raise().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            _log.error("transport task %s failed", task.get_name(), exc_info=exc)

    async def _end_tasks(self) -> None:
        """Cancel every task this transport started and wait until all have ended."""
        for task in self._tasks:
            task.cancel()
        while self._tasks:
            await asyncio.wait(list(self._tasks))

    def _notify(self, callback: LinkCallback | None, link: Link) -> None:
        """Run a user callback; its failure is logged, never propagated into the transport."""
        if callback is None:
            return
        try:
            callback(link)
        except Exception:
            _log.exception("link callback %r failed", callback)


# ---------------------------------------------------------- shared by the implementations


def flatten_views(
    op: str, views: Sequence[Any] | DeviceRuns, *, writable: bool
) -> tuple[Sequence[memoryview], int]:
    """Flat, non-empty ``'B'`` views over ``views`` and their total length (a
    :class:`~aiokv._layout.LayoutViews` is returned as it is: checked when made).

    The argument check of every transport's ``read`` / ``write`` buffers and of grants.

    Raises:
        TypeError: ``views`` is not a sequence of buffers.
        LLMException: ``LLM_PARAM_INVALID`` for a non-contiguous buffer, a read-only
            one where bytes must be written, or :class:`DeviceRuns` (device memory is
            moved by address only by a link that takes it, never as socket payload).
    """
    if isinstance(views, DeviceRuns):
        raise LLMException(
            f"{op}: this link cannot move {views.device} memory by address",
            status_code=LLMStatusCode.LLM_PARAM_INVALID,
        )
    if type(views) is LayoutViews and not (writable and views.readonly):
        return views, views.total  # checked when the layout made it
    if isinstance(views, bytes | bytearray | memoryview) or not isinstance(views, Sequence):
        raise TypeError(f"{op}: expected a sequence of memoryviews, got {type(views).__name__}")
    out: list[memoryview] = []
    for i, v in enumerate(views):
        mv = v if isinstance(v, memoryview) else memoryview(v)  # TypeError if not a buffer
        if not mv.c_contiguous:
            raise LLMException(
                f"{op}: buffer {i} is not contiguous", status_code=LLMStatusCode.LLM_PARAM_INVALID
            )
        if writable and mv.readonly:
            raise LLMException(
                f"{op}: buffer {i} is read-only", status_code=LLMStatusCode.LLM_PARAM_INVALID
            )
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        if mv.nbytes:
            out.append(mv)
    return out, sum(len(v) for v in out)


def check_address(op: str, host: str, port: int) -> None:
    """The argument check of every transport's ``listen`` / ``connect`` address.

    Raises:
        TypeError: ``host`` is not a string, ``port`` not an int (a bool is not one).
        ValueError: ``port`` outside ``0..65535`` (it would wrap around in the kernel).
    """
    if not isinstance(host, str):
        raise TypeError(f"{op}: host must be str, got {type(host).__name__}")
    if isinstance(port, bool) or not isinstance(port, int):
        raise TypeError(f"{op}: port must be int, got {type(port).__name__}")
    if not 0 <= port <= 65535:
        raise ValueError(f"{op}: port {port} is out of range [0, 65535]")


def check_connect_timeout(op: str, timeout: float) -> None:
    """The check of ``connect``'s ``timeout``: a finite number of seconds (``<= 0`` is
    allowed and means no time is left: the call raises ``LLM_TIMEOUT``).

    Raises:
        TypeError: not an int or float (a bool is not a number).
        ValueError: NaN or infinite.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise TypeError(f"{op}: timeout must be a number of seconds")
    if not math.isfinite(timeout):
        raise ValueError(f"{op}: timeout={timeout} must be finite")


def check_request(op: str, meta: bytes, timeout: float, max_meta_bytes: int) -> None:
    """The argument check of every transport's ``read`` / ``write``, besides the buffers.

    Raises:
        TypeError / ValueError: ``timeout`` is not a number > 0; ``meta`` is not bytes.
        LLMException: ``LLM_PARAM_INVALID`` for ``meta`` over ``max_meta_bytes``.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise TypeError(f"{op}: timeout must be a number of seconds")
    if not timeout > 0:  # also NaN
        raise ValueError(f"{op}: timeout={timeout} must be > 0")
    if not isinstance(meta, bytes):
        raise TypeError(f"{op}: meta must be bytes, got {type(meta).__name__}")
    if len(meta) > max_meta_bytes:
        raise LLMException(
            f"{op}: meta of {len(meta)} bytes exceeds the cap of {max_meta_bytes}",
            status_code=LLMStatusCode.LLM_PARAM_INVALID,
        )


def grant_reason(grant: object) -> str:
    """The reason of a refusing grant (``""`` when it gives none or is no ``Grant``)."""
    return grant.reason if isinstance(grant, Grant) and isinstance(grant.reason, str) else ""


def check_grant(
    grant: object, name: str, *, writable: bool, device_ok: bool = False
) -> tuple[LLMStatusCode, Sequence[memoryview], int]:
    """A handler's answer as ``(status, flat buffers, total)``.

    Anything unusable (not a :class:`Grant`, an unknown status, buffers that are not flat
    byte buffers, read-only buffers for a write, a :attr:`Grant.device` grant unless
    ``device_ok`` — the request was offered ``direct`` — or one with buffers or bad
    runs) is logged and becomes ``LLM_FAILED``. A device grant gives no buffers and its
    :attr:`DeviceRuns.total`.
    """
    if not isinstance(grant, Grant):
        _log.error("handler %s returned %r, not a Grant", name, type(grant).__name__)
        return LLMStatusCode.LLM_FAILED, [], 0
    try:
        status = LLMStatusCode(grant.status)
        if status is not LLMStatusCode.LLM_SUCCESS:
            return status, [], 0
        if grant.device is not None:
            dev = grant.device
            if not device_ok or grant.buffers or not _valid_runs(dev.runs):
                raise ValueError(f"a device grant it may not make ({dev.device})")
            return status, [], dev.total
        views, total = flatten_views(name, grant.buffers, writable=writable)
    except (ValueError, TypeError, LLMException) as exc:
        _log.error("handler %s granted unusable buffers: %s", name, exc)
        return LLMStatusCode.LLM_FAILED, [], 0
    return status, views, total


def _valid_runs(runs: object) -> bool:
    """``(address, length)`` rows: a non-empty ``uint64`` array of shape ``(n, 2)``,
    every length > 0."""
    return (
        isinstance(runs, np.ndarray)
        and runs.dtype == np.uint64
        and runs.ndim == 2
        and runs.shape[0] > 0
        and runs.shape[1] == 2
        and bool(runs[:, 1].all())
    )


def encode_reason(reason: object) -> bytes:
    """A refusal's reason as the UTF-8 bytes that travel: at most :data:`REASON_CAP`
    bytes, cut at a character boundary; ``b""`` for anything that is not a string."""
    if not isinstance(reason, str) or not reason:
        return b""
    raw = reason.encode("utf-8", "replace")
    if len(raw) <= REASON_CAP:
        return raw
    return raw[:REASON_CAP].decode("utf-8", "ignore").encode()


def decode_reason(raw: bytes | bytearray | memoryview | str) -> str:
    """A peer's reason made safe to show and log: at most :data:`REASON_CAP` bytes
    read, invalid UTF-8 replaced, control characters (newlines included) replaced by
    ``?``, surrounding blanks stripped. Untrusted text stays text: never parsed."""
    if isinstance(raw, str):
        raw = encode_reason(raw)
    text = bytes(raw[:REASON_CAP]).decode("utf-8", "replace")
    return "".join(c if c.isprintable() else "?" for c in text).strip()


def failure_code(exc: Exception) -> LLMStatusCode:
    """The code that answers a peer's request that this side failed to serve with
    ``exc`` (not an ``LLMException``): what a caller of aiokv sees for it
    (:func:`~aiokv._errors.code_of_failure`: out of memory stays ``LLM_OUT_OF_MEMORY``,
    a timeout ``LLM_TIMEOUT``), but never ``LLM_LINK_FAILED``, which would tell the
    peer that its link broke; anything else ``LLM_FAILED``."""
    code = code_of_failure(exc)
    return LLMStatusCode.LLM_FAILED if code is LLMStatusCode.LLM_LINK_FAILED else code


def handler_failed(exc: Exception) -> Grant:
    """The refusal of a peer's request whose handler raised ``exc`` (not an
    ``LLMException``): its :func:`failure_code`, and no local exception text."""
    return Grant(failure_code(exc), reason="the peer's handler failed")


def refusal(op: str, cluster_id: int, status: LLMStatusCode, reason: str) -> LLMException:
    """The requester's error for a peer's refusal: the code, and the peer's (already
    sanitized) reason when it gave one."""
    why = f": {reason}" if reason else ""
    return LLMException(
        f"{op}: cluster {cluster_id} refused ({status.name}){why}", status_code=status
    )


def auth_mismatch(mine: bool, theirs: bool) -> str:
    """What a failed link authentication means, for a person: ``mine`` / ``theirs``:
    whether this side / the peer holds a secret."""
    if mine and not theirs:
        return "this side has a link_secret and the peer has none; set the same on both"
    if theirs and not mine:
        return "the peer requires a link_secret and this side has none; set the same on both"
    return "the two sides' link_secret differ; set the same on both"
