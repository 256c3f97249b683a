"""``LinkTable``: the live links of one ``LLMDataDist``, by peer cluster id.

Owned by ``LLMDataDist`` (which links and unlinks) and read by the remote client (which
needs the link of a cluster). Incoming links are filed as the transport reports them;
a link that breaks is dropped, so the cluster can be linked again.

Threads: only the engine thread changes the table (linking, unlinking and the
transport's callbacks all run there); other threads only read it, and every read is
one atomic dict operation (a copy, for :meth:`LinkTable.clusters`).
"""

from __future__ import annotations

import logging

from .._enums import LLMStatusCode
from .._errors import LLMException
from ..transport import Link

__all__ = ["LinkTable"]

log = logging.getLogger("aiokv.links")


class LinkTable:
    """Peer cluster id → live link; the clusters being linked right now."""

    def __init__(self) -> None:
        self._links: dict[int, Link] = {}
        self._linking: set[int] = set()

    def get(self, cluster_id: int) -> Link | None:
        """The live link to ``cluster_id``, or None (a broken link counts as none)."""
        link = self._links.get(cluster_id)
        return None if link is None or link.broken else link

    def require(self, op: str, cluster_id: int) -> Link:
        """The live link to ``cluster_id``.

        Raises:
            LLMException: ``LLM_NOT_YET_LINK`` when there is none.
        """
        link = self.get(cluster_id)
        if link is None:
            raise LLMException(
                f"{op}: cluster {cluster_id} is not linked", LLMStatusCode.LLM_NOT_YET_LINK, op=op
            )
        return link

    def add(self, link: Link, *, replace: bool = True) -> None:
        """File ``link`` under its peer's cluster id; with ``replace=False`` (an incoming
        link) a live link already filed for that cluster is kept."""
        cid = link.peer.cluster_id
        if not replace and self.get(cid) is not None:
            return
        self._links[cid] = link
        log.info("link to cluster %d up (%s:%d)", cid, *link.peer.address)

    def lost(self, link: Link) -> None:
        """Forget ``link`` if it is the one filed for its cluster (the transport saw it end)."""
        cid = link.peer.cluster_id
        if self._links.get(cid) is link:
            del self._links[cid]
            log.info("link to cluster %d down", cid)

    def pop(self, cluster_id: int) -> Link | None:
        """Remove and return the link filed for ``cluster_id`` (live or not), if any."""
        return self._links.pop(cluster_id, None)

    def clusters(self) -> list[int]:
        """Cluster ids with a live link, sorted."""
        return sorted(cid for cid, link in list(self._links.items()) if not link.broken)

    def begin(self, cluster_id: int) -> bool:
        """Mark ``cluster_id`` as being linked; False if a link attempt is already running."""
        if cluster_id in self._linking:
            return False
        self._linking.add(cluster_id)
        return True

    def end(self, cluster_id: int) -> None:
        """The link attempt for ``cluster_id`` is over."""
        self._linking.discard(cluster_id)
