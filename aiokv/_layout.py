"""``ByteLayout``: which bytes of which buffers a transfer moves, in wire order.

A transfer moves a list of *buffers* (one per selected tensor, or one per raw
destination address) and, from each buffer in turn, the same *runs* of bytes. Both
sides compute their own layout from the request independently — the requester from its
arguments, the server from the validated request — so only the byte ORDER must agree:
each side merges its own consecutive memory into one run, and buffer boundaries never
need to match. Pull, push, the serving side and layer-wise transfers all use this one
definition.

Runs are computed once per layout (numpy for long block lists, kept as numpy arrays, so
a layout that is only ever turned into addresses — NIXL — costs no Python per run;
plain Python for short ones). Turning a layout into buffers (:meth:`ByteLayout.views`)
makes no Python object per run: a :class:`LayoutViews` hands out address rows (numpy)
to transports that move bytes by address, and makes a view (one memoryview slice,
~0.1 µs) only when one is asked for.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from collections.abc import Sequence
from typing import overload

import numpy as np
import numpy.typing as npt
import torch

__all__ = ["ByteLayout", "LayoutViews", "address_of", "tensor_bytes", "total_bytes"]

#: block lists up to this long are laid out in plain Python (cheaper than numpy's setup)
_SMALL = 32


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable ``'B'`` memoryview over a contiguous CPU tensor's bytes (no copy).

    The caller keeps the memory alive while the view is used (caches are pinned while a
    transfer uses them).
    """
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class ByteLayout:
    """The runs ``[start, end)`` moved from each buffer of a transfer, in wire order.

    Build one with :meth:`of_blocks` or :meth:`of_span`; then :meth:`views` gives the
    memoryviews to hand to a transport. Immutable.

    Attributes:
        starts / ends: the runs ``[start, end)`` of one buffer, in wire order.
        per_buffer: bytes moved from each buffer.
        extent: one past the last byte touched in a buffer: a buffer must be at least this
            long (the serving side checks it against the memory it registered).
    """

    __slots__ = ("_nonempty", "ends", "extent", "per_buffer", "runs", "starts")

    def __init__(
        self,
        starts: Sequence[int] | npt.NDArray[np.int64],
        ends: Sequence[int] | npt.NDArray[np.int64],
    ) -> None:
        self.starts, self.ends = starts, ends
        self.runs = len(starts)
        if isinstance(starts, np.ndarray) and isinstance(ends, np.ndarray):
            lens = ends - starts  # long lists stay numpy: no Python object per run
            self._nonempty = bool((lens > 0).all())
            self.per_buffer = int(lens.sum())
            self.extent = int(ends.max()) if self.runs else 0
            return
        self._nonempty = all(b > a for a, b in zip(starts, ends, strict=True))
        self.per_buffer = sum(ends) - sum(starts)
        self.extent = max(ends) if self.runs else 0

    @classmethod
    def of_blocks(
        cls,
        blocks: npt.NDArray[np.int64],
        block_bytes: int,
        *,
        stride: int | None = None,
        base: int = 0,
    ) -> ByteLayout:
        """Blocks ``blocks`` (in that order) of ``block_bytes`` each, block ``b`` starting at
        byte ``base + b * stride`` (``stride`` defaults to ``block_bytes``).

        Blocks that follow each other in the list and in memory become one run. The
        indices must already be validated (non-negative; in range of the buffers).
        """
        step = block_bytes if stride is None else stride
        b = np.asarray(blocks, dtype=np.int64)
        if b.size <= _SMALL:  # numpy's fixed cost (~50 µs) would dominate a short list
            return cls._of_few(b.tolist(), block_bytes, step, base)
        if step != block_bytes:  # gaps between blocks: every block is its own run
            starts = base + b * step
            return cls(starts, starts + block_bytes)
        breaks = np.flatnonzero(np.diff(b) != 1) + 1
        first = np.concatenate(([0], breaks))
        counts = np.diff(np.concatenate((first, [b.size])))
        starts = base + b[first] * step
        return cls(starts, starts + counts * block_bytes)

    @classmethod
    def _of_few(cls, blocks: list[int], block_bytes: int, step: int, base: int) -> ByteLayout:
        """:meth:`of_blocks` in plain Python, for a short list: the same runs."""
        starts: list[int] = []
        ends: list[int] = []
        prev = None
        for blk in blocks:
            if step == block_bytes and prev is not None and blk == prev + 1:
                ends[-1] += block_bytes
            else:
                starts.append(base + blk * step)
                ends.append(base + blk * step + block_bytes)
            prev = blk
        return cls(starts, ends)

    @classmethod
    def of_span(cls, offset: int, nbytes: int) -> ByteLayout:
        """One run of ``nbytes`` bytes from byte ``offset`` of each buffer."""
        return cls([offset], [offset + nbytes])

    def total(self, nbuffers: int) -> int:
        """Bytes a transfer over ``nbuffers`` buffers moves."""
        return self.per_buffer * nbuffers

    def views(self, buffers: Sequence[memoryview]) -> Sequence[memoryview]:
        """The runs of each buffer in wire order (buffer-major): slices, no copies.

        Over flat ``'B'`` buffers each at least :attr:`extent` long, with every run
        non-empty (the usual case), the answer is a :class:`LayoutViews`: it makes no
        view until one is asked for, and knows the runs' addresses without any, so a
        transport that moves bytes by address (TCP's ``readv`` / ``writev``, NIXL) costs
        no Python object per run. Otherwise it is a list of slices.
        """
        if (
            self.runs
            and all(b.format == "B" and b.ndim == 1 and len(b) >= self.extent for b in buffers)
            and self._nonempty
        ):
            return LayoutViews(self, list(buffers))
        bounds = self.bounds()
        return [buf[a:b] for buf in buffers for a, b in bounds]

    def at(self, bases: npt.NDArray[np.uint64], size: int) -> LayoutViews:
        """The runs of each buffer of host memory at ``bases`` (``uint64`` addresses, in
        order), each at least ``size`` bytes long, as :meth:`views` gives them over
        views of that memory: a :class:`LayoutViews`, with no Python object per buffer
        (the bases are an array, e.g. a slice of :meth:`~aiokv._cache.Cache.bases`).

        The caller keeps the memory alive and in place while the views are used, and
        writable where they are written: nothing here can check an address.

        Raises:
            ValueError: a run outside ``size`` bytes, an empty run, or no run at all (a
                validated request never has one).
        """
        if not (self.runs and self._nonempty and self.extent <= size):
            raise ValueError(f"{self!r} does not fit buffers of {size} bytes")
        return LayoutViews(self, bases)

    def bounds(self) -> list[tuple[int, int]]:
        """The runs of one buffer as ``(start, end)`` Python ints, in wire order."""
        starts, ends = self.starts, self.ends
        if isinstance(starts, np.ndarray):
            starts = starts.tolist()
        if isinstance(ends, np.ndarray):
            ends = ends.tolist()
        return list(zip(starts, ends, strict=True))

    def addresses(self, bases: Sequence[int] | npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
        """``(address, length)`` rows of every run over buffers at ``bases``, wire order,
        adjacent runs merged (numpy: no per-run Python); a fresh array."""
        starts = np.asarray(self.starts, dtype=np.uint64)
        b = np.asarray(bases, dtype=np.uint64)
        grid = np.empty((b.size, starts.size, 2), dtype=np.uint64)
        np.add(b[:, None], starts, out=grid[:, :, 0])
        np.subtract(np.asarray(self.ends, dtype=np.uint64), starts, out=grid[:, :, 1])
        rows = grid.reshape(-1, 2)
        if len(rows) > 1:
            addr, n = rows[:, 0], rows[:, 1]
            first = np.flatnonzero(addr[1:] != addr[:-1] + n[:-1]) + 1
            if first.size + 1 < addr.size:  # some neighbours: merge them
                first = np.concatenate(([0], first))
                rows = np.stack((addr[first], np.add.reduceat(n, first)), axis=1)
        return rows

    def __repr__(self) -> str:
        return f"ByteLayout(runs={self.runs}, per_buffer={self.per_buffer}, extent={self.extent})"


class LayoutViews(Sequence[memoryview]):
    """:meth:`ByteLayout.views` over flat ``'B'`` buffers (or :meth:`ByteLayout.at` over
    buffers by address): a read-only sequence of the views (flat, non-empty, each inside
    its buffer), made one at a time when asked for (indexing, iteration), plus their
    memory as address rows (:meth:`runs`), for transports that move bytes by address
    without a Python object per run.

    The buffers' memory must stay alive (and, for :meth:`runs` or buffers by address,
    in place) while the views or rows are used, as for any view.

    Attributes:
        total: bytes over all views.
        readonly: whether any buffer is read-only (never, for buffers by address).
    """

    __slots__ = ("_bases", "_buffers", "_count", "_layout", "readonly", "total")

    def __init__(
        self, layout: ByteLayout, buffers: list[memoryview] | npt.NDArray[np.uint64]
    ) -> None:
        self._layout = layout
        if isinstance(buffers, np.ndarray):
            self._buffers: list[memoryview] | None = None
            self._bases: npt.NDArray[np.uint64] | None = buffers
            self.readonly = False
        else:
            self._buffers, self._bases = buffers, None
            self.readonly = any(b.readonly for b in buffers)
        self._count = len(buffers)
        self.total = layout.per_buffer * self._count

    def __len__(self) -> int:
        return self._layout.runs * self._count

    @overload
    def __getitem__(self, index: int) -> memoryview: ...
    @overload
    def __getitem__(self, index: slice) -> list[memoryview]: ...
    def __getitem__(self, index: int | slice) -> memoryview | list[memoryview]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError("LayoutViews index out of range")
        buf, run = divmod(index, self._layout.runs)
        return self._view(buf, int(self._layout.starts[run]), int(self._layout.ends[run]))

    def __iter__(self) -> Iterator[memoryview]:
        bounds = self._layout.bounds()
        for buf in range(self._count):
            for a, b in bounds:
                yield self._view(buf, a, b)

    def _view(self, buf: int, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` of buffer ``buf``."""
        if self._bases is None:
            assert self._buffers is not None
            return self._buffers[buf][start:end]
        addr = int(self._bases[buf]) + start
        return memoryview((ctypes.c_char * (end - start)).from_address(addr)).cast("B")

    def runs(self) -> npt.NDArray[np.uint64]:
        """The views' memory as ``(address, length)`` rows in order, adjacent ones merged
        (numpy: no per-run Python)."""
        if self._bases is not None:
            return self._layout.addresses(self._bases)
        assert self._buffers is not None
        return self._layout.addresses([address_of(b) for b in self._buffers])


def total_bytes(views: Sequence[memoryview]) -> int:
    """Bytes over flat ``'B'`` ``views`` (a :class:`LayoutViews` knows without making any)."""
    return views.total if isinstance(views, LayoutViews) else sum(map(len, views))


def address_of(view: memoryview) -> int:
    """The address of a flat ``'B'`` view (read-only ones too)."""
    if not view.readonly:  # ctypes: ~5x faster than numpy, which read-only views need
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
