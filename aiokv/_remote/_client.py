"""``RemoteClient``: the local half of pulls and pushes.

Given a validated request and the local buffers of the bytes it moves (a
:class:`~aiokv._layout.ByteLayout` over this side's cache), it finds the link, sends
the encoded request, moves the bytes within ``sync_kv_timeout`` and reports failure as
one ``LLMException`` carrying the public operation and what it was about — context
added here, once. Pinning the local cache is the caller's business.
"""

from __future__ import annotations

import logging
from typing import Any

from .._cache import Cache
from .._config import LLMConfig
from .._enums import LLMStatusCode
from .._errors import LLMException, map_errors
from .._stats import PeerCounters
from ..transport import Link
from ._links import LinkTable
from ._protocol import Request, encode

__all__ = ["RemoteClient"]

log = logging.getLogger("aiokv.remote")


class RemoteClient:
    """Sends requests over the links of one ``LLMDataDist``.

    Args:
        links: the link table (owned by ``LLMDataDist``).
        config: read at each call for ``sync_kv_timeout``.
        counters: where each transfer is counted, per peer cluster.
    """

    def __init__(
        self, links: LinkTable, config: LLMConfig, counters: PeerCounters | None = None
    ) -> None:
        self._links = links
        self._config = config
        self._counters = counters if counters is not None else PeerCounters()

    def link(self, op: str, cluster_id: int) -> Link:
        """The live link to ``cluster_id`` (``LLM_NOT_YET_LINK`` when there is none)."""
        return self._links.require(op, cluster_id)

    @staticmethod
    def require_host(op: str, cache: Cache) -> None:
        """Refuse a cache the transport cannot address (``LLM_FEATURE_NOT_ENABLED``)."""
        if not cache.on_host:
            raise LLMException(
                f"{op}: cache {cache.cache_id} is on {cache.tensors[0].device}; the tcp "
                "transport moves host-addressable memory",
                status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                op=op,
            )

    async def transfer(
        self,
        op: str,
        link: Link,
        request: Request,
        views: list[memoryview],
        *,
        write: bool,
        about: dict[str, Any],
    ) -> None:
        """Push ``views`` (``write``) or pull into them, as ``request`` names on the peer.

        Raises:
            LLMException: the peer's refusal code, ``LLM_TIMEOUT`` past
                ``sync_kv_timeout``, ``LLM_LINK_FAILED``; ``op`` and ``about`` attached.
                On failure the bytes of a pull's destination are unspecified.
        """
        meta = encode(request)
        timeout = self._config.sync_kv_timeout / 1000
        cid = link.peer.cluster_id
        nbytes = sum(map(len, views))
        try:
            with (
                self._links.request(cid),
                self._counters.requests(cid).measure(nbytes),
                map_errors(op),
            ):
                if write:
                    await link.write(meta, views, timeout=timeout)
                else:
                    await link.read(meta, views, timeout=timeout)
        except LLMException as exc:
            ctx = exc.in_context(op, **about)
            log.debug("%s %s cluster %d failed: %s", op, _dir(write), cid, ctx)
            if ctx is exc:
                raise
            raise ctx from exc
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s: %d bytes %s cluster %d", op, nbytes, _dir(write), cid)


def _dir(write: bool) -> str:
    return "to" if write else "from"
