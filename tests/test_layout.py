"""ByteLayout: the byte order both sides of a transfer compute independently."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aiokv._cache import Cache
from aiokv._layout import ByteLayout
from aiokv._layout import LayoutViews
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


def test_views_by_address_match_views_of_the_memory() -> None:
    """``at``: the same views, in the same order, as ``views`` over the same memory, with
    writes landing in it, and its runs as address rows; nothing made per buffer."""
    tensors = [torch.arange(64, dtype=torch.uint8) + 64 * i for i in range(3)]
    bases = np.array([t.data_ptr() for t in tensors], dtype=np.uint64)
    layout = ByteLayout.of_blocks(np.array([3, 1, 2], dtype=np.int64), 8)
    by_addr = layout.at(bases, 64)
    by_view = layout.views([tensor_bytes(t) for t in tensors])
    assert isinstance(by_addr, LayoutViews) and not by_addr.readonly
    assert len(by_addr) == len(by_view) == 6 and by_addr.total == 3 * 24
    assert [bytes(v) for v in by_addr] == [bytes(v) for v in by_view]
    assert bytes(by_addr[-1]) == bytes(tensors[2][8:24].numpy())  # blocks 1, 2 merged
    assert by_addr.runs().tolist() == by_view.runs().tolist()
    assert by_addr.runs().tolist()[0] == [int(bases[0]) + 24, 8]
    by_addr[3][:] = b"\xff" * 16  # tensor 1, blocks 1 and 2
    assert tensors[1][8:24].tolist() == [255] * 16 and tensors[1][:8].tolist() == list(
        range(64, 72)
    )
    with pytest.raises(IndexError):
        by_addr[6]


def test_views_by_address_refuse_what_does_not_fit() -> None:
    layout = ByteLayout.of_blocks(np.array([7], dtype=np.int64), 8)  # bytes [56, 64)
    bases = np.zeros(1, dtype=np.uint64)
    for bad, size in (
        (layout, 63),
        (ByteLayout.of_blocks(np.empty(0, dtype=np.int64), 8), 64),
        (ByteLayout([0, 8], [8, 8]), 64),
    ):
        with pytest.raises(ValueError, match="does not fit"):
            bad.at(bases, size)
    assert layout.at(bases, 64).total == 8


def test_bases_of_a_cache() -> None:
    from aiokv import CacheDesc
    from aiokv import DataType

    tensors = [torch.zeros(4, 16) for _ in range(3)]
    cache = Cache(CacheDesc(3, [4, 16], DataType.DT_FLOAT), tensors, is_blocks_cache=True)
    bases = cache.bases()
    assert bases.dtype == np.uint64 and bases.tolist() == [t.data_ptr() for t in tensors]
    assert cache.bases() is bases  # built once
    assert cache.bases(range(1, 3)).tolist() == bases.tolist()[1:]
    assert cache.block_bytes == 64 and cache.slot_bytes == 64  # one row of 16 floats
    views = cache.at(ByteLayout.of_blocks(np.array([3, 1]), 64), range(1, 3))
    assert len(views) == 4 and views.total == 256  # a run per block per tensor
    for view in views:
        view[:] = b"\x01" * 64
    # the bytes landed in blocks 3 and 1 of tensors 1 and 2, and nowhere else
    assert not tensors[0].any()
    for t in tensors[1:]:
        assert t[[1, 3]].view(torch.uint8).eq(1).all() and not t[[0, 2]].any()
    with pytest.raises(ValueError, match="does not fit"):  # past a tensor's end
        cache.at(ByteLayout.of_blocks(np.array([4]), 64), range(3))
