"""Issue #8 items 3 and 5: link_clusters / unlink_clusters codes, retries, force,
switch_role and check_link_status — real links between LLMDataDist on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from _helpers import free_port
from _helpers import raises
from _helpers import until
from participants import info
from participants import participant

from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import DataType
from aiokv import LLMConfig
from aiokv import LLMDataDist
from aiokv import LLMRole
from aiokv import LLMStatusCode
from aiokv.transport import Grant
from aiokv.transport import PeerInfo
from aiokv.transport import get_transport

CODE = LLMStatusCode


def config(backend: str = "tcp", **kw: Any) -> LLMConfig:
    return participant(transfer_backend=backend, **kw)


def blocks() -> CacheDesc:
    return CacheDesc(2, [4, 256], DataType.DT_UINT8)


@contextlib.asynccontextmanager
async def pair(backend: str = "tcp", **kw: Any) -> AsyncIterator[tuple[LLMDataDist, LLMDataDist]]:
    """A prompt (cluster 1) and a decoder (cluster 2), both listening, not linked."""
    async with (
        LLMDataDist(LLMRole.PROMPT, 1, config(backend, **kw)) as p,
        LLMDataDist(LLMRole.DECODER, 2, config(backend, **kw)) as d,
    ):
        yield p, d


# ---- link_clusters / unlink_clusters --------------------------------------------------------
async def test_codes_and_arguments() -> None:
    async with pair() as (p, d):
        for call in (d.link_clusters, d.unlink_clusters):
            assert await call([]) == (CODE.LLM_PARAM_INVALID, [])
            for bad in (0, -5):
                await raises(CODE.LLM_PARAM_INVALID, call([info(1, p.listen_address)], bad))
            with pytest.raises(ValueError):
                await call([info(1, p.listen_address)], 2**31)
            with pytest.raises(TypeError):
                await call([info(1, p.listen_address)], "3000")
        assert d.linked_clusters() == []  # refused calls changed nothing
        wrong = info(9, p.listen_address)  # P is cluster 1, not 9
        code, codes = await d.link_clusters([info(1, p.listen_address), wrong])
        assert (code, codes) == (CODE.LLM_LINK_FAILED, [CODE.LLM_SUCCESS, CODE.LLM_LINK_FAILED])
        code, codes = await d.link_clusters([info(1, p.listen_address)])
        assert (code, codes) == (CODE.LLM_ALREADY_LINK, [CODE.LLM_ALREADY_LINK])
        await d.check_link_status(1)
        await raises(CODE.LLM_NOT_YET_LINK, d.check_link_status(9))
        with pytest.raises(ValueError):
            await d.check_link_status(-1)


async def test_link_the_peer_opened_first_succeeds() -> None:
    async with pair() as (p, d):
        assert (await d.link_clusters([info(1, p.listen_address)]))[0] == CODE.LLM_SUCCESS
        await until(lambda: p.linked_clusters() == [2])
        # P links D, which already linked P: no failure, no second connection needed
        assert await p.link_clusters([info(2, d.listen_address)]) == (
            CODE.LLM_SUCCESS,
            [CODE.LLM_SUCCESS],
        )
        assert await p.link_clusters([info(2, d.listen_address)]) == (
            CODE.LLM_ALREADY_LINK,
            [CODE.LLM_ALREADY_LINK],
        )
        src = await p.cache_manager.allocate_blocks_cache(blocks(), BlocksCacheKey(1))
        dst = await d.cache_manager.allocate_blocks_cache(blocks())
        src.tensors[0].fill_(7)
        await d.cache_manager.pull_blocks(BlocksCacheKey(1), dst, [0], [0])
        assert int(dst.tensors[0][0].sum()) == 7 * 256


@pytest.mark.parametrize("first", ["prompt", "decoder"])
async def test_unlink_in_any_order(first: str) -> None:
    async with pair() as (p, d):
        assert (await d.link_clusters([info(1, p.listen_address)]))[0] == CODE.LLM_SUCCESS
        await until(lambda: p.linked_clusters() == [2])
        a, b, b_peer = (p, d, 1) if first == "prompt" else (d, p, 2)
        a_peer = 2 if a is p else 1
        assert await a.unlink_clusters([info(a_peer, ("127.0.0.1", 1))]) == (
            CODE.LLM_SUCCESS,
            [CODE.LLM_SUCCESS],
        )
        await until(lambda: b.linked_clusters() == [])  # the peer saw the link end
        await raises(CODE.LLM_NOT_YET_LINK, b.check_link_status(b_peer))
        # the other side unlinks a cluster no longer linked, and one never linked: success
        assert await b.unlink_clusters(
            [info(b_peer, ("127.0.0.1", 1)), info(77, ("127.0.0.1", 1))]
        ) == (
            CODE.LLM_SUCCESS,
            [CODE.LLM_SUCCESS, CODE.LLM_SUCCESS],
        )
        dst = await d.cache_manager.allocate_blocks_cache(blocks())
        await raises(
            CODE.LLM_NOT_YET_LINK, d.cache_manager.pull_blocks(BlocksCacheKey(1), dst, [0], [0])
        )
        assert (await d.link_clusters([info(1, p.listen_address)]))[0] == CODE.LLM_SUCCESS


class SlowPeer:
    """Answers every request after ``delay`` seconds, with a refusal."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    async def grant_read(self, peer: PeerInfo, meta: bytes) -> Grant:
        await asyncio.sleep(self.delay)
        return Grant(CODE.LLM_KV_CACHE_NOT_EXIST)

    async def grant_write(self, peer: PeerInfo, meta: bytes, nbytes: int) -> Grant:
        await asyncio.sleep(self.delay)
        return Grant(CODE.LLM_KV_CACHE_NOT_EXIST)


