"""``LLMDataDist``: one participant of a disaggregated deployment (SPEC §1.6)."""

from __future__ import annotations

import logging
from types import TracebackType
from typing import Any

from ._device import device_empty, host_empty, pre_touch, resolve_device, supports_pinning
from ._enums import LLMRole, LLMStatusCode
from ._errors import LLMException, check_instance, check_int, map_errors
from ._manager import CacheManager, KvCacheManager
from ._models import LLMConfig, MemPoolConfig
from ._pool import MemPool
from ._scheduler import CopyScheduler, SchedulerConfig

__all__ = ["LLMDataDist"]

log = logging.getLogger("aiokv")


class LLMDataDist:
    """A prompt, decoder or mixed participant with its pools, caches and links.

    Use ``await dd.init(config)`` then ``await dd.finalize()``, or as an async context
    manager (``async with LLMDataDist(role, cluster_id, config) as dd:``). Several
    instances may live in one process, each with its own cluster id and listener.

    Args:
        role: ``LLMRole.PROMPT``, ``DECODER`` or ``MIX``.
        cluster_id: this participant's id (uint64), what peers name it by.
        config: optional; when given, ``async with`` calls ``init(config)``.
    """

    def __init__(
        self, role: LLMRole, cluster_id: int, config: LLMConfig | dict[str, str] | None = None
    ) -> None:
        op = "LLMDataDist"
        self._role = check_instance(op, "role", role, LLMRole)
        self._cluster_id = check_int(op, "cluster_id", cluster_id, 0, 2**64 - 1)
        if config is not None:
            check_instance(op, "config", config, (LLMConfig, dict))
        self._pending_config = config
        self._config: LLMConfig | None = None
        self._manager: CacheManager | None = None
        self._scheduler: CopyScheduler | None = None

    # ---- properties ---------------------------------------------------------------------
    @property
    def role(self) -> LLMRole:
        """This participant's role."""
        return self._role

    @property
    def cluster_id(self) -> int:
        """This participant's cluster id."""
        return self._cluster_id

    @property
    def initialized(self) -> bool:
        """Whether ``init`` succeeded and ``finalize`` has not run."""
        return self._manager is not None

    def _require(self, op: str) -> CacheManager:
        if self._manager is None:
            raise RuntimeError(f"{op}: LLMDataDist is not initialized; await init() first")
        return self._manager

    @property
    def config(self) -> LLMConfig:
        """The configuration ``init`` was given (RuntimeError before ``init``)."""
        self._require("config")
        assert self._config is not None
        return self._config

    @property
    def cache_manager(self) -> CacheManager:
        """The ``CacheManager`` (``enable_cache_manager=True``).

        Raises:
            RuntimeError: before ``init`` / after ``finalize``.
            LLMException: ``LLM_FEATURE_NOT_ENABLED`` in legacy mode (use
                ``kv_cache_manager``).
        """
        mgr = self._require("cache_manager")
        if isinstance(mgr, KvCacheManager):
            raise LLMException(
                "cache_manager: enable_cache_manager is False; use kv_cache_manager",
                LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
            )
        return mgr

    @property
    def kv_cache_manager(self) -> KvCacheManager:
        """The legacy ``KvCacheManager`` (``enable_cache_manager=False``), with role gates.

        Raises:
            RuntimeError: before ``init`` / after ``finalize``.
            LLMException: ``LLM_FEATURE_NOT_ENABLED`` when ``enable_cache_manager`` is True.
        """
        mgr = self._require("kv_cache_manager")
        if not isinstance(mgr, KvCacheManager):
            raise LLMException(
                "kv_cache_manager: enable_cache_manager is True; use cache_manager",
                LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
            )
        return mgr

    # ---- lifecycle ----------------------------------------------------------------------
    async def init(self, options: LLMConfig | dict[str, str]) -> None:
        """Resolve the device, reserve the pools, start the worker threads (and the
        listener when ``listen_ip_info`` is set).

        Args:
            options: an ``LLMConfig`` or its ``generate_options()`` dict form. The config is
                copied: later changes to it do not affect this instance.

        Raises:
            TypeError / ValueError: bad options.
            LLMException: ``LLM_PARAM_INVALID`` (device unavailable),
                ``LLM_DEVICE_OUT_OF_MEMORY`` / ``LLM_OUT_OF_MEMORY`` (pool reservation).
            RuntimeError: already initialized.
        """
        op = "init"
        if self._manager is not None:
            raise RuntimeError(f"{op}: LLMDataDist is already initialized")
        check_instance(op, "options", options, (LLMConfig, dict))
        config = (
            options.model_copy() if isinstance(options, LLMConfig)
            else LLMConfig.from_options(options)
        )
        device = resolve_device(config.device_type, config.device_id)
        scheduler = CopyScheduler(
            device,
            SchedulerConfig(
                swap_out_threads=config.swap_out_threads, swap_in_buffers=config.swap_in_buffers
            ),
        )
        try:
            device_pool = await self._make_pool(scheduler, config.mem_pool_cfg, device, True)
            host_pool = await self._make_pool(scheduler, config.host_mem_pool_cfg, device, False)
        except BaseException:
            await scheduler.aclose()
            raise
        cls = CacheManager if config.enable_cache_manager else KvCacheManager
        self._manager = cls(
            cluster_id=self._cluster_id,
            role=self._role,
            config=config,
            device=device,
            scheduler=scheduler,
            device_pool=device_pool,
            host_pool=host_pool,
        )
        self._config = config
        self._scheduler = scheduler
        log.info("LLMDataDist %d (%s) initialized on %s", self._cluster_id, self._role.name,
                 device)

    @staticmethod
    async def _make_pool(
        scheduler: CopyScheduler, cfg: MemPoolConfig | None, device: Any, on_device: bool
    ) -> MemPool | None:
        if cfg is None:
            return None
        name = "device pool" if on_device else "host pool"
        code = LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY if on_device else LLMStatusCode.LLM_OUT_OF_MEMORY
        with map_errors(f"init ({name} of {cfg.memory_size} bytes)", code):
            def reserve() -> Any:
                region = (
                    device_empty(cfg.memory_size, device) if on_device
                    else host_empty(cfg.memory_size, device, pin=supports_pinning(device))
                )
                pre_touch(region)  # commit the pages now, not on the first transfer
                return region

            region = await scheduler.call(reserve)
        return MemPool(region, cfg.page_shift, name)

    async def finalize(self) -> None:
        """Stop links, listener and worker threads; release the pools.

        Idempotent. Caches handed out before become unusable.
        """
        mgr, sched = self._manager, self._scheduler
        if mgr is None or sched is None:
            return
        self._manager = None
        self._scheduler = None
        mgr._close()
        await sched.aclose()
        log.info("LLMDataDist %d finalized", self._cluster_id)

    async def __aenter__(self) -> LLMDataDist:
        if self._manager is None and self._pending_config is not None:
            await self.init(self._pending_config)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.finalize()

    def __repr__(self) -> str:
        state = "initialized" if self.initialized else "not initialized"
        return f"LLMDataDist(role={self._role.name}, cluster_id={self._cluster_id}, {state})"
