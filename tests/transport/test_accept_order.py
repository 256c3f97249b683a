"""A link the connecting side sees accepted is already registered on the accepting side.

The accepting side's last handshake frame goes out as the new link's first frame, after
the link is registered: so a ``link_clusters`` that returned can be followed at once by
an operation of the *other* side over that link (a prefill pushing to the decoder that
linked to it). Before, the frame went out first and the registration followed, and an
engine thread that lagged made such a push fail with "not linked".
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from aiokv import LLMConfig
from aiokv import LLMDataDist
from aiokv import LLMRole
from aiokv.testing import cluster_info
from aiokv.transport.tcp import _transport


def config() -> LLMConfig:
    return LLMConfig(listen_ip_info="127.0.0.1:0", enable_cache_manager=True)


@pytest.fixture
def slow_acceptor(monkeypatch: pytest.MonkeyPatch) -> None:
    """The accepting side lags between its handshake and registering the link."""
    real = _transport.server_handshake

    async def lagging(*args: Any, **kwargs: Any) -> int:
        peer = await real(*args, **kwargs)
        await asyncio.sleep(0.3)
        return peer

    monkeypatch.setattr(_transport, "server_handshake", lagging)


@pytest.mark.usefixtures("slow_acceptor")
async def test_a_returned_link_is_registered_on_the_accepting_side() -> None:
    async with (
        LLMDataDist(LLMRole.PROMPT, 1, config()) as prefill,
        LLMDataDist(LLMRole.DECODER, 2, config()) as decode,
    ):
        peer = cluster_info(1, prefill.listen_address)
        code, _ = await decode.link_clusters([peer], timeout=10_000)
        assert code.name == "LLM_SUCCESS"
        assert 2 in prefill.linked_clusters()  # at once: no wait, no retry
        await prefill.send_notification(2, b"over the accepted link")
        assert await asyncio.wait_for(_next(decode), 5) == (1, b"over the accepted link")


async def _next(dd: LLMDataDist) -> tuple[int, bytes]:
    async for item in dd.notifications():
        return item
    raise AssertionError("notifications ended")
