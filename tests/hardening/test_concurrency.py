"""Requester and peer agree on every outcome (issue #9, item 4): thousands of
concurrent mixed pulls and pushes between two processes, honest peer, no faults —
zero failures and every byte right."""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from multiprocessing.connection import Connection

import torch
from _helpers import mixed_block_ops
from _helpers import spawned

from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import DataType
from aiokv import LLMDataDist
from aiokv import LLMRole
from aiokv import LLMStatusCode
from aiokv.testing import cluster_info
from aiokv.testing import make_config

HOST = "127.0.0.1"
# 16 KiB blocks: a writer batch (chunks of several streams) fills the socket mid-way,
# so a stream's last byte can reach the peer before the batch's tail leaves.
DESC = CacheDesc(2, [512, 16384], DataType.DT_UINT8)
OWNER = 31


def _content(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (512, 16384), generator=g, dtype=torch.uint8) for _ in range(2)]


def _digest(tensors: list[torch.Tensor], blocks: list[int]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t[blocks].numpy().tobytes())
    return h.hexdigest()


def _owner(conn: Connection) -> None:
    """The serving process: one blocks cache (seed 1), pulls read blocks 0..255 and
    pushes write blocks 256..511; answers "digest" with a hash of requested blocks."""

    async def main() -> None:
        cfg = make_config("tcp", pool=24 << 20, sync_kv_timeout=20000)
        async with LLMDataDist(LLMRole.PROMPT, OWNER, cfg) as dd:
            cache = await dd.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(OWNER, 0))
            for t, c in zip(cache.tensors, _content(1), strict=True):
                t.copy_(c)
            assert dd.listen_address is not None
            conn.send(dd.listen_address[1])
            while True:
                cmd = await asyncio.to_thread(conn.recv)
                if cmd == "stop":
                    return
                conn.send((_digest(cache.tensors, cmd), dd.cache_manager.statistics().pins))

    asyncio.run(main())


def test_thousands_of_concurrent_mixed_ops_between_processes_all_succeed() -> None:
    """5,000 pulls and pushes of 1-40 blocks, 48 in flight, against a peer process:
    none fails, every pulled byte equals the owner's, every pushed byte landed."""
    with spawned(_owner) as (parent, port):

        async def main() -> None:
            cfg = make_config("tcp", pool=40 << 20, listen_ip_info=None, sync_kv_timeout=20000)
            async with LLMDataDist(LLMRole.DECODER, 32, cfg) as d:
                info = cluster_info(OWNER, (HOST, port))
                assert (await d.link_clusters([info]))[0] == LLMStatusCode.LLM_SUCCESS
                cm, key = d.cache_manager, BlocksCacheKey(OWNER, 0)
                mine = await cm.allocate_blocks_cache(DESC)  # pushed from (256..511)
                back = await cm.allocate_blocks_cache(DESC)  # pulled into (0..255)
                for t, c in zip(mine.tensors, _content(2), strict=True):
                    t.copy_(c)
                rng = random.Random(4)
                t0 = time.monotonic()
                pulled, pushed = await mixed_block_ops(
                    cm, key, back, mine, ops=5000, in_flight=48, rng=rng, seconds=60
                )
                elapsed = time.monotonic() - t0
                assert len(pulled) > 250 and len(pushed) > 250
                want = _content(1)
                idx = sorted(pulled)
                for t, w in zip(back.tensors, want, strict=True):
                    assert torch.equal(t[idx], w[idx])
                hi_idx = sorted(pushed)
                parent.send(hi_idx)
                digest, pins = await asyncio.to_thread(parent.recv)
                assert digest == _digest(mine.tensors, hi_idx)
                assert pins == 0  # every grant ended on the owner
                assert cm.statistics().pins == 0
                assert elapsed < 40

        asyncio.run(main())
