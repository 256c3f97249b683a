"""Notifications: small messages over an existing link, over every transport present
(and TCP with TLS): order, bounds, not-linked, the receive queue's bound, the async
iterator, polling, and the blocking API."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

import aiokv.sync as blocking
from aiokv import LLMConfig
from aiokv import LLMDataDist
from aiokv import LLMException
from aiokv import LLMRole
from aiokv import LLMStatusCode
from aiokv._bench._pki import TlsFiles
from aiokv._bench._pki import make_pki
from aiokv._remote import MAX_NOTIFICATION_BYTES
from aiokv._remote import NOTIFICATION_QUEUE
from aiokv._remote import _protocol as protocol
from aiokv.testing import cluster_info
from aiokv.testing import linked_pair
from aiokv.testing import make_config
from aiokv.testing import skip_unless_transport

CODE = LLMStatusCode
BACKENDS = ["local", "tcp", "tcp+tls", "nixl"]


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    """Throwaway TLS files (made once, outside any event loop: openssl blocks)."""
    return make_pki(tmp_path_factory.mktemp("pki")).leaves["a"]


def config(backend: str, **kw: Any) -> LLMConfig:
    """No pools, refusing pushes: notifications need neither."""
    if backend == "nixl":
        skip_unless_transport("nixl")
    options = {"enable_remote_cache_accessible": False, "sync_kv_timeout": 3000}
    return make_config(backend, pool=None, **(options | kw))


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> dict[str, Any]:
    """A transport's options: every transport present, and TCP with TLS."""
    if request.param == "tcp+tls":
        files: TlsFiles = request.getfixturevalue("tls")
        return {"transfer_backend": "tcp", **files.options()}
    return {"transfer_backend": request.param}


async def test_both_ways_in_order(backend: dict[str, Any]) -> None:
    opts = dict(backend)
    async with linked_pair(config(opts.pop("transfer_backend"), **opts)) as (p, d):
        payloads = [b"", b"x", bytes(range(256)) * 3, b"y" * MAX_NOTIFICATION_BYTES]
        for payload in payloads:
            await d.send_notification(1, payload)
        await p.send_notification(2, b"back")  # on the link D opened
        assert p.get_notifications() == [(2, x) for x in payloads]
        assert p.get_notifications() == []
        assert d.get_notifications() == [(1, b"back")]
        stats = p.statistics().notifications
        assert (stats.sent, stats.received, stats.refused, stats.queued) == (1, 4, 0, 0)
        assert d.statistics().notifications.sent == 4


async def test_async_iterator_waits_and_ends_at_finalize() -> None:
    async with linked_pair(config("tcp")) as (p, d):
        got: list[tuple[int, bytes]] = []
        five = asyncio.Event()

        async def take() -> None:
            async for item in p.notifications():
                got.append(item)
                if len(got) == 5:
                    five.set()

        taker = asyncio.create_task(take())
        await asyncio.sleep(0.05)  # the iterator waits on an empty queue
        assert not got
        for i in range(5):
            await d.send_notification(1, b"%d" % i)
        async with asyncio.timeout(10):
            await five.wait()
        assert got == [(2, b"%d" % i) for i in range(5)]
        await p.finalize()
        async with asyncio.timeout(10):
            await taker  # ended, without an error


async def test_iterator_cancelled_leaves_the_queue_intact() -> None:
    async with linked_pair(config("local")) as (p, d):
        it = p.notifications()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.1):
                await anext(it)
        await it.aclose()
        await d.send_notification(1, b"kept")
        assert p.get_notifications() == [(2, b"kept")]


async def test_bad_arguments_and_not_linked() -> None:
    async with linked_pair(config("tcp")) as (p, d):
        with pytest.raises(LLMException) as ei:
            await d.send_notification(1, b"z" * (MAX_NOTIFICATION_BYTES + 1))
        assert ei.value.status_code == CODE.LLM_PARAM_INVALID
        with pytest.raises(LLMException) as ei:
            await d.send_notification(77, b"nobody")
        assert ei.value.status_code == CODE.LLM_NOT_YET_LINK
        with pytest.raises(TypeError):
            await d.send_notification(1, "text")  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            await d.send_notification(-1, b"")
        assert p.get_notifications() == []
        assert p.statistics().notifications.received == 0


async def test_unlinked_after_unlink() -> None:
    async with linked_pair(config("tcp")) as (p, d):
        await d.unlink_clusters([cluster_info(1, p.listen_address)])
        with pytest.raises(LLMException) as ei:
            await d.send_notification(1, b"late")
        assert ei.value.status_code == CODE.LLM_NOT_YET_LINK


async def test_queue_bound_refuses_and_counts() -> None:
    async with linked_pair(config("local")) as (p, d):
        for i in range(NOTIFICATION_QUEUE):
            await d.send_notification(1, i.to_bytes(4, "little"))
        with pytest.raises(LLMException) as ei:
            await d.send_notification(1, b"one too many")
        assert ei.value.status_code == CODE.LLM_LINK_BUSY
        stats = p.statistics().notifications
        assert (stats.received, stats.refused, stats.queued) == (NOTIFICATION_QUEUE, 1, 1024)
        got = p.get_notifications()
        assert [int.from_bytes(x, "little") for _, x in got] == list(range(NOTIFICATION_QUEUE))
        await d.send_notification(1, b"room again")  # taken: room again
        assert p.get_notifications() == [(2, b"room again")]


