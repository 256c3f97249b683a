"""Link identity (issue #9 item 7): who holds a cluster id on the accepting side.

Reported: incoming links were filed first come first served, so a hung decoder kept
its slot (pushes meant for its replacement timed out) and, without a secret, whoever
linked first under an id received that cluster's pushes. The rule now
(``aiokv/_remote/_links.py``, docs/api.md "Link identity"): a new incoming claim for
an id replaces the filed link only if that link fails a liveness probe; a live filed
link keeps the id and the claim is refused (closed, logged at WARNING); with
``link_secret`` only authenticated peers can claim at all.

Peers here: real ``LLMDataDist`` instances and raw-socket peers that complete the
handshake and then never read again (a hung process, as a SIGSTOPped one looks from
the other side), all on 127.0.0.1 port 0, every wait bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
from _helpers import until

from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import DataType
from aiokv import LLMConfig
from aiokv import LLMDataDist
from aiokv import LLMRole
from aiokv import LLMStatusCode
from aiokv import Placement
from aiokv._remote._links import PROBE_TIMEOUT_S
from aiokv.testing import cluster_info as info
from aiokv.testing import make_config
from aiokv.transport import _wire as wire
from aiokv.transport.tcp._handshake import mac

CODE = LLMStatusCode
X = 2  # the contested cluster id
DESC = CacheDesc(2, [4, 4096], DataType.DT_UINT8, Placement.DEVICE)
SECRET = "s3cret"


def config(secret: str | None = None) -> LLMConfig:
    return make_config("tcp", pool=1 << 20, sync_kv_timeout=3000, link_secret=secret)


@contextlib.asynccontextmanager
async def participant(
    role: LLMRole, cluster_id: int, secret: str | None = None
) -> AsyncIterator[LLMDataDist]:
    async with LLMDataDist(role, cluster_id, config(secret)) as dd:
        yield dd


class Decoder:
    """A decoder holding cluster id ``X`` with one keyed cache the prompt pushes into."""

    def __init__(self, dd: LLMDataDist) -> None:
        self.dd = dd
        self.cache: Any = None

    async def setup(self) -> Decoder:
        self.cache = await self.dd.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(X, 0))
        for t in self.cache.tensors:
            t.zero_()
        return self

    def holds(self, value: int) -> bool:
        return all(bool((t[0] == value).all()) for t in self.cache.tensors)


async def push(p: LLMDataDist, value: int) -> None:
    """The prompt pushes block 0 filled with ``value`` to cluster ``X``."""
    src = await p.cache_manager.allocate_blocks_cache(DESC)
    try:
        for t in src.tensors:
            t.fill_(value)
        await p.cache_manager.push_blocks(BlocksCacheKey(X, 0), src, [0], [0])
    finally:
        await p.cache_manager.deallocate_blocks_cache(src)


def filed_address(p: LLMDataDist) -> tuple[str, int] | None:
    """Where the link the prompt files for ``X`` comes from (None: none filed)."""
    link = p._links.live(X)
    return None if link is None else link.peer.address


class RawPeer:
    """A raw-socket peer: the handshake under ``cluster_id``, then it never reads (hung)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.address: tuple[str, int] = writer.get_extra_info("sockname")[:2]

    @classmethod
    async def claim(
        cls, address: tuple[str, int], cluster_id: int, secret: bytes | None = None
    ) -> tuple[int, RawPeer]:
        """Connect and run the handshake; the final AUTH status (or ERROR's) and the peer."""
        reader, writer = await asyncio.open_connection(*address)
        peer = cls(reader, writer)
        nonce_c = os.urandom(32)
        peer.send(wire.FrameType.HELLO, {"cluster_id": cluster_id, "nonce": nonce_c.hex()})
        kind, _, hello = await peer.recv()
        assert kind is wire.FrameType.HELLO
        server_id, nonce_s = hello["cluster_id"], bytes.fromhex(hello["nonce"])
        mac_c = None
        if secret is not None:
            mac_c = mac(secret, b"client", nonce_c, nonce_s, cluster_id, server_id)
        peer.send(wire.FrameType.AUTH, {"mac": mac_c})
        kind, status, _ = await peer.recv()
        return (status if kind is wire.FrameType.AUTH else CODE.LLM_LINK_FAILED), peer

    def send(self, kind: wire.FrameType, meta: dict[str, Any]) -> None:
        raw = wire.encode_meta(meta, wire.HANDSHAKE_META_CAP)
        self.writer.write(wire.encode_frame(kind, meta=raw))

    async def recv(self) -> tuple[wire.FrameType, int, dict[str, Any]]:
        async with asyncio.timeout(5):
            h = wire.decode_header(await self.reader.readexactly(wire.HEADER_SIZE))
            return h.type, h.status, wire.decode_meta(await self.reader.readexactly(h.meta_len))

    async def closed_by_peer(self) -> bool:
        """Whether the other side closed the connection (reads what is pending)."""
        try:
            async with asyncio.timeout(5):
                while await self.reader.read(1 << 16):
                    pass
        except (TimeoutError, ConnectionError):
            return False
        return True

    def close(self) -> None:
        self.writer.close()


def warnings_of(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "aiokv.links" and r.levelno == logging.WARNING and text in r.getMessage()
    ]


# ------------------------------------------------------------------------------ (a)


