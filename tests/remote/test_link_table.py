"""The link table: a link replaced in the table is counted down; an unlink ends a claim
for the cluster being decided; the peer's open link holds the cluster when the one this
side opened ends (found in review; each test fails on the code before its fix)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from dataclasses import field

import pytest

from aiokv._remote import LinkTable
from aiokv._stats import PeerCounters
from aiokv.transport import PeerInfo


@dataclass
class _Link:
    """What the table reads of a link: its peer and whether it broke."""

    peer: PeerInfo
    initiator: bool = False
    broken: bool = False
    why_broken: str | None = None
    closed: list[bool] = field(default_factory=list)
    answers: asyncio.Event | None = None  # probe: waits for it, then answers False

    async def probe(self, timeout: float) -> bool:
        if self.answers is not None:
            await self.answers.wait()
        return False

    async def aclose(self) -> None:
        self.broken = True
        self.closed.append(True)


async def test_a_replaced_link_is_counted_down() -> None:
    """Two engines linking each other at the same moment: the peer's link arrives and is
    filed, then the link this side opened replaces it (the peer's stays open, unfiled).
    ``links_up`` / ``links_down`` must still pair up: after the unlink, every link counted
    up was counted down and the cluster is not listed as linked. Before the fix the
    replaced link was never counted down (``links_up`` 2, ``links_down`` 1 after the
    unlink: the Prometheus counters said one link was still up)."""
    counters = PeerCounters()
    table = LinkTable(counters)
    theirs = _Link(PeerInfo(2, ("127.0.0.1", 50001)))
    ours = _Link(PeerInfo(2, ("127.0.0.1", 40000)))
    table.add(theirs)  # type: ignore[arg-type]
    table.add(ours, ours=True)  # type: ignore[arg-type]
    assert table.get(2) is ours and table.ours(2)
    assert counters.links_up - counters.links_down == 1
    assert table.pop(2) is ours  # unlink
    assert counters.links_up == counters.links_down == 2
    assert table.clusters() == [] and table.get(2) is None
    table.lost(theirs)  # type: ignore[arg-type]  # the unfiled one ends: not counted
    assert counters.links_up == counters.links_down == 2


async def test_an_unlink_ends_a_claim_being_decided() -> None:
    """An incoming link claims a cluster id whose filed incoming link is being probed
    (a contest); the cluster is unlinked meanwhile. Once the probe ends (unanswered), no
    link may be filed for the cluster: ``unlink_clusters`` returned, and the claimant is
    among the connections the unlink closes. Before the fix the contest filed the
    claimant after the unlink (the cluster was listed as linked again)."""
    table = LinkTable(PeerCounters())
    probe = asyncio.Event()
    filed = _Link(PeerInfo(2, ("127.0.0.1", 50001)), answers=probe)
    claimant = _Link(PeerInfo(2, ("127.0.0.1", 50002)))
    table.add(filed)  # type: ignore[arg-type]
    table.add(claimant)  # type: ignore[arg-type]  # a claim: the filed link is probed
    contest = table.contest(2)
    assert contest is not None
    await asyncio.sleep(0)  # the probe is under way
    assert table.unlinked(2) is filed
    probe.set()  # the probe would have found the filed link dead
    await asyncio.wait([contest], timeout=5)
    assert contest.done()
    assert table.get(2) is None and table.clusters() == []
    await table.aclose()


def _broke(link: _Link, why: str = "connection reset by peer") -> None:
    link.broken, link.why_broken = True, why


@pytest.mark.parametrize("order", ["ours first", "theirs first"])
async def test_the_peers_link_holds_the_cluster_when_ours_ends(order: str) -> None:
    """Two engines linked each other: two connections, the one this side opened filed,
    the peer's left open, unfiled (it arrived second, or ours replaced it). When only
    ours ends (the peer closed that socket, or it broke), the peer still links this
    side, on a live connection: the cluster must stay linked on it, as if only the peer
    had linked it. It was listed as unlinked, and every transfer to it failed with
    ``LLM_NOT_YET_LINK``, while the peer listed this side as linked."""
    counters = PeerCounters()
    table = LinkTable(counters)
    ours = _Link(PeerInfo(2, ("127.0.0.1", 40000)))
    theirs = _Link(PeerInfo(2, ("127.0.0.1", 50001)))
    if order == "ours first":
        table.add(ours, ours=True)  # type: ignore[arg-type]
        table.add(theirs)  # type: ignore[arg-type]
    else:
        table.add(theirs)  # type: ignore[arg-type]
        table.add(ours, ours=True)  # type: ignore[arg-type]
    assert table.get(2) is ours and table.ours(2)
    _broke(ours)
    table.lost(ours)  # type: ignore[arg-type]
    assert table.get(2) is theirs and table.clusters() == [2]
    assert not table.ours(2)  # the peer's link now: this side's own link ended
    assert counters.links_up - counters.links_down == 1
    _broke(theirs)
    table.lost(theirs)  # type: ignore[arg-type]
    assert table.get(2) is None and table.clusters() == []
    assert counters.links_up == counters.links_down


async def test_an_unlinked_cluster_stays_unlinked_when_its_connections_close() -> None:
    """An unlink closes every connection of the cluster, the peer's spare one too: as
    they end, none is filed again (the cluster is not linked after
    ``unlink_clusters``)."""
    counters = PeerCounters()
    table = LinkTable(counters)
    ours = _Link(PeerInfo(2, ("127.0.0.1", 40000)))
    theirs = _Link(PeerInfo(2, ("127.0.0.1", 50001)))
    table.add(ours, ours=True)  # type: ignore[arg-type]
    table.add(theirs)  # type: ignore[arg-type]
    assert table.unlinked(2) is ours
    for link in (ours, theirs):
        _broke(link, "closed locally")
        table.lost(link)  # type: ignore[arg-type]
    assert table.get(2) is None and table.clusters() == []
    assert counters.links_up == counters.links_down == 1
