"""aiokv.sync from threads that run loops, outlive the main thread, or are another
engine's; and an interrupt during a cancellation still waits for the operation's end.
"""

from __future__ import annotations

import asyncio
import contextlib
import textwrap
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _helpers import run_code
from _helpers import slow_to_cancel

import aiokv.sync
from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import DataType
from aiokv import LLMRole
from aiokv import LLMStatusCode
from aiokv import Placement
from aiokv import TransferWithCacheKeyConfig
from aiokv._engine import Engine
from aiokv._engine import _Call
from aiokv.testing import cluster_info
from aiokv.testing import make_config

CODE = LLMStatusCode
DESC = CacheDesc(4, [8, 256], DataType.DT_UINT8, Placement.HOST)  # 2 layers
KEY = BlocksCacheKey(2, 0)


def _config(**kw: Any) -> Any:
    return make_config(pool=None, host_pool=4 << 20, **({"sync_kv_timeout": 3000} | kw))


@contextlib.contextmanager
def _linked() -> Iterator[tuple[aiokv.sync.LLMDataDist, aiokv.sync.LLMDataDist]]:
    """A blocking prompt (cluster 1) and decoder (cluster 2) linked, the decoder holding
    a blocks cache of ``DESC`` under ``KEY``; both finalized on exit."""
    with (
        aiokv.sync.LLMDataDist(LLMRole.PROMPT, 1, _config()) as p,
        aiokv.sync.LLMDataDist(LLMRole.DECODER, 2, _config()) as d,
    ):
        code, _ = d.link_clusters([cluster_info(1, p.listen_address)])
        assert code == CODE.LLM_SUCCESS
        d.cache_manager.allocate_blocks_cache(DESC, KEY)
        yield p, d


def test_blocking_async_synchronizer_from_a_thread_running_a_loop_does_not_deadlock() -> None:
    """``aiokv.sync``'s contract: an ``async def`` layer synchronizer runs on the engine
    loop (there is no caller loop). A blocking caller whose thread also runs an asyncio
    loop (a Jupyter cell, a sync helper called from a coroutine) relies on
    ``task.synchronize()`` completing: the synchronizer must not be sent to the caller's
    loop, which ``synchronize`` itself blocks."""
    ran: list[int] = []

    class Async:
        async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
            await asyncio.sleep(0)
            ran.append(layer_index)
            return True

    async def main() -> tuple[Any, Any]:
        with _linked() as (p, _):
            src = p.cache_manager.allocate_blocks_cache(DESC)
            for t in src.tensors:
                t.copy_(torch.full_like(t, 7))
            task = p.cache_manager.transfer_cache_async(
                src, Async(), [TransferWithCacheKeyConfig(KEY)]
            )
            # bounded: a deadlock shows as LLM_TIMEOUT, not as a hang
            got = task.synchronize(5000)
            if not task.done():
                task.cancel()
                await asyncio.sleep(0.1)  # let the caller's loop run the synchronizer out
                task.synchronize(5000)
            return got, task.get_results()

    got, results = asyncio.run(main())
    assert got == CODE.LLM_SUCCESS, (got, results)
    assert ran == [0, 1]


def test_blocking_copies_from_a_thread_that_outlives_the_main_thread() -> None:
    """A plain non-daemon thread keeps the program alive after the main thread returns
    (Python waits for it): an ``aiokv.sync`` worker thread relies on its copies still
    working then, not on the copy workers being stopped as the main thread ends."""
    script = textwrap.dedent(
        """
        import threading, time
        import aiokv.sync as llm_datadist
        from aiokv import CacheDesc, DataType, LLMRole, Placement
        from aiokv.testing import make_config
        desc = CacheDesc(4, [64, 65536], DataType.DT_UINT8, Placement.HOST)
        dd = llm_datadist.LLMDataDist(LLMRole.PROMPT, 1)
        dd.init(make_config(pool=None, host_pool=64 << 20))
        src = dd.cache_manager.allocate_blocks_cache(desc)
        src.tensors[0][0].fill_(7)
        dd.cache_manager.copy_blocks(src, {1: [2]})  # the copy workers are started

        def work():
            threading.main_thread().join(30)  # the main thread has returned ...
            time.sleep(0.5)  # ... and the interpreter's exit hooks have run
            for i in range(4):
                dd.cache_manager.copy_blocks(src, {0: [32 + i]})
            assert all(int(src.tensors[0][32 + i].min()) == 7 for i in range(4))
            print("worker copies OK", flush=True)

        threading.Thread(target=work, name="user-worker").start()
        """
    )
    out = run_code(script, timeout=120)
    assert "worker copies OK" in out.stdout, out.stderr[-3000:]


def test_a_blocking_call_from_any_engine_thread_is_refused_at_once() -> None:
    """``aiokv.sync``: "none [no blocking call] may be made from inside an async
    synchronizer (it runs on the engine loop ...): ``RuntimeError``". A user relies on
    that error also when the call is on ANOTHER instance: blocking this engine's loop
    on it stalls every peer this engine serves (here the very pull it waits for, which
    then fails only after ``sync_kv_timeout``)."""
    seen: list[BaseException | None] = []

    with _linked() as (p, d):
        held = p.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(1, 0))
        assert held.num_blocks == 8
        into = d.cache_manager.allocate_blocks_cache(DESC)
        src = p.cache_manager.allocate_blocks_cache(DESC)

        class PullsFromTheEngineLoop:
            async def synchronize_layer(
                self, layer_index: int, timeout_in_millis: int | None
            ) -> bool:
                try:  # on p's engine loop: a blocking call on d, which pulls from p
                    d.cache_manager.pull_blocks(BlocksCacheKey(1, 0), into, [0], [0])
                except BaseException as exc:
                    seen.append(exc)
                else:
                    seen.append(None)
                return True

        task = p.cache_manager.transfer_cache_async(
            src, PullsFromTheEngineLoop(), [TransferWithCacheKeyConfig(KEY)]
        )
        assert task.synchronize(30000) == CODE.LLM_SUCCESS
    assert len(seen) == 2
    assert all(isinstance(e, RuntimeError) and "engine thread" in str(e) for e in seen), seen


def test_a_second_interrupt_inside_the_cancel_still_waits_for_the_operations_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs/cancellation.md: an interrupted blocking call "cancels the operation, waits
    for its end (however often interrupted again meanwhile)". A user pressing Ctrl-C
    twice relies on that also when the second lands while the cancellation is being
    sent: the call must not return while the operation still runs (bytes could land
    after it)."""
    engine = Engine("aiokv-test-interrupt-in-cancel")
    started = threading.Event()
    ran: list[str] = []

    async def op() -> None:
        await slow_to_cancel(ran, started)

    real_cancel = _Call.cancel

    second = [True]

    def interrupted_cancel(self: _Call[Any]) -> None:
        real_cancel(self)
        if second.pop() if second else False:
            raise KeyboardInterrupt  # the second Ctrl-C, landing as the cancel is sent

    def interrupted_submit(call: _Call[Any], engine_: Engine) -> None:
        real_submit(call, engine_)
        assert started.wait(10)
        raise KeyboardInterrupt  # the first Ctrl-C, once the operation runs

    real_submit = _Call.submit
    monkeypatch.setattr(_Call, "cancel", interrupted_cancel)
    monkeypatch.setattr(_Call, "submit", interrupted_submit)
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.call(op)
        returned_with = list(ran)
    finally:
        monkeypatch.undo()
        engine.stop()
    assert returned_with == ["started", "ended"], "the call returned while the operation ran"
