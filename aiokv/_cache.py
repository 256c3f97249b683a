"""``Cache``: a KV cache's descriptor and tensors, and wrapping user memory as tensors.

Who tracks a cache (ids, keys, refcounts) is :mod:`aiokv._registry`; a ``Cache`` only
carries an opaque ``owner`` token naming the registry that tracks it.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ._checks import UINT64_MAX
from ._checks import check_instance
from ._checks import param_invalid
from ._checks import renamed
from ._cuda_memory import cuda_memory
from ._enums import Placement
from ._layout import ByteLayout
from ._layout import LayoutViews
from ._models import CacheDesc

__all__ = ["UNTRACKED_ID", "Cache", "KvCache", "wrap_memory"]

log = logging.getLogger("aiokv")

#: the ``cache_id`` of a cache no ``LLMDataDist`` tracks (``create_cpu_cache``), as
#: llm_datadist's
UNTRACKED_ID = -1


class Cache:
    """A KV cache: ``num_tensors`` tensors of ``cache_desc.shape`` and dtype.

    Attributes:
        cache_id: numbered from 1 by the ``LLMDataDist`` that allocated or registered
            it, in order, never reused while it lives (as llm_datadist's cache engine);
            ``-1`` for ``create_cpu_cache``, which no ``LLMDataDist`` tracks.
        cache_desc: its descriptor (a copy of the one it was made with, whose dims
            ``update_dim`` may no longer change).
        tensors: the tensors (views of a pool region, or of user memory); empty once
            the memory of an allocated cache went back to its pool (at its
            ``deallocate_*``, or later while a ``CacheKey`` still holds it).
        tensor_addrs: ``data_ptr()`` of each tensor (empty with ``tensors``).
        is_blocks_cache: a paged cache (dim 0 is the block index).
        placement: ``HOST`` or ``DEVICE``.
    """

    __slots__ = (
        "__weakref__",
        "_bases",
        "_block_bytes",
        "_host_rows",
        "_owner",
        "_rows",
        "_size",
        "cache_desc",
        "cache_id",
        "is_blocks_cache",
        "tensors",
    )

    def __init__(
        self,
        cache_desc: CacheDesc,
        tensors: list[torch.Tensor],
        *,
        is_blocks_cache: bool,
        cache_id: int = UNTRACKED_ID,
    ) -> None:
        self.cache_id = cache_id
        self.cache_desc = cache_desc.locked_copy()
        self.tensors = tensors
        self.is_blocks_cache = is_blocks_cache
        # the registry that tracks this cache; None for create_cpu_cache (user-owned)
        self._owner: object | None = None
        self._rows: list[torch.Tensor] | None = None  # memoized views, see rows()
        self._host_rows: list[npt.NDArray[np.uint8]] | None = None
        self._bases: npt.NDArray[np.uint64] | None = None
        # a cache's descriptor is locked (frozen, dims refused): its sizes never change
        self._size = self.cache_desc.size
        self._block_bytes = self._size // self.num_blocks

    def _memory_freed(self) -> None:
        """Its pool memory went back to the pool (the registry, once the last reference
        is dropped): ``tensors`` and ``tensor_addrs`` become empty, as llm_datadist
        empties ``tensor_addrs``, so that the released cache no longer reaches memory
        that another cache may be given."""
        self.tensors = []
        self._rows = self._host_rows = None
        self._bases = None

    @property
    def placement(self) -> Placement:
        """Where the cache lives."""
        return self.cache_desc.placement

    @property
    def tensor_addrs(self) -> list[int]:
        """Address of each tensor's first byte."""
        return [t.data_ptr() for t in self.tensors]

    @property
    def per_device_tensor_addrs(self) -> list[list[int]]:
        """llm_datadist's ``KvCache`` form of :attr:`tensor_addrs`: one list per device
        (one device per ``LLMDataDist`` here)."""
        return [self.tensor_addrs]

    @property
    def num_blocks(self) -> int:
        """``shape[0]`` (blocks of a paged cache, batch of a contiguous one)."""
        return self.cache_desc.shape[0] if self.cache_desc.shape else 1

    @property
    def block_bytes(self) -> int:
        """Bytes of one dim-0 row of one tensor."""
        return self._block_bytes

    @property
    def slot_bytes(self) -> int:
        """Bytes of one batch slot of one tensor (a contiguous cache)."""
        return self._size // self.cache_desc.batch_size

    @property
    def slots_contiguous(self) -> bool:
        """Whether each batch slot is one contiguous byte range (batch dim 0)."""
        d = self.cache_desc
        return d.batch_dim_index % max(len(d.shape), 1) == 0

    @property
    def on_host(self) -> bool:
        """Whether the tensors are host-addressable (CPU) memory."""
        return not self.tensors or self.tensors[0].device.type == "cpu"

    def rows(self) -> list[torch.Tensor]:
        """Each tensor as a ``[num_blocks, block_bytes]`` uint8 view (same memory).

        Built once per cache (the tensors never change); do not modify the list."""
        rows = self._rows
        if rows is None:
            n, bb = self.num_blocks, self.block_bytes
            rows = self._rows = [t.view(torch.uint8).view(n, bb) for t in self.tensors]
        return rows

    def host_rows(self) -> list[npt.NDArray[np.uint8]] | None:
        """:meth:`rows` as numpy arrays (same memory) when the tensors are host memory,
        else ``None``. Built once per cache; do not modify the list."""
        rows = self._host_rows
        if rows is None and self.on_host:
            rows = self._host_rows = [r.numpy() for r in self.rows()]
        return rows

    def bases(self, tensors: range | None = None) -> npt.NDArray[np.uint64]:
        """:attr:`tensor_addrs` of ``tensors`` (default: all) as a ``uint64`` array: where
        :meth:`~aiokv._layout.ByteLayout.at` and the lease rows find each tensor's bytes
        (no Python object per tensor). A view of an array built once per cache; do not
        modify it."""
        bases = self._bases
        if bases is None:
            bases = self._bases = np.array(self.tensor_addrs, dtype=np.uint64)
        return bases if tensors is None else bases[tensors.start : tensors.stop : tensors.step]

    def at(self, layout: ByteLayout, tensors: range) -> LayoutViews:
        """The host memory of ``layout`` in each of ``tensors``, by address
        (:meth:`~aiokv._layout.ByteLayout.at`: no Python object per tensor). Host
        caches only; ``ValueError`` for a run past the end of a tensor."""
        return layout.at(self.bases(tensors), self._size)

    def __repr__(self) -> str:
        kind = "blocks" if self.is_blocks_cache else "contiguous"
        d = self.cache_desc
        return (
            f"Cache(id={self.cache_id}, {kind}, {d.num_tensors}x{list(d.shape)} "
            f"{d.data_type.name}, {d.placement.name})"
        )

    @classmethod
    @renamed(tensors_or_addrs="addrs")
    def create_cpu_cache(
        cls,
        cache_desc: CacheDesc,
        addrs: Sequence[torch.Tensor] | Sequence[int] | Sequence[Sequence[int]],
        *,
        is_blocks_cache: bool = True,
    ) -> Cache:
        """Wrap existing host memory as a cache, without copying.

        Args:
            cache_desc: describes the memory; its placement must be ``HOST``.
            addrs: ``num_tensors`` CPU tensors (contiguous, of the described shape and
                dtype) or ``num_tensors`` integer host addresses of ``cache_desc.size``
                bytes each, or ``KvCache``'s per-device form ``[[addr, ...]]`` (one
                device). The caller keeps that memory alive while the cache is used.
                Today's keyword ``tensors_or_addrs`` also works.
            is_blocks_cache: whether dim 0 is a block index (llm_datadist uses these for
                ``swap_blocks``).

        Raises:
            TypeError / NoneArgumentError: wrong argument types.
            LLMException: ``LLM_PARAM_INVALID`` if the tensors do not match the descriptor.
        """
        op = "Cache.create_cpu_cache"
        check_instance(op, "cache_desc", cache_desc, CacheDesc)
        if cache_desc.placement != Placement.HOST:
            param_invalid(op, "cache_desc.placement must be HOST")
        if isinstance(addrs, list | tuple) and addrs and isinstance(addrs[0], list | tuple):
            if len(addrs) != 1:
                param_invalid(op, f"addresses for {len(addrs)} devices; aiokv drives one")
            addrs = addrs[0]
        tensors = wrap_memory(op, cache_desc, addrs, torch.device("cpu"))
        return cls(cache_desc, tensors, is_blocks_cache=is_blocks_cache)


KvCache = Cache


def wrap_memory(
    op: str, desc: CacheDesc, tensors_or_addrs: Any, device: torch.device
) -> list[torch.Tensor]:
    """Validate user memory against ``desc`` and return tensors viewing it (no copy).

    Integer addresses are host addresses (wrapped with ctypes), or on a CUDA device
    device addresses, each checked with the driver (:func:`.cuda_memory`); each must be
    a multiple of the dtype's element size. A bad one raises before anything is kept.
    Tensors must be contiguous, on ``device`` (its index too, where it has one; CPU for
    HOST placement), of ``desc``'s shape and dtype.
    """
    if tensors_or_addrs is None:
        check_instance(op, "tensors_or_addrs", tensors_or_addrs, (list, tuple))
    if not isinstance(tensors_or_addrs, list | tuple):
        raise TypeError(
            f"{op}: tensors_or_addrs must be a list or tuple, got {type(tensors_or_addrs).__name__}"
        )
    items = list(tensors_or_addrs)
    if len(items) != desc.num_tensors:
        param_invalid(op, f"got {len(items)} tensors/addresses, cache_desc has {desc.num_tensors}")
    if all(isinstance(a, int) and not isinstance(a, bool) for a in items):
        return _wrap_addresses(op, desc, items, device)
    # DEVICE placement: this instance's device, index included (cuda:1 memory is not
    # cuda:0's: a kernel there would fault, a copy would cross devices)
    want = torch.device("cpu") if desc.placement == Placement.HOST else device
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: tensors_or_addrs[{i}] must be a torch.Tensor or an int")
        if tuple(t.shape) != desc.shape or t.dtype != desc.torch_dtype:
            param_invalid(
                op,
                f"tensor {i} is {list(t.shape)} {t.dtype}, "
                f"cache_desc says {list(desc.shape)} {desc.torch_dtype}",
            )
        if not t.is_contiguous():
            param_invalid(op, f"tensor {i} is not contiguous")
        if t.device.type != want.type or want.index not in (None, t.device.index):
            param_invalid(op, f"tensor {i} is on {t.device}, expected {want}")
    return [t.detach() for t in items]


def _wrap_addresses(
    op: str, desc: CacheDesc, addrs: list[int], device: torch.device
) -> list[torch.Tensor]:
    """Tensors of ``desc``'s shape over the memory at ``addrs``: host memory (ctypes) for
    a HOST placement or a cpu device, else CUDA memory checked with the driver."""
    on_device = desc.placement != Placement.HOST and device.type != "cpu"
    if on_device and device.type != "cuda":
        param_invalid(
            op, f"integer addresses name host or CUDA memory; on {device.type}, pass tensors"
        )
    out = []
    align = desc.torch_dtype.itemsize
    for a in addrs:
        if not 0 < a <= UINT64_MAX:
            raise ValueError(f"{op}: address {a} out of range")
        if a % align:
            param_invalid(
                op,
                f"address {a:#x} is not aligned to the {align}-byte elements of "
                f"{desc.data_type.name}",
            )
        if on_device:
            t = cuda_memory(op, a, desc.size, device)
        else:
            t = torch.frombuffer((ctypes.c_uint8 * desc.size).from_address(a), dtype=torch.uint8)
        out.append(t.view(desc.torch_dtype).view(desc.shape))
    return out
