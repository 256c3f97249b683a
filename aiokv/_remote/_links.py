"""``LinkTable``: the live links of one ``LLMDataDist``, by peer cluster id.

Owned by ``LLMDataDist`` (which links and unlinks) and read by the remote client (which
needs the link of a cluster). Incoming links are filed as the transport reports them;
a link that breaks is dropped, so the cluster can be linked again.

**Identity** (issue #9 item 7). A link is filed under the cluster id its peer announced
in the handshake: with ``link_secret`` set only authenticated peers get that far;
without it, the id is only what the peer says. Who holds a cluster id:

* a link this side opened (``ours=True``: ``link_clusters`` / ``link`` connected to the
  address given for that cluster) is filed, replacing what was filed — by the linker,
  once it checked the peer's id: the transport's report of it (``on_link``, ``ours``
  False, :attr:`Link.initiator` set) files nothing, so a link to the wrong cluster is
  never filed, nor taken for a claim on a cluster's id;
* an incoming link is filed when no live link is filed for its id;
* an incoming link claiming an id whose filed link is also incoming starts a *contest*:
  the filed link gets a liveness probe (:meth:`Link.probe`, :data:`PROBE_TIMEOUT_S`).
  No answer: the filed link is closed and the claimant filed (logged at WARNING) — a
  hung or half-open peer is replaced by its successor. An answer: the claim is refused,
  its connection closed and logged at WARNING (so a peer that linked FIRST under an id,
  impostor or not, keeps it while it answers; only ``link_secret`` prevents that). One
  contest per id at a time; a claim made meanwhile is refused;
* an incoming link claiming an id whose filed link this side opened is left open,
  unfiled (the peer may send its own requests on it; ours go on the link we opened),
  as is a live link replaced by one this side opened. Such a *spare* is filed when the
  filed link ends (or a cancelled ``link_clusters`` takes its link back): the peer still
  links this side, so the cluster stays linked, as if only the peer had linked it.

Besides the links it knows, per cluster: whether this side linked it (``link_clusters``
or ``link``) or only the peer did; whether a link attempt is running; whether its link
is *held* (a two-sided ``link`` not yet ``OK``: filed, but not handed out); and how many
requests this side has in flight on it (a graceful unlink waits for them).

Threads: only the engine thread changes the table (linking, unlinking, the transport's
callbacks and the remote client's requests all run there); other threads only read it,
and every read is one atomic dict or set operation (a copy, for :meth:`clusters`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from .._enums import LLMStatusCode
from .._errors import LLMException
from .._stats import PeerCounters
from ..transport import Link

__all__ = ["LinkTable"]

log = logging.getLogger("aiokv.links")

#: How long a filed incoming link has to answer a liveness probe when another incoming
#: link claims its cluster id (a live peer answers in well under a millisecond; a peer
#: busy receiving a big push answers once the data ahead of the probe has been read).
PROBE_TIMEOUT_S: Final = 1.0
#: Most clusters whose link's end is remembered (why it ended, for their next operation
#: and ``link_failure``): the most recent; a peer could otherwise grow the table without
#: bound by linking and leaving under ever new cluster ids.
MAX_LOST_REASONS: Final = 1024


class LinkTable:
    """Peer cluster id → live link; who linked it; attempts, holds and requests in flight."""

    def __init__(self, counters: PeerCounters | None = None) -> None:
        self._counters = counters if counters is not None else PeerCounters()
        self._links: dict[int, Link] = {}
        self._ours: set[int] = set()  # clusters this side linked, not only the peer
        self._dialed: set[int] = set()  # clusters whose filed link this side connected
        self._contests: dict[int, asyncio.Task[None]] = {}  # cluster -> claim being decided
        self._closing: set[asyncio.Task[None]] = set()  # refused links being closed
        self._spares: dict[int, list[Link]] = {}  # cluster -> live links left unfiled
        self._linking: set[int] = set()
        self._held: set[int] = set()
        self._busy: dict[int, int] = {}  # cluster -> requests of ours in flight
        self._changed: dict[int, asyncio.Event] = {}  # woken when a link is filed / a request ends
        self._failures: dict[int, str] = {}  # cluster -> why its last link attempt failed
        self._lost: dict[int, str] = {}  # cluster -> why its link ended (none filed since)

    def live(self, cluster_id: int) -> Link | None:
        """The live link filed for ``cluster_id``, held or not."""
        link = self._links.get(cluster_id)
        return None if link is None or link.broken else link

    def get(self, cluster_id: int) -> Link | None:
        """The live link to ``cluster_id`` for requests, or None (broken or held: none)."""
        return None if cluster_id in self._held else self.live(cluster_id)

    def require(self, op: str, cluster_id: int) -> Link:
        """The live link to ``cluster_id``.

        Raises:
            LLMException: ``LLM_NOT_YET_LINK`` when there is none.
        """
        link = self.get(cluster_id)
        failure = self._failures.get(cluster_id)
        lost = self._lost.get(cluster_id)
        if link is None and lost is not None and failure is None:
            raise LLMException(
                f"{op}: cluster {cluster_id} is not linked: its link ended ({lost}); "
                "call link_clusters to link it again",
                status_code=LLMStatusCode.LLM_NOT_YET_LINK,
                op=op,
            )
        if link is None and failure is not None:
            raise LLMException(
                f"{op}: cluster {cluster_id} is not linked: the last attempt to link it "
                f"failed ({failure}); remove the cause and call link_clusters again",
                status_code=LLMStatusCode.LLM_NOT_YET_LINK,
                op=op,
            )
        if link is None:
            raise LLMException(
                f"{op}: cluster {cluster_id} is not linked; call link_clusters first (or "
                "link() with a rank table, then wait for query_register_mem_status OK)",
                status_code=LLMStatusCode.LLM_NOT_YET_LINK,
                op=op,
            )
        return link

    def failed(self, cluster_id: int, reason: str) -> None:
        """Record why linking ``cluster_id`` failed (until a link to it is filed)."""
        self._failures[cluster_id] = reason

    def failure(self, cluster_id: int) -> str | None:
        """Why the last attempt to link ``cluster_id`` failed, else why its last link
        ended (``"link ended: ..."``); None if neither, or a link to it was filed since."""
        failure = self._failures.get(cluster_id)
        if failure is None:
            # Asked from any thread: the filed link first, then _lost, which lost() fills
            # before it unfiles the link. A broken link is not listed as linked any more,
            # though the transport has not reported its end yet: say why now.
            link = self._links.get(cluster_id)
            why = _ended(link) if link is not None and link.broken else self._lost.get(cluster_id)
            failure = None if why is None else f"link ended: {why}"
        return failure

    def add(self, link: Link, *, ours: bool = False) -> None:
        """File ``link`` under its peer's cluster id, by the rule in the module docstring.

        One this side opened (``ours=True``) replaces what was filed and marks the
        cluster as linked by this side. An incoming one is filed if no live link is;
        else it may start a contest (a task on the running loop) that files or closes it.
        The transport's report of a link this side opened (``ours`` False, the link's
        :attr:`~Link.initiator` set) is ignored: the linker files it once it checked
        the peer's cluster id.
        """
        if not ours and link.initiator:
            return
        cid = link.peer.cluster_id
        filed = self.live(cid)
        if ours:
            self._ours.add(cid)
            self._dialed.add(cid)
        elif filed is link:
            return
        elif filed is not None:
            self._claim(cid, filed, link)
            return
        else:
            self._dialed.discard(cid)
        self._file(cid, link)

    def _file(self, cid: int, link: Link) -> None:
        old = self._links.get(cid)
        new = old is not link
        # before the link is filed: read from other threads, a cluster listed as linked
        # has no failure to report (see failure())
        self._failures.pop(cid, None)
        self._lost.pop(cid, None)
        self._links[cid] = link
        self._wake(cid)
        if new and old is not None:  # replaced (e.g. the peer's link, by the one we
            # opened while it opened its own): that one is no longer filed, so its end
            # will not be counted (lost() ignores links not filed)
            self._counters.down(cid)
            if not old.broken:
                self._spare(cid, old)
        if new:  # the transport reports a link this side opened, then the linker files it
            self._counters.up(cid)
            log.info("link to cluster %d up (%s:%d)", cid, *link.peer.address)

    def _claim(self, cid: int, filed: Link, claimant: Link) -> None:
        """An incoming ``claimant`` for ``cid`` while ``filed`` is live."""
        if cid in self._dialed:
            self._spare(cid, claimant)
            return
        loop = asyncio.get_running_loop()
        if cid in self._contests:
            self._refuse(cid, claimant, "a claim for it is being decided")
            return
        task = loop.create_task(self._contest(cid, filed, claimant), name=f"aiokv-claim-{cid}")
        self._contests[cid] = task
        task.add_done_callback(
            lambda t: self._contests.pop(cid, None) if self.contest(cid) is t else None
        )

    async def _contest(self, cid: int, filed: Link, claimant: Link) -> None:
        alive = await filed.probe(PROBE_TIMEOUT_S)
        if claimant.broken:
            return
        current = self.live(cid)
        if current is None or (current is filed and not alive):
            if current is filed:
                log.warning(
                    "cluster %d: the link from %s:%d did not answer a probe within %.3g s; "
                    "replaced by the link from %s:%d",
                    cid,
                    *filed.peer.address,
                    PROBE_TIMEOUT_S,
                    *claimant.peer.address,
                )
                self.pop(cid)
            self._dialed.discard(cid)
            self._file(cid, claimant)
            if current is filed:
                await filed.aclose()  # its pending operations fail now, not at their timeout
        elif cid in self._dialed:
            self._spare(cid, claimant)
        else:
            self._refuse(cid, claimant, f"the link from {current.peer.address} answers")

    def _spare(self, cid: int, link: Link) -> None:
        """Keep ``link``, a live link to ``cid`` left unfiled, to file if the filed one
        ends (the most recent first; broken ones are dropped as it goes). The filed
        link itself is never a spare."""
        if self._links.get(cid) is link:
            return
        log.debug("cluster %d: link from %s:%d left unfiled", cid, *link.peer.address)
        spares = [x for x in self._spares.get(cid, ()) if not x.broken and x is not link]
        self._spares[cid] = [*spares, link]

    def _file_spare(self, cid: int) -> None:
        """File the most recent live spare of ``cid``, if any (its filed link is gone);
        the other live spares stay spares."""
        spares = [x for x in self._spares.pop(cid, []) if not x.broken]
        if not spares:
            return
        link = spares.pop()
        if spares:
            self._spares[cid] = spares
        log.info(
            "cluster %d: the link from %s:%d, open beside the one that ended, links it now",
            cid,
            *link.peer.address,
        )
        self._file(cid, link)

    def _refuse(self, cid: int, claimant: Link, why: str) -> None:
        log.warning(
            "cluster %d: refused a second link claiming this id from %s:%d (%s); without "
            "link_secret a cluster id is only what a peer announces",
            cid,
            *claimant.peer.address,
            why,
        )
        task = asyncio.get_running_loop().create_task(claimant.aclose())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def aclose(self) -> None:
        """Stop the contests under way and wait for refused links to close (finalize)."""
        for task in list(self._contests.values()):
            task.cancel()
        pending = [*self._contests.values(), *self._closing]
        if pending:
            await asyncio.wait(pending)

    def lost(self, link: Link) -> None:
        """Forget ``link`` if it is the one filed for its cluster (the transport saw it end)."""
        cid = link.peer.cluster_id
        if self._links.get(cid) is link:
            why = _ended(link)
            if why is not None:  # before the link is unfiled (see failure())
                self._lost.pop(cid, None)  # the most recent last
                self._lost[cid] = why
                if len(self._lost) > MAX_LOST_REASONS:  # a peer may churn cluster ids
                    del self._lost[next(iter(self._lost))]
            del self._links[cid]
            self._ours.discard(cid)
            self._dialed.discard(cid)
            self._counters.down(cid)
            log.info("link to cluster %d down (%s)", cid, why or "closed locally")
            self._file_spare(cid)
        elif link in self._spares.get(cid, ()):
            self._spares[cid].remove(link)

    def contest(self, cluster_id: int) -> asyncio.Task[None] | None:
        """The claim for ``cluster_id`` being decided, if any."""
        return self._contests.get(cluster_id)

    def unlinked(self, cluster_id: int) -> Link | None:
        """An unlink: stop a claim for ``cluster_id`` being decided (its claimant is one
        of the cluster's connections the unlink closes), so that no link is filed for it
        after the unlink, then :meth:`pop` the filed link."""
        task = self._contests.pop(cluster_id, None)
        if task is not None:
            task.cancel()
            self._closing.add(task)  # finalize waits for it (aclose)
            task.add_done_callback(self._closing.discard)
        self._spares.pop(cluster_id, None)  # the unlink closes them too
        return self.pop(cluster_id)

    def pop(self, cluster_id: int) -> Link | None:
        """Remove and return the link filed for ``cluster_id`` (live or not), if any."""
        self._ours.discard(cluster_id)
        self._dialed.discard(cluster_id)
        self._lost.pop(cluster_id, None)
        link = self._links.pop(cluster_id, None)
        if link is not None:
            self._counters.down(cluster_id)
            log.info("link to cluster %d down (unlinked or replaced)", cluster_id)
        return link

    def clusters(self) -> list[int]:
        """Cluster ids with a live link, sorted."""
        return sorted(cid for cid, link in list(self._links.items()) if not link.broken)

    def ours(self, cluster_id: int) -> bool:
        """Whether this side linked ``cluster_id`` (rather than only the peer), held
        links (a two-sided ``link`` not yet ``OK``) excepted."""
        return (
            cluster_id in self._ours
            and cluster_id not in self._held
            and self.live(cluster_id) is not None
        )

    def claim(self, cluster_ids: Iterable[int]) -> None:
        """Count the live links to ``cluster_ids`` as linked by this side."""
        self._ours.update(c for c in cluster_ids if self.live(c) is not None)

    def undo(self, cluster_id: int, link: Link | None) -> bool:
        """Take back what a cancelled ``link_clusters`` did for ``cluster_id``: its
        :meth:`claim` of the peer's link (``link`` None: that link stays filed, as the
        peer's), or ``link``, the link it opened, unfiled if still filed (a live link of
        the peer's it had replaced is filed again). True when ``link`` was unfiled (the
        caller closes it)."""
        if link is None:
            self._ours.discard(cluster_id)
            return False
        if self._links.get(cluster_id) is not link:
            return False
        self.pop(cluster_id)
        self._file_spare(cluster_id)
        return True

    def begin(self, cluster_id: int) -> bool:
        """Mark ``cluster_id`` as being linked; False if a link attempt is already running."""
        if cluster_id in self._linking:
            return False
        self._linking.add(cluster_id)
        return True

    def end(self, cluster_id: int) -> None:
        """The link attempt for ``cluster_id`` is over."""
        self._linking.discard(cluster_id)

    def attempting(self) -> list[int]:
        """Cluster ids a link attempt is running for (``link_clusters``, ``link``), sorted."""
        return sorted(self._linking)

    def hold(self, cluster_ids: Iterable[int]) -> None:
        """Hand out no link to ``cluster_ids`` until :meth:`release`."""
        self._held.update(cluster_ids)

    def release(self, cluster_ids: Iterable[int]) -> None:
        """Hand out the links to ``cluster_ids`` again."""
        self._held.difference_update(cluster_ids)

    async def wait_live(self, cluster_id: int) -> Link:
        """Wait until a live link to ``cluster_id`` is filed (either side may open it)."""
        while (link := self.live(cluster_id)) is None:
            await self._event(cluster_id).wait()
        return link

    def request(self, cluster_id: int) -> _InFlight:
        """``with table.request(cid):`` counts one request of ours in flight to
        ``cluster_id`` for the block's duration."""
        return _InFlight(self, cluster_id)

    def _enter(self, cluster_id: int) -> None:
        self._busy[cluster_id] = self._busy.get(cluster_id, 0) + 1

    def _leave(self, cluster_id: int) -> None:
        left = self._busy[cluster_id] - 1
        if left:
            self._busy[cluster_id] = left
        else:
            del self._busy[cluster_id]
            self._wake(cluster_id)

    async def drained(self, cluster_id: int) -> None:
        """Wait until no request of ours to ``cluster_id`` is in flight."""
        while self._busy.get(cluster_id):
            await self._event(cluster_id).wait()

    def _event(self, cluster_id: int) -> asyncio.Event:
        event = self._changed.get(cluster_id)
        if event is None:
            event = self._changed[cluster_id] = asyncio.Event()
        return event

    def _wake(self, cluster_id: int) -> None:
        event = self._changed.pop(cluster_id, None)
        if event is not None:
            event.set()


@dataclass(slots=True)
class _InFlight:
    """:meth:`LinkTable.request`'s context manager (a class: it is on every request's path)."""

    table: LinkTable
    cluster_id: int

    def __enter__(self) -> None:
        self.table._enter(self.cluster_id)

    def __exit__(self, *exc_info: object) -> None:
        self.table._leave(self.cluster_id)


def _ended(link: Link) -> str | None:
    """Why ``link`` ended, None if this side closed it (an unlink, a finalize)."""
    why = link.why_broken or "broken or closed"
    return None if why == "closed locally" else why
