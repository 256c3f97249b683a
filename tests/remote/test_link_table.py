"""The link table: a link replaced in the table is counted down; an unlink ends a claim
for the cluster being decided (found in review; each test fails on the code before its
fix)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from dataclasses import field

from aiokv._remote import LinkTable
from aiokv._stats import PeerCounters
from aiokv.transport import PeerInfo


@dataclass
class _Link:
    """What the table reads of a link: its peer and whether it broke."""

    peer: PeerInfo
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
