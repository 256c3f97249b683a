"""A page allocator over one preallocated region (SPEC §1.4).

The pool owns one ``torch.uint8`` tensor of ``memory_size`` bytes (on the device, or in
host memory, pinned where the device supports it), zeroed once at creation so its pages
are committed. Allocations are rounded up to whole pages and served best-fit from free
spans kept in two sorted indexes (by size, by start): allocate and free are O(log n) in
the number of free spans, and a freed span coalesces with free neighbours at once.

All methods are synchronous bookkeeping and never await; callers on the event loop
thread keep them atomic.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field

import torch
from sortedcontainers import SortedDict
from sortedcontainers import SortedList

from ._enums import LLMStatusCode
from ._errors import LLMException

__all__ = ["MemPool", "PoolStats", "Span"]


@dataclass(frozen=True, slots=True)
class Span:
    """An allocation: ``npages`` pages from page ``start``; ``nbytes`` is what was asked."""

    start: int
    npages: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class PoolStats:
    """A snapshot of a pool, in bytes (``allocations`` counts live spans).

    ``peak_used``: the most bytes ever in use at once; ``failed_allocations``: requests
    refused for lack of a large enough free span (``LLM_OUT_OF_MEMORY``). These two
    are history, not state: ``==`` compares the pool's state only. ``quarantined``:
    bytes of ``used`` kept out of the pool for good (:meth:`MemPool.keep`): a NIXL
    transfer that could not be stopped may still touch them.
    """

    total: int
    used: int
    free: int
    largest_free: int
    allocations: int
    page_size: int
    peak_used: int = field(default=0, compare=False)
    failed_allocations: int = field(default=0, compare=False)
    quarantined: int = 0


class MemPool:
    """Best-fit page allocator over ``region``.

    Args:
        region: the memory, a 1-D ``uint8`` tensor; the pool serves views of it.
        page_shift: pages are ``1 << page_shift`` bytes; trailing bytes short of a page
            are never served.
        name: used in error messages ("device pool", "host pool").
    """

    def __init__(self, region: torch.Tensor, page_shift: int, name: str = "pool") -> None:
        if region.dtype != torch.uint8 or region.dim() != 1:
            raise ValueError("MemPool: region must be a 1-D uint8 tensor")
        self.region = region
        self.name = name
        self.page_size = 1 << page_shift
        self._pages = region.numel() // self.page_size
        if self._pages < 1:
            raise ValueError("MemPool: region is smaller than one page")
        self._by_size: SortedList[tuple[int, int]] = SortedList()  # (npages, start)
        self._by_start: SortedDict[int, int] = SortedDict()  # start -> npages
        self._live: dict[int, Span] = {}
        self._used_pages = 0
        self._kept_pages = 0  # of live spans never freed (keep)
        self._peak_pages = 0
        self._failed = 0
        self._insert_free(0, self._pages)

    def _insert_free(self, start: int, npages: int) -> None:
        self._by_start[start] = npages
        self._by_size.add((npages, start))

    def _remove_free(self, start: int, npages: int) -> None:
        del self._by_start[start]
        self._by_size.remove((npages, start))

    def allocate(self, nbytes: int) -> Span:
        """Reserve at least ``nbytes`` bytes (whole pages), best fit, lowest address on ties.

        Raises:
            ValueError: ``nbytes`` < 1.
            LLMException: ``LLM_OUT_OF_MEMORY`` when no free span is large enough; the pool
                is unchanged.
        """
        if nbytes < 1:
            raise ValueError(f"{self.name}: cannot allocate {nbytes} bytes")
        need = -(-nbytes // self.page_size)
        i = self._by_size.bisect_left((need, -1))
        if i == len(self._by_size):
            self._failed += 1
            raise LLMException(
                f"{self.name}: out of memory allocating {nbytes} bytes "
                f"({self.stats().free} free, largest span {self.stats().largest_free})",
                status_code=LLMStatusCode.LLM_OUT_OF_MEMORY,
            )
        npages, start = self._by_size[i]
        self._remove_free(start, npages)
        if npages > need:
            self._insert_free(start + need, npages - need)
        span = Span(start, need, nbytes)
        self._live[start] = span
        self._used_pages += need
        self._peak_pages = max(self._peak_pages, self._used_pages)
        return span

    def allocate_many(self, nbytes: int, count: int) -> list[Span]:
        """:meth:`allocate` ``count`` spans of ``nbytes``, all or none: on failure the
        pool is as before, its ``peak_used`` included (a rolled-back partial allocation
        was never in use).

        Raises:
            as :meth:`allocate`.
        """
        peak = self._peak_pages
        spans: list[Span] = []
        try:
            for _ in range(count):
                spans.append(self.allocate(nbytes))
        except BaseException:
            for s in spans:
                self.free(s)
            self._peak_pages = peak
            raise
        return spans

    def free(self, span: Span) -> None:
        """Return ``span`` to the pool, coalescing with free neighbours.

        Raises:
            ValueError: ``span`` is not a live allocation of this pool (double free).
        """
        if self._live.get(span.start) is not span:
            raise ValueError(f"{self.name}: {span} is not a live allocation")
        del self._live[span.start]
        self._used_pages -= span.npages
        start, npages = span.start, span.npages
        i = self._by_start.bisect_left(start)
        if i > 0:
            pstart, pn = self._by_start.peekitem(i - 1)
            if pstart + pn == start:
                self._remove_free(pstart, pn)
                start, npages = pstart, npages + pn
        nxt = start + npages
        if nxt in self._by_start:
            nn = self._by_start[nxt]
            self._remove_free(nxt, nn)
            npages += nn
        self._insert_free(start, npages)

    def keep(self, span: Span) -> None:
        """Never return ``span`` to the pool (in place of :meth:`free`): memory a transfer
        that could not be stopped may still touch stays used, counted as
        ``quarantined``.

        Raises:
            ValueError: ``span`` is not a live allocation of this pool.
        """
        if self._live.get(span.start) is not span:
            raise ValueError(f"{self.name}: {span} is not a live allocation")
        self._kept_pages += span.npages

    def view(self, span: Span) -> torch.Tensor:
        """The ``span.nbytes`` bytes of ``span`` as a 1-D uint8 view of the region."""
        off = span.start * self.page_size
        return self.region[off : off + span.nbytes]

    def statistics(self) -> PoolStats:
        """Usage in bytes (the same as :meth:`stats`)."""
        return self.stats()

    def stats(self) -> PoolStats:
        """Usage in bytes."""
        largest = self._by_size[-1][0] if self._by_size else 0
        total = self._pages * self.page_size
        used = self._used_pages * self.page_size
        return PoolStats(
            total=total,
            used=used,
            free=total - used,
            largest_free=largest * self.page_size,
            allocations=len(self._live),
            page_size=self.page_size,
            peak_used=self._peak_pages * self.page_size,
            failed_allocations=self._failed,
            quarantined=self._kept_pages * self.page_size,
        )

    def check(self) -> None:
        """Assert the internal invariants (tests call this after every step)."""
        assert len(self._by_start) == len(self._by_size)
        prev_end = -1
        free_pages = 0
        for start, n in self._by_start.items():
            assert n > 0 and start > prev_end, "free spans overlap or touch (not coalesced)"
            assert (n, start) in self._by_size
            prev_end = start + n
            free_pages += n
        assert prev_end <= self._pages
        assert free_pages + self._used_pages == self._pages
        assert sum(s.npages for s in self._live.values()) == self._used_pages
