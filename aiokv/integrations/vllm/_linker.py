"""Links of a connector worker to the prefill workers its requests name.

One attempt at a time per cluster; a cluster's lock goes with the last load that links
to it, so cluster ids named in requests' params (untrusted) leave nothing behind.
"""

from __future__ import annotations

import asyncio

from ... import LLMClusterInfo
from ... import LLMDataDist
from ... import LLMException
from ... import LLMStatusCode
from ._options import ConnectorOptions
from ._params import Endpoint

__all__ = ["Linker"]


class Linker:
    """Links ``dd`` (on its engine loop only) to the endpoints asked for."""

    def __init__(self, options: ConnectorOptions) -> None:
        self._options = options
        # cluster -> its lock and how many links wait for it
        self._locks: dict[int, tuple[asyncio.Lock, list[int]]] = {}

    def __len__(self) -> int:
        """Clusters being linked now."""
        return len(self._locks)

    async def link(self, dd: LLMDataDist, source: Endpoint) -> None:
        """Link to ``source`` unless linked (one attempt at a time per cluster).

        Raises:
            LLMException: the link failed (its code).
        """
        cid = source.cluster_id
        lock, users = self._locks.setdefault(cid, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                await self._link_once(dd, source)
        finally:
            users[0] -= 1
            if not users[0]:
                del self._locks[cid]

    async def _link_once(self, dd: LLMDataDist, source: Endpoint) -> None:
        if source.cluster_id in dd.linked_clusters():
            return
        info = LLMClusterInfo(
            remote_cluster_id=source.cluster_id,
            remote_ip_info=[(source.host, source.port)],
            local_ip_info=[(self._options.public_host, 0)],  # required, as llm_datadist
        )
        _, codes = await dd.link_clusters([info], timeout=self._options.link_timeout_ms)
        if codes[0] not in (LLMStatusCode.LLM_SUCCESS, LLMStatusCode.LLM_ALREADY_LINK):
            raise LLMException(
                f"link to {source.host}:{source.port} (cluster {source.cluster_id}) failed",
                status_code=codes[0],
            )
