"""Host staging's two ways to gather scattered runs, in one run: run by run (a Python
copy per run) and one gather by row index (``aiokv/_copy/_staging.py`` ``_rows``), on
the same 8,192 scattered blocks of two buffers (nearly one run each), CPU; median of 12
after 3 warm-ups.

Usage: PYTHONPATH=. python scripts/bench_staging_rows.py [ROW_BYTES ...]
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import torch

from aiokv._copy import _staging
from aiokv._layout import ByteLayout

COUNT = 8192


def _gather_ms(layout: ByteLayout, buffers: list[torch.Tensor], min_row: int) -> float:
    """Median ms of ``_gather`` with ``_MIN_ROW`` set to ``min_row`` (restored after)."""
    saved = _staging._MIN_ROW
    _staging._MIN_ROW = min_row  # type: ignore[misc]
    try:
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            _staging._gather(buffers, layout, torch.device("cpu"))
            times.append(time.perf_counter() - t0)
    finally:
        _staging._MIN_ROW = saved  # type: ignore[misc]
    return statistics.median(times[3:]) * 1e3


def main(rows: list[int]) -> None:
    print("row bytes | run by run ms | by row index ms | ratio")
    for row in rows:
        rng = np.random.default_rng(row)
        layout = ByteLayout.of_blocks(rng.permutation(2 * COUNT)[:COUNT].astype(np.int64), row)
        buffers = [
            torch.from_numpy(rng.integers(0, 256, 2 * COUNT * row, dtype=np.uint8))
            for _ in range(2)
        ]
        per_run = _gather_ms(layout, buffers, min_row=row + 1)
        by_index = _gather_ms(layout, buffers, min_row=row)
        print(f"{row} | {per_run:.2f} | {by_index:.2f} | {per_run / by_index:.0f}x")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [32, 64, 128, 256])
