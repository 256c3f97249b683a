"""Small host copies run inline on the caller's loop (issue #8, "small operations").

- ``copy_rows`` moves the right bytes, aliasing included (a property against the
  one-block-at-a-time reference);
- through the manager: small ``swap_blocks`` / ``copy_blocks`` / ``copy_kv_blocks``
  never reach the workers, move the right bytes and release their pins; anything past
  ``fits_inline`` still goes to the workers (a property over shapes);
- a cancelled inline copy copies nothing; errors keep their codes; trio works too.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

import anyio
import numpy as np
import pytest
import torch
from _helpers import not_listening
from _helpers import snapshot
from copy_helpers import expected
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from aiokv import Cache
from aiokv import CacheDesc
from aiokv import CacheManager
from aiokv import DataType
from aiokv import LLMConfig
from aiokv import LLMDataDist
from aiokv import LLMException
from aiokv import LLMRole
from aiokv import LLMStatusCode
from aiokv import Placement
from aiokv._copy import INLINE_MAX_BYTES
from aiokv._copy import copy_rows
from aiokv._copy import fits_inline
from aiokv._copy._inline import INLINE_MAX_ROWS

POOL = 16 << 20


def config() -> LLMConfig:
    """Not listening, refusing pushes: local copies only."""
    return not_listening(pool=POOL, host_pool=POOL, sync_kv_timeout=1000)


@pytest.fixture
async def cm() -> AsyncIterator[CacheManager]:
    async with LLMDataDist(LLMRole.MIX, 1, config()) as dd:
        yield dd.cache_manager


class Spy:
    """Counts the jobs that reach the copy workers."""

    def __init__(self, cm: CacheManager, monkeypatch: pytest.MonkeyPatch) -> None:
        self.jobs = 0
        sched = cm._scheduler
        real = sched.copy_blocks

        async def counted(*args: Any) -> None:
            self.jobs += 1
            await real(*args)

        monkeypatch.setattr(sched, "copy_blocks", counted)


def desc(placement: Placement, nblocks: int, block_bytes: int, ntensors: int = 4) -> CacheDesc:
    return CacheDesc(ntensors, [nblocks, block_bytes], DataType.DT_UINT8, placement)


def fill(cache: Cache, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in cache.tensors:
        t.copy_(torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8))


def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# ---- the kernel ----------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(2, 12),
    width=st.integers(1, 40),
    tensors=st.integers(1, 4),
    same=st.booleans(),
    data=st.data(),
)
def test_copy_rows_matches_the_reference(
    rows: int, width: int, tensors: int, same: bool, data: st.DataObject
) -> None:
    g = torch.Generator().manual_seed(rows * 131 + width)
    src = [
        torch.randint(0, 256, (rows, width), generator=g, dtype=torch.uint8) for _ in range(tensors)
    ]
    dst = src if same else [torch.zeros(rows, width, dtype=torch.uint8) for _ in range(tensors)]
    n = data.draw(st.integers(1, rows))
    dsts = data.draw(st.permutations(range(rows)))[:n]  # unique destinations
    srcs = data.draw(st.lists(st.integers(0, rows - 1), min_size=n, max_size=n))
    pairs = list(zip(srcs, dsts, strict=True))
    want = expected(src, dst, pairs)  # reads every source before any write, even aliased
    copy_rows([t.numpy() for t in src], [t.numpy() for t in dst], pairs)
    assert equal(dst, want)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 256), st.integers(1, 256), st.integers(1, 1 << 20))
def test_fits_inline_is_the_documented_bound(tensors: int, pairs: int, block: int) -> None:
    rows = tensors * pairs
    assert fits_inline(tensors, pairs, block) == (
        rows <= INLINE_MAX_ROWS and rows * block <= INLINE_MAX_BYTES
    )


# ---- through the manager ---------------------------------------------------------------------
async def test_small_ops_run_inline_with_the_right_bytes(
    cm: CacheManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = Spy(cm, monkeypatch)
    dev = await cm.allocate_blocks_cache(desc(Placement.DEVICE, 8, 16 << 10))
    host = await cm.allocate_blocks_cache(desc(Placement.HOST, 8, 16 << 10))
    fill(dev, 1)
    fill(host, 2)
    want_host = expected(snapshot(dev), snapshot(host), [(0, 1)])
    await cm.swap_blocks(dev, host, {0: 1})  # 4 tensors x 16 KiB: the benchmark's op
    assert equal(snapshot(host), want_host)
    want_dev = expected(snapshot(host), snapshot(dev), [(5, 2), (6, 7)])
    await cm.swap_blocks(host, dev, {5: 2, 6: 7})
    assert equal(snapshot(dev), want_dev)
    want_dev = expected(snapshot(dev), snapshot(dev), [(3, 4)])
    await cm.copy_blocks(dev, {3: [4]})
    assert equal(snapshot(dev), want_dev)
    want_host = expected(snapshot(dev), snapshot(host), [(2, 0)])
    await cm.copy_kv_blocks(dev, host, [2], [[0]])
    assert equal(snapshot(host), want_host)
    assert spy.jobs == 0  # none reached the workers
    assert cm.statistics().pins == 0
    # released while pinned by a pending inline copy: memory stays until it ends
    task = asyncio.create_task(cm.swap_blocks(dev, host, {1: 3}))
    await asyncio.sleep(0)  # the swap pinned both and is at its checkpoint
    assert cm.statistics().pins == 2
    want_host = expected(snapshot(dev), snapshot(host), [(1, 3)])
    kept = list(host.tensors)  # views of its memory, read back once the swap ended
    await cm.deallocate_blocks_cache(host)
    assert len(host.tensors) == 4  # still pinned: its memory is not back in the pool
    await task
    assert equal([t.clone() for t in kept], want_host)
    assert cm.statistics().pins == 0 and cm.statistics().caches == 1
    assert host.tensors == [] and host.tensor_addrs == []  # back in the pool now


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    tensors=st.integers(1, 4),
    block=st.sampled_from([512, 4 << 10, 16 << 10, 64 << 10]),
    npairs=st.integers(1, 16),  # at most 4 x 32 x 64 KiB = 8 MiB per cache
    seed=st.integers(0, 1000),
)
def test_large_copies_still_go_to_the_workers(
    tensors: int, block: int, npairs: int, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        async with LLMDataDist(LLMRole.MIX, 1, config()) as dd:
            cm = dd.cache_manager
            spy = Spy(cm, monkeypatch)
            nblocks = 2 * npairs
            dev = await cm.allocate_blocks_cache(desc(Placement.DEVICE, nblocks, block, tensors))
            host = await cm.allocate_blocks_cache(desc(Placement.HOST, nblocks, block, tensors))
            fill(dev, seed)
            rng = random.Random(seed)
            pairs = list(
                zip(
                    rng.sample(range(nblocks), npairs),
                    rng.sample(range(nblocks), npairs),
                    strict=True,
                )
            )
            want = expected(snapshot(dev), snapshot(host), pairs)
            await cm.swap_blocks(dev, host, dict(pairs))
            assert equal(snapshot(host), want)
            inline = fits_inline(tensors, npairs, block)
            assert spy.jobs == (0 if inline else 1)
            if tensors * npairs * block > INLINE_MAX_BYTES:
                assert spy.jobs == 1  # past the byte threshold: always a worker
            assert cm.statistics().pins == 0

    asyncio.run(main())


async def test_cancelled_at_the_checkpoint_copies_nothing(cm: CacheManager) -> None:
    dev = await cm.allocate_blocks_cache(desc(Placement.DEVICE, 4, 1024))
    host = await cm.allocate_blocks_cache(desc(Placement.HOST, 4, 1024))
    fill(dev, 3)
    before = snapshot(host)
    task = asyncio.create_task(cm.swap_blocks(dev, host, {0: 0, 1: 1}))
    await asyncio.sleep(0)  # the task ran up to its checkpoint
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert equal(snapshot(host), before)
    assert cm.statistics().pins == 0


async def test_errors_keep_their_codes(cm: CacheManager) -> None:
    dev = await cm.allocate_blocks_cache(desc(Placement.DEVICE, 4, 1024))
    host = await cm.allocate_blocks_cache(desc(Placement.HOST, 4, 1024))
    with pytest.raises(LLMException) as ei:
        await cm.swap_blocks(dev, host, {0: 4})
    assert ei.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    await cm.deallocate_blocks_cache(host)
    with pytest.raises(LLMException) as ei:
        await cm.swap_blocks(dev, host, {0: 1})
    assert ei.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    assert cm.statistics().pins == 0


def test_inline_under_trio() -> None:
    async def main() -> None:
        async with LLMDataDist(LLMRole.MIX, 1, config()) as dd:
            cm = dd.cache_manager
            jobs = 0
            real = cm._scheduler.copy_blocks

            async def counted(*args: Any) -> None:
                nonlocal jobs
                jobs += 1
                await real(*args)

            cm._scheduler.copy_blocks = counted  # type: ignore[method-assign]
            dev = await cm.allocate_blocks_cache(desc(Placement.DEVICE, 4, 4096))
            host = await cm.allocate_blocks_cache(desc(Placement.HOST, 4, 4096))
            fill(dev, 4)
            want = expected(snapshot(dev), snapshot(host), [(2, 1)])
            await cm.swap_blocks(dev, host, {2: 1})
            assert equal(snapshot(host), want)
            with anyio.CancelScope() as scope:  # cancelled at the checkpoint: no copy
                scope.cancel()
                await cm.swap_blocks(dev, host, {3: 0})
            assert equal(snapshot(host), want)
            assert cm.statistics().pins == 0 and jobs == 0

    anyio.run(main, backend="trio")


def test_host_rows_view_the_cache_memory() -> None:
    t = [torch.arange(64, dtype=torch.float32).view(4, 16) for _ in range(2)]
    cache = Cache.create_cpu_cache(CacheDesc(2, [4, 16], DataType.DT_FLOAT, Placement.HOST), t)
    rows = cache.host_rows()
    assert rows is not None and rows is cache.host_rows()  # built once
    assert [r.shape for r in rows] == [(4, 64), (4, 64)]
    rows[0][1] = 0
    assert not t[0][1].any()
    assert np.shares_memory(rows[1], t[1].numpy())
