"""Issue #8 item 4: two-sided ``link`` / ``query_register_mem_status`` / ``unlink`` driven
by the rank-table JSON clients build (plus the blocking faces in ``aiokv.sync``)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from _helpers import raises
from participants import participant

import aiokv.sync
from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import DataType
from aiokv import LLMClusterInfo
from aiokv import LLMConfig
from aiokv import LLMDataDist
from aiokv import LLMException
from aiokv import LLMRole
from aiokv import LLMStatusCode
from aiokv import RegisterMemStatus
from aiokv.testing import cluster_info

CODE = LLMStatusCode
OK, PREPARING, FAILED = RegisterMemStatus.OK, RegisterMemStatus.PREPARING, RegisterMemStatus.FAILED


def config(**kw: Any) -> LLMConfig:
    return participant(**{"sync_kv_timeout": 3000, **kw})


def rank_table(*parties: Any) -> str:
    """The shape vLLM-Ascend and the llm_datadist samples build, one server per party,
    with ``device_port`` added: where that party's aiokv listener is."""
    servers = []
    for rank, dd in enumerate(parties):
        device: dict[str, str] = {"device_id": "0", "rank_id": str(rank)}
        if dd.listen_address is not None:
            device["device_ip"], port = dd.listen_address
            device["device_port"] = str(port)
        servers.append({"device": [device], "server_id": f"10.0.0.{rank}"})
    return json.dumps(
        {
            "server_count": str(len(servers)),
            "server_list": servers,
            "status": "completed",
            "version": "1.2",
        }
    )


def _info(cluster_id: int) -> LLMClusterInfo:
    return cluster_info(cluster_id, ("127.0.0.1", 1))


def blocks() -> CacheDesc:
    return CacheDesc(2, [4, 256], DataType.DT_UINT8)


async def status_until(dd: LLMDataDist, comm_id: int, want: RegisterMemStatus) -> None:
    deadline = time.monotonic() + 5
    while (got := await dd.query_register_mem_status(comm_id)) != want:
        assert got == PREPARING and time.monotonic() < deadline, got
        await asyncio.sleep(0.02)


async def test_three_parties_link_concurrently_pull_after_ok_and_unlink() -> None:
    async with (
        LLMDataDist(LLMRole.PROMPT, 10, config()) as a,
        LLMDataDist(LLMRole.PROMPT, 11, config()) as b,
        LLMDataDist(LLMRole.DECODER, 12, config(listen_ip_info=None)) as c,  # top rank
    ):
        ranks = {10: 0, 11: 1, 12: 2}
        table = rank_table(a, b, c)
        src = await b.cache_manager.allocate_blocks_cache(blocks(), BlocksCacheKey(11))
        src.tensors[0].fill_(5)
        dst = await a.cache_manager.allocate_blocks_cache(blocks())
        # A and B link at once; C has not called yet
        ida, idb = await asyncio.gather(a.link("pd", ranks, table), b.link("pd", ranks, table))
        deadline = time.monotonic() + 5
        while 11 not in a.linked_clusters():  # B's link to A is up ...
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert await a.query_register_mem_status(ida) == PREPARING  # ... but C's is not
        assert await b.query_register_mem_status(idb) == PREPARING
        # before OK, transfers on the communicator's links fail as in llm_datadist
        await raises(
            CODE.LLM_NOT_YET_LINK, a.cache_manager.pull_blocks(BlocksCacheKey(11), dst, [0], [0])
        )
        # a link_clusters call for a cluster the communicator is linking waits its turn
        code, codes = await a.link_clusters([_info(12)])
        assert (code, codes) == (CODE.LLM_PROCESSING_LINK, [CODE.LLM_PROCESSING_LINK])
        # C (the top rank: it connects to both, listens to nobody) joins
        idc = await c.link("pd", ranks, table)
        for dd, comm in ((a, ida), (b, idb), (c, idc)):
            await status_until(dd, comm, OK)
        await a.cache_manager.pull_blocks(BlocksCacheKey(11), dst, [0, 1], [2, 3])
        assert int(dst.tensors[0][2:4].sum()) == 5 * 2 * 256
        await a.check_link_status(12)
        await raises(CODE.LLM_ALREADY_LINK, a.link("again", {10: 0, 11: 1}, table))
        # unlink in any order; the others see their links end
        await b.unlink(idb)
        await raises(CODE.LLM_PARAM_INVALID, b.unlink(idb))  # forgotten
        await raises(CODE.LLM_PARAM_INVALID, b.query_register_mem_status(idb))
        await c.unlink(idc)
        await a.unlink(ida)
        deadline = time.monotonic() + 5
        while a.linked_clusters() or b.linked_clusters() or c.linked_clusters():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        await raises(
            CODE.LLM_NOT_YET_LINK, a.cache_manager.pull_blocks(BlocksCacheKey(11), dst, [0], [0])
        )


