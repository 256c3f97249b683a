"""The data plane of a TCP link: what moves a request's payload, when not the socket.

A :class:`~aiokv.transport.tcp._link.TcpLink` agrees on every transfer over its socket
(requests, grants, refusals, cancels, acknowledgements: the control plane) and hands
the moving of the payload to its :class:`DataPlane`, which it is given when it is made:

* the **stream plane** (:data:`STREAM`, every plain TCP link): it offers nothing, so
  every payload moves as ``DATA`` frames on the link's own socket;
* another medium (RDMA: the plane that the transport making the link hands it): a
  request whose buffers it can reach is *offered* to it (:meth:`DataPlane.offer`) and
  sent as a plane request; the granter's plane *answers* with an opaque grant
  (:meth:`DataPlane.answer`, a ``PLANE_GRANT`` frame) or leaves it to ``DATA``; the
  requester's plane then *moves* the bytes itself (:meth:`DataPlane.move`), settling
  its transfer before it returns.

The link stays the only owner of the request state (:mod:`._protocol`); a plane holds
its medium's state for the link (the peer's agent, transfers in flight) and learns of
the peer's plane through ``PLANE_HELLO`` frames (:meth:`DataPlane.hello`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from typing import Protocol
from typing import TypeVar

from .._base import Capability
from .._base import DeviceRuns
from .._base import DirectCheck
from .._base import PeerInfo
from ._ops import MyOp
from ._ops import PeerOp

__all__ = ["STREAM", "DataPlane", "PlaneHost", "StreamPlane"]

T = TypeVar("T")


class PlaneHost(Protocol):
    """What a data plane may ask of the link that carries it."""

    peer: PeerInfo

    @property
    def broken(self) -> bool: ...

    def _hello(self, payload: bytes) -> None:
        """Send the peer's plane ``payload`` in a ``PLANE_HELLO`` (with our meta cap)."""

    def _break(self, reason: str) -> None:
        """Close the link: it fails everything pending and calls :meth:`DataPlane.closed`."""


class DataPlane(Protocol):
    """Moves granted payload outside the link's socket; one per link.

    Plans and grants are the plane's own objects, opaque to the link: it only carries
    a grant's bytes from the granter's plane (:meth:`answer`) to the requester's
    (:meth:`accept`).
    """

    #: the plane's name (ASCII, at most 255 bytes): ``PLANE_HELLO`` frames of a peer plane
    #: of another name are ignored, so two different planes never mix
    name: str

    def bind(self, link: PlaneHost) -> None:
        """Called once, by the link being made: the plane's link (it may greet the peer)."""

    def hello(self, payload: bytes, cap: int) -> None:
        """The peer's plane greeted us with ``payload`` (untrusted); ``cap``: the
        largest meta the peer accepts."""

    def closed(self) -> None:
        """The link broke: release what the plane holds for it once unused. Called
        before the link ends its operations: a grant served that is not over yet ends
        unheard (the peer's transfer on it may not have ended)."""

    # ---- requester side

    def offer(self, views: Sequence[memoryview], total: int) -> Any | None:
        """A plan to move the payload of our request over ``views`` (``total`` bytes)
        outside the socket, or None: it moves as ``DATA``. With a plan the request is
        sent as ``PLANE_READ_REQ`` / ``PLANE_WRITE_REQ``."""

    def offer_device(self, dev: DeviceRuns) -> Any | None:
        """As :meth:`offer`, for device memory (which moves no other way: None makes
        the request ``LLM_PARAM_INVALID``)."""

    def accept(self, grant: bytes | bytearray, size: int) -> Any | None:
        """The peer's ``PLANE_GRANT`` bytes for our plan request of ``size`` bytes, as the
        plane's grant (stored in ``MyOp.remote``), or None when unusable (the request
        fails ``LLM_PARAM_INVALID``)."""

    async def move(self, op: MyOp, plan: Any) -> None:
        """Move granted ``op``'s payload per ``plan`` (``op.remote``: the grant). Once the
        payload moved whole (a write: every byte in the peer's memory, the medium's
        remote completion) the plane marks ``op.stream`` sent; the link then asks the
        granter to confirm and the op ends by its word: ``WRITE_DONE`` answering
        ``PLANE_WRITE_CHECK`` (the granter learns of the landing from that frame
        alone), ``READ_RESP`` answering ``PLANE_READ_CHECK`` (the granter may have
        revoked the grant while the bytes moved). A plane that fails the op finishes
        it. When this returns or raises, nothing touches the buffers any more."""

    # ---- granter side

    def direct(self, op: PeerOp) -> DirectCheck | None:
        """For the peer's plane request ``op``: which device memory the handler may
        grant by address (:attr:`~aiokv.transport.Grant.device`), or None: none."""

    def answer(self, op: PeerOp, views: Sequence[memoryview], total: int) -> bytes | None:
        """The ``PLANE_GRANT`` bytes of the peer's plane request ``op``, whose handler
        granted ``views``, or None: they move as ``DATA``. With bytes, the plane serves
        the grant from now on; the link ends it (the requester's check, ``READ_DONE``,
        ``CANCEL``, a revocation)."""

    def answer_device(self, op: PeerOp, dev: DeviceRuns) -> bytes | None:
        """As :meth:`answer`, for a device grant; None refuses the request."""

    # ---- optional capabilities of the link (Link.extra)

    def extra(self, capability: Capability[T]) -> T | None:
        """The plane's ``capability`` as it stands now, or None."""


class StreamPlane:
    """The default plane: nothing moves outside the socket; every payload is ``DATA``."""

    name = "stream"

    def bind(self, link: PlaneHost) -> None:
        return

    def hello(self, payload: bytes, cap: int) -> None:
        return  # a peer's other plane: this side speaks none, so it is never asked for one

    def closed(self) -> None:
        return

    def offer(self, views: Sequence[memoryview], total: int) -> None:
        return None

    def offer_device(self, dev: DeviceRuns) -> None:
        return None

    def accept(self, grant: bytes | bytearray, size: int) -> None:
        return None

    async def move(self, op: MyOp, plan: Any) -> None:
        raise AssertionError("the stream plane makes no plans")

    def direct(self, op: PeerOp) -> None:
        return None

    def answer(self, op: PeerOp, views: Sequence[memoryview], total: int) -> None:
        return None

    def answer_device(self, op: PeerOp, dev: DeviceRuns) -> None:
        return None

    def extra(self, capability: Capability[T]) -> T | None:
        return None


#: The stream plane; it keeps no state, so every plain TCP link shares it.
STREAM: DataPlane = StreamPlane()
