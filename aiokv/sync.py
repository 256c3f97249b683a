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

from collections.abc import Iterator
from typing import Any

# aiokv's public names are this module's: type checkers read them from this import, and
# each name is imported here as itself (``X as X``), an explicit re-export
from . import __all__ as __all__
from ._blocking import blocking
from ._blocking import wrapping
from ._cache import Cache as Cache
from ._cache import KvCache as KvCache
from ._config import LLMConfig as LLMConfig
from ._config import LlmConfig as LlmConfig
from ._config import MemPoolConfig as MemPoolConfig
from ._datadist import LLMDataDist as _AsyncDataDist
from ._engine import Engine
from ._enums import DataType as DataType
from ._enums import LLMRole as LLMRole
from ._enums import LLMStatusCode as LLMStatusCode
from ._enums import Memtype as Memtype
from ._enums import Placement as Placement
from ._enums import RegisterMemStatus as RegisterMemStatus
from ._errors import LLMException as LLMException
from ._errors import NoneArgumentError as NoneArgumentError
from ._errors import Status as Status
from ._layerwise import CacheTask as _AsyncCacheTask
from ._layerwise import LayerSynchronizer as LayerSynchronizer
from ._manager import CacheManager as _AsyncCacheManager
from ._models import BlocksCacheKey as BlocksCacheKey
from ._models import CacheDesc as CacheDesc
from ._models import CacheKey as CacheKey
from ._models import CacheKeyByIdAndIndex as CacheKeyByIdAndIndex
from ._models import LLMClusterInfo as LLMClusterInfo
from ._models import MemInfo as MemInfo
from ._models import TransferConfig as TransferConfig
from ._models import TransferWithCacheKeyConfig as TransferWithCacheKeyConfig
from ._pool import PoolStats as PoolStats
from ._registry import RegistryStats
from ._stats import CopyStats as CopyStats
from ._stats import DataDistStats as DataDistStats
from ._stats import Histogram as Histogram
from ._stats import LinkStats as LinkStats
from ._stats import NotificationStats as NotificationStats
from ._stats import OpStats as OpStats
from ._stats import ServedStats as ServedStats

__all__ = list(__all__)  # every public name of aiokv (a copy: aiokv's stays as it is) ...
__all__.remove("__version__")  # ... but its version


class _Blocking:
    """A blocking face of the async object ``wrapped``, whose operations run on ``engine``."""

    __slots__ = ("_async", "_engine")

    def __init__(self, engine: Engine, wrapped: Any) -> None:
        self._engine = engine
        self._async = wrapped

    def _engine_for(self, op: str) -> Engine:
        return self._engine


class _Here:
    """What a face's ended operation runs on instead of an engine: the caller's thread
    (a coroutine that completes without suspending, e.g. an ended task's results)."""

    @staticmethod
    def call(fn: Any, *args: Any, **kwargs: Any) -> Any:
        coro = fn(*args, **kwargs)
        try:
            coro.send(None)
        except StopIteration as stop:
            return stop.value
        coro.close()
        raise AssertionError(f"{fn!r} suspended")


class CacheTask(_Blocking):
    """A running layer-wise transfer; ``synchronize`` / ``get_results`` block."""

    synchronize = blocking(_AsyncCacheTask.synchronize)
    get_results = blocking(_AsyncCacheTask.get_results)

    def _engine_for(self, op: str) -> Any:
        # an ended task answers from its own state (as the async one does), also once
        # its engine has ended (after finalize)
        return _Here if self._async.done() else self._engine

    def cancel(self) -> None:
        """Stop the transfer (returns at once; ``synchronize`` waits for the end)."""
        self._async.cancel()

    def done(self) -> bool:
        """Whether the transfer finished (or was cancelled)."""
        return bool(self._async.done())

    def errors(self) -> list[str | None]:
        """Per destination, why it failed so far (:meth:`aiokv.CacheTask.errors`)."""
        return list(self._async.errors())


