"""Descriptor lists as numpy arrays: buffers as coalesced ``(address, length)`` rows, their
wire form in a NIXL plane's grant (``PLANE_GRANT``) and the pairing of two lists of the
same total.

Nothing here loops over blocks in Python: a :class:`~aiokv._layout.LayoutViews` gives
its rows from the layout (numpy), and every other step is a numpy operation on them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

from ..._layout import LayoutViews
from ..._layout import address_of

__all__ = [
    "MEMS",
    "Place",
    "Runs",
    "address_of",
    "decode_grant",
    "encode_grant",
    "pair",
    "runs_of",
]

#: NIXL memory kinds by their code in a grant
MEMS: Final = ("DRAM", "VRAM")
#: ``(address, length)`` rows, ``uint64``, shape ``(n, 2)``
Runs = npt.NDArray[np.uint64]
#: memory by address: NIXL's kind ("DRAM" / "VRAM"), device id, rows
Place = tuple[str, int, Runs]


def runs_of(views: Sequence[memoryview]) -> Runs:
    """Flat, non-empty ``views`` as ``(address, length)`` rows in order, adjacent ones
    merged. A :class:`LayoutViews` answers from its layout; other lists cost one address
    look-up per view."""
    if isinstance(views, LayoutViews):
        return views.runs()
    addr = np.fromiter(map(address_of, views), dtype=np.uint64, count=len(views))
    n = np.fromiter(map(len, views), dtype=np.uint64, count=len(views))
    if addr.size > 1:
        first = np.flatnonzero(addr[1:] != addr[:-1] + n[:-1]) + 1
        if first.size + 1 < addr.size:
            first = np.concatenate(([0], first))
            addr, n = addr[first], np.add.reduceat(n, first)
    return np.stack((addr, n), axis=1)


def encode_grant(place: Place) -> bytes:
    """The grant's bytes (``PLANE_GRANT`` meta): the memory kind's code and the device
    id (little-endian u32 each), then the rows as little-endian u64 pairs."""
    mem, dev, runs = place
    head = MEMS.index(mem).to_bytes(4, "little") + dev.to_bytes(4, "little")
    return head + runs.astype("<u8", copy=False).tobytes()


def decode_grant(meta: bytes | bytearray, total: int) -> Place | None:
    """``(mem, dev, runs)`` of a peer's grant, or None unless the kind is known and the
    runs are non-empty and total exactly ``total`` bytes (the addresses and device are
    the peer's own business: NIXL refuses any outside the memory it registered)."""
    body = len(meta) - 8
    if body <= 0 or body % 16:
        return None
    code = int.from_bytes(meta[:4], "little")
    dev = int.from_bytes(meta[4:8], "little")
    if code >= len(MEMS):
        return None
    runs = np.frombuffer(meta, dtype="<u8", offset=8).reshape(-1, 2).astype(np.uint64)
    n = runs[:, 1]
    # lengths are at most `total` each, so their sum cannot wrap before the check
    if not n.all() or int(n.max()) > total or int(n.sum()) != total:
        return None
    return MEMS[code], dev, runs


def pair(
    a: Runs, b: Runs, dev_a: int = 0, dev_b: int = 0
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """Two run lists of the same total, split at their common boundaries: NIXL
    descriptor rows ``(address, length, device)`` (``dev_a`` / ``dev_b``; 0 for host
    memory), row i of both of the same length."""
    if a.shape == b.shape and bool((a[:, 1] == b[:, 1]).all()):  # already paired
        return _rows(a, dev_a), _rows(b, dev_b)
    ea, eb = np.cumsum(a[:, 1]), np.cumsum(b[:, 1])  # run ends, as byte offsets
    ends = np.union1d(ea, eb)
    starts = np.concatenate((np.zeros(1, np.uint64), ends[:-1]))
    cuts = ends - starts
    ia = np.searchsorted(ea, starts, side="right")  # the run holding each piece
    ib = np.searchsorted(eb, starts, side="right")
    da = a[ia, 0] + (starts - (ea[ia] - a[ia, 1]))
    db = b[ib, 0] + (starts - (eb[ib] - b[ib, 1]))
    return _descs(da, cuts, dev_a), _descs(db, cuts, dev_b)


def _rows(runs: Runs, dev: int) -> npt.NDArray[np.uint64]:
    """NIXL descriptor rows ``(address, length, dev)`` of ``runs``."""
    out = np.empty((runs.shape[0], 3), dtype=np.uint64)
    out[:, :2] = runs
    out[:, 2] = dev
    return out


def _descs(
    addr: npt.NDArray[np.uint64], lens: npt.NDArray[np.uint64], dev: int
) -> npt.NDArray[np.uint64]:
    """NIXL descriptor rows ``(address, length, dev)``."""
    out = np.empty((addr.size, 3), dtype=np.uint64)
    out[:, 0] = addr
    out[:, 1] = lens
    out[:, 2] = dev
    return out
