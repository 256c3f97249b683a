"""No Python object per block in the data path, on either side: a ``pull_blocks`` or
``push_blocks`` of 8,192 scattered blocks keeps no more Python objects alive than one of
1,024, over every transport that links processes and through host staging (the path of
device memory), both ends in this process, so the requester and the serving side are
counted together.

What is counted: objects the garbage collector tracks (containers: tuples, lists,
memoryviews, slices, ...) allocated and still alive, summed over every thread (the
engines serve on their own threads). These are what make collections fire: per-block
views or ``(start, end)`` tuples made every 4k-block transfer pay full collections. The
count is read with no clock: generation 0 is collected after every ``STEP`` net new
tracked objects, so the number of those collections during one operation, times
``STEP``, is how far live tracked objects climbed while it ran. Objects that die at once
(a chunk's temporaries) do not add up; per-block ones kept for the transfer do. Untracked
objects (ints, bytes) never trigger a collection and are not counted; numpy arrays of
per-run rows are one object each, whatever their length.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import DataType
from aiokv import LLMDataDist
from aiokv._copy import _staging
from aiokv.testing import linked_pair
from aiokv.testing import make_config
from aiokv.testing import skip_unless_transport

#: net new tracked objects between two generation-0 collections while counting
STEP = 100
#: blocks of each cache (4 KiB each: two tensors of 2 KiB rows)
BLOCKS = 8192
FEW, MANY = 1024, 8192
#: the most more tracked objects a MANY-block operation may keep than a FEW-block one:
#: one per 8 extra blocks (a per-block object adds one per block, per tensor and side)
SLACK = (MANY - FEW) // 8


@contextlib.contextmanager
def tracked_growth() -> Iterator[Callable[[], int]]:
    """Count, from a fresh young collection on, how many tracked objects were allocated and kept
    (to the nearest ``STEP`` below): yields a function that answers so far. The
    collector's thresholds and state are restored on exit."""
    collections: list[int] = []

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start" and info["generation"] == 0:
            collections.append(0)

    enabled, thresholds = gc.isenabled(), gc.get_threshold()
    gc.collect(0)  # the count starts at zero (a young collection: quick, unlike a full one)
    gc.set_threshold(STEP, 10**9, 10**9)  # only generation 0, every STEP objects
    gc.enable()
    gc.callbacks.append(on_gc)
    try:
        yield lambda: len(collections) * STEP
    finally:
        gc.callbacks.remove(on_gc)
        gc.set_threshold(*thresholds)
        if not enabled:
            gc.disable()


async def kept(op: Callable[..., Awaitable[None]], *args: Any) -> int:
    """Tracked objects kept during one ``op(*args)`` after a warm-up one: the least of
    three (a timer of the links firing meanwhile adds a few, never fewer)."""
    await op(*args)
    counts = []
    for _ in range(3):
        with tracked_growth() as count:
            await op(*args)
            counts.append(count())
    return min(counts)


#: staged rows this short are gathered by row index (aiokv/_copy/_staging.py _MIN_ROW: 8)
SHORT_ROW = 128
TINY_ROW = 16


@pytest.mark.parametrize(
    ("transport", "row", "staged"),
    [
        ("tcp", 2048, False),
        ("nixl", 2048, False),
        ("tcp", 2048, True),
        ("tcp", SHORT_ROW, True),
        ("tcp", TINY_ROW, True),
    ],
    ids=["tcp", "nixl", "tcp-staged", "tcp-staged-short-rows", "tcp-staged-tiny-rows"],
)
async def test_many_blocks_keep_no_more_objects_than_few(
    transport: str, row: int, staged: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``row``: bytes of a block in each of the two tensors; ``staged``: the caches move
    through host staging, as device memory does (the testing knob, on CPU caches)."""
    if transport == "nixl":
        skip_unless_transport("nixl")
    monkeypatch.setattr(_staging, "_STAGE_HOST", staged)
    async with linked_pair(make_config(transport)) as (p, d):
        counts = await kept_by_size(p, d, CacheDesc(2, [BLOCKS, row], DataType.DT_UINT8))
    for op in ("pull", "push"):
        few, many = counts[op, FEW], counts[op, MANY]
        assert many <= few + SLACK, f"{op}: {few} objects kept for {FEW} blocks, {many} for {MANY}"


async def kept_by_size(
    p: LLMDataDist, d: LLMDataDist, desc: CacheDesc
) -> dict[tuple[str, int], int]:
    """Objects kept by a pull (``d`` from ``p``) and a push (``p`` to ``d``) of FEW and of
    MANY scattered blocks of caches ``desc`` on each side, by ``(op, blocks)``."""
    src = await p.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(1, 0))
    dst = await d.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(2, 0))
    rng = np.random.default_rng(0)
    counts: dict[tuple[str, int], int] = {}
    for n in (FEW, MANY):
        # scattered blocks: nearly every block is a run of its own on both sides
        srcs = rng.permutation(BLOCKS)[:n].tolist()
        dsts = rng.permutation(BLOCKS)[:n].tolist()
        pull = d.cache_manager.pull_blocks
        counts["pull", n] = await kept(pull, BlocksCacheKey(1, 0), dst, srcs, dsts)
        push = p.cache_manager.push_blocks
        counts["push", n] = await kept(push, BlocksCacheKey(2, 0), src, srcs, dsts)
    return counts