class CacheManager(_Blocking):
    """The blocking ``CacheManager`` (``LLMDataDist.cache_manager``); each blocking method
    has the async one's signature and contract (:mod:`aiokv._blocking`)."""

    check_cache_key = staticmethod(_AsyncCacheManager.check_cache_key)
    allocate_cache = blocking(_AsyncCacheManager.allocate_cache)
    allocate_blocks_cache = blocking(_AsyncCacheManager.allocate_blocks_cache)
    register_cache = blocking(_AsyncCacheManager.register_cache)
    register_blocks_cache = blocking(_AsyncCacheManager.register_blocks_cache)
    deallocate_cache = blocking(_AsyncCacheManager.deallocate_cache)
    deallocate_blocks_cache = blocking(_AsyncCacheManager.deallocate_blocks_cache)
    remove_cache_key = blocking(_AsyncCacheManager.remove_cache_key)
    unregister_cache = blocking(_AsyncCacheManager.unregister_cache)
    copy_cache = blocking(_AsyncCacheManager.copy_cache)
    copy_blocks = blocking(_AsyncCacheManager.copy_blocks)
    copy_kv_blocks = blocking(_AsyncCacheManager.copy_kv_blocks)
    swap_blocks = blocking(_AsyncCacheManager.swap_blocks)
    pull_cache = blocking(_AsyncCacheManager.pull_cache)
    pull_blocks = blocking(_AsyncCacheManager.pull_blocks)
    push_cache = blocking(_AsyncCacheManager.push_cache)
    push_blocks = blocking(_AsyncCacheManager.push_blocks)
    remap_registered_memory = blocking(_AsyncCacheManager.remap_registered_memory)
    #: returns at once, as the async one does: the blocking face of the started task
    transfer_cache_async = wrapping(_AsyncCacheManager.transfer_cache_async, CacheTask)

    def _engine_for(self, op: str) -> Engine:
        # finalized (or being finalized): the async manager's RuntimeError, here, not the
        # hop's "finalized while this ran" from an engine that ended before the call
        if self._async._closed:
            self._async._check_open(op)
        return self._engine

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

    link_clusters = blocking(_AsyncDataDist.link_clusters)
    unlink_clusters = blocking(_AsyncDataDist.unlink_clusters)
    check_link_status = blocking(_AsyncDataDist.check_link_status)
    send_notification = blocking(_AsyncDataDist.send_notification)
    link = blocking(_AsyncDataDist.link)
    query_register_mem_status = blocking(_AsyncDataDist.query_register_mem_status)
    unlink = blocking(_AsyncDataDist.unlink)
    switch_role = blocking(_AsyncDataDist.switch_role)

    def _engine_for(self, op: str = "LLMDataDist") -> Engine:
        self._async._require(op)  # not initialized, finalized, being finalized: say which
        engine = self._async._engine
        assert engine is not None
        return engine

    def _face(self, manager: Any, cls: type[CacheManager]) -> Any:
        face = self._managers.get(id(manager))
        if face is None or face._async is not manager:
            face = self._managers[id(manager)] = cls(self._engine_for(), manager)
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

    def statistics(self) -> DataDistStats:
        """A snapshot of this participant (see the async ``LLMDataDist.statistics``)."""
        return self._async.statistics()

    def linked_clusters(self) -> list[int]:
        """Cluster ids with a live link."""
        return self._async.linked_clusters()

    def get_notifications(self) -> list[tuple[int, bytes]]:
        """Take the notifications received so far, oldest first; never blocks."""
        return self._async.get_notifications()

    def notifications(self) -> Iterator[tuple[int, bytes]]:
        """Every notification received, ``(cluster_id, payload)``, blocking until the
        next arrives; ends at ``finalize`` (see the async ``notifications``)."""
        engine = self._engine_for()
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

    def link_failure(self, remote_cluster_id: int) -> str | None:
        """Why the last attempt to link ``remote_cluster_id`` failed, or ``None`` (see
        the async ``LLMDataDist.link_failure``)."""
        return self._async.link_failure(remote_cluster_id)

    def __enter__(self) -> LLMDataDist:
        if not self.initialized and self._config_at_enter is not None:
            self.init(self._config_at_enter)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.finalize()

    def __repr__(self) -> str:
        return repr(self._async)
