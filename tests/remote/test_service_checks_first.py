"""The serving side checks a request before it acts: a refused notification is not
delivered, a malformed request cannot forge the log, a request of the wrong size is
refused before it is staged, and raw-address refusals carry the codes the docs state.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import pytest
import torch

from aiokv import CacheDesc
from aiokv import DataType
from aiokv import LLMConfig
from aiokv import LLMDataDist
from aiokv import LLMException
from aiokv import LLMStatusCode
from aiokv import Placement
from aiokv._copy import Stager
from aiokv._copy import _staging
from aiokv._remote import _protocol as protocol
from aiokv._remote._protocol import KeyById
from aiokv._remote._protocol import SlotReq
from aiokv._remote._protocol import Tensors
from aiokv._remote._protocol import encode
from aiokv.testing import linked_pair
from aiokv.testing import make_config

CODE = LLMStatusCode
MIB = 1 << 20


def config(**kw: Any) -> LLMConfig:
    """TCP, small pools, pushes allowed unless told otherwise."""
    options = {"enable_remote_cache_accessible": True, "sync_kv_timeout": 3000}
    return make_config("tcp", pool=8 * MIB, host_pool=4 * MIB, **(options | kw))


async def _send(d: LLMDataDist, op: str, meta: bytes, payload: list[Any]) -> LLMException | None:
    """``meta`` sent as a ``op`` (``"read"`` / ``"write"``) of ``payload`` on ``d``'s link
    to cluster 1, from ``d``'s engine, as a peer that builds its own requests would:
    the error it got, or None."""
    link = d._links.require("test", 1)

    async def send() -> None:
        method = link.read if op == "read" else link.write
        await method(meta, payload, timeout=3)

    assert d._engine is not None
    try:
        await d._engine.run(send)
    except LLMException as exc:
        return exc
    return None


async def test_a_refused_notification_is_not_delivered() -> None:
    """A notification is a write of 0 bytes. A peer that sends one as a write of some
    bytes is refused (``LLM_PARAM_INVALID``: the grant is of 0 bytes), so its sender
    learns that it was not delivered; the receiving application relies on that: a
    notification its sender was told failed must not show up anyway (a sender that
    retries would deliver it twice). It was filed in the inbox before the size was
    checked, and counted as received."""
    async with linked_pair(config()) as (p, d):
        meta = protocol.encode(protocol.NotifyReq(b"refused"))
        exc = await _send(d, "write", meta, [bytearray(16)])
        assert exc is not None and exc.status_code == CODE.LLM_PARAM_INVALID, exc
        assert p.get_notifications() == []
        assert p.statistics().notifications.received == 0


async def test_a_malformed_request_cannot_forge_or_flood_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each refusal of a peer's request is logged at WARNING on ``aiokv.remote`` with its
    reason (docs/observability.md), and the reason is sent back to the peer. A malformed
    request's reason quoted the peer's own text (an unknown request type) verbatim: a
    linked peer could write lines of its choosing into the operator's log (newlines,
    escape sequences) and make one 30-byte header plus 1 MiB of meta cost a 1 MiB log
    record. An operator relies on the log to say what happened, not what a peer says
    happened: the peer's text is made safe (control characters replaced) and bounded
    (the 512 bytes of a refusal reason)."""
    caplog.set_level(logging.WARNING, logger="aiokv.remote")
    async with linked_pair(config()) as (_, d):
        forged = "x\nCRITICAL aiokv: forged \x1b[2J" + "A" * (256 << 10)
        meta = msgspec.msgpack.encode([protocol.PROTOCOL, {"type": forged}])
        exc = await _send(d, "read", meta, [bytearray(16)])
        assert exc is not None and exc.status_code == CODE.LLM_PARAM_INVALID, exc
        assert "malformed request" in str(exc)
        refusals = [r.getMessage() for r in caplog.records if r.name == "aiokv.remote"]
        assert any("malformed request" in m for m in refusals), refusals
        for m in refusals:
            assert "\n" not in m and "\x1b" not in m, m[:200]
            assert len(m) < 2048, len(m)


@pytest.mark.parametrize("op", ["read", "write"])
async def test_a_request_of_the_wrong_size_is_refused_before_it_is_staged(
    monkeypatch: pytest.MonkeyPatch, op: str
) -> None:
    """A request names its payload's size in its frame; a grant of another size is
    refused (``LLM_PARAM_INVALID``). On device memory (host staging) the serving side
    gathered the whole region into staging (a read: up to 64 MiB copied device→host)
    or reserved staging room for it (a write) before that check, so a peer's ~100-byte
    request that asks for 1 byte cost a full staged copy and held staging room every
    other link waits for. An owner relies on peers' untrusted sizes being checked
    before any work proportional to them (docs/security.md, "Work per request is
    bounded before anything is built"). Host caches take the staged path here."""
    monkeypatch.setattr(_staging, "_STAGE_HOST", True)
    calls: list[str] = []
    real_gather, real_reserve = Stager.gather, Stager.reserve

    async def gather(self: Stager, *args: Any, **kw: Any) -> Any:
        calls.append("gather")
        return await real_gather(self, *args, **kw)

    async def reserve(self: Stager, *args: Any, **kw: Any) -> Any:
        calls.append("reserve")
        return await real_reserve(self, *args, **kw)

    monkeypatch.setattr(Stager, "gather", gather)
    monkeypatch.setattr(Stager, "reserve", reserve)
    n = 64 << 10
    async with linked_pair(config()) as (p, d):
        buf = torch.zeros(1, n, dtype=torch.uint8)
        desc = CacheDesc(1, [1, n], DataType.DT_UINT8, Placement.HOST)
        cache = await p.cache_manager.register_cache(desc, [buf], remote_accessible=True)
        meta = encode(SlotReq(KeyById(1, cache.cache_id, 0), Tensors(1), n, exact=True))
        exc = await _send(d, op, meta, [bytearray(1)])
        assert exc is not None and exc.status_code == CODE.LLM_PARAM_INVALID, exc
        assert calls == [], f"staged ({calls}) before the size was checked"
        stats = p.cache_manager.statistics()
        assert stats.pins == 0
        # the right size is still served
        exc = await _send(d, op, meta, [bytearray(n)])
        assert exc is None, exc


async def test_raw_address_refusals_have_the_codes_docs_security_states() -> None:
    """docs/security.md said every raw destination address (``TransferConfig``) outside
    remote-accessible memory is refused ``LLM_PARAM_INVALID``; memory that is registered
    but takes no pushes is refused ``LLM_FEATURE_NOT_ENABLED``, as a push into it is
    (the docs now say so). Nothing is written either way."""
    n = 4096
    async with linked_pair(config()) as (p, d):
        buf = torch.zeros(1, n, dtype=torch.uint8)
        desc = CacheDesc(1, [1, n], DataType.DT_UINT8, Placement.HOST)
        await p.cache_manager.register_cache(desc, [buf], remote_accessible=False)
        loose = torch.zeros(n, dtype=torch.uint8)
        sealed = protocol.AddrsReq([buf.data_ptr()], 64, 64)
        outside = protocol.AddrsReq([loose.data_ptr()], 64, 64)
        exc = await _send(d, "write", encode(sealed), [bytearray(b"\xab" * 64)])
        assert exc is not None and exc.status_code == CODE.LLM_FEATURE_NOT_ENABLED, exc
        exc = await _send(d, "write", encode(outside), [bytearray(b"\xab" * 64)])
        assert exc is not None and exc.status_code == CODE.LLM_PARAM_INVALID, exc
        assert not buf.any() and not loose.any()