async def test_a_hung_holder_is_replaced_by_a_live_claimant(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="aiokv.links")
    async with participant(LLMRole.PROMPT, 1) as p:
        code, hung = await RawPeer.claim(p.listen_address, X)  # type: ignore[arg-type]
        assert code == CODE.LLM_SUCCESS
        try:
            await until(lambda: filed_address(p) == hung.address, 10.0)
            # it answers nothing from now on: a hung (SIGSTOPped) decoder
            async with participant(LLMRole.DECODER, X) as d_dd:
                d = await Decoder(d_dd).setup()
                t0 = time.monotonic()
                code, _ = await d_dd.link_clusters([info(1, p.listen_address)])
                assert code == CODE.LLM_SUCCESS
                await until(lambda: filed_address(p) not in (None, hung.address), 10.0)
                # the probe decided it: about PROBE_TIMEOUT_S, not a transfer timeout
                assert time.monotonic() - t0 < PROBE_TIMEOUT_S + 2
                await push(p, 7)
                assert d.holds(7)  # the push reached the live successor
                assert p.linked_clusters() == [X]
                assert await hung.closed_by_peer()  # the hung link was closed
                assert warnings_of(caplog, "did not answer a probe")
        finally:
            hung.close()


# ------------------------------------------------------------------------------ (b)


async def test_b_a_second_live_claim_is_refused_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="aiokv.links")
    async with (
        participant(LLMRole.PROMPT, 1) as p,
        participant(LLMRole.DECODER, X) as first_dd,
        participant(LLMRole.DECODER, X) as second_dd,
    ):
        # Both announce X; nothing tells them apart without link_secret, so this is also
        # the case of an impostor that linked first: it keeps the id while it answers.
        first = await Decoder(first_dd).setup()
        second = await Decoder(second_dd).setup()
        assert (await first_dd.link_clusters([info(1, p.listen_address)]))[0] == CODE.LLM_SUCCESS
        await until(lambda: p.linked_clusters() == [X], 10.0)
        filed = filed_address(p)
        await push(p, 3)
        assert first.holds(3)
        # the second decoder's handshake succeeds; then its claim is decided and refused
        await second_dd.link_clusters([info(1, p.listen_address)])
        await until(lambda: second_dd.linked_clusters() == [], PROBE_TIMEOUT_S + 5)
        assert warnings_of(caplog, "refused a second link")
        assert filed_address(p) == filed
        await push(p, 4)  # the first keeps working; nothing reaches the second
        assert first.holds(4) and second.holds(0)
        assert first_dd.linked_clusters() == [1]


# ------------------------------------------------------------------------------ (c)


async def test_c_with_a_secret_an_unauthenticated_claimant_never_displaces() -> None:
    key = SECRET.encode()
    async with participant(LLMRole.PROMPT, 1, SECRET) as p:
        address = p.listen_address
        assert address is not None
        # an authenticated holder that then hangs
        code, hung = await RawPeer.claim(address, X, key)
        assert code == CODE.LLM_SUCCESS
        try:
            await until(lambda: filed_address(p) == hung.address, 10.0)
            for secret in (None, b"wrong"):
                code, raw = await RawPeer.claim(address, X, secret)
                assert code != CODE.LLM_SUCCESS  # refused in the handshake
                raw.close()
            await asyncio.sleep(PROBE_TIMEOUT_S + 0.3)  # no contest was ever started
            assert filed_address(p) == hung.address
            # an unauthenticated real instance cannot claim it either
            async with participant(LLMRole.DECODER, X) as plain_dd:
                code, _ = await plain_dd.link_clusters([info(1, address)], timeout=1000)
                assert code == CODE.LLM_LINK_FAILED
            assert filed_address(p) == hung.address
            # an authenticated successor replaces the hung holder
            async with participant(LLMRole.DECODER, X, SECRET) as d_dd:
                d = await Decoder(d_dd).setup()
                assert (await d_dd.link_clusters([info(1, address)]))[0] == CODE.LLM_SUCCESS
                await until(lambda: filed_address(p) not in (None, hung.address), 10.0)
                await push(p, 9)
                assert d.holds(9)
        finally:
            hung.close()


async def test_links_this_side_opened_keep_todays_semantics() -> None:
    """Both sides link each other: nothing is refused, both directions work."""
    async with (
        participant(LLMRole.PROMPT, 1) as p,
        participant(LLMRole.DECODER, X) as d_dd,
    ):
        d = await Decoder(d_dd).setup()
        codes = await asyncio.gather(
            p.link_clusters([info(X, d_dd.listen_address)]),
            d_dd.link_clusters([info(1, p.listen_address)]),
        )
        assert [c[0] for c in codes] == [CODE.LLM_SUCCESS, CODE.LLM_SUCCESS]
        await asyncio.sleep(PROBE_TIMEOUT_S + 0.3)  # any contest would have ended
        assert p.linked_clusters() == [X] and d_dd.linked_clusters() == [1]
        await push(p, 5)
        assert d.holds(5)
        dst = await d_dd.cache_manager.allocate_blocks_cache(DESC)
        src = await p.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(1, 0))
        for t in src.tensors:
            t.fill_(6)
        await d_dd.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [0], [0])
        assert all(bool((t[0] == 6).all()) for t in dst.tensors)
        assert torch.equal(dst.tensors[0][0], src.tensors[0][0])
