"""ByteLayout: the byte order both sides of a transfer compute independently."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aiokv._layout import ByteLayout
from aiokv._layout import tensor_bytes


def _gather(layout: ByteLayout, buffers: list[bytes]) -> bytes:
    return b"".join(bytes(v) for v in layout.views([memoryview(b) for b in buffers]))


def test_blocks_in_list_order_and_runs_merged() -> None:
    buf = bytes(range(64))
    layout = ByteLayout.of_blocks(np.array([2, 3, 4, 0, 7], dtype=np.int64), 8)
    assert layout.runs == 3  # [2,3,4] merged; 0; 7
    assert layout.per_buffer == 40
    assert layout.extent == 64
    want = buf[16:40] + buf[0:8] + buf[56:64]
    assert _gather(layout, [buf]) == want


def test_buffer_major_order() -> None:
    a, b = bytes(range(32)), bytes(range(100, 132))
    layout = ByteLayout.of_blocks(np.array([1, 0], dtype=np.int64), 16)
    assert _gather(layout, [a, b]) == a[16:] + a[:16] + b[16:] + b[:16]
    assert layout.total(2) == 64


def test_stride_keeps_blocks_apart() -> None:
    buf = bytes(range(100))
    layout = ByteLayout.of_blocks(np.array([0, 1, 2], dtype=np.int64), 4, stride=10, base=3)
    assert layout.runs == 3
    assert layout.extent == 3 + 20 + 4
    assert _gather(layout, [buf]) == buf[3:7] + buf[13:17] + buf[23:27]


def test_span_and_empty() -> None:
    buf = bytes(range(50))
    assert _gather(ByteLayout.of_span(5, 10), [buf]) == buf[5:15]
    empty = ByteLayout.of_blocks(np.empty(0, dtype=np.int64), 8)
    assert empty.runs == 0 and empty.per_buffer == 0 and empty.views([memoryview(buf)]) == []


def test_views_write_through_to_tensor_memory() -> None:
    t = torch.zeros(4, 8, dtype=torch.uint8)
    views = ByteLayout.of_blocks(np.array([3, 1], dtype=np.int64), 8).views([tensor_bytes(t)])
    views[0][:] = b"\x01" * 8
    views[1][:] = b"\x02" * 8
    assert t[3].tolist() == [1] * 8 and t[1].tolist() == [2] * 8
    assert t[0].sum() == 0 and t[2].sum() == 0


@pytest.mark.parametrize("seed", range(5))
def test_random_layouts_match_a_per_block_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    nblocks, bb = 64, 16
    blocks = rng.permutation(nblocks)[: rng.integers(1, nblocks)].astype(np.int64)
    buf = rng.integers(0, 256, nblocks * bb, dtype=np.uint8).tobytes()
    want = b"".join(buf[b * bb : (b + 1) * bb] for b in blocks.tolist())
    assert _gather(ByteLayout.of_blocks(blocks, bb), [buf]) == want


@pytest.mark.parametrize("stride", [None, 24])
@pytest.mark.parametrize("seed", range(20))
def test_short_and_long_lists_give_the_same_runs(seed: int, stride: int | None) -> None:
    """Short lists take a plain-Python path, long ones numpy: the layouts must agree."""
    rng = np.random.default_rng(seed)
    runs = [rng.integers(0, 100, rng.integers(1, 6)) + rng.integers(0, 1000) for _ in range(8)]
    blocks = np.concatenate([np.arange(r[0], r[0] + len(r)) for r in runs])
    short = ByteLayout.of_blocks(blocks[:30], 16, stride=stride, base=7)
    longer = np.concatenate([blocks[:30], np.arange(5000, 5040)])  # over the threshold
    long_ = ByteLayout.of_blocks(longer, 16, stride=stride, base=7)
    pattern = memoryview(bytes(i % 251 for i in range(200_000)))  # every offset tells
    got = [bytes(v) for v in short.views([pattern])]
    assert got == [bytes(v) for v in long_.views([pattern])[: short.runs]]
    step = stride or 16
    assert b"".join(got) == b"".join(
        bytes(pattern[7 + b * step : 7 + b * step + 16]) for b in blocks[:30].tolist()
    )
    assert short.extent == max(7 + b * step + 16 for b in blocks[:30].tolist())
