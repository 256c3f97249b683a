"""Links this side opens are filed only by the linker, after their cluster id was checked;
a cancelled or broken link attempt leaves no link filed or open.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import pytest
from _helpers import Refusing

from aiokv import LLMDataDist
from aiokv import LLMRole
from aiokv import LLMStatusCode
from aiokv._remote import LinkTable
from aiokv._stats import PeerCounters
from aiokv.testing import cluster_info as info
from aiokv.testing import make_config
from aiokv.transport import PeerInfo

CODE = LLMStatusCode


@dataclass
class _Link:
    """What the table reads of a link: its peer, who opened it, whether it broke."""

    peer: PeerInfo
    initiator: bool = False
    broken: bool = False
    why_broken: str = ""
    answers: asyncio.Event | None = None  # probe: waits for it, then answers True
    closed: list[bool] = field(default_factory=list)

    async def probe(self, timeout: float) -> bool:
        if self.answers is not None:
            await self.answers.wait()
        return not self.broken

    async def aclose(self) -> None:
        self.broken, self.why_broken = True, "closed locally"
        self.closed.append(True)


async def test_a_link_to_the_wrong_cluster_is_never_filed() -> None:
    """``link_clusters`` names cluster 9 at an address that answers as cluster 1: the
    call gives ``LLM_LINK_FAILED`` and closes that connection. A user relies on nothing
    having been linked: no link filed (``statistics().links_up`` 0, Prometheus'
    ``aiokv_links_up_total``), and the reason kept for cluster 1 (an earlier failure,
    ``link_failure(1)``) untouched. Before the fix the transport's ``on_link`` filed the
    connection under cluster 1 before the linker checked the id: cluster 1 was listed
    as linked for a moment (a transfer or a two-sided ``link`` waiting for cluster 1
    could take that link as it was closed), counted up and down, and its
    ``link_failure`` was erased."""
    async with (
        LLMDataDist(LLMRole.PROMPT, 1, make_config("tcp", pool=1 << 20)) as p,
        LLMDataDist(LLMRole.DECODER, 2, make_config("tcp", pool=1 << 20)) as d,
    ):
        code, _ = await d.link_clusters([info(1, ("127.0.0.1", 1))], 200)
        assert code == CODE.LLM_LINK_FAILED
        failure = d.link_failure(1)
        assert failure is not None
        code, _ = await d.link_clusters([info(9, p.listen_address)])
        assert code == CODE.LLM_LINK_FAILED
        assert "is cluster 1, not 9" in (d.link_failure(9) or "")
        stats = d.statistics()
        assert (stats.links_up, stats.links_down) == (0, 0)
        assert d.link_failure(1) == failure
        assert d.linked_clusters() == []


async def test_a_cancelled_link_keeps_the_peers_concurrent_link() -> None:
    """Both engines link each other at the same moment: on this side the peer's link
    arrives (filed) while this side's own connect runs; the transport then reports this
    side's new link (``on_link``) and the linker files it, the peer's left open as a
    spare. This side's ``link_clusters`` is then cancelled: it takes back the link it
    opened, and the peer's live link must hold the cluster again (as documented: "a
    cancelled link_clusters takes its link back" and the spare is filed). Before the
    fix the ``on_link`` report started a contest that put this side's own link among
    the spares; the undo filed that one again (about to be closed) and dropped the
    peer's: once closed, the cluster was listed as unlinked (transfers
    ``LLM_NOT_YET_LINK``) although the peer's connection was open."""
    table = LinkTable(PeerCounters())
    theirs = _Link(PeerInfo(2, ("127.0.0.1", 50001)))
    ours = _Link(PeerInfo(2, ("127.0.0.1", 40000)), initiator=True)
    table.add(theirs)  # type: ignore[arg-type]  # the peer's link arrives first
    table.add(ours)  # type: ignore[arg-type]  # the transport's on_link for our connect
    table.add(ours, ours=True)  # type: ignore[arg-type]  # the linker files it
    contest = table.contest(2)
    if contest is not None:
        await asyncio.wait([contest], timeout=5)
    assert table.get(2) is ours
    assert table.undo(2, ours)  # type: ignore[arg-type]  # link_clusters cancelled
    await ours.aclose()  # the caller closes it; the transport reports its end
    table.lost(ours)  # type: ignore[arg-type]
    assert table.get(2) is theirs and table.clusters() == [2]
    await table.aclose()


