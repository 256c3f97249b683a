"""Small host copies on the caller's thread: cheaper than the thread hop they replace.

A one-block ``swap_blocks`` moves a few tens of KiB; a worker-thread hop costs ~45 µs
(submit, wake the worker, wake the loop back), an order of magnitude more than the
copy. Below :data:`INLINE_MAX_BYTES` a block copy between host tensors therefore runs
right where it was awaited, as numpy row assignments on views of the cache's memory
(~0.5 µs per row plus the bytes, against ~3 µs for a torch ``copy_``).

The threshold bounds how long the loop is blocked. Measured on the 2-core CI VM
(``docs/benchmarks.md``, "Small operations"): copying N bytes split over 4 tensors,
rows drawn at random from 256 MiB buffers (not cache-resident), takes a median of
5 µs at 16 KiB, 9 µs at 64 KiB, 14 µs at 128 KiB, 23 µs at 256 KiB and 74 µs at
1 MiB (~10–14 GB/s). At 128 KiB a call holds the loop for ~15 µs, a third of the hop
it saves and far below the slow-callback guard; larger copies go to the workers,
where they overlap with the loop. :data:`INLINE_MAX_ROWS` bounds the per-row
overhead of calls with many tensors or pairs the same way (~0.5 µs each).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["INLINE_MAX_BYTES", "INLINE_MAX_ROWS", "copy_rows", "fits_inline"]

INLINE_MAX_BYTES = 128 << 10
INLINE_MAX_ROWS = 64

Rows = npt.NDArray[np.uint8]
"""One tensor as a ``[num_blocks, block_bytes]`` uint8 array (a view, no copy)."""


def fits_inline(tensors: int, pairs: int, block_bytes: int) -> bool:
    """Whether copying ``pairs`` blocks of ``block_bytes`` for each of ``tensors`` tensors
    is small enough to run on the caller's thread."""
    rows = tensors * pairs
    return rows <= INLINE_MAX_ROWS and rows * block_bytes <= INLINE_MAX_BYTES


def copy_rows(src: Sequence[Rows], dst: Sequence[Rows], pairs: Sequence[tuple[int, int]]) -> None:
    """``dst[i][d] = src[i][s]`` for every tensor ``i`` and pair ``(s, d)``.

    Same contract as ``CopyScheduler.copy_blocks``: indices already validated; when
    ``src[i]`` and ``dst[i]`` share memory every read happens before any write (numpy
    copies overlapping operands first); which source wins a duplicated destination is
    unspecified.
    """
    if len(pairs) == 1:
        s, d = pairs[0]
        for a, b in zip(src, dst, strict=True):
            b[d] = a[s]
        return
    sidx = np.fromiter((s for s, _ in pairs), dtype=np.intp, count=len(pairs))
    didx = np.fromiter((d for _, d in pairs), dtype=np.intp, count=len(pairs))
    for a, b in zip(src, dst, strict=True):
        b[didx] = a[sidx]  # the gather is a copy: reads before writes
