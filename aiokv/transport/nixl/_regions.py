"""The memory registered with a transport: counted ranges, looked up by address.

Thread-safe: owners register from their own threads, links look up on the loop.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["Region", "Regions"]


@dataclass(slots=True)
class Region:
    addr: int
    nbytes: int
    count: int = 1
    handle: Any = None  # the agent's registration, once made


class Regions:
    """Registered ``[addr, addr + nbytes)`` ranges of one memory kind: NIXL's ``mem``
    (``"DRAM"``, ``"VRAM"``) on device ``dev`` (0 for host memory); ``generation``
    changes with them. ``failed``: NIXL refused a registration of this kind, which is
    then not used by address at all."""

    def __init__(self, mem: str = "DRAM", dev: int = 0) -> None:
        self.mem = mem
        self.dev = dev
        self.failed = False
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._by_start: dict[int, Region] = {}
        self._bounds = np.zeros((2, 0), dtype=np.uint64)  # starts, ends (sorted)
        self._spans: tuple[list[int], list[int]] = ([], [])  # the same, as lists
        self.generation = 0

    def _changed(self) -> None:
        self.generation += 1
        ends = [self._by_start[a].addr + self._by_start[a].nbytes for a in self._starts]
        self._bounds = np.array([self._starts, ends], dtype=np.uint64).reshape(2, -1)
        self._spans = (list(self._starts), ends)

    def add(self, addr: int, nbytes: int, register: Callable[[int, int], Any] | None) -> None:
        """Count one registration of the range; the first one calls ``register`` (when
        given) and keeps its handle.

        Raises:
            ValueError: the range overlaps another registered range (not the same one).
        """
        with self._lock:
            r = self._by_start.get(addr)
            if r is not None and r.nbytes == nbytes:
                r.count += 1
                return
            i = bisect.bisect_right(self._starts, addr)
            prev = self._by_start[self._starts[i - 1]] if i else None
            if (
                r is not None
                or (prev is not None and prev.addr + prev.nbytes > addr)
                or (i < len(self._starts) and self._starts[i] < addr + nbytes)
            ):
                raise ValueError(f"memory [{addr:#x}, +{nbytes}) overlaps a registered range")
            region = Region(addr, nbytes)
            if register is not None:
                region.handle = register(addr, nbytes)
            self._starts.insert(i, addr)
            self._by_start[addr] = region
            self._changed()

    def remove(self, addr: int, nbytes: int) -> Region | None:
        """Count one deregistration; the region once its count drops to 0, else None."""
        with self._lock:
            r = self._by_start.get(addr)
            if r is None or r.nbytes != nbytes:
                return None
            r.count -= 1
            if r.count:
                return None
            del self._by_start[addr]
            self._starts.remove(addr)
            self._changed()
            return r

    def covers(self, runs: npt.NDArray[np.uint64]) -> bool:
        """Whether every ``(address, length)`` row lies inside one registered range."""
        if self.failed:
            return False
        # the usual case first: all rows inside the range that holds the lowest address
        # (three numpy calls instead of seven)
        if runs.size:
            addr = runs[:, 0]
            if self.holds(int(addr.min()), int((addr + runs[:, 1]).max())):
                return True
        starts, ends = self._bounds
        i = np.searchsorted(starts, runs[:, 0], side="right") - 1
        if not starts.size or (i < 0).any():
            return False
        return bool((runs[:, 0] + runs[:, 1] <= ends[i]).all())

    def cut(self, runs: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64] | None:
        """``runs`` as NIXL descriptors of this memory: as they are when every row lies
        inside one registered range (:meth:`covers`), else cut at the boundaries of the
        ranges (a row over adjacent ranges, e.g. the tensors of one allocation registered
        one by one, whose runs :func:`~._descs.runs_of` merged: NIXL takes a descriptor
        only inside one registration); None when some byte is not registered."""
        if self.covers(runs):
            return runs
        starts, ends = self._bounds
        if self.failed:
            return None
        if not runs.size or not starts.size:
            return None
        lo = runs[:, 0]
        hi = lo + runs[:, 1]
        bounds = np.union1d(starts, ends)
        first = np.searchsorted(bounds, lo, side="right")  # bounds strictly inside a row
        count = np.searchsorted(bounds, hi, side="left") - first
        if not count.any():
            return None  # nothing to cut: some row is not registered
        rows = np.arange(len(runs))
        cut_row = np.repeat(rows, count)
        offset = np.arange(cut_row.size) - np.repeat(np.cumsum(count) - count, count)
        piece_row = np.concatenate((rows, cut_row))
        piece_lo = np.concatenate((lo, bounds[np.repeat(first, count) + offset]))
        order = np.lexsort((piece_lo, piece_row))  # row by row, in address order
        piece_row, piece_lo = piece_row[order], piece_lo[order]
        piece_hi = hi[piece_row]
        same = piece_row[1:] == piece_row[:-1]  # the next piece is of the same row
        piece_hi[:-1][same] = piece_lo[1:][same]
        pieces = np.stack((piece_lo, piece_hi - piece_lo), axis=1)
        return pieces if self.covers(pieces) else None

    def holds(self, lo: int, hi: int) -> bool:
        """Whether ``[lo, hi)`` lies inside one registered range (not failed)."""
        # the table is replaced, never changed in place: no lock
        first, last = self._spans
        j = bisect.bisect_right(first, lo) - 1
        return not self.failed and j >= 0 and hi <= last[j]

    def all(self) -> list[Region]:
        with self._lock:
            return list(self._by_start.values())
