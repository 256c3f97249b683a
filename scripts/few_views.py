"""Where a TCP payload should move by address rows instead of as views: the sender's
work for one payload of N one-run buffers, both ways, timed alone (no socket).

``PYTHONPATH=. python scripts/few_views.py`` (repository root): for N = 1..64 buffers
given by address (``ByteLayout.at``, as every remote transfer's), the best of three
``timeit`` repeats, µs per payload, of

* ``views``: the cursor over the payload's views (``Cursor``: one memoryview made from an
  address per buffer), plus the frame header, consumed whole;
* ``rows``: the cursor over its address rows (``RunCursor``: numpy), joined to the frame
  header's row (``as_rows``) and consumed whole (``advance_rows``).

``tcp/_ops.py``'s ``_FEW_VIEWS`` is the largest N where ``views`` still wins.
"""

from __future__ import annotations

import timeit
from functools import partial

import numpy as np
import torch

from aiokv._layout import ByteLayout
from aiokv.transport.tcp._io import advance_rows
from aiokv.transport.tcp._io import as_rows
from aiokv.transport.tcp._io import consumed
from aiokv.transport.tcp._ops import Cursor
from aiokv.transport.tcp._ops import RunCursor

RUN = 64  # bytes of each buffer's one run
HEADER = bytes(16)


def main() -> None:
    tensors = [torch.zeros(4 * RUN, dtype=torch.uint8) for _ in range(64)]
    bases = np.array([t.data_ptr() for t in tensors], dtype=np.uint64)
    layout = ByteLayout.of_blocks(np.array([1], dtype=np.int64), RUN)

    def views(n: int) -> None:
        payload = layout.at(bases[:n], 4 * RUN)
        iov: list[bytes | memoryview] = [
            HEADER,
            *Cursor(list(payload), payload.total).take(n * RUN),
        ]
        consumed(iov, 0, len(HEADER) + n * RUN)

    def rows(n: int) -> None:
        payload = layout.at(bases[:n], 4 * RUN)
        cursor = RunCursor(payload)
        joined, _ = as_rows([HEADER, cursor.take_rows(n * RUN)])
        advance_rows(joined, 0, len(HEADER) + n * RUN)

    number = 20_000
    for n in (1, 2, 4, 8, 12, 16, 24, 32, 64):
        t = {
            name: min(timeit.repeat(partial(f, n), number=number, repeat=3)) / number * 1e6
            for name, f in (("views", views), ("rows", rows))
        }
        print(f"{n:3d} buffers: views {t['views']:6.1f} µs, rows {t['rows']:6.1f} µs")


if __name__ == "__main__":
    main()
