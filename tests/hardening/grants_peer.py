"""A pushing peer run in its own process (multiprocessing "spawn") for test_grants.py.

It links to the owner (cluster 1) at 127.0.0.1:``port``, fills a cache of ``nbytes``
with 0xAB, reports ready, then on "push" pushes it into the owner's cache ``cache_id``
(slot 0) and sends back the status code (0 on success).
"""

from __future__ import annotations

import asyncio
from multiprocessing.connection import Connection

from aiokv import CacheDesc
from aiokv import CacheKeyByIdAndIndex
from aiokv import DataType
from aiokv import LLMDataDist
from aiokv import LLMException
from aiokv import LLMRole
from aiokv.testing import cluster_info
from aiokv.testing import make_config


async def _run(conn: Connection, port: int, cache_id: int, nbytes: int) -> None:
    pool = nbytes + (1 << 20)
    cfg = make_config("tcp", pool=pool, page_shift=16, listen_ip_info=None, sync_kv_timeout=10000)
    async with LLMDataDist(LLMRole.PROMPT, 2, cfg) as dd:
        owner = cluster_info(1, ("127.0.0.1", port))
        code, _ = await dd.link_clusters([owner])
        cm = dd.cache_manager
        src = await cm.allocate_cache(CacheDesc(1, [1, nbytes], DataType.DT_UINT8))
        src.tensors[0].fill_(0xAB)
        conn.send(int(code))
        while (cmd := await asyncio.to_thread(conn.recv)) == "push":
            try:
                await cm.push_cache(CacheKeyByIdAndIndex(1, cache_id, 0), src)
                conn.send(0)
            except LLMException as exc:
                conn.send(int(exc.status_code))
        assert cmd == "stop"


def serve(conn: Connection, port: int, cache_id: int, nbytes: int) -> None:
    """Process entry point."""
    asyncio.run(_run(conn, port, cache_id, nbytes))