async def test_connecting_side_first_and_failed_status() -> None:
    async with (
        LLMDataDist(LLMRole.PROMPT, 1, config(link_total_time=1)) as p,
        LLMDataDist(LLMRole.DECODER, 2, config(link_total_time=1)) as d,
    ):
        ranks = {1: 0, 2: 1}
        table = rank_table(p, d)
        # D (rank 1) links first: its link to P's listener is up before P calls link
        idd = await d.link("pd", ranks, table)
        await status_until(d, idd, OK)
        deadline = time.monotonic() + 5
        while p.linked_clusters() != [2]:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        idp = await p.link("pd", ranks, table)
        await status_until(p, idp, OK)  # the link the peer opened first counts
        await d.unlink(idd)
        await p.unlink(idp)
        # P waits for a rank 1 that never links: FAILED after link_total_time
        t0 = time.monotonic()
        idp = await p.link("pd", ranks, table)
        await status_until(p, idp, FAILED)
        assert 0.8 < time.monotonic() - t0 < 3
        await p.unlink(idp)
        assert p.linked_clusters() == []


async def test_link_arguments() -> None:
    async with (
        LLMDataDist(LLMRole.PROMPT, 1, config()) as p,
        LLMDataDist(LLMRole.DECODER, 2, config(listen_ip_info=None)) as d,
    ):
        table = rank_table(p, d)
        bad = CODE.LLM_PARAM_INVALID
        await raises(bad, p.link("", {1: 0, 2: 1}, table))
        await raises(bad, p.link("x" * 128, {1: 0, 2: 1}, table))
        await raises(bad, p.link("c", {1: 0}, table))  # one party
        await raises(bad, p.link("c", {1: 0, 2: 1, 3: 2, 4: 3, 5: 4}, table))  # five
        await raises(bad, p.link("c", {1: 1, 2: 0}, table))  # ranks not ascending
        await raises(bad, p.link("c", {3: 0, 2: 1}, table))  # this side is not a party
        await raises(bad, p.link("c", {1: 0, 2: 1}, "not json"))
        await raises(bad, p.link("c", {1: 0, 2: 5}, table))  # no device with rank 5
        await raises(bad, d.link("c", {1: 0, 2: 1}, rank_table(d, d)))  # rank 0 has no port
        # D is rank 0 here: P would connect to it, but D neither listens nor has an address
        await raises(bad, d.link("c", {2: 0, 1: 1}, rank_table(d, p)))
        with pytest.raises(TypeError):
            await p.link("c", {1: "0", 2: 1}, table)  # type: ignore[dict-item]
        with pytest.raises(TypeError):
            await p.link("c", {1: 0, 2: 1}, json.loads(table))  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            await p.link("c", {1: 0, 2: 2**32}, table)
        await raises(bad, p.query_register_mem_status(12345))
        await raises(bad, p.unlink(12345))
        assert p.linked_clusters() == [] and d.linked_clusters() == []


def test_blocking_faces() -> None:
    """aiokv.sync: the same calls, blocking, from plain threads."""
    with (
        aiokv.sync.LLMDataDist(LLMRole.PROMPT, 1, config()) as p,
        aiokv.sync.LLMDataDist(LLMRole.DECODER, 2, config()) as d,
    ):
        assert aiokv.sync.RegisterMemStatus is RegisterMemStatus
        table = rank_table(p, d)
        idp = p.link("pd", {1: 0, 2: 1}, table)
        idd = d.link("pd", {1: 0, 2: 1}, table)
        deadline = time.monotonic() + 5
        while (p.query_register_mem_status(idp), d.query_register_mem_status(idd)) != (OK, OK):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        d.check_link_status(1)
        with pytest.raises(LLMException) as ei:
            p.switch_role(LLMRole.DECODER)
        assert ei.value.status_code == CODE.LLM_EXIST_LINK
        d.unlink(idd)
        p.unlink(idp)
        while p.linked_clusters():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        p.switch_role(LLMRole.DECODER)
        assert p.listen_address is None and p.role == LLMRole.DECODER
        with pytest.raises(LLMException) as ei:
            d.check_link_status(1)
        assert ei.value.status_code == CODE.LLM_NOT_YET_LINK