async def test_a_nixl_connect_cancelled_in_its_probe_closes_its_link(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``NixlTransport.connect`` reports its link (``on_link``) as the handshake ends,
    then probes it (the peer's NIXL metadata) before returning it. A ``link_clusters``
    cancelled during that probe (its caller's timeout, a shutdown) never receives the
    link, so it cannot close it: a user relies on the cancelled call leaving no
    connection (docs/cancellation.md), else the peer lists this side as linked and a
    ``switch_role`` here goes ahead with a connection up. Before the fix the link
    stayed open."""
    from aiokv.transport import get_transport
    from aiokv.transport.nixl._transport import NixlTransport
    from aiokv.transport.tcp import _link as tcp_link
    from aiokv.transport.tcp._plane import STREAM

    class _NoAgent(NixlTransport):  # the connect's own steps, without NIXL itself
        async def _start_agent(self, op: str) -> None:
            return None

        def _new_plane(self) -> Any:
            return STREAM

    stuck = asyncio.Event()

    async def probe(self: Any, timeout: float) -> bool:  # a peer slow to answer
        stuck.set()
        await asyncio.Event().wait()
        return True

    monkeypatch.setattr(tcp_link.TcpLink, "probe", probe)
    reported: list[Any] = []
    server = get_transport("tcp")(1, Refusing())
    client = _NoAgent(2, Refusing(), on_link=reported.append)
    try:
        host, port = await server.listen("127.0.0.1", 0)
        task = asyncio.create_task(client.connect(host, port, timeout=60))
        await asyncio.wait_for(stuck.wait(), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(reported) == 1
        assert reported[0].broken  # closed: nobody else could
        assert client.links() == []
    finally:
        await client.aclose()
        await server.aclose()


async def test_a_link_that_ends_as_it_is_made_is_not_filed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With ``NixlTransport`` the link is probed after its handshake (the peer's NIXL
    metadata); a peer that closes it meanwhile (it refused the claim, it exited) ends
    it before ``connect`` returns. ``link_clusters`` must not report ``LLM_SUCCESS``
    for a link that already ended, nor file it: a user relies on a cluster it was
    told is linked being linked, and on ``links_up`` / ``links_down`` pairing up.
    Before the fix the ended link was filed after the transport had reported its end:
    ``LLM_SUCCESS``, the cluster not linked, no reason kept (``link_failure`` None),
    and ``links_up`` one above ``links_down`` for good."""
    from aiokv import LLMConfig
    from aiokv._remote._linker import Linker
    from aiokv.transport import get_transport
    from aiokv.transport.nixl._transport import NixlTransport
    from aiokv.transport.tcp import _link as tcp_link
    from aiokv.transport.tcp._plane import STREAM

    class _NoAgent(NixlTransport):  # the connect's own steps, without NIXL itself
        async def _start_agent(self, op: str) -> None:
            return None

        def _new_plane(self) -> Any:
            return STREAM

    async def probe(self: Any, timeout: float) -> bool:  # the peer closes it meanwhile
        self._break("closed by peer")
        return False

    monkeypatch.setattr(tcp_link.TcpLink, "probe", probe)
    counters = PeerCounters()
    table = LinkTable(counters)
    server = get_transport("tcp")(1, Refusing())
    client = _NoAgent(2, Refusing(), on_link=table.add, on_link_lost=table.lost)
    linker = Linker(table, client, LLMConfig(link_retry_count=1))
    try:
        address = await server.listen("127.0.0.1", 0)
        code, _ = await linker.link_all([info(1, address)], 3000)
        assert code == CODE.LLM_LINK_FAILED
        assert "closed by peer" in (table.failure(1) or "")
        assert table.clusters() == [] and table.get(1) is None
        assert counters.links_up == counters.links_down
    finally:
        await client.aclose()
        await server.aclose()
        await table.aclose()
