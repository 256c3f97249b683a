"""Copy kernels: byte-exact copies on every path (host, staged, accelerator, aliasing)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from copy_helpers import CPU
from copy_helpers import DTYPES
from copy_helpers import PAIR_KINDS
from copy_helpers import WITHIN_ONE_TENSOR
from copy_helpers import assert_bytes_equal
from copy_helpers import expected
from copy_helpers import make_pairs
from copy_helpers import needs_cuda
from copy_helpers import rand_tensor

from aiokv._copy import CopyScheduler
from aiokv._copy import DeviceContext
from aiokv._copy import SchedulerConfig
from aiokv._copy._kernels import Ring
from aiokv._copy._kernels import copy_cross
from aiokv._copy._plan import Planner


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", PAIR_KINDS)
async def test_copy_blocks_exact(sched: CopyScheduler, dtype: torch.dtype, kind: str) -> None:
    gen = torch.Generator().manual_seed(1)
    rows = 96
    # per-tensor block shapes differ: 16 KiB rows (runs become slices) and tiny rows
    shapes = [(rows, 2, 4096 // dtype.itemsize), (rows, 3, 5), (rows, 16 // dtype.itemsize)]
    src = [rand_tensor(s, dtype, gen) for s in shapes]
    dst = [rand_tensor(s, dtype, gen) for s in shapes]
    pairs = make_pairs(kind, 24, rows, random.Random(2))
    want = expected(src, dst, pairs)
    src_before = [s.clone() for s in src]
    await sched.copy_blocks(src, dst, pairs)
    for d, w in zip(dst, want, strict=True):
        assert_bytes_equal(d, w)  # copied blocks match, untouched blocks unchanged
    for s, b in zip(src, src_before, strict=True):
        assert_bytes_equal(s, b)


@pytest.mark.parametrize("staging", [1, 3 * 1024, 1 << 20])
async def test_copy_blocks_chunked_staging(staging: int) -> None:
    gen = torch.Generator().manual_seed(3)
    src = [rand_tensor((64, 4, 32), torch.bfloat16, gen) for _ in range(4)]
    dst = [rand_tensor((80, 4, 32), torch.bfloat16, gen) for _ in range(4)]
    rng = random.Random(4)
    pairs = list(zip(rng.sample(range(64), 50), rng.sample(range(80), 50), strict=True))
    want = expected(src, dst, pairs)
    s = CopyScheduler(CPU, SchedulerConfig(staging_bytes=staging))
    try:
        await s.copy_blocks(src, dst, pairs)
    finally:
        await s.aclose()
    for d, w in zip(dst, want, strict=True):
        assert_bytes_equal(d, w)


async def test_copy_blocks_byte_rows_and_odd_layouts(sched: CopyScheduler) -> None:
    """uint8 row views (what Cache.rows() hands over), 1-D and non-contiguous tensors."""
    gen = torch.Generator().manual_seed(5)
    base = rand_tensor((40, 3, 8), torch.float16, gen)
    src = [
        rand_tensor((40, 256), torch.uint8, gen),
        rand_tensor((40,), torch.float32, gen),
        base.transpose(1, 2),  # dim 0 is still blocks, but rows are not contiguous
        rand_tensor((40, 1000), torch.uint8, gen)[:, 3:515],  # misaligned rows
    ]
    dst = [torch.zeros_like(s) for s in src]
    rng = random.Random(6)
    pairs = list(zip(rng.sample(range(40), 30), rng.sample(range(40), 30), strict=True))
    want = expected(src, dst, pairs)
    await sched.copy_blocks(src, dst, pairs)
    for d, w in zip(dst, want, strict=True):
        assert_bytes_equal(d, w)


@pytest.mark.parametrize("kind", list(WITHIN_ONE_TENSOR))
async def test_copy_blocks_within_one_tensor(sched: CopyScheduler, kind: str) -> None:
    """Same tensor as source and destination: every read happens before any write."""
    gen = torch.Generator().manual_seed(7)
    t = rand_tensor((64, 2048), torch.bfloat16, gen)
    pairs = WITHIN_ONE_TENSOR[kind]
    want = expected([t], [t], pairs)
    await sched.copy_blocks([t], [t], pairs)
    assert_bytes_equal(t, want[0])


@pytest.mark.parametrize(("src_host", "dst_host"), [(True, False), (False, True), (False, False)])
@pytest.mark.parametrize("kind", PAIR_KINDS)
def test_accelerator_path_logic_on_cpu(src_host: bool, dst_host: bool, kind: str) -> None:
    """Every branch of the host<->device path (pinned ring slots, owed host scatters,
    gathers, chunking) driven with CPU tensors, so it is checked without a GPU."""
    gen = torch.Generator().manual_seed(12)
    rows = 96
    shapes = [(rows, 2, 4096), (rows, 3, 5)]  # 16 KiB rows (slices) and odd tiny rows
    src = [rand_tensor(sh, torch.bfloat16, gen) for sh in shapes]
    dst = [rand_tensor(sh, torch.bfloat16, gen) for sh in shapes]
    pairs = make_pairs(kind, 24, rows, random.Random(13))
    want = expected(src, dst, pairs)
    ring = Ring(DeviceContext(CPU), 2, 1024)  # 2 slots: chunks cycle through them
    planner = Planner(pairs)
    for s, d in zip(src, dst, strict=True):
        copy_cross(s, d, planner, ring, 40 * 1024, src_host, dst_host)
    ring.drain()
    for d, w in zip(dst, want, strict=True):
        assert_bytes_equal(d, w)


@pytest.mark.parametrize("kind", list(WITHIN_ONE_TENSOR))
def test_accelerator_path_within_one_tensor_on_cpu(kind: str) -> None:
    gen = torch.Generator().manual_seed(14)
    t = rand_tensor((64, 2048), torch.bfloat16, gen)
    pairs = WITHIN_ONE_TENSOR[kind]
    want = expected([t], [t], pairs)
    ring = Ring(DeviceContext(CPU), 2, 1024)
    copy_cross(t, t, Planner(pairs), ring, 8192, False, False)
    ring.drain()
    assert_bytes_equal(t, want[0])


async def test_copy_many_exact(sched: CopyScheduler) -> None:
    gen = torch.Generator().manual_seed(8)
    src = rand_tensor((4096,), torch.uint8, gen)
    dst = rand_tensor((4096,), torch.uint8, gen)
    want = dst.clone()
    spans = [(0, 100, 50), (1000, 0, 999), (3000, 3001, 1000), (17, 2500, 1)]
    for s, d, n in spans:
        want[d : d + n] = src[s : s + n]
    await sched.copy_many([(src[s : s + n], dst[d : d + n]) for s, d, n in spans])
    assert_bytes_equal(dst, want)
    await sched.copy_many([])


@needs_cuda
@pytest.mark.parametrize("direction", ["h2d", "d2h", "d2d"])
@pytest.mark.parametrize("kind", PAIR_KINDS)
async def test_copy_blocks_cuda(direction: str, kind: str) -> None:
    dev = torch.device("cuda", 0)
    gen = torch.Generator().manual_seed(10)
    rows = 96
    src_h = [rand_tensor((rows, 4, 2048), torch.bfloat16, gen) for _ in range(3)]
    dst_h = [rand_tensor((rows, 4, 2048), torch.bfloat16, gen) for _ in range(3)]
    pairs = make_pairs(kind, 24, rows, random.Random(11))
    want = expected(src_h, dst_h, pairs)
    on: Callable[[torch.Tensor, bool], torch.Tensor] = lambda t, d: t.to(dev) if d else t  # noqa: E731
    src = [on(t, direction in ("d2h", "d2d")) for t in src_h]
    dst = [on(t, direction in ("h2d", "d2d")) for t in dst_h]
    s = CopyScheduler(dev, SchedulerConfig(staging_bytes=64 * 1024))
    try:
        await s.copy_blocks(src, dst, pairs)
        await s.copy_many([(src[0][:2], dst[1][5:7])])
    finally:
        await s.aclose()
    want[1][5:7] = src_h[0][:2]
    for d, w in zip(dst, want, strict=True):
        assert_bytes_equal(d.cpu(), w)
