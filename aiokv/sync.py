"""The blocking API, llm_datadist's shape: ``import aiokv.sync as llm_datadist``.

Every public name of :mod:`aiokv` is here. The values (keys, descriptors, configs,
enums, ``Cache``, errors) are the very same classes. ``LLMDataDist``, ``CacheManager``,
``KvCacheManager`` and ``CacheTask`` are thin blocking faces of the async objects: each
call runs the async operation on the instance's engine thread and blocks the calling
thread until it ends (the engine keeps serving peers meanwhile). Same engine, same
objects, one implementation. Calls are safe from many threads at once; none may be
made from inside an async synchronizer (it runs on the engine loop, and would wait for
itself: ``RuntimeError``).

Differences from the async API: an ``async def`` layer synchronizer runs on the
engine loop (there is no caller loop); ``with LLMDataDist(...) as dd`` finalizes on
exit. An instance never finalized is finalized at interpreter exit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any, TypeVar

from . import _layerwise, _manager
from ._cache import Cache, KvCache
from ._config import LLMConfig, LlmConfig, MemPoolConfig
from ._datadist import LLMDataDist as _AsyncDataDist
from ._engine import Engine
from ._enums import DataType, LLMRole, LLMStatusCode, Memtype, Placement, RegisterMemStatus
from ._errors import LLMException, NoneArgumentError, Status
from ._layerwise import LayerSynchronizer
from ._models import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    LLMClusterInfo,
    MemInfo,
    TransferConfig,
    TransferWithCacheKeyConfig,
)
from ._pool import PoolStats
from ._registry import RegistryStats
from ._stats import (
    CopyStats,
    DataDistStats,
    Histogram,
    LinkStats,
    NotificationStats,
    OpStats,
    ServedStats,
)

__all__ = [
    "BlocksCacheKey",
    "Cache",
    "CacheDesc",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "CacheManager",
    "CacheTask",
    "CopyStats",
    "DataDistStats",
    "DataType",
    "Histogram",
    "KvCache",
    "KvCacheManager",
    "LLMClusterInfo",
    "LLMConfig",
    "LLMDataDist",
    "LLMException",
    "LLMRole",
    "LLMStatusCode",
    "LayerSynchronizer",
    "LinkStats",
    "LlmConfig",
    "MemInfo",
    "MemPoolConfig",
    "Memtype",
    "NoneArgumentError",
    "NotificationStats",
    "OpStats",
    "Placement",
    "PoolStats",
    "RegisterMemStatus",
    "ServedStats",
    "Status",
    "TransferConfig",
    "TransferWithCacheKeyConfig",
]

T = TypeVar("T")


def _blocking(name: str, doc_of: type) -> Callable[..., Any]:
    """A method that blocks on the async method ``name`` of the wrapped object."""
    coro_fn = getattr(doc_of, name)

    @functools.wraps(coro_fn)
    def method(self: _Blocking, *args: Any, **kwargs: Any) -> Any:
        return self._engine.call(getattr(self._async, name), *args, **kwargs)

    method.__doc__ = (
        f"Blocking form of the async ``{doc_of.__name__}.{name}``.\n\n{coro_fn.__doc__}"
    )
    return method


class _Blocking:
    __slots__ = ("_async", "_engine")

    def __init__(self, engine: Engine, wrapped: Any) -> None:
        self._engine = engine
        self._async = wrapped


class CacheTask(_Blocking):
    """A running layer-wise transfer; ``synchronize`` / ``get_results`` block."""

    synchronize = _blocking("synchronize", _layerwise.CacheTask)
    get_results = _blocking("get_results", _layerwise.CacheTask)

    def cancel(self) -> None:
        """Stop the transfer (returns at once; ``synchronize`` waits for the end)."""
        self._async.cancel()

    def done(self) -> bool:
        """Whether the transfer finished (or was cancelled)."""
        return bool(self._async.done())


#: the async manager's operations, blocking here
_MANAGER_OPS = (
    "allocate_cache",
    "allocate_blocks_cache",
    "register_cache",
    "register_blocks_cache",
    "deallocate_cache",
    "deallocate_blocks_cache",
    "remove_cache_key",
    "unregister_cache",
    "copy_cache",
    "copy_blocks",
    "copy_kv_blocks",
    "swap_blocks",
    "pull_cache",
    "pull_blocks",
    "push_cache",
    "push_blocks",
    "remap_registered_memory",
)


class CacheManager(_Blocking):
    """The blocking ``CacheManager`` (``LLMDataDist.cache_manager``)."""

    for _op in _MANAGER_OPS:
        locals()[_op] = _blocking(_op, _manager.CacheManager)
    del _op

    check_cache_key = staticmethod(_manager.CacheManager.check_cache_key)

    @property
    def device(self) -> Any:
        """The torch device DEVICE-placed caches live on."""
        return self._async.device

    def get_pool_stats(self, placement: Placement = Placement.DEVICE) -> PoolStats | None:
        """Statistics of the device or host pool; ``None`` if that pool is not configured."""
        stats: PoolStats | None = self._async.get_pool_stats(placement)
        return stats

    def statistics(self) -> RegistryStats:
        """A snapshot of the caches, keys and pins this manager tracks."""
        stats: RegistryStats = self._async.statistics()
        return stats

    def transfer_cache_async(self, *args: Any, **kwargs: Any) -> CacheTask:
        """Start a layer-wise transfer (see the async ``transfer_cache_async``); returns
        a :class:`CacheTask` whose ``synchronize()`` blocks."""
        return CacheTask(self._engine, self._async.transfer_cache_async(*args, **kwargs))


class KvCacheManager(CacheManager):
    """The blocking legacy ``KvCacheManager`` (``LLMDataDist.kv_cache_manager``)."""

    def is_initialized(self) -> bool:
        """Whether the ``LLMDataDist`` is still initialized."""
        return bool(self._async.is_initialized())

    def get_cache_tensors(self, cache: Cache, tensor_index: int = 0) -> list[Any]:
        """Tensor ``tensor_index`` of ``cache``, once per device (see the async manager)."""
        tensors: list[Any] = self._async.get_cache_tensors(cache, tensor_index)
        return tensors


class LLMDataDist:
    """The blocking ``LLMDataDist``: ``LLMDataDist(role, cluster_id).init(options)``.

    Args:
        role: as the async ``LLMDataDist``.
        cluster_id: as the async ``LLMDataDist``.
        config: as the async ``LLMDataDist``; with it,
            ``with LLMDataDist(role, cluster_id, config) as dd:`` initializes.
    """

    def __init__(
        self, role: LLMRole, cluster_id: int, config: LLMConfig | dict[str, str] | None = None
    ) -> None:
        self._async = _AsyncDataDist(role, cluster_id, config)
        self._config_at_enter = config
        self._managers: dict[int, CacheManager] = {}

    @property
    def role(self) -> LLMRole:
        """This participant's role."""
        return self._async.role

    @property
    def cluster_id(self) -> int:
        """This participant's cluster id."""
        return self._async.cluster_id

    @property
    def initialized(self) -> bool:
        """Whether ``init`` succeeded and ``finalize``'s teardown has not completed
        (see the async ``LLMDataDist.initialized``)."""
        return self._async.initialized

    @property
    def listen_address(self) -> tuple[str, int] | None:
        """The bound ``(host, port)`` after ``init`` when ``listen_ip_info`` was set."""
        return self._async.listen_address

    @property
    def config(self) -> LLMConfig:
        """The configuration ``init`` was given."""
        return self._async.config

    def _engine(self) -> Engine:
        engine = self._async._engine
        if engine is None:
            raise RuntimeError("LLMDataDist is not initialized; call init() first")
        return engine

    def _face(self, manager: Any, cls: type[CacheManager]) -> Any:
        face = self._managers.get(id(manager))
        if face is None or face._async is not manager:
            face = self._managers[id(manager)] = cls(self._engine(), manager)
        return face

    @property
    def cache_manager(self) -> CacheManager:
        """The blocking ``CacheManager`` (``enable_cache_manager=True``)."""
        face: CacheManager = self._face(self._async.cache_manager, CacheManager)
        return face

    @property
    def kv_cache_manager(self) -> KvCacheManager:
        """The blocking legacy ``KvCacheManager`` (``enable_cache_manager=False``)."""
        face: KvCacheManager = self._face(self._async.kv_cache_manager, KvCacheManager)
        return face

    def init(self, options: LLMConfig | dict[str, str]) -> None:
        """Start the engine, reserve the pools and the listener (see the async ``init``)."""
        self._async._init_blocking(options)

    def finalize(self) -> None:
        """Stop everything ``init`` started and join its threads (idempotent)."""
        self._managers.clear()
        self._async._finalize_blocking()

    def link_clusters(
        self, clusters: Sequence[LLMClusterInfo], timeout: int = 3000
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Link to each cluster within ``timeout`` ms: ``(overall, per_cluster)``."""
        return self._engine().call(self._async.link_clusters, clusters, timeout)

    def unlink_clusters(
        self, clusters: Sequence[LLMClusterInfo], timeout: int = 3000, force: bool = False
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Close the links to each cluster: ``(overall, per_cluster)``."""
        return self._engine().call(self._async.unlink_clusters, clusters, timeout, force)

    def statistics(self) -> DataDistStats:
        """A snapshot of this participant (see the async ``LLMDataDist.statistics``)."""
        return self._async.statistics()

    def linked_clusters(self) -> list[int]:
        """Cluster ids with a live link."""
        return self._async.linked_clusters()

    def check_link_status(self, remote_cluster_id: int) -> None:
        """Raise ``LLMException(LLM_NOT_YET_LINK)`` unless the cluster is linked."""
        self._engine().call(self._async.check_link_status, remote_cluster_id)

    def send_notification(self, cluster_id: int, payload: bytes) -> None:
        """Send a notification to a linked cluster (see the async ``send_notification``)."""
        self._engine().call(self._async.send_notification, cluster_id, payload)

    def get_notifications(self) -> list[tuple[int, bytes]]:
        """Take the notifications received so far, oldest first; never blocks."""
        return self._async.get_notifications()

    def notifications(self) -> Iterator[tuple[int, bytes]]:
        """Every notification received, ``(cluster_id, payload)``, blocking until the
        next arrives; ends at ``finalize`` (see the async ``notifications``)."""
        engine = self._engine()
        inbox = self._async._inbox
        while True:
            item = inbox.pop()
            if item is not None:
                yield item
                continue
            try:
                if not engine.call(inbox.wait):
                    return
            except LLMException:
                if self._async._engine is not engine or self._async._closing:
                    return
                raise

    def link(self, comm_name: str, cluster_rank_info: dict[int, int], rank_table: str) -> int:
        """Start a two-sided link (see the async ``link``); its ``comm_id``."""
        return self._engine().call(self._async.link, comm_name, cluster_rank_info, rank_table)

    def query_register_mem_status(self, comm_id: int) -> RegisterMemStatus:
        """``PREPARING``, ``OK`` or ``FAILED``: the state of ``link``'s communicator."""
        return self._engine().call(self._async.query_register_mem_status, comm_id)

    def unlink(self, comm_id: int) -> None:
        """Close the links of ``link``'s communicator and forget it."""
        self._engine().call(self._async.unlink, comm_id)

    def switch_role(self, role: LLMRole, switch_options: dict[str, str] | None = None) -> None:
        """Take ``role``; start, move or stop the listener (see the async ``switch_role``)."""
        self._engine().call(self._async.switch_role, role, switch_options)

    def __enter__(self) -> LLMDataDist:
        if not self.initialized and self._config_at_enter is not None:
            self.init(self._config_at_enter)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.finalize()

    def __repr__(self) -> str:
        return repr(self._async)
