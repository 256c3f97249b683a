"""NIXL's trust boundary and ends: a greeting whose metadata names another agent loads
nothing; our own NIXL's refusal does not blame the peer; metadata taken during a
deregistration is not cached stale; a transfer outliving its settle bound (known limit,
xfail)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from _helpers import until

from aiokv._enums import LLMStatusCode as Code
from aiokv._errors import LLMException
from aiokv.testing import requires_transport
from aiokv.transport import Grant
from aiokv.transport import PeerInfo
from aiokv.transport import get_transport

needs_nixl = requires_transport("nixl")


class _Regions:
    """Grants ``int(meta)`` bytes of ``buf`` from offset 0."""

    def __init__(self, buf: bytearray) -> None:
        self.buf = buf

    async def grant_read(self, peer: PeerInfo, meta: bytes) -> Grant:
        return Grant(Code.LLM_SUCCESS, [memoryview(self.buf)[: int(meta)]], lambda ok: None)

    async def grant_write(self, peer: PeerInfo, meta: bytes, nbytes: int) -> Grant:
        return Grant(Code.LLM_SUCCESS, [memoryview(self.buf)[: int(meta)]], lambda ok: None)


def _renamed(metadata: bytes, old: str, new: str) -> bytes:
    """NIXL agent ``metadata`` with its agent name ``old`` replaced by ``new`` (NIXL's
    serialisation: ``nixlSerDes|Agent`` + 8-byte length + name + ``|``)."""
    head = b"nixlSerDes|Agent"
    o, n = old.encode(), new.encode()
    before = head + len(o).to_bytes(8, "little") + o + b"|"
    assert metadata.startswith(before)
    return head + len(n).to_bytes(8, "little") + n + b"|" + metadata[len(before) :]


@needs_nixl
async def test_a_greeting_naming_another_agent_in_its_metadata_loads_nothing() -> None:
    """A linked peer (cluster 2) greets us with its own, valid agent name, but metadata
    that names a third cluster's agent (cluster 3's, which a peer linked to both knows)
    over its own connection. The greeting must be refused before anything is loaded:
    else the third cluster's agent name is taken in our NIXL agent by the peer's
    connection (left there after the link broke), NIXL refuses cluster 3's real
    metadata later (NIXL_ERR_NOT_ALLOWED), and our link to cluster 3 never moves over
    NIXL."""
    from aiokv.transport.nixl._descs import address_of

    cls: Any = get_transport("nixl")
    third_buf = bytearray(b"\x77") * 65536
    me, peer = cls(1, _Regions(bytearray(1))), cls(2, _Regions(bytearray(1)))
    third = cls(3, _Regions(third_buf))
    mine = bytearray(65536)
    try:
        me.register_memory(address_of(memoryview(mine)), len(mine))
        third.register_memory(address_of(memoryview(third_buf)), len(third_buf))
        third_at = await third.listen("127.0.0.1", 0)
        link = await peer.connect(*await me.listen("127.0.0.1", 0), timeout=5)
        forged = _renamed(peer.agent.metadata(), peer.agent_name, third.agent_name)
        name = peer.agent_name.encode()
        link._hello(len(name).to_bytes(2, "little") + name + forged)
        await until(lambda: link.broken)  # refused: we dropped the link
        assert not me.agent._a.check_remote_metadata(third.agent_name)
        # cluster 3's own metadata loads, and our link to it moves over NIXL
        to_third = await me.connect(*third_at, timeout=5)
        await to_third.read(b"65536", [memoryview(mine)], timeout=5)
        assert mine == third_buf
        assert me.moved == 1
    finally:
        await me.aclose()
        await peer.aclose()
        await third.aclose()


@needs_nixl
async def test_our_nixl_refusing_a_transfer_does_not_blame_the_peer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """When OUR NIXL agent refuses to build a transfer on a grant, the error must not
    read "cluster 2 refused": the peer granted the request; this side failed."""
    from aiokv.transport.nixl._descs import address_of

    cls: Any = get_transport("nixl")
    owner_buf = bytearray(b"\x11") * 4096
    owner, me = cls(2, _Regions(owner_buf)), cls(1, _Regions(bytearray(1)))
    mine = bytearray(4096)
    try:
        owner.register_memory(address_of(memoryview(owner_buf)), len(owner_buf))
        me.register_memory(address_of(memoryview(mine)), len(mine))
        link = await me.connect(*await owner.listen("127.0.0.1", 0), timeout=5)

        def refused(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("NIXL_ERR_NOT_FOUND")

        monkeypatch.setattr(me.agent, "xfer", refused)
        with pytest.raises(LLMException) as info:
            await link.read(b"4096", [memoryview(mine)], timeout=5)
        assert info.value.status_code == Code.LLM_FAILED
        assert "cluster 2 refused" not in str(info.value), str(info.value)
        assert "NIXL" in str(info.value), str(info.value)
    finally:
        await me.aclose()
        await owner.aclose()


@needs_nixl
async def test_metadata_taken_during_a_deregistration_is_not_cached_stale() -> None:
    """``deregister_memory`` (any thread) removes a region from the table (a new
    generation) before NIXL deregisters it. Metadata generated in between (the loop
    greeting a peer) still lists the region, and was cached under the new generation:
    every peer was sent it until the next registration change."""
    from aiokv.transport.nixl._descs import address_of

    cls: Any = get_transport("nixl")
    t = cls(1, _Regions(bytearray(1)))
    buf = bytearray(65536)
    try:
        await t.listen("127.0.0.1", 0)
        t.register_memory(address_of(memoryview(buf)), len(buf))
        t.metadata()
        agent = t.agent
        real = agent.deregister
        between, taken = threading.Event(), threading.Event()

        def deregister(handle: Any) -> None:
            between.set()  # the region left the table; NIXL still has it
            taken.wait(0.5)  # another thread takes the metadata now (or cannot: locked)
            real(handle)

        agent.deregister = deregister

        def metadata_between() -> None:
            assert between.wait(5)
            t.metadata()
            taken.set()

        other = threading.Thread(target=metadata_between)
        other.start()
        # from a thread of its own, as the registry's hooks may
        await asyncio.to_thread(t.deregister_memory, address_of(memoryview(buf)), len(buf))
        await asyncio.to_thread(other.join, 10)
        assert not other.is_alive()
        assert t.metadata()[1] == agent.metadata(), "stale metadata cached"
    finally:
        await t.aclose()
