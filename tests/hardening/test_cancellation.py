"""A cancelled operation either did not happen or returns its result.

``pull_cache`` by ``CacheKey`` releases the key on its owner once the bytes landed (and
frees a cache only the key held). A caller cancelled at any moment must find the key
still bound if the pull raised its cancellation, and released if it returned: never a
pull reported as cancelled whose key (and KV) is gone. Seeded random cancellation over
thousands of pulls, counted against that model together with pool bytes and pins.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
import threading
import time
from collections.abc import Callable
from collections.abc import Coroutine
from collections.abc import Iterator
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import anyio
import pytest
import torch
from _helpers import cancel_after

from aiokv import BlocksCacheKey
from aiokv import Cache
from aiokv import CacheDesc
from aiokv import CacheKey
from aiokv import DataType
from aiokv import LLMConfig
from aiokv import LLMDataDist
from aiokv import LLMException
from aiokv import LLMRole
from aiokv import LLMStatusCode
from aiokv import Placement
from aiokv import TransferWithCacheKeyConfig
from aiokv._copy import _staging
from aiokv._engine import Engine
from aiokv.testing import linked_pair
from aiokv.testing import make_config

CODE = LLMStatusCode
DESC = CacheDesc(2, [1, 4096], DataType.DT_UINT8, Placement.HOST)
WIDE = CacheDesc(2, [10, 4096], DataType.DT_UINT8, Placement.HOST)  # a slot per pull
CHUNKS = CacheDesc(2, [40, 1024], DataType.DT_UINT8, Placement.HOST)  # 4 blocks per pull
SEED = 20261125


def config(backend: str, **kw: Any) -> LLMConfig:
    """No device pool, a 4 MiB host pool; refuses pushes."""
    options = {"enable_remote_cache_accessible": False, "sync_kv_timeout": 10000}
    return make_config(backend, pool=None, host_pool=4 << 20, **(options | kw))


async def settled(p: LLMDataDist, d: LLMDataDist) -> None:
    """One refused round trip: the owner has handled every earlier frame of the link
    (read confirmations and cancellations included); then its grants still finishing
    (a staging copy a cancellation waits for) end: its keys and pins are final."""
    probe = Cache.create_cpu_cache(
        CacheDesc(1, [1, 64], DataType.DT_UINT8, Placement.HOST),
        [torch.zeros(1, 64, dtype=torch.uint8)],
    )
    with pytest.raises(LLMException) as ei:
        await d.cache_manager.pull_blocks(BlocksCacheKey(1, 2**63), probe, [0], [0])
    assert ei.value.status_code == CODE.LLM_KV_CACHE_NOT_EXIST
    end = time.monotonic() + 10
    while p.cache_manager.statistics().pins:
        assert time.monotonic() < end, "the owner's grants never ended"
        await anyio.sleep(0.001)


@dataclass
class Model:
    """What happened to each pull, and what that leaves on both sides."""

    returned: int = 0
    cancelled: int = 0
    lost: list[int] = field(default_factory=list)  # cancelled, yet the key was released
    kept: list[int] = field(default_factory=list)  # returned, yet the key is still bound

    def check(self, i: int, p: LLMDataDist, key: CacheKey, pulled: bool) -> None:
        bound = p.cache_manager._registry.by_key(key) is not None  # type: ignore[attr-defined]
        if pulled:
            self.returned += 1
            if bound:
                self.kept.append(i)
        else:
            self.cancelled += 1
            if not bound:
                self.lost.append(i)


def _balanced(p: LLMDataDist, d: LLMDataDist, dst_bytes: int, dsts: int = 1) -> None:
    """Once what cancelled pulls left bound is released: nothing is held on the owner,
    only the destination on the decoder, and no operation pins anything."""
    ps, ds = p.cache_manager.statistics(), d.cache_manager.statistics()
    assert (ps.caches, ps.keys, ps.pins) == (0, 0, 0), ps
    assert (ds.caches, ds.pins) == (dsts, 0), ds
    pool_p = p.cache_manager.get_pool_stats(Placement.HOST)
    pool_d = d.cache_manager.get_pool_stats(Placement.HOST)
    assert pool_p is not None and pool_p.used == 0
    assert pool_d is not None and pool_d.used == dst_bytes


async def _typical(p: LLMDataDist, d: LLMDataDist, dst: Cache, batch: int) -> float:
    """Median seconds of an uncancelled pull by key, ``batch`` at a time (as the test
    runs them), to aim cancellations around it."""
    took: list[float] = []

    async def timed(key: CacheKey, slot: int) -> None:
        t0 = time.perf_counter()
        await d.cache_manager.pull_cache(key, dst, slot)
        took.append(time.perf_counter() - t0)

    for r in range(4):
        keys = [CacheKey(1, req_id=10**9 + batch * r + j) for j in range(batch)]
        for key in keys:
            src = await p.cache_manager.allocate_cache(DESC, [key])
            await p.cache_manager.deallocate_cache(src)
        async with anyio.create_task_group() as tg:  # asyncio or trio
            for j, k in enumerate(keys):
                tg.start_soon(timed, k, j)
    return statistics.median(took)


async def _pull_cancelled(
    d: LLMDataDist,
    key: CacheKey,
    dst: Cache,
    slot: int,
    rng: random.Random,
    typical: float,
    blocks: Cache | None = None,
) -> bool:
    """Pull ``key`` into ``slot`` of ``dst`` (or, half the time when ``blocks`` is
    given, into blocks ``4 * slot ...`` of that blocks cache, by ``pull_blocks``),
    cancelled (``Task.cancel`` or an ``asyncio.timeout``) after a random number of loop
    turns or a random delay around a pull's duration: whether the pull returned. A
    timeout that expired raises ``TimeoutError``, also where the pull returned (at the
    block's next await)."""
    delay = rng.uniform(0, 1.5 * typical)
    turns = rng.randrange(40) if rng.random() < 0.5 else None
    pulled = False
    chunks = [4 * slot + i for i in range(4)]
    by_blocks = blocks is not None and rng.random() < 0.5

    def op() -> Coroutine[Any, Any, None]:
        if by_blocks:
            assert blocks is not None
            return d.cache_manager.pull_blocks(key, blocks, dst_blocks=chunks)
        return d.cache_manager.pull_cache(key, dst, slot)

    if rng.random() < 0.5:
        task = await cancel_after(op(), turns or 0, delay if turns is None else 0.0)
        return not task.cancelled()
    timed_out = False
    try:
        async with asyncio.timeout(delay) as cm:
            await op()
            pulled = True
            await asyncio.sleep(0)  # where a late cancellation must arrive
    except TimeoutError:
        timed_out = True
    if cm.expired():
        assert timed_out, f"{key}: the timeout expired and raised nothing"
    return pulled


@pytest.mark.parametrize(
    ("backend", "loop", "staged"),
    [("tcp", "asyncio", False), ("local", "uvloop", False), ("tcp", "asyncio", True)],
)
def test_a_pull_by_key_cancelled_at_random_moments_keeps_or_releases_the_key(
    backend: str, loop: str, staged: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1,000 pulls by ``CacheKey`` per case (``pull_cache``, or ``pull_blocks`` of the
    slot's chunks), 10 at a time, each cancelled at a random moment: a pull that raised
    leaves the key bound, one that returned released it; pools, keys and pins balance
    after each round. An ``asyncio.timeout`` that expired
    still raises ``TimeoutError``. ``staged``: the caches move through host staging as
    device memory does (the pulled bytes are copied into the cache after the owner was
    told they arrived). Run without asyncio's debug mode, which slows every step
    six-fold: this test is about timing, not slow callbacks."""
    if staged:
        monkeypatch.setattr(_staging, "_STAGE_HOST", True)
    rng = random.Random(SEED + staged)
    model = Model()

    async def main() -> None:
        async with linked_pair(config(backend)) as (p, d):
            dst = await d.cache_manager.allocate_cache(WIDE)
            blocks = await d.cache_manager.allocate_blocks_cache(CHUNKS)
            dst_bytes = d.cache_manager.get_pool_stats(Placement.HOST).used  # type: ignore[union-attr]
            typical = await _typical(p, d, dst, 10)
            for round_ in range(100):
                keys = [CacheKey(1, req_id=10 * round_ + j) for j in range(10)]
                for key in keys:
                    src = await p.cache_manager.allocate_cache(DESC, [key])
                    await p.cache_manager.deallocate_cache(src)  # the key alone holds it now
                outcomes = await asyncio.gather(
                    *(
                        _pull_cancelled(d, k, dst, j, rng, typical, blocks)
                        for j, k in enumerate(keys)
                    )
                )
                await settled(p, d)
                for key, pulled in zip(keys, outcomes, strict=True):
                    model.check(key.req_id, p, key, pulled)
                    await p.cache_manager.remove_cache_key(key)
                _balanced(p, d, dst_bytes, 2)

    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        with asyncio.Runner(loop_factory=uvloop.new_event_loop, debug=False) as runner:
            runner.run(main())
    else:
        asyncio.run(main(), debug=False)
    assert not model.lost, f"{len(model.lost)} cancelled pulls released their key: {model.lost}"
    assert not model.kept, f"{len(model.kept)} pulls returned, key still bound: {model.kept}"
    # both outcomes were exercised often (else the test proves nothing)
    assert model.returned > 20 and model.cancelled > 20, model


def test_a_pull_by_key_under_trio_cancel_scopes_keeps_or_releases_the_key() -> None:
    """The same model under trio: ``anyio.move_on_after`` at random deadlines."""
    rng = random.Random(SEED + 1)
    model = Model()

    async def main() -> None:
        async with linked_pair(config("tcp")) as (p, d):
            dst = await d.cache_manager.allocate_cache(DESC)
            dst_bytes = d.cache_manager.get_pool_stats(Placement.HOST).used  # type: ignore[union-attr]
            typical = await _typical(p, d, dst, 1)
            for i in range(400):
                key = CacheKey(1, req_id=i)
                src = await p.cache_manager.allocate_cache(DESC, [key])
                await p.cache_manager.deallocate_cache(src)
                pulled = False
                with anyio.move_on_after(rng.uniform(0, 2 * typical)):
                    await d.cache_manager.pull_cache(key, dst)
                    pulled = True
                    await anyio.lowlevel.checkpoint()
                await settled(p, d)
                model.check(i, p, key, pulled)
                await p.cache_manager.remove_cache_key(key)
                _balanced(p, d, dst_bytes)

    anyio.run(main, backend="trio")
    assert not model.lost, f"{len(model.lost)} cancelled pulls released their key: {model.lost}"
    assert not model.kept, f"{len(model.kept)} pulls returned, key still bound: {model.kept}"
    assert model.returned > 8 and model.cancelled > 8, model


# -------------------------------------------- the engine: the race, made deterministic


@pytest.fixture
def engine() -> Iterator[Engine]:
    e = Engine("aiokv-engine-cancel-test")
    yield e
    e.stop()


_DONE: dict[int, threading.Event] = {}


def _finishing(go: threading.Event) -> Callable[[], Coroutine[Any, Any, int]]:
    """An engine operation that completes (with 5) once ``go`` is set; ``_landed(go)``
    blocks until it has."""
    done = _DONE.setdefault(id(go), threading.Event())

    async def op() -> int:
        await asyncio.to_thread(go.wait, 10)
        done.set()
        return 5  # the engine reports the end right after, in this same step

    return op


def _finishing_op() -> tuple[threading.Event, Callable[[], Coroutine[Any, Any, int]], list[object]]:
    """A fresh ``_finishing`` operation: its ``go`` event, the operation, and a list for
    what the test's body saw."""
    go = threading.Event()
    return go, _finishing(go), []


def _landed(go: threading.Event) -> None:
    """Set ``go`` and block (this thread, and so its loop) until the operation has
    completed on the engine and its end is queued for the caller."""
    go.set()
    assert _DONE.pop(id(go)).wait(10)
    time.sleep(0.1)  # the rest of the engine's step: the end is queued for the caller


async def _race(
    engine: Engine, body: Callable[[], Coroutine[Any, Any, None]]
) -> asyncio.Task[None]:
    """Start ``body`` (which awaits an operation on ``engine``) and let it reach that
    await. The test then blocks this loop while the engine completes the operation, so
    that its end and a cancellation reach the caller in the same loop turn."""
    task = asyncio.create_task(body())
    for _ in range(5):
        await asyncio.sleep(0.01)
    return task


async def test_a_timeout_that_expires_as_the_operation_completes_returns_then_raises(
    engine: Engine,
) -> None:
    go, op, got = _finishing_op()

    async def body() -> None:
        async with asyncio.timeout(0.1):
            got.append(await engine.run(op))
            await asyncio.sleep(0)  # the expired timeout's cancellation arrives here
            got.append("not cancelled")

    task = await _race(engine, body)
    _landed(go)  # the engine completes; the timeout falls due meanwhile
    with pytest.raises(TimeoutError):
        await task
    assert got == [5]


async def test_a_completed_last_operation_ends_its_timeout_block_normally(engine: Engine) -> None:
    """The operation was the block's last await: the block ends normally with its
    result, and no stale cancellation reaches the code after it."""
    go, op, got = _finishing_op()

    async def body() -> None:
        async with asyncio.timeout(0.1):
            got.append(await engine.run(op))
        await asyncio.sleep(0.01)
        await asyncio.sleep(0)
        got.append("after")

    task = await _race(engine, body)
    _landed(go)
    await task
    assert got == [5, "after"]
    assert task.cancelling() == 0


async def test_a_task_cancelled_as_its_operation_completes_gets_the_result_then_the_cancel(
    engine: Engine,
) -> None:
    go, op, got = _finishing_op()

    async def body() -> None:
        got.append(await engine.run(op))
        await asyncio.sleep(10)  # the cancellation arrives at this next await
        got.append("not cancelled")

    task = await _race(engine, body)
    _landed(go)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert got == [5]


async def test_an_anyio_scope_on_asyncio_swallows_only_its_own_cancellation(
    engine: Engine,
) -> None:
    go, op, got = _finishing_op()

    async def body() -> None:
        with anyio.move_on_after(0.1) as scope:
            got.append(await engine.run(op))
            await anyio.sleep(10)
            got.append("not cancelled")
        got.append(scope.cancelled_caught)

    task = await _race(engine, body)
    _landed(go)
    await task  # the scope's cancellation, not the task's
    assert got == [5, True]


def test_a_trio_scope_cancelled_as_the_operation_completes_gets_the_result(engine: Engine) -> None:
    go, op, got = _finishing_op()

    async def main() -> None:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:

                async def complete_then_cancel() -> None:
                    await anyio.sleep(0.05)  # the operation is under way, its caller waits
                    _landed(go)  # the engine completes meanwhile
                    scope.cancel()  # before trio saw that end

                tg.start_soon(complete_then_cancel)
                got.append(await engine.run(op))
                await anyio.sleep(10)
                got.append("not cancelled")
        got.append(scope.cancelled_caught)

    anyio.run(main, backend="trio")
    assert got == [5, True]


# ------------------------------------------------ a layer-wise transfer cancelled late


class _Layers:
    """A synchronizer that releases layer 0 and never layer 1."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        self.asked.append(layer_index)
        if layer_index:
            await asyncio.Event().wait()
        return True


def test_a_destination_that_completed_reports_success_after_cancel() -> None:
    """Destination 0 needs layer 0 only, destination 1 layers 0 and 1; layer 1 never
    comes, so the task is cancelled: destination 0, whose layer landed before, reports
    ``LLM_SUCCESS`` (not ``None``, "cut short"); destination 1 reports ``None``."""
    asyncio.run(_completed_destination(), debug=False)  # timing, not slow callbacks


async def _completed_destination() -> None:
    paged = CacheDesc(4, [8, 256], DataType.DT_UINT8, Placement.HOST)
    cfg = {"enable_remote_cache_accessible": True}
    async with linked_pair(config("tcp", **cfg)) as (p, d):
        src = await p.cache_manager.allocate_blocks_cache(paged)
        for i, t in enumerate(src.tensors):
            t.fill_(i + 1)
        a = await d.cache_manager.allocate_blocks_cache(paged, BlocksCacheKey(2, 0))
        await d.cache_manager.allocate_blocks_cache(paged, BlocksCacheKey(2, 1))
        sync = _Layers()
        task = p.cache_manager.transfer_cache_async(
            src,
            sync,
            [
                TransferWithCacheKeyConfig(BlocksCacheKey(2, 0), range(0, 1), range(0, 1)),
                TransferWithCacheKeyConfig(BlocksCacheKey(2, 1), range(0, 2), range(0, 2)),
            ],
            [3],
            [5],
        )
        end = time.monotonic() + 5
        while task._results[0] is None and time.monotonic() < end:  # type: ignore[attr-defined]  # noqa: ASYNC110
            await asyncio.sleep(0.005)
        task.cancel()
        assert await task.get_results() == [CODE.LLM_SUCCESS, None]
        assert all(bool((a.tensors[t][5] == t + 1).all()) for t in (0, 1))


# ------------------------------------------------------ switch_role cancelled midway


def test_a_cancelled_switch_role_leaves_one_listener_the_one_it_reports() -> None:
    """``switch_role`` to a new address opens the new listener, then closes the old one.
    Cancelled at random moments, it is never left half done: exactly one listener is
    open, and it is the one ``listen_address`` reports (it completes, cancelled or not:
    a bind and a close)."""
    rng = random.Random(SEED + 2)
    cancelled_while_running = 0

    async def main() -> None:
        nonlocal cancelled_while_running
        async with LLMDataDist(LLMRole.PROMPT, 1, config("tcp")) as p:
            listeners: dict[Any, Any] = p._transport._listeners  # type: ignore[union-attr]
            opts = {"llm.listenIpInfo": "127.0.0.1:0"}
            took = []
            for _ in range(10):
                t0 = time.perf_counter()
                await p.switch_role(LLMRole.PROMPT, opts)
                took.append(time.perf_counter() - t0)
            typical = statistics.median(took)
            for _ in range(300):
                before = p.listen_address
                task = asyncio.create_task(p.switch_role(LLMRole.PROMPT, opts))
                await asyncio.sleep(rng.uniform(0, 1.5 * typical))
                cancelled_while_running += task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                await asyncio.sleep(0)
                assert set(listeners) == {p.listen_address}, (before, p.listen_address)

    asyncio.run(main(), debug=False)
    assert cancelled_while_running > 20  # the test cancelled switches under way
