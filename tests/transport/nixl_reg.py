"""``nixl+reg``: the nixl transport with every test buffer registered, so that the
contract suite moves its payload over NIXL (plain ``nixl`` moves the suite's unregistered
bytearrays over its TCP fallback). Registering is the memory owner's job (here: the test),
so this subclass registers each buffer's whole base object the first time it sees it, as
a cache layer registers its pools once, and keeps it alive while registered."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aiokv.transport import Grant
from aiokv.transport import PeerInfo
from aiokv.transport import RequestHandler
from aiokv.transport import get_transport
from aiokv.transport.nixl._descs import address_of
from aiokv.transport.nixl._plane import NixlPlane
from aiokv.transport.nixl._transport import NixlTransport


def _register(t: Any, views: Any) -> None:
    try:
        bases = [memoryview(v).obj for v in views]
    except TypeError:
        return  # bad arguments: the transport's own checks answer them
    for obj in bases:
        if isinstance(obj, bytearray) and len(obj) and id(obj) not in t.kept:
            t.kept[id(obj)] = obj
            t.register_memory(address_of(memoryview(obj)), len(obj))


class _RegisteringHandler:
    def __init__(self, transport: Any, inner: RequestHandler) -> None:
        self.t, self.inner = transport, inner

    async def grant_read(self, peer: PeerInfo, meta: bytes) -> Grant:
        grant = await self.inner.grant_read(peer, meta)
        if isinstance(grant, Grant):
            _register(self.t, grant.buffers)
        return grant

    async def grant_write(self, peer: PeerInfo, meta: bytes, nbytes: int) -> Grant:
        grant = await self.inner.grant_write(peer, meta, nbytes)
        if isinstance(grant, Grant):
            _register(self.t, grant.buffers)
        return grant


class _RegisteringPlane(NixlPlane):
    """Registers the buffers of every request the link offers it (the requester's)."""

    def offer(self, views: Sequence[memoryview], total: int) -> Any:
        _register(self._n, views)
        return super().offer(views, total)


def registering_nixl() -> type[NixlTransport]:
    """The class (importing it needs NIXL: call only after ``get_transport("nixl")``)."""
    get_transport("nixl")

    class RegisteringNixl(NixlTransport):
        def _new_plane(self) -> NixlPlane:
            return _RegisteringPlane(self)

        def __init__(self, cluster_id: int, handler: Any, **kwargs: Any) -> None:
            super().__init__(cluster_id, handler, **kwargs)
            self.kept: dict[int, bytearray] = {}
            self.handler = _RegisteringHandler(self, handler)

    return RegisteringNixl