async def _refused_as_invalid(d: LLMDataDist, op: str, meta: bytes) -> None:
    """``meta``, sent as a ``op`` (``"read"`` or ``"write"``) on ``d``'s link to cluster 1
    from ``d``'s engine, is refused with ``LLM_PARAM_INVALID``."""
    link = d._links.require("test", 1)

    async def send() -> None:
        method = link.read if op == "read" else link.write
        await method(meta, [], timeout=3)

    assert d._engine is not None
    with pytest.raises(LLMException) as ei:
        await d._engine.run(send)
    assert ei.value.status_code == CODE.LLM_PARAM_INVALID


async def test_remote_payload_over_the_bound_is_refused() -> None:
    # a peer that encodes a bigger payload itself: the decoder refuses it before filing
    async with linked_pair(config("tcp")) as (p, d):
        big = protocol._encoder.encode(
            protocol._Envelope(1, protocol.NotifyReq(b"q" * (MAX_NOTIFICATION_BYTES + 1)))
        )
        await _refused_as_invalid(d, "write", big)
        assert p.get_notifications() == []


async def test_a_read_is_not_a_notification() -> None:
    async with linked_pair(config("tcp")) as (p, d):
        meta = protocol.encode(protocol.NotifyReq(b"as a read"))
        await _refused_as_invalid(d, "read", meta)
        assert p.get_notifications() == []


async def test_authenticated_like_the_link() -> None:
    async with linked_pair(config("tcp", link_secret="s3cret")) as (p, d):
        await d.send_notification(1, b"signed")
        assert p.get_notifications() == [(2, b"signed")]


def test_blocking_api() -> None:
    cfg = config("tcp")
    with (
        blocking.LLMDataDist(LLMRole.PROMPT, 1, cfg) as p,
        blocking.LLMDataDist(LLMRole.DECODER, 2, cfg) as d,
    ):
        code, _ = d.link_clusters([cluster_info(1, p.listen_address)])
        assert code == CODE.LLM_SUCCESS
        got: list[tuple[int, bytes]] = []

        def take() -> None:
            for item in p.notifications():
                got.append(item)

        taker = threading.Thread(target=take)
        taker.start()
        d.send_notification(1, b"a")
        d.send_notification(1, b"b")
        with pytest.raises(LLMException) as ei:
            d.send_notification(9, b"c")
        assert ei.value.status_code == CODE.LLM_NOT_YET_LINK
        p.send_notification(2, b"polled")
        assert d.get_notifications() == [(1, b"polled")]
        # those still waiting at finalize are dropped (documented): let the taker have them
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        p.finalize()
        taker.join(10)
        assert not taker.is_alive()
        assert got == [(2, b"a"), (2, b"b")]


async def test_prometheus_exports_the_counters() -> None:
    pytest.importorskip("prometheus_client")
    from aiokv.metrics import Collector

    async with linked_pair(config("local")) as (p, d):
        await d.send_notification(1, b"a")
        await d.send_notification(1, b"b")
        samples = {
            (s.name, s.labels.get("state")): s.value
            for fam in Collector(p, d).collect()
            for s in fam.samples
            if s.labels.get("cluster") == "1" and s.name.startswith("aiokv_notifications")
        }
        assert samples[("aiokv_notifications_total", "received")] == 2
        assert samples[("aiokv_notifications_total", "refused")] == 0
        assert samples[("aiokv_notifications_queued", None)] == 2


def test_under_trio() -> None:
    import anyio

    async def main() -> list[tuple[int, bytes]]:
        async with (
            LLMDataDist(LLMRole.PROMPT, 1, config("tcp")) as p,
            LLMDataDist(LLMRole.DECODER, 2, config("tcp")) as d,
        ):
            code, _ = await d.link_clusters([cluster_info(1, p.listen_address)])
            assert code == CODE.LLM_SUCCESS
            got: list[tuple[int, bytes]] = []
            async with anyio.create_task_group() as tg:

                async def take() -> None:
                    async for item in p.notifications():
                        got.append(item)
                        if len(got) == 2:
                            tg.cancel_scope.cancel()

                tg.start_soon(take)
                await d.send_notification(1, b"one")
                await d.send_notification(1, b"two")
            await d.send_notification(1, b"three")  # the cancelled iterator lost nothing
            return [*got, *p.get_notifications()]

    assert anyio.run(main, backend="trio") == [(2, b"one"), (2, b"two"), (2, b"three")]


async def test_inbox_waiting_takes_nothing() -> None:
    # the iterators take a notification on the caller's side, after the engine-side
    # wait: a wait cancelled at any point (even as a notification arrives) loses none
    from aiokv._remote import Inbox

    inbox = Inbox(capacity=2)
    assert not inbox.put(1, b"closed")  # refused before open()
    inbox.open()
    waiter = asyncio.ensure_future(inbox.wait())
    await asyncio.sleep(0)
    assert inbox.put(1, b"x") and inbox.put(1, b"y") and not inbox.put(1, b"full")
    assert await waiter is True
    waiter = asyncio.ensure_future(inbox.wait())
    await asyncio.sleep(0)
    waiter.cancel()
    assert inbox.pop() == (1, b"x")
    assert inbox.drain() == [(1, b"y")]
    assert inbox.pop() is None
    stats = inbox.statistics()
    assert (stats.received, stats.refused, stats.queued) == (2, 2, 0)
    closer = asyncio.ensure_future(inbox.wait())
    await asyncio.sleep(0)
    inbox.close()
    assert await closer is False
