"""How a layer-wise transfer reports failures: the first failure of a destination is
the one it reports, and a synchronizer that raises anything (``SystemExit`` too) fails
its destinations without harming the instance."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import aiokv
from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import DataType
from aiokv import LLMStatusCode
from aiokv import Placement
from aiokv import TransferWithCacheKeyConfig
from aiokv.testing import linked_pair
from aiokv.testing import make_config

CODE = LLMStatusCode
BLOCKS = 8
DESC = CacheDesc(6, [BLOCKS, 256], DataType.DT_UINT8, Placement.HOST)  # 3 layers
KEY = BlocksCacheKey(2, 0)


def config(**kw: Any) -> aiokv.LLMConfig:
    return make_config(pool=None, host_pool=4 << 20, **({"sync_kv_timeout": 3000} | kw))


class Gate:
    """def synchronizer: layer 0 True at once; layer 1 waits for ``release`` then
    returns ``answer``; others True."""

    def __init__(self, answer: Any = False) -> None:
        self.release = threading.Event()
        self.asked1 = threading.Event()
        self.answer = answer

    def synchronize_layer(self, layer: int, timeout_ms: int | None) -> Any:
        if layer == 1:
            self.asked1.set()
            self.release.wait(10)
            return self.answer
        return True


async def test_a_destinations_first_failure_is_the_one_reported() -> None:
    """Layer 0's send fails (no such key on the peer) while layer 1's synchronizer is
    still deciding; its later ``False`` does not replace that first failure."""
    async with linked_pair(config(), config()) as (p, d):
        await d.cache_manager.allocate_blocks_cache(DESC, KEY)
        src = await p.cache_manager.allocate_blocks_cache(DESC)
        gate = Gate(False)
        gone = TransferWithCacheKeyConfig(BlocksCacheKey(2, 7))  # no such key on the peer
        task = p.cache_manager.transfer_cache_async(src, gate, [gone])
        assert await asyncio.to_thread(gate.asked1.wait, 5)
        # wait until the send of layer 0 has failed and been recorded
        for _ in range(500):
            if task.errors()[0] is not None:
                break
            await asyncio.sleep(0.01)
        first = task.errors()[0]
        assert first is not None and first.startswith("layers 0-0")
        gate.release.set()
        results = await task.get_results()
        assert task.errors()[0] == first, "first failure overwritten"
        assert results[0] != CODE.LLM_PARAM_INVALID


async def test_a_synchronizer_raising_system_exit_fails_its_destinations_only() -> None:
    """A ``def`` synchronizer's ``SystemExit`` (``sys.exit()`` on its thread) fails the
    transfer's destinations (``LLM_FAILED``); re-raised on the engine loop it stopped the
    engine, and every later operation of the instance failed."""
    async with linked_pair(config(), config()) as (p, d):
        await d.cache_manager.allocate_blocks_cache(DESC, KEY)
        src = await p.cache_manager.allocate_blocks_cache(DESC)

        class Exits:
            def synchronize_layer(self, layer: int, timeout_ms: int | None) -> bool:
                raise SystemExit(3)

        task = p.cache_manager.transfer_cache_async(src, Exits(), [TransferWithCacheKeyConfig(KEY)])
        assert await asyncio.wait_for(task.get_results(), 5) == [CODE.LLM_FAILED]
        errors = task.errors()
        assert errors[0] is not None and "raised SystemExit" in errors[0]
        assert p._engine.thread.is_alive()  # type: ignore[attr-defined]
        await asyncio.wait_for(p.check_link_status(2), 5)  # raises if the engine stopped