async def test_unlink_force_and_graceful() -> None:
    peer = SlowPeer(0.3)
    async with (
        get_transport("tcp")(1, peer) as fake,
        LLMDataDist(LLMRole.DECODER, 2, config()) as d,
    ):
        address = await fake.listen("127.0.0.1", 0)
        dst = await d.cache_manager.allocate_blocks_cache(blocks())
        pull = d.cache_manager.pull_blocks
        # graceful: waits for the pull in flight, which ends with the peer's own answer
        assert (await d.link_clusters([info(1, address)]))[0] == CODE.LLM_SUCCESS
        task = asyncio.create_task(pull(BlocksCacheKey(1), dst, [0], [0]))
        await asyncio.sleep(0.05)
        assert await d.unlink_clusters([info(1, address)], 3000) == (
            CODE.LLM_SUCCESS,
            [CODE.LLM_SUCCESS],
        )
        await raises(CODE.LLM_KV_CACHE_NOT_EXIST, task)
        await until(lambda: fake.links() == [])  # the peer's end closed too
        # graceful past its timeout: fails and leaves the link up, the pull running
        peer.delay = 2.0
        assert (await d.link_clusters([info(1, address)]))[0] == CODE.LLM_SUCCESS
        task = asyncio.create_task(pull(BlocksCacheKey(1), dst, [0], [0]))
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        assert await d.unlink_clusters([info(1, address)], 200) == (
            CODE.LLM_UNLINK_FAILED,
            [CODE.LLM_UNLINK_FAILED],
        )
        assert 0.15 < time.monotonic() - t0 < 1.0
        assert d.linked_clusters() == [1] and not task.done()
        # forced: closes now; the pull in flight fails
        t0 = time.monotonic()
        assert (await d.unlink_clusters([info(1, address)], 3000, force=True))[
            0
        ] == CODE.LLM_SUCCESS
        # the error says why the link ended, and what to do
        await raises(CODE.LLM_LINK_FAILED, task, "closed on this side", "link_clusters")
        assert time.monotonic() - t0 < 1.0 and d.linked_clusters() == []


# ---- retries and time budgets ---------------------------------------------------------------
async def test_prompt_starting_late_links_through_retries() -> None:
    port = free_port()
    async with LLMDataDist(LLMRole.DECODER, 2, config(link_retry_count=5)) as d:

        async def late_prompt() -> LLMDataDist:
            await asyncio.sleep(0.3)
            p = LLMDataDist(LLMRole.PROMPT, 1)
            await p.init(config(listen_ip_info=f"127.0.0.1:{port}"))
            return p

        starting = asyncio.create_task(late_prompt())
        t0 = time.monotonic()
        code, codes = await d.link_clusters([info(1, ("127.0.0.1", port))], timeout=3000)
        elapsed = time.monotonic() - t0
        p = await starting
        try:
            assert (code, codes) == (CODE.LLM_SUCCESS, [CODE.LLM_SUCCESS])
            assert 0.3 < elapsed < 3.0
        finally:
            await p.finalize()


@pytest.mark.parametrize(
    ("cfg", "timeout_ms", "low", "high"),
    [
        # n attempts spread over the budget: the last one starts at (n-1)/n of it
        ({"link_retry_count": 5}, 1000, 0.75, 1.5),
        ({"link_retry_count": 1}, 1000, 0.0, 0.5),  # one attempt, refused at once
        ({"link_retry_count": 3, "link_total_time": 10}, 600, 0.35, 1.0),  # timeout wins
        ({"link_retry_count": 3, "link_total_time": 1}, 5000, 0.6, 1.5),  # total time wins
    ],
)
async def test_link_budget(cfg: dict[str, Any], timeout_ms: int, low: float, high: float) -> None:
    port = free_port()  # nobody listens there
    async with LLMDataDist(LLMRole.DECODER, 2, config(**cfg)) as d:
        t0 = time.monotonic()
        code, codes = await d.link_clusters([info(1, ("127.0.0.1", port))], timeout=timeout_ms)
        assert (code, codes) == (CODE.LLM_LINK_FAILED, [CODE.LLM_LINK_FAILED])
        assert low < time.monotonic() - t0 < high


