"""``Transfer``: one pull or push as the requester sees it, and its split into parts.

A transfer pairs the request sent to the peer with the local bytes it moves: which
local tensors (in wire order) and which runs of each (blocks, or one span). A transfer
too big for one request — over what the peer may stage, or over what this side
pipelines through host staging — is cut into :class:`Part` s along two axes that both
sides can name: groups of tensors (whole layers, as a sub-range of the request's layer
range) and groups of blocks (a sub-list of the block list, on both sides). Each part is
a complete request of its own, which also carries what the peer needs to check the
whole transfer (its tensor selection, the top of its block list), so that a transfer
the peer would refuse is refused at its first part; only the last part of a pull by
``CacheKey`` asks the peer to release the key (or, for device memory, a one-byte
:meth:`Transfer.tail` once every part landed).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import msgspec

from .._checks import Blocks
from .._layout import ByteLayout
from ._protocol import AddrsReq
from ._protocol import BlocksReq
from ._protocol import ChunksReq
from ._protocol import Request
from ._protocol import SlotReq
from ._protocol import Tensors
from ._protocol import pack_blocks

__all__ = ["Part", "Transfer"]


@dataclass(frozen=True, slots=True)
class Part:
    """One request of a transfer: what to send and the local bytes it moves.

    Attributes:
        request: the peer's request.
        tensors: local tensor indices, in wire order.
        layout: the runs moved from each of those tensors.
        nbytes: bytes it moves.
    """

    request: Request
    tensors: range
    layout: ByteLayout
    nbytes: int


@dataclass(frozen=True, slots=True)
class Transfer:
    """A pull or push: ``request`` on the peer, these local bytes here. Build one with
    :meth:`of_blocks` or :meth:`of_span`.

    Attributes:
        request: the whole request (its block list, if any, is ``remote``).
        tensors: local tensor indices, in wire order.
        built: the local runs of each tensor if already built (:attr:`layout` builds
            them when first asked: a transfer under a lease never needs them).
        local: local blocks of ``block_bytes`` (a paged transfer; pairs with ``remote``),
            or None for a span.
        remote: the request's block list as an array (None when it has none).
        block_bytes: bytes of one block, or of the span.
        offset: byte offset of the span in each local tensor (a span transfer).
    """

    request: Request
    tensors: range
    built: ByteLayout | None
    local: Blocks | None
    remote: Blocks | None
    block_bytes: int
    offset: int = 0

    @classmethod
    def of_blocks(
        cls,
        request: Request,
        tensors: range,
        local: Blocks,
        remote: Blocks | None,
        block_bytes: int,
        layout: ByteLayout | None = None,
    ) -> Transfer:
        """Blocks ``local`` here, ``remote`` (the request's list, same length) there;
        ``layout`` is ``ByteLayout.of_blocks(local, block_bytes)`` if already built."""
        return cls(request, tensors, layout, local, remote, block_bytes)

    @property
    def layout(self) -> ByteLayout:
        """The local runs of each tensor (built on first use, then kept)."""
        built = self.built
        if built is None:
            assert self.local is not None  # a span's layout is always built
            built = ByteLayout.of_blocks(self.local, self.block_bytes)
            object.__setattr__(self, "built", built)
        return built

    @classmethod
    def of_span(cls, request: Request, tensors: range, offset: int, nbytes: int) -> Transfer:
        """``nbytes`` from byte ``offset`` of each local tensor."""
        return cls(request, tensors, ByteLayout.of_span(offset, nbytes), None, None, nbytes, offset)

    @property
    def nbytes(self) -> int:
        """Bytes the transfer moves."""
        return self.layout.total(len(self.tensors))

    def whole(self) -> Part:
        """The transfer as one part."""
        return Part(self.request, self.tensors, self.layout, self.nbytes)

    def parts(self, limit: int) -> Iterator[Part]:
        """Parts of at most ``limit`` bytes where the transfer can be cut that fine (one
        block, or the span, of one tensor is the smallest part), in wire order: whole
        layers while one block of a layer fits, else single tensors. A transfer that
        needs no cut is one part. Only the last part keeps the request's ``release``."""
        group = self._group()
        if group * self.block_bytes > limit:
            group = 1  # one block of a layer is too big: cut inside layers
        ntensors = len(self.tensors)
        rows = 1 if self.local is None else int(self.local.size)
        per_group = group * rows * self.block_bytes
        if per_group <= limit:
            groups_per_part, rows_per_part = max(1, limit // per_group), rows
        else:
            groups_per_part = 1
            rows_per_part = max(1, limit // (group * self.block_bytes)) if rows > 1 else 1
        ngroups = ntensors // group
        cuts = [
            (g, min(g + groups_per_part, ngroups), r, min(r + rows_per_part, rows))
            for g in range(0, ngroups, groups_per_part)
            for r in range(0, rows, rows_per_part)
        ]
        if len(cuts) == 1:
            yield self.whole()
            return
        for i, (g0, g1, r0, r1) in enumerate(cuts):
            last = i == len(cuts) - 1
            request = self._cut(g0 * group, g1 * group, r0, r1, group, keep_release=last)
            tensors = self.tensors[g0 * group : g1 * group]
            if self.local is None:
                layout = ByteLayout.of_span(self.offset, self.block_bytes)
            else:
                layout = ByteLayout.of_blocks(self.local[r0:r1], self.block_bytes)
            yield Part(request, tensors, layout, len(tensors) * (r1 - r0) * self.block_bytes)

    def _group(self) -> int:
        """Tensors that must stay together: a layer (or all of them, when the request's
        tensor count is not a whole number of layers); one address of an AddrsReq."""
        req = self.request
        if isinstance(req, AddrsReq):
            return 1
        n, per = req.tensors.count, req.tensors.per_layer
        return per if n % per == 0 else n

    def _part_tensors(self, t0: int, t1: int, group: int) -> Tensors:
        """The selection of tensors ``[t0, t1)`` of the request's (groups of ``group``):
        it carries what the peer needs to check the whole transfer with every part, as
        the whole request would be — its tensor count (``whole``: no layer range) or its
        layer range and tensors per layer (``span``)."""
        req = self.request
        assert not isinstance(req, AddrsReq)
        sel = req.tensors
        first = 0 if sel.layers is None else sel.layers[0]
        whole = sel.count if sel.layers is None else None
        span = None if sel.layers is None else (*sel.layers, sel.per_layer)
        if group == 1:  # single tensors, named as layers of one tensor
            first *= sel.per_layer
        layers = (first + t0 // group, first + t1 // group)
        return Tensors(t1 - t0, layers, group, sel.dtype, whole, span)

    def tail(self) -> Request:
        """A request of one byte of the first tensor that asks the peer to release the
        key as the whole transfer read it (``whole`` / ``span``): sent once every part
        (none releasing) landed here, staging copies included."""
        req = self.request
        assert isinstance(req, SlotReq | ChunksReq) and req.release
        return SlotReq(req.key, self._part_tensors(0, 1, 1), 1, exact=False, release=True)

    def _cut(
        self, t0: int, t1: int, r0: int, r1: int, group: int, *, keep_release: bool
    ) -> Request:
        req = self.request
        changes: dict[str, object] = {}
        if isinstance(req, AddrsReq):
            changes["bases"] = req.bases[t0:t1]
        else:
            sel = req.tensors
            if (t0, t1) != (0, sel.count):  # (a group of every tensor is never cut)
                changes["tensors"] = self._part_tensors(t0, t1, group)
            if not keep_release and getattr(req, "release", False):
                changes["release"] = False
        if self.remote is not None and (r0, r1) != (0, int(self.remote.size)):
            packed = pack_blocks(self.remote[r0:r1])
            if isinstance(req, BlocksReq | AddrsReq):
                changes["blocks"] = packed
            elif isinstance(req, ChunksReq):
                changes["chunks"] = packed
            if isinstance(req, BlocksReq | ChunksReq):  # the peer checks the whole list's
                changes["top"] = int(self.remote.max())  # range with every part
        assert not isinstance(req, SlotReq) or "blocks" not in changes
        return msgspec.structs.replace(req, **changes)
