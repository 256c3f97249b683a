"""CopyScheduler: argument handling, config, closed state, never blocking the loop.

Async tests run on asyncio and uvloop (``event_loop_policy`` in conftest.py) with loop
debug on; conftest fails any test whose loop was blocked.
"""

from __future__ import annotations

import asyncio
import logging
import random

import pytest
import torch
from _helpers import loop_turns
from copy_helpers import CPU
from copy_helpers import Gate

from aiokv._copy import CopyScheduler
from aiokv._copy import SchedulerConfig


async def test_copy_blocks_empty_and_mismatch(sched: CopyScheduler) -> None:
    t = torch.zeros(4, 4)
    await sched.copy_blocks([t], [t.clone()], [])
    await sched.copy_blocks([], [], [(0, 1)])
    with pytest.raises(ValueError, match="source"):
        await sched.copy_blocks([t], [], [(0, 1)])


async def test_copy_blocks_error_propagates(sched: CopyScheduler) -> None:
    src, dst = torch.zeros(4, 8), torch.zeros(4, 8)
    with pytest.raises((IndexError, RuntimeError)):
        await sched.copy_blocks([src], [dst], [(0, 1), (9, 2)])
    await sched.copy_blocks([src + 1], [dst], [(0, 1)])  # still usable
    assert dst[1].eq(1).all()


async def test_cancel_large_copy_never_writes_after_return() -> None:
    """Cancel a ~256 MiB copy right as it starts: raised or returned, never both — a
    cancellation raised means nothing was copied, a return that all was (the job had
    started and ran to its end) — and no byte changes afterwards."""
    s = CopyScheduler(CPU, SchedulerConfig(swap_out_threads=1))
    try:
        rows, width = 1024, 32 * 1024  # 4 tensors x 1024 blocks x 64 KiB

        def make() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            src = [torch.full((rows, width), i + 1, dtype=torch.int16) for i in range(2)]
            return src, [torch.zeros(rows, width, dtype=torch.int16) for _ in range(2)]

        src, dst = await s.call(make)  # building 256 MiB on the loop would block it
        pairs = [(i, rows - 1 - i) for i in range(rows)]  # reversed: the index path
        gate = Gate()
        blocker = asyncio.ensure_future(s.call(gate))
        await gate.started.wait()
        copy = asyncio.ensure_future(s.copy_blocks(src, dst, pairs))
        await asyncio.sleep(0)
        gate.release.set()
        await blocker  # the worker moves straight on to the copy
        copy.cancel()
        try:
            await copy
            returned = True
        except asyncio.CancelledError:
            returned = False
        at_return = [d[:, :8].clone() for d in dst]
        for i, d in enumerate(at_return):
            want = i + 1 if returned else 0  # returned: copied; raised: never started
            assert bool(d.eq(want).all()), f"returned={returned} but not all {want}"
        await s.call(lambda: None)
        for d, snap in zip(dst, at_return, strict=True):
            assert torch.equal(d[:, :8], snap), "written after the call returned"
        await s.copy_blocks(src, dst, pairs[:4])  # still works
        assert dst[0][rows - 1].eq(1).all()
        await s.call(lambda: (src.clear(), dst.clear()))  # freeing is worker work too
    finally:
        await s.aclose()


async def test_large_copy_never_blocks_the_loop(
    sched: CopyScheduler, caplog: pytest.LogCaptureFixture
) -> None:
    loop = asyncio.get_running_loop()
    loop.set_debug(True)
    loop.slow_callback_duration = 0.05
    caplog.set_level(logging.WARNING, logger="asyncio")
    rows, width = 2048, 16 * 1024

    def make(value: int) -> list[torch.Tensor]:
        return [torch.full((rows, width), value, dtype=torch.uint8) for _ in range(4)]

    # even building 256 MiB of test tensors would block the loop: do it on a worker
    src, dst = await sched.call(lambda: make(1)), await sched.call(lambda: make(0))
    rng = random.Random(9)
    pairs = list(zip(rng.sample(range(rows), rows), range(rows), strict=True))
    async with loop_turns() as turns:
        await sched.copy_blocks(src, dst, pairs)
        await sched.copy_blocks(src, dst, [(i, i) for i in range(rows)])
        await sched.copy_many([(s, d) for s, d in zip(src, dst, strict=True)])
        ticks = turns()
    assert await sched.call(lambda: all(bool(d.eq(1).all()) for d in dst))
    assert ticks > 1, "the loop made no progress while the copy ran"
    slow = [r.getMessage() for r in caplog.records if "Executing" in r.getMessage()]
    assert not slow

    def free() -> None:
        src.clear()
        dst.clear()

    await sched.call(free)  # freeing 256 MiB is also work for a worker


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="swap_out_threads"):
        SchedulerConfig(swap_out_threads=0)
    with pytest.raises(TypeError, match="staging_bytes"):
        SchedulerConfig(staging_bytes=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        CopyScheduler("cpu")  # type: ignore[arg-type]