# ---- switch_role --------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["tcp", "local"])
async def test_switch_role_moves_the_listener(backend: str) -> None:
    async with pair(backend) as (p, d):
        old = p.listen_address
        assert (await d.link_clusters([info(1, old)]))[0] == CODE.LLM_SUCCESS
        await until(lambda: p.linked_clusters() == [2])
        await raises(CODE.LLM_EXIST_LINK, p.switch_role(LLMRole.DECODER))
        assert p.role == LLMRole.PROMPT and p.listen_address == old  # nothing changed
        await d.unlink_clusters([info(1, old)])
        await until(lambda: p.linked_clusters() == [])
        # bad options change nothing
        with pytest.raises(ValueError):
            await p.switch_role(LLMRole.DECODER, {"llm.listenIpInfo": "nowhere"})
        with pytest.raises(ValueError):
            await p.switch_role(LLMRole.DECODER, {"llm.NoSuchOption": "1"})
        with pytest.raises(TypeError):
            await p.switch_role("decoder")  # type: ignore[arg-type]
        assert p.role == LLMRole.PROMPT and p.listen_address == old
        # same address: the listener stays
        await p.switch_role(LLMRole.MIX, {"llm.listenIpInfo": f"{old[0]}:{old[1]}"})
        assert p.listen_address == old and p.role == LLMRole.MIX
        # without llm.listenIpInfo: stop listening
        await p.switch_role(LLMRole.DECODER)
        assert p.role == LLMRole.DECODER and p.listen_address is None
        assert (await d.link_clusters([info(1, old)]))[0] == CODE.LLM_LINK_FAILED
        # with it: listen again (a generate_options() dict, as llm_datadist's samples pass)
        await p.switch_role(
            LLMRole.PROMPT, LLMConfig(listen_ip_info="127.0.0.1:0").generate_options()
        )
        first = p.listen_address
        assert first is not None and p.role == LLMRole.PROMPT
        await p.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": "127.0.0.1:0"})  # move
        moved = p.listen_address
        assert moved is not None and moved != first
        assert (await d.link_clusters([info(1, first)]))[0] == CODE.LLM_LINK_FAILED
        assert (await d.link_clusters([info(1, moved)]))[0] == CODE.LLM_SUCCESS
        await d.check_link_status(1)


async def test_switch_role_legacy_rules() -> None:
    legacy = config(enable_cache_manager=False, listen_ip_info=None)
    async with LLMDataDist(LLMRole.DECODER, 2, legacy) as d:
        await raises(CODE.LLM_PARAM_INVALID, d.switch_role(LLMRole.DECODER))  # unchanged
        await raises(CODE.LLM_PARAM_INVALID, d.switch_role(LLMRole.PROMPT))  # needs listen
        dst = await d.kv_cache_manager.allocate_blocks_cache(blocks())
        await raises(
            CODE.LLM_NOT_YET_LINK, d.kv_cache_manager.pull_blocks(BlocksCacheKey(1), dst, [0], [0])
        )
        await d.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": "127.0.0.1:0"})
        assert d.role == LLMRole.PROMPT and d.listen_address is not None
        # the role gates follow: a PROMPT does not pull
        await raises(
            CODE.LLM_FEATURE_NOT_ENABLED,
            d.kv_cache_manager.pull_blocks(BlocksCacheKey(1), dst, [0], [0]),
        )
        await d.switch_role(LLMRole.DECODER)
        assert d.listen_address is None
        # legacy mode: llm_datadist's LLM_PARAM_INVALID, naming the option to set
        await raises(
            CODE.LLM_PARAM_INVALID,
            d.link("c", {1: 0, 2: 1}, "{}"),
            "not supported when llm.EnableCacheManager is not configured",
            "enable_cache_manager=True",
        )
        await d.kv_cache_manager.deallocate_blocks_cache(dst)


async def test_switch_role_refuses_while_link_clusters_is_connecting() -> None:
    """``switch_role`` raises ``LLM_EXIST_LINK`` "while any link is up or being made":
    a ``link_clusters`` call still waiting for its peer's handshake counts. Before the
    fix the role switched (and the listener moved) under it, and the link came up after
    the switch, as if made by the new role."""
    import socket

    silent = socket.socket()  # accepts connections (backlog), never answers a handshake
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    try:
        async with pair("tcp") as (p, _):
            old = p.listen_address
            linking = asyncio.ensure_future(
                p.link_clusters([info(3, silent.getsockname())], timeout=3000)
            )
            await until(lambda: p._links.attempting() == [3])
            await raises(CODE.LLM_EXIST_LINK, p.switch_role(LLMRole.DECODER))
            assert p.role == LLMRole.PROMPT and p.listen_address == old  # nothing changed
            code, _ = await linking
            assert code == CODE.LLM_LINK_FAILED
            await p.switch_role(LLMRole.DECODER)  # the attempt is over: allowed
            assert p.role == LLMRole.DECODER
    finally:
        silent.close()
