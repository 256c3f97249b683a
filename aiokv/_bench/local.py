"""``aiokv bench local``: ``swap_blocks`` against the best plain-torch method, in one run.

For each block size and block count it times, on the same tensors, ``swap_blocks``
(device → host; the device is the CPU here, registered as user memory) and the fastest
of several plain-torch ways to do the same copy, for random ``(src, dst)`` pairs and
for one contiguous run, and reports GB/s, the ratio ``t_raw / t_aiokv`` and the
framework overhead per block pair, ``(t_aiokv - t_raw) / N``. A second table times
small ops as a serving loop issues them (one op, then other awaits, repeatedly): a
one-block ``swap_blocks`` and ``copy_blocks`` (4 tensors x 16 KiB) against a bare
``loop.run_in_executor(None, noop)``, interleaved, with their ratio (target <= 0.5).

Memory is bounded by two preallocated host buffers (``pool_bytes`` each, 1 GiB by
default); every case carves its tensors out of them, using fewer than ``2 * layers``
tensors when ``2 * nblocks`` blocks per tensor would not fit.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import torch

from .. import Cache
from .. import CacheDesc
from .. import CacheManager
from .. import DataType
from .. import LLMConfig
from .. import LLMDataDist
from .. import LLMRole
from .. import Placement
from ._harness import Report
from ._harness import gbps
from ._harness import interleave
from ._harness import median
from ._harness import run_loop
from ._progress import steps

__all__ = ["run_local_bench"]

_CASE_BUDGET_S = 0.3
_MAX_REPEAT = 30


def _raw_methods(
    src: list[torch.Tensor], dst: list[torch.Tensor], sidx: torch.Tensor, didx: torch.Tensor
) -> dict[str, Callable[[], None]]:
    """Plain-torch ways to do ``dst[i][didx] = src[i][sidx]``; the bench keeps the fastest."""
    n = len(sidx)
    stage = torch.empty((n, *src[0].shape[1:]), dtype=src[0].dtype)
    # The same bytes seen as 16-byte elements: index_copy_ is per element, so it is ~2x
    # faster this way. This is plain torch too, so it counts as a baseline.
    src16 = [s.view(torch.complex128) for s in src]
    dst16 = [d.view(torch.complex128) for d in dst]
    stage16 = stage.view(torch.complex128)

    def index_copy() -> None:
        for s, d in zip(src, dst, strict=True):
            d.index_copy_(0, didx, s.index_select(0, sidx))

    def staged() -> None:
        for s, d in zip(src, dst, strict=True):
            torch.index_select(s, 0, sidx, out=stage)
            d.index_copy_(0, didx, stage)

    def staged16() -> None:
        for s, d in zip(src16, dst16, strict=True):
            torch.index_select(s, 0, sidx, out=stage16)
            d.index_copy_(0, didx, stage16)

    return {"index_copy": index_copy, "staged": staged, "staged-as-16B": staged16}


def _slice_copy(src: list[torch.Tensor], dst: list[torch.Tensor], n: int) -> Callable[[], None]:
    def copy() -> None:
        for s, d in zip(src, dst, strict=True):
            d[n : 2 * n].copy_(s[:n])

    return copy


async def _copy_case(
    raw: dict[str, Callable[[], None]], aiokv: Callable[[], object], repeat: int
) -> tuple[float, str, float]:
    """Best raw time, its method name and best aiokv time, runs interleaved.

    Each contender runs twice in a row per round and the best time is kept: raw torch
    runs on this thread's OpenMP team and aiokv on its worker's, and a team that just
    finished spin-waits for a while, taking a core from the other one's first run on a
    2-core machine. Quick cases get more rounds (up to ~0.3 s of work each), so that
    their best time is as trustworthy as that of the slow ones on a noisy machine.
    """
    contenders = {**raw, "aiokv": aiokv}
    # warm up (first touch of temporaries, thread start) and estimate one round's time
    one_round = sum(sum(t) for t in (await interleave(contenders, 1, warmup=0)).values())
    rounds = max(repeat, min(_MAX_REPEAT, int(_CASE_BUDGET_S / one_round / 2)))
    best = {k: min(v) for k, v in (await interleave(contenders, rounds, per_round=2)).items()}
    t_aiokv = best.pop("aiokv")
    method = min(best, key=lambda k: best[k])
    return best[method], method, t_aiokv


def _carve(pool: torch.Tensor, tensors: int, rows: int, block: int) -> list[torch.Tensor]:
    """``tensors`` bf16 ``[rows, block / 2]`` tensors laid out one after another in ``pool``."""
    per = rows * block
    return [
        pool[i * per : (i + 1) * per].view(torch.bfloat16).view(rows, block // 2)
        for i in range(tensors)
    ]


async def _register(cm: CacheManager, tensors: list[torch.Tensor], placement: Placement) -> Cache:
    desc = CacheDesc(len(tensors), list(tensors[0].shape), DataType.DT_BF16, placement)
    return await cm.register_blocks_cache(desc, tensors)


async def _swap_case(
    cm: CacheManager,
    src: list[torch.Tensor],
    dst: list[torch.Tensor],
    pairs: list[tuple[int, int]],
    raw: dict[str, Callable[[], None]],
    repeat: int,
) -> tuple[float, str, float]:
    """:func:`_copy_case` with ``swap_blocks`` of ``pairs`` from ``src`` to ``dst``."""
    s_cache = await _register(cm, src, Placement.DEVICE)
    d_cache = await _register(cm, dst, Placement.HOST)
    mapping = dict(pairs)
    try:
        return await _copy_case(raw, lambda: cm.swap_blocks(s_cache, d_cache, mapping), repeat)
    finally:
        await cm.unregister_cache(s_cache.cache_id)
        await cm.unregister_cache(d_cache.cache_id)


async def _small_ops(cm: CacheManager, rounds: int) -> list[dict[str, Any]]:
    """One small op at a time, as a serving loop issues them: a 1-block ``swap_blocks``
    and ``copy_blocks`` (4 tensors x 16 KiB) and a bare ``run_in_executor(None, noop)``,
    in turn, each followed by another await (``sleep(0)``) and timed alone; medians."""
    loop = asyncio.get_running_loop()
    shape = (8, 8 << 10)  # 8 blocks of 16 KiB (bf16)
    dev = [torch.ones(shape, dtype=torch.bfloat16) for _ in range(4)]
    host = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(4)]
    s_cache = await _register(cm, dev, Placement.DEVICE)
    d_cache = await _register(cm, host, Placement.HOST)

    def noop() -> None:
        return None

    ops: dict[str, Callable[[], Awaitable[object]]] = {
        "run_in_executor(None, noop)": lambda: loop.run_in_executor(None, noop),
        "swap_blocks (1 block)": lambda: cm.swap_blocks(s_cache, d_cache, {0: 1}),
        "copy_blocks (1 block)": lambda: cm.copy_blocks(s_cache, {2: [3]}),
    }
    times: dict[str, list[float]] = {name: [] for name in ops}
    warmup = max(10, rounds // 10)
    try:
        for r in range(warmup + rounds):
            for name, op in ops.items():
                start = time.perf_counter()
                await op()
                took = time.perf_counter() - start
                await asyncio.sleep(0)  # the serving loop's other awaits
                if r >= warmup:
                    times[name].append(took)
    finally:
        await cm.unregister_cache(s_cache.cache_id)
        await cm.unregister_cache(d_cache.cache_id)
    if not all(torch.equal(h[1], d[0]) for h, d in zip(host, dev, strict=True)):
        raise RuntimeError("small swap_blocks left wrong bytes")
    base = median(times["run_in_executor(None, noop)"])
    rows = []
    for name, ts in times.items():
        ts.sort()
        rows.append(
            {
                "op": name,
                "median_us": median(ts) * 1e6,
                "p90_us": ts[int(0.9 * (len(ts) - 1))] * 1e6,
                "vs_executor": median(ts) / base,
            }
        )
    return rows


async def _bench(
    report: Report,
    block_kib: Sequence[int],
    nblocks: Sequence[int],
    layers: int,
    repeat: int,
    pool_bytes: int,
    seed: int,
    small_rounds: int,
) -> None:
    rows = report.table(
        "swap_blocks",
        "swap_blocks (device → host) vs the best plain-torch copy; best of interleaved rounds",
    )
    rng = random.Random(seed)
    src_pool = torch.ones(pool_bytes, dtype=torch.uint8)  # every page touched, distinct
    dst_pool = torch.zeros(pool_bytes, dtype=torch.uint8)
    config = LLMConfig(device_type="cpu", enable_cache_manager=True)  # user memory only
    async with LLMDataDist(LLMRole.MIX, 1, config) as dd:
        cm = dd.cache_manager
        # (block KiB, blocks, tensors) that fit the pool: two cases each, then small ops
        shapes = [
            (kib, n, tensors)
            for kib in block_kib
            for n in nblocks
            if (tensors := min(2 * layers, pool_bytes // (2 * n * (kib << 10)))) > 0
        ]
        with steps("swap_blocks", 2 * len(shapes) + 1) as part:
            for kib, n, tensors in shapes:
                block, blocks = kib << 10, 2 * n
                src = _carve(src_pool, tensors, blocks, block)
                dst = _carve(dst_pool, tensors, blocks, block)
                moved = tensors * n * block
                s_ids, d_ids = rng.sample(range(blocks), n), rng.sample(range(blocks), n)
                cases: dict[str, tuple[list[tuple[int, int]], dict[str, Callable[[], None]]]] = {
                    "random": (
                        list(zip(s_ids, d_ids, strict=True)),
                        _raw_methods(src, dst, torch.tensor(s_ids), torch.tensor(d_ids)),
                    ),
                    "contiguous": (
                        [(i, n + i) for i in range(n)],
                        {"slice copy_": _slice_copy(src, dst, n)},
                    ),
                }
                for case, (pairs, raw) in cases.items():
                    with part.step(f"swap_blocks {case} {kib} KiB x {n}"):
                        t_raw, method, t_aiokv = await _swap_case(cm, src, dst, pairs, raw, repeat)
                    rows.append(
                        {
                            "case": case,
                            "block_kib": kib,
                            "nblocks": n,
                            "tensors": tensors,
                            "mib_moved": moved / (1 << 20),
                            "raw_method": method,
                            "raw_gbps": gbps(moved, t_raw),
                            "aiokv_gbps": gbps(moved, t_aiokv),
                            "ratio": t_raw / t_aiokv,
                            "overhead_us_per_block": (t_aiokv - t_raw) / n * 1e6,
                        }
                    )
            with part.step("small ops"):
                small = await _small_ops(cm, small_rounds)
    report.table(
        "small_ops",
        "one small op, then another await, repeated (interleaved); vs_executor = "
        "t_op / t_run_in_executor (target <= 0.5)",
    ).extend(small)


def run_local_bench(
    block_kib: Sequence[int] = (16, 64),
    nblocks: Sequence[int] = (64, 256, 1024, 4096),
    layers: int = 32,
    repeat: int = 5,
    pool_bytes: int = 1 << 30,
    seed: int = 0,
    use_uvloop: bool = False,
    small_rounds: int = 3000,
) -> Report:
    """Run the benchmark: a ``swap_blocks`` table and a ``small_ops`` table.

    Args:
        block_kib: block sizes in KiB (bf16 blocks).
        nblocks: block pairs per call.
        layers: layers of K and V, so up to ``2 * layers`` tensors per call.
        repeat: timed rounds at least; the best of each is kept.
        pool_bytes: size of each of the two host buffers the tensors are carved from.
        seed: seed of the random pairs.
        use_uvloop: run on uvloop instead of the default asyncio loop.
        small_rounds: timed rounds of the small-op comparison.
    """
    report = Report(
        "local",
        {
            "torch": torch.__version__,
            "intra-op threads": torch.get_num_threads(),
            "loop": "uvloop" if use_uvloop else "asyncio",
            "ratio": "t_raw / t_aiokv (>1: aiokv faster)",
        },
    )
    run_loop(
        lambda: _bench(report, block_kib, nblocks, layers, repeat, pool_bytes, seed, small_rounds),
        use_uvloop=use_uvloop,
    )
    return report
