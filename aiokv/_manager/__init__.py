"""``CacheManager``: the public async operations on caches (SPEC §1.4–1.5), a façade.

Every operation checks its arguments (synchronously: a failed call changes nothing),
plans, and delegates: bookkeeping to the registry, copies to the copy scheduler, remote
transfers to the remote client (as a :class:`~aiokv._remote._parts.Transfer` of this
side's cache), layer-wise transfers to :mod:`aiokv._layerwise`. Caches an operation
touches are pinned for its duration, so a concurrent ``deallocate_cache`` defers the free
instead of handing the bytes to someone else mid-copy.

``KvCacheManager`` is the same class with llm_datadist's legacy role gates: a table the
base methods consult, so its signatures and docstrings are the base's.

The operations live in one module per job, mixed into ``CacheManager`` over the shared
state of :class:`._base.ManagerBase`: :mod:`._bookkeeping` (allocate, register, release),
:mod:`._local` (copies and swaps), :mod:`._remote` (pulls and pushes), :mod:`._layers`
(``transfer_cache_async``); this module holds the class, its introspection and lifecycle.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import ClassVar

import torch

from .._cache import Cache
from .._checks import check_instance
from .._checks import check_int
from .._checks import param_invalid
from .._config import LLMConfig
from .._copy import CopyScheduler
from .._engine import Engine
from .._enums import LLMRole
from .._enums import Placement
from .._pool import MemPool
from .._pool import PoolStats
from .._registry import CacheRegistry
from .._registry import RegistryStats
from .._remote import RemoteClient
from ._bookkeeping import Bookkeeping
from ._layers import LayerWise
from ._local import LocalCopies
from ._remote import RemoteTransfers

__all__ = ["CacheManager", "KvCacheManager"]

_PULL_ROLES = (LLMRole.DECODER, LLMRole.MIX)
_PROMPT_ROLES = (LLMRole.PROMPT, LLMRole.MIX)


class CacheManager(Bookkeeping, LocalCopies, RemoteTransfers, LayerWise):
    """Allocates, registers, copies, swaps and transfers caches of one ``LLMDataDist``.

    Obtained from ``LLMDataDist.cache_manager`` after ``init``; every operation is async
    (``transfer_cache_async`` returns its started ``CacheTask`` at once) and never blocks
    the event loop beyond a small inline host copy (tens of µs, see
    :mod:`aiokv._copy._inline`). Errors follow SPEC §1.2.
    """

    def __init__(
        self,
        *,
        role: LLMRole,
        config: LLMConfig,
        device: torch.device,
        scheduler: CopyScheduler,
        registry: CacheRegistry,
        client: RemoteClient,
        engine: Engine,
        device_pool: MemPool | None,
        host_pool: MemPool | None,
    ) -> None:
        self._role = role
        self._engine = engine
        self._config = config
        self._device = device
        self._scheduler = scheduler
        self._registry = registry
        self._client = client
        self._pools = {Placement.DEVICE: device_pool, Placement.HOST: host_pool}
        self._closed = False
        self._tasks: set[asyncio.Task[None]] = set()  # layer-wise transfers, owned here

    # ---- introspection ------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """The torch device DEVICE-placed caches live on (CPU when there is no accelerator)."""
        return self._device

    def get_pool_stats(self, placement: Placement = Placement.DEVICE) -> PoolStats | None:
        """Statistics of the device or host pool; ``None`` if that pool is not configured."""
        self._check_open("get_pool_stats")
        check_instance("get_pool_stats", "placement", placement, Placement)
        pool = self._pools[placement]
        if pool is None:
            return None
        with self._registry.lock:
            return pool.stats()

    def statistics(self) -> RegistryStats:
        """A snapshot of the caches, keys and pins this manager tracks."""
        return self._registry.statistics()

    # ---- lifecycle ----------------------------------------------------------------------
    async def _close(self) -> None:
        """Refuse new work and stop layer-wise transfers (``LLMDataDist.finalize``)."""
        self._closed = True
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._client.leases is not None:
            await self._client.leases.aclose()


class KvCacheManager(CacheManager):
    """Legacy-mode manager (``enable_cache_manager=False``): the same operations, with
    llm_datadist's role gates (only DECODER pulls; only PROMPT removes keys or calls
    ``transfer_cache_async``; MIX may do both). A gated call raises
    ``LLMException(LLM_FEATURE_NOT_ENABLED)``.
    """

    _GATES: ClassVar[Mapping[str, tuple[LLMRole, ...]]] = {
        "pull_cache": _PULL_ROLES,
        "pull_blocks": _PULL_ROLES,
        "remove_cache_key": _PROMPT_ROLES,
        "transfer_cache_async": _PROMPT_ROLES,
    }

    def is_initialized(self) -> bool:
        """Whether the ``LLMDataDist`` is still initialized (``False`` after ``finalize``)."""
        return not self._closed

    def get_cache_tensors(self, cache: Cache, tensor_index: int = 0) -> list[torch.Tensor]:
        """Tensor ``tensor_index`` of ``cache``, once per device: a one-item list here
        (aiokv drives one device per ``LLMDataDist``), the same memory, no copy.

        Raises:
            TypeError / NoneArgumentError / ValueError: wrong ``cache`` or index type.
            LLMException: ``LLM_PARAM_INVALID`` for an index outside
                ``[0, num_tensors)``; ``LLM_KV_CACHE_NOT_EXIST`` for a released cache.
        """
        op = "get_cache_tensors"
        self._check_open(op)
        self._registry.entry(op, cache, "cache")
        index = check_int(op, "tensor_index", tensor_index, -(2**31), 2**31 - 1)
        if not 0 <= index < cache.cache_desc.num_tensors:
            param_invalid(
                op, f"tensor_index {index} out of range, [0, {cache.cache_desc.num_tensors})"
            )
        return [cache.tensors[index]]
