"""Errors a person can act on (issue #11 item 4): the peer's reason travels with its
refusal over every transport, bounded and sanitized; a wrong ``link_secret`` says so on
both sides; common misuses name the fix."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from _helpers import Refusing
from _helpers import fake_peer
from _helpers import fake_peer_hello
from _helpers import raises

from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import DataType
from aiokv import LLMConfig
from aiokv import LLMDataDist
from aiokv import LLMRole
from aiokv import LLMStatusCode
from aiokv import Placement
from aiokv.testing import cluster_info as info
from aiokv.testing import linked_pair
from aiokv.testing import make_config
from aiokv.transport import _wire as wire
from aiokv.transport import get_transport
from aiokv.transport._base import REASON_CAP
from aiokv.transport._base import decode_reason
from aiokv.transport._base import encode_reason
from aiokv.transport._wire import FrameType
from aiokv.transport.tcp import TcpTransport

CODE = LLMStatusCode
HOST = "127.0.0.1"
pytestmark = pytest.mark.timeout(60)


def config(backend: str, **kw: Any) -> LLMConfig:
    return make_config(backend, pool=4 << 20, **({"sync_kv_timeout": 3000} | kw))


def blocks(width: int = 32) -> CacheDesc:
    """Two bf16 tensors of 8 blocks of ``[4, 2, width]`` (``width`` 32: 512 bytes a block)."""
    return CacheDesc(2, [8, 4, 2, width], DataType.DT_BF16)


@pytest.fixture(params=["local", "tcp"])
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[tuple[LLMDataDist, LLMDataDist]]:
    async with linked_pair(config(request.param)) as (p, d):
        yield p, d


async def test_peer_reason_reaches_the_requester(
    pair: tuple[LLMDataDist, LLMDataDist], caplog: pytest.LogCaptureFixture
) -> None:
    """A pull whose block size differs from the owner's: the requester's error carries
    the owner's reason, and the owner logs the refusal at WARNING."""
    p, d = pair
    await p.cache_manager.allocate_blocks_cache(blocks(64), BlocksCacheKey(1, 0))
    dst = await d.cache_manager.allocate_blocks_cache(blocks())
    with caplog.at_level(logging.WARNING, logger="aiokv"):
        await raises(
            CODE.LLM_PARAM_INVALID,
            d.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [0], [0]),
            "block sizes differ: the requester's cache has 512 bytes per block",
            "has 1024",
            "pull_blocks",  # the public operation, once
        )
    refusals = [r for r in caplog.records if r.name == "aiokv.remote" and "refused" in r.message]
    assert refusals and refusals[0].levelno == logging.WARNING
    assert "block sizes differ" in refusals[0].getMessage()

    missing = await d.cache_manager.allocate_blocks_cache(blocks())
    await raises(
        CODE.LLM_KV_CACHE_NOT_EXIST,
        d.cache_manager.pull_blocks(BlocksCacheKey(1, 9), missing, [0], [0]),
        "no cache for",
    )


