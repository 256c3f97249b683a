"""``LLMDataDist``: one participant of a disaggregated deployment (SPEC §1.6).

The composition root: ``init`` starts the engine thread, then (on it) builds the device,
pools, copy scheduler, registry, link table, remote client, peer service, transport and
cache manager, and wires them together; ``finalize`` takes them down in reverse order
and joins the engine. It also owns linking, which runs on the engine.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import threading
import time
import warnings
import weakref
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from ._checks import check_instance, check_int
from ._config import LLMConfig, MemPoolConfig
from ._copy import (
    CopyScheduler,
    SchedulerConfig,
    device_empty,
    host_empty,
    pre_touch,
    resolve_device,
    supports_pinning,
)
from ._engine import Engine
from ._enums import LLMRole, LLMStatusCode
from ._errors import LLMException, map_errors, status_of
from ._manager import CacheManager, KvCacheManager
from ._models import LLMClusterInfo
from ._pool import MemPool
from ._registry import CacheRegistry
from ._remote import LinkTable, PeerService, RemoteClient
from .transport import Transport, get_transport

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
        self._transport: Transport | None = None
        self._links = LinkTable()
        self._listen: tuple[str, int] | None = None
        self._engine: Engine | None = None
        self._teardown: asyncio.Task[None] | None = None

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
    def listen_address(self) -> tuple[str, int] | None:
        """The bound ``(host, port)`` after ``init`` when ``listen_ip_info`` was set, else None."""
        return self._listen

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

        On an initialized instance it does nothing (as llm_datadist), whatever ``options``.

        Args:
            options: an ``LLMConfig`` or a ``dict[str, str]`` of option keys (its
                ``generate_options()``, or llm_datadist's: see ``LLMConfig.from_options``).
                The config is copied: later changes to it do not affect this instance.
                Options aiokv accepts but does not act on are logged at debug.

        Raises:
            TypeError: bad options.
            LLMException: ``LLM_PARAM_INVALID`` (bad option value, device unavailable),
                ``LLM_DEVICE_OUT_OF_MEMORY`` / ``LLM_OUT_OF_MEMORY`` (pool reservation).
            RuntimeError: an ``init`` or ``finalize`` of this instance is under way.
        """
        started = self._start(options)
        if started is None:
            return
        config, engine = started
        try:
            await engine.run(self._build, config, engine)
        except BaseException:
            self._engine = None
            await engine.aclose()
            raise
        self._started()

    def _init_blocking(self, options: LLMConfig | dict[str, str]) -> None:
        """``init`` from a plain thread (``aiokv.sync``)."""
        started = self._start(options)
        if started is None:
            return
        config, engine = started
        try:
            engine.call(self._build, config, engine)
        except BaseException:
            self._engine = None
            engine.stop()
            raise
        self._started()

    def _start(self, options: Any) -> tuple[LLMConfig, Engine] | None:
        """Check ``options`` and start the engine thread (the synchronous half of init);
        ``None`` when already initialized."""
        op = "init"
        if self.initialized:
            log.debug("LLMDataDist %d: already initialized, init ignored", self._cluster_id)
            return None
        if self._engine is not None:
            raise RuntimeError(f"{op}: an init or finalize of this LLMDataDist is under way")
        check_instance(op, "options", options, (LLMConfig, dict))
        # through the dict form, as llm_datadist: ge_options' keys meet the fields there
        config = LLMConfig.from_options(
            options.generate_options() if isinstance(options, LLMConfig) else options
        )
        for key, value in config.ignored_options().items():
            log.debug("%s: option %s=%r accepted, not used by aiokv", op, key, value)
        engine = Engine(f"aiokv-engine-{self._cluster_id}")
        self._engine = engine  # taken now: a concurrent init fails instead of racing
        return config, engine

    def _started(self) -> None:
        _live.add(self)
        log.info(
            "LLMDataDist %d (%s) initialized on %s", self._cluster_id, self._role.name, self._device
        )

    async def _build(self, config: LLMConfig, engine: Engine) -> None:
        """On the engine: everything ``init`` promises, or nothing."""
        op = "init"
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
        registry = CacheRegistry()
        links = LinkTable()
        cls = CacheManager if config.enable_cache_manager else KvCacheManager
        mgr = cls(
            role=self._role,
            config=config,
            device=device,
            scheduler=scheduler,
            registry=registry,
            client=RemoteClient(links, config),
            engine=engine,
            device_pool=device_pool,
            host_pool=host_pool,
        )
        secret = None if config.link_secret is None else config.link_secret.encode()
        transport = get_transport(config.transfer_backend)(
            self._cluster_id,
            PeerService(self._cluster_id, registry, config),
            secret=secret,
            on_link=lambda link: links.add(link, replace=False),
            on_link_lost=links.lost,
        )
        try:
            if config.listen_address is not None:
                with map_errors(f"{op} (listen on {config.listen_ip_info})"):
                    self._listen = await transport.listen(*config.listen_address)
        except BaseException:
            await transport.aclose()
            await scheduler.aclose()
            raise
        self._manager = mgr
        self._links = links
        self._config = config
        self._scheduler = scheduler
        self._transport = transport
        self._device = device
        self._teardown = None

    @staticmethod
    async def _make_pool(
        scheduler: CopyScheduler, cfg: MemPoolConfig | None, device: Any, on_device: bool
    ) -> MemPool | None:
        if cfg is None:
            return None
        name = "device pool" if on_device else "host pool"
        code = (
            LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY if on_device else LLMStatusCode.LLM_OUT_OF_MEMORY
        )
        with map_errors(f"init ({name} of {cfg.memory_size} bytes)", code):

            def reserve() -> Any:
                region = (
                    device_empty(cfg.memory_size, device)
                    if on_device
                    else host_empty(cfg.memory_size, device, pin=supports_pinning(device))
                )
                pre_touch(region)  # commit the pages now, not on the first transfer
                return region

            region = await scheduler.call(reserve)
        return MemPool(region, cfg.page_shift, name)

    async def finalize(self) -> None:
        """Stop links, listener and worker threads; release the pools; join the engine.

        Idempotent. Caches handed out before become unusable. Cancelled, it can be
        called again and completes what the first call started.
        """
        engine = self._engine
        if engine is None:
            return
        await engine.run(self._tear_down)
        await engine.aclose()
        self._engine = None
        _live.discard(self)
        log.info("LLMDataDist %d finalized", self._cluster_id)

    async def _tear_down(self) -> None:
        """On the engine: one teardown, shielded, however many callers wait for it."""
        if self._teardown is None:
            self._teardown = asyncio.get_running_loop().create_task(self._tear_down_once())
        await asyncio.shield(self._teardown)

    async def _tear_down_once(self) -> None:
        mgr, sched, transport = self._manager, self._scheduler, self._transport
        self._manager = None
        self._listen = None
        if mgr is not None:
            await mgr._close()
        if transport is not None:
            await transport.aclose()  # fails in-flight transfers, closes links and listener
        if sched is not None:
            await sched.aclose()
        self._scheduler = None
        self._transport = None

    def _finalize_blocking(self) -> None:
        """Finalize from a plain thread (``aiokv.sync``, the exit hook)."""
        engine = self._engine
        if engine is None:
            return
        if engine.on_engine():
            raise RuntimeError("finalize: called on the engine thread")
        engine.call(self._tear_down)
        engine.stop()
        self._engine = None
        _live.discard(self)

    def __del__(self) -> None:
        if getattr(self, "_engine", None) is None:
            return
        warnings.warn(f"{self!r} was dropped without finalize()", ResourceWarning, stacklevel=2)
        # Not here: a collection may run on any thread, even one the teardown waits for.
        threading.Thread(target=self._finalize_blocking, name="aiokv-finalize", daemon=True).start()

    # ---- links --------------------------------------------------------------------------
    @staticmethod
    def _check_clusters(op: str, clusters: Any, timeout: Any) -> list[LLMClusterInfo]:
        check_instance(op, "clusters", clusters, (list, tuple))
        for i, c in enumerate(clusters):
            check_instance(op, f"clusters[{i}]", c, LLMClusterInfo)
        check_int(op, "timeout", timeout, 1, 3_600_000)
        return list(clusters)

    async def link_clusters(
        self, clusters: Sequence[LLMClusterInfo], timeout: int = 3000
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Link to each cluster, concurrently, within ``timeout`` milliseconds.

        Returns ``(overall, per_cluster)``: ``LLM_SUCCESS`` per linked cluster,
        ``LLM_ALREADY_LINK`` if already linked, ``LLM_PROCESSING_LINK`` while another call
        links it, ``LLM_LINK_FAILED`` when the peer is unreachable, refuses, fails
        authentication or is not the cluster named; ``overall`` is ``LLM_SUCCESS`` only if
        every cluster is. More than 16 clusters: ``LLM_CLUSTER_NUM_EXCEED_LIMIT`` for all.
        A failed peer never raises.

        Raises:
            TypeError / ValueError: bad arguments.
            RuntimeError: not initialized.
        """
        op = "link_clusters"
        self._require(op)
        infos = self._check_clusters(op, clusters, timeout)
        if len(infos) > 16:
            code = LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT
            return code, [code] * len(infos)
        assert self._engine is not None
        return await self._engine.run(self._link_all, infos, timeout)

    async def _link_all(
        self, infos: list[LLMClusterInfo], timeout: int
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(self._link_one(c, timeout)) for c in infos]
        codes = [t.result() for t in tasks]
        ok = all(c == LLMStatusCode.LLM_SUCCESS for c in codes)
        return (LLMStatusCode.LLM_SUCCESS if ok else LLMStatusCode.LLM_FAILED), codes

    async def _link_one(self, info: LLMClusterInfo, timeout_ms: int) -> LLMStatusCode:
        """Link one cluster; every failure becomes its code (logged), never an exception."""
        cid = info.remote_cluster_id
        if self._links.get(cid) is not None:
            return LLMStatusCode.LLM_ALREADY_LINK
        if not info.remote_ip_info:
            log.warning("link_clusters: cluster %d has no remote_ip_info", cid)
            return LLMStatusCode.LLM_LINK_FAILED
        if not self._links.begin(cid):
            return LLMStatusCode.LLM_PROCESSING_LINK
        assert self._config is not None and self._transport is not None
        total = self._config.link_total_time or timeout_ms / 1000
        deadline = time.monotonic() + total
        try:
            for attempt in range(self._config.link_retry_count):
                for host, port in info.remote_ip_info:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return LLMStatusCode.LLM_LINK_FAILED
                    try:
                        link = await self._transport.connect(host, port, timeout=left)
                    except LLMException as exc:
                        status_of(exc, log, f"link to {cid} at {host}:{port}, try {attempt + 1}")
                        continue
                    if link.peer.cluster_id != cid:
                        log.warning(
                            "%s:%d is cluster %d, not %d", host, port, link.peer.cluster_id, cid
                        )
                        await link.aclose()
                        return LLMStatusCode.LLM_LINK_FAILED
                    self._links.add(link)
                    return LLMStatusCode.LLM_SUCCESS
            return LLMStatusCode.LLM_LINK_FAILED
        finally:
            self._links.end(cid)

    async def unlink_clusters(
        self, clusters: Sequence[LLMClusterInfo], timeout: int = 3000, force: bool = False
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Close the links to each cluster; in-flight transfers on them fail.

        Returns ``(overall, per_cluster)`` with ``LLM_SUCCESS`` per closed link and
        ``LLM_NOT_YET_LINK`` for a cluster that was not linked. ``force`` is accepted for
        llm_datadist compatibility (closing never waits for the peer).
        """
        op = "unlink_clusters"
        self._require(op)
        infos = self._check_clusters(op, clusters, timeout)
        check_instance(op, "force", force, bool)
        assert self._engine is not None
        return await self._engine.run(self._unlink_all, infos, timeout)

    async def _unlink_all(
        self, infos: list[LLMClusterInfo], timeout: int
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        codes: list[LLMStatusCode] = []
        for info in infos:
            link = self._links.pop(info.remote_cluster_id)
            if link is None:
                codes.append(LLMStatusCode.LLM_NOT_YET_LINK)
                continue
            try:
                async with asyncio.timeout(timeout / 1000):
                    await link.aclose()
                codes.append(LLMStatusCode.LLM_SUCCESS)
            except TimeoutError:
                codes.append(LLMStatusCode.LLM_UNLINK_FAILED)
        ok = all(c == LLMStatusCode.LLM_SUCCESS for c in codes)
        return (LLMStatusCode.LLM_SUCCESS if ok else LLMStatusCode.LLM_FAILED), codes

    def linked_clusters(self) -> list[int]:
        """Cluster ids with a live link (either direction)."""
        self._require("linked_clusters")
        return self._links.clusters()

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


#: instances initialized and not yet finalized, finalized at interpreter exit
_live: weakref.WeakSet[LLMDataDist] = weakref.WeakSet()


@atexit.register
def _finalize_forgotten() -> None:
    for dd in list(_live):
        try:
            dd._finalize_blocking()
        except Exception:  # exit goes on; say what could not be released
            log.exception("finalizing %r at exit failed", dd)
