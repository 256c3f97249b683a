"""Two-sided ``link`` by a party without ``listen_ip_info`` (llm_datadist's samples set
none): it listens at its own rank-table entry's ``device_ip`` / ``device_port``."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from _helpers import free_port
from _helpers import not_listening
from _helpers import raises

from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import DataType
from aiokv import LLMConfig
from aiokv import LLMDataDist
from aiokv import LLMRole
from aiokv import LLMStatusCode
from aiokv import RegisterMemStatus


def config() -> LLMConfig:
    """A participant that does not listen (the rank table says where), over TCP."""
    return not_listening(pool=1 << 20, sync_kv_timeout=1000)


def table(rank0: dict[str, str]) -> str:
    servers = [{"device": [{"rank_id": "0", **rank0}]}, {"device": [{"rank_id": "1"}]}]
    return json.dumps({"server_count": "2", "server_list": servers, "version": "1.2"})


async def test_party_without_listener_listens_at_its_entry() -> None:
    port = free_port()
    rank_table = table({"device_ip": "127.0.0.1", "device_port": str(port)})
    async with (
        LLMDataDist(LLMRole.PROMPT, 1, config()) as p,
        LLMDataDist(LLMRole.DECODER, 2, config()) as d,
    ):
        assert p.listen_address is None
        src = await p.cache_manager.allocate_blocks_cache(
            CacheDesc(1, [2, 64], DataType.DT_UINT8), BlocksCacheKey(1)
        )
        src.tensors[0].fill_(7)
        ids = await asyncio.gather(
            p.link("c", {1: 0, 2: 1}, rank_table), d.link("c", {1: 0, 2: 1}, rank_table)
        )
        assert p.listen_address == ("127.0.0.1", port)
        assert d.listen_address is None  # the top rank is never reached
        deadline = time.monotonic() + 5
        ok = RegisterMemStatus.OK
        while (
            await p.query_register_mem_status(ids[0]),
            await d.query_register_mem_status(ids[1]),
        ) != (ok, ok):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        dst = await d.cache_manager.allocate_blocks_cache(CacheDesc(1, [2, 64], DataType.DT_UINT8))
        await d.cache_manager.pull_blocks(BlocksCacheKey(1), dst, [1], [0])
        assert int(dst.tensors[0][0].min()) == 7
        await d.unlink(ids[1])
        await p.unlink(ids[0])


async def test_entries_without_device_port_use_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM-Ascend builds rank tables without ports: AIOKV_DEVICE_PORT is every party's."""
    port = free_port()
    monkeypatch.setenv("AIOKV_DEVICE_PORT", str(port))
    rank_table = table({"device_ip": "127.0.0.1"})
    async with (
        LLMDataDist(LLMRole.PROMPT, 1, config()) as p,
        LLMDataDist(LLMRole.DECODER, 2, config()) as d,
    ):
        ids = await asyncio.gather(
            p.link("c", {1: 0, 2: 1}, rank_table), d.link("c", {1: 0, 2: 1}, rank_table)
        )
        assert p.listen_address == ("127.0.0.1", port)
        deadline = time.monotonic() + 5
        while await d.query_register_mem_status(ids[1]) != RegisterMemStatus.OK:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        assert d.linked_clusters() == [1]
        await d.unlink(ids[1])
        await p.unlink(ids[0])
    monkeypatch.setenv("AIOKV_DEVICE_PORT", "not a port")
    async with LLMDataDist(LLMRole.DECODER, 2, config()) as d:
        await raises(LLMStatusCode.LLM_PARAM_INVALID, d.link("c", {1: 0, 2: 1}, rank_table))


async def test_party_without_listener_or_address_is_refused() -> None:
    async with LLMDataDist(LLMRole.PROMPT, 1, config()) as p:
        await raises(
            LLMStatusCode.LLM_PARAM_INVALID,
            p.link("c", {1: 0, 2: 1}, table({"device_ip": "127.0.0.1"})),
        )
        assert p.listen_address is None


async def test_own_entry_that_cannot_be_bound_fails_the_call() -> None:
    async with (
        LLMDataDist(LLMRole.PROMPT, 1, config()) as p,
        LLMDataDist(LLMRole.DECODER, 2, LLMConfig(listen_ip_info="127.0.0.1:0")) as busy,
    ):
        assert busy.listen_address is not None
        host, port = busy.listen_address
        await raises(
            LLMStatusCode.LLM_LINK_FAILED,
            p.link("c", {1: 0, 2: 1}, table({"device_ip": host, "device_port": str(port)})),
        )
        assert p.listen_address is None
        assert p.linked_clusters() == []