def test_reason_is_capped_and_sanitized() -> None:
    raw = encode_reason("é" * 400)  # 800 bytes of UTF-8
    assert len(raw) <= REASON_CAP and raw.decode() == "é" * (REASON_CAP // 2)
    assert encode_reason(None) == b"" and encode_reason("") == b""
    hostile = b"evil\n\x1b[31mred\x00\xff\xfe" + b"x" * 1000
    text = decode_reason(hostile)
    assert "\n" not in text and "\x1b" not in text and "\x00" not in text
    assert text.startswith("evil??[31mred?") and "\ufffd" in text
    assert len(text.encode()) <= REASON_CAP + 3 * 2  # replacement chars may widen


# ------------------------------------------------------------ a raw peer's reason (TCP)


@contextlib.asynccontextmanager
async def raw_peer(reason: bytes) -> AsyncIterator[int]:
    """A TCP peer that completes the handshake, then refuses the first request with
    ``reason`` as the refusal's meta."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await fake_peer_hello(reader, writer)
        h = wire.decode_header(await reader.readexactly(wire.HEADER_SIZE))
        await reader.readexactly(h.meta_len)
        code = int(CODE.LLM_KV_CACHE_NOT_EXIST)
        # built by hand: the peer may send anything, even over the cap
        head = wire.HEADER.pack(
            wire.MAGIC, wire.VERSION, FrameType.READ_RESP, code, len(reason), h.req_id, 0
        )
        writer.write(head + reason)
        await writer.drain()
        await reader.read()  # until the requester closes

    async with fake_peer(serve) as port:
        yield port


async def read_refused_by_raw_peer(reason: bytes, code: LLMStatusCode) -> tuple[str, bool]:
    """A read over TCP from a :func:`raw_peer` refusing with ``reason``: it must fail
    with ``code``; returns the error's message and whether the link is broken after."""
    async with raw_peer(reason) as port:
        t = TcpTransport(1, Refusing(CODE.LLM_FAILED))
        try:
            link = await t.connect(HOST, port, timeout=5)
            exc = await raises(code, link.read(b"{}", [memoryview(bytearray(16))], timeout=5))
            return str(exc), link.broken
        finally:
            await t.aclose()


async def test_hostile_reason_is_sanitized_by_the_requester() -> None:
    reason = b"gone\r\n\x1b[2J" + "ü".encode() + b"\xff" * 3
    msg, _ = await read_refused_by_raw_peer(reason, CODE.LLM_KV_CACHE_NOT_EXIST)
    assert "cluster 9 refused (LLM_KV_CACHE_NOT_EXIST): gone???[2Jü\ufffd\ufffd\ufffd" in msg
    assert "\n" not in msg and "\x1b" not in msg


async def test_reason_over_the_cap_is_a_protocol_violation() -> None:
    _, broken = await read_refused_by_raw_peer(b"x" * (REASON_CAP + 1), CODE.LLM_LINK_FAILED)
    assert broken


# ------------------------------------------------------------------------ link_secret


@pytest.mark.parametrize(
    ("client", "server", "says"),
    [
        (b"a" * 16, b"b" * 16, "link_secret differ"),
        (None, b"b" * 16, "the peer requires a link_secret and this side has none"),
        (b"a" * 16, None, "this side has a link_secret and the peer has none"),
    ],
)
@pytest.mark.parametrize("backend", ["tcp", "local"])
async def test_wrong_link_secret_says_so_on_both_sides(
    backend: str,
    client: bytes | None,
    server: bytes | None,
    says: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    cls = get_transport(backend)
    refusing = Refusing(CODE.LLM_FAILED)
    srv, cli = cls(2, refusing, secret=server), cls(1, refusing, secret=client)
    try:
        with caplog.at_level(logging.WARNING, logger="aiokv"):
            host, port = await srv.listen(HOST, 0)
            exc = await raises(
                CODE.LLM_LINK_FAILED,
                cli.connect(host, port, timeout=5),
                "authentication failed",
                says,
            )
            for _ in range(100):  # the acceptor logs once its handshake task ends
                if any("refused a link" in r.getMessage() for r in caplog.records):
                    break
                await asyncio.sleep(0.01)
    finally:
        await cli.aclose()
        await srv.aclose()
    assert exc.context.get("authenticated") is False
    accepted = [r for r in caplog.records if "refused a link" in r.getMessage()]
    assert accepted and accepted[0].levelno == logging.WARNING
    assert "link_secret" in accepted[0].getMessage()
    assert srv.links() == [] and cli.links() == []


async def test_link_clusters_with_a_wrong_secret_warns(caplog: pytest.LogCaptureFixture) -> None:
    async with (
        LLMDataDist(LLMRole.PROMPT, 1, config("tcp", link_secret="s" * 16)) as p,
        LLMDataDist(LLMRole.DECODER, 2, config("tcp", link_secret="t" * 16)) as d,
    ):
        with caplog.at_level(logging.WARNING, logger="aiokv"):
            code, codes = await d.link_clusters([info(1, p.listen_address)], timeout=500)
        assert code == CODE.LLM_LINK_FAILED and codes == [CODE.LLM_LINK_FAILED]
    mine = [r for r in caplog.records if r.name == "aiokv.links" and r.levelno == logging.WARNING]
    assert any("link_secret differ" in r.getMessage() for r in mine)


# ---------------------------------------------------------------- misuses name the fix


async def test_unlinked_cluster_says_link_clusters_first() -> None:
    async with LLMDataDist(LLMRole.DECODER, 2, config("tcp")) as d:
        dst = await d.cache_manager.allocate_blocks_cache(blocks())
        await raises(
            CODE.LLM_NOT_YET_LINK,
            d.cache_manager.pull_blocks(BlocksCacheKey(7, 0), dst, [0], [0]),
            "cluster 7 is not linked",
            "call link_clusters first",
        )
        await raises(CODE.LLM_NOT_YET_LINK, d.check_link_status(7), "link_clusters")


async def test_pool_too_small_says_how_big_and_which_option() -> None:
    cfg = config(
        "tcp",
        host_mem_pool_cfg='{"memory_size": 1048576, "page_shift": 12}',
        listen_ip_info=None,
    )
    async with LLMDataDist(LLMRole.DECODER, 2, cfg) as d:
        cm = d.cache_manager
        await raises(
            CODE.LLM_OUT_OF_MEMORY,
            cm.allocate_cache(CacheDesc(5, [1024, 1024], DataType.DT_UINT8)),
            "5 tensor(s) of 1048576 bytes need 5242880 bytes",
            "4194304 of 4194304 bytes are free",
            "mem_pool_cfg.memory_size",
        )
        await raises(
            CODE.LLM_OUT_OF_MEMORY,
            cm.allocate_cache(CacheDesc(2, [1024, 1024], DataType.DT_UINT8, Placement.HOST)),
            "host pool",
            "host_mem_pool_cfg.memory_size",
        )
        # the failed allocations took nothing
        stats = cm.get_pool_stats(Placement.DEVICE)
        assert stats is not None and stats.used == 0 and stats.failed_allocations == 1
