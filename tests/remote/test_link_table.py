"""The link table's counters: a link replaced in the table is counted down (found in
review; fails on the code before its fix)."""

from __future__ import annotations

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
