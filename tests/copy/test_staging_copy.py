"""Host staging's copy of scattered runs (``_copy/_staging.py``): byte-exact both ways
whichever way it copies — run by run (few runs, or rows under ``_MIN_ROW``) or one
gather / scatter by row index (many runs sharing a row length of at least ``_MIN_ROW``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aiokv._copy import _staging
from aiokv._layout import ByteLayout

CPU = torch.device("cpu")


@pytest.mark.parametrize("row", [4, 8, 16, 32, 48, 128, 2048])
@pytest.mark.parametrize("count", [4, 300])
def test_gather_then_scatter_moves_exactly_the_layouts_bytes(row: int, count: int) -> None:
    rng = np.random.default_rng(row + count)
    blocks = rng.permutation(2 * count)[:count].astype(np.int64)
    layout = ByteLayout.of_blocks(blocks, row)
    buffers = [
        torch.from_numpy(rng.integers(0, 256, 2 * count * row, dtype=np.uint8)) for _ in range(2)
    ]
    # the order bytes go on the wire: each buffer's runs in the layout's order
    want = b"".join(bytes(buf[a:b].numpy()) for buf in buffers for a, b in layout.bounds())
    host = _staging._gather(buffers, layout, CPU)
    assert bytes(host.numpy()) == want
    back = [torch.zeros_like(buf) for buf in buffers]
    _staging._scatter(host, back, layout, CPU)
    for buf, got in zip(buffers, back, strict=True):
        for a, b in layout.bounds():
            assert torch.equal(got[a:b], buf[a:b])
        untouched = torch.ones(got.numel(), dtype=torch.bool)
        for a, b in layout.bounds():
            untouched[a:b] = False
        assert not got[untouched].any()  # nothing written outside the runs


def test_rows_are_gathered_by_index_from_min_row_up() -> None:
    """Many runs: by row index at ``_MIN_ROW`` bytes a row, run by run below it."""
    blocks = np.arange(0, 64, 2, dtype=np.int64)  # 32 runs, none adjacent
    assert _staging._rows(ByteLayout.of_blocks(blocks, _staging._MIN_ROW)) is not None
    assert _staging._rows(ByteLayout.of_blocks(blocks, _staging._MIN_ROW // 2)) is None
