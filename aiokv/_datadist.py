"""``LLMDataDist``: one participant of a disaggregated deployment (SPEC §1.6).

The composition root: ``init`` starts the engine thread, then (on it) builds the device,
pools, copy scheduler, registry, link table, remote client, peer service, transport and
cache manager, and wires them together; ``finalize`` takes them down in reverse order
and joins the engine. It also owns linking, which runs on the engine.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import threading
import weakref
from collections.abc import AsyncIterator
from collections.abc import Sequence
from typing import Any

from ._checks import check_instance
from ._checks import check_int
from ._checks import param_invalid
from ._config import LLMConfig
from ._config import MemPoolConfig
from ._copy import CopyScheduler
from ._copy import SchedulerConfig
from ._copy import Stager
from ._copy import device_empty
from ._copy import host_empty
from ._copy import pre_touch
from ._copy import resolve_device
from ._copy import supports_pinning
from ._engine import Engine
from ._engine import completing
from ._engine import on_asyncio
from ._enums import LLMRole
from ._enums import LLMStatusCode
from ._enums import Placement
from ._enums import RegisterMemStatus
from ._errors import LLMException
from ._errors import map_errors
from ._errors import warn
from ._manager import CacheManager
from ._manager import KvCacheManager
from ._models import LLMClusterInfo
from ._pool import MemPool
from ._pool import PoolStats
from ._registry import CacheRegistry
from ._registry import RegistryStats
from ._remote import MAX_NOTIFICATION_BYTES
from ._remote import Inbox
from ._remote import Leases
from ._remote import Linker
from ._remote import LinkTable
from ._remote import PeerService
from ._remote import RemoteClient
from ._remote import parse_link
from ._remote._protocol import NotifyReq
from ._remote._protocol import encode
from ._stats import CopyStats
from ._stats import DataDistStats
from ._stats import OpCounter
from ._stats import PeerCounters
from .transport import Link
from .transport import LinkCallback
from .transport import Transport
from .transport import get_transport
from .transport import load_tls

__all__ = ["LEGACY_POOL", "LLMDataDist"]

log = logging.getLogger("aiokv")

#: The device pool legacy mode (``enable_cache_manager=False``) reserves when
#: ``mem_pool_cfg`` is not given: 1 GiB in 64 KiB pages, its pages committed on first use.
LEGACY_POOL = MemPoolConfig(1 << 30)


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
        self._linker: Linker | None = None
        # statistics: totals over the instance's life, across init / finalize cycles
        self._counters = PeerCounters()
        self._copy_jobs = OpCounter()
        self._copy_inline = OpCounter()
        self._links = LinkTable(self._counters)
        self._inbox = Inbox()  # notifications; its counters survive init cycles
        self._listen: tuple[str, int] | None = None
        self._engine: Engine | None = None
        self._starting = threading.Lock()  # an init's check-and-take of the engine is one step
        self._closing = False  # finalize has begun: the teardown runs until the engine ends
        self._finalized = False  # a finalize completed (and no init since)
        self._building: asyncio.Future[None] | None = None  # set by _build, on the engine

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
        """Whether ``init`` succeeded and ``finalize``'s teardown has not completed.

        A ``finalize`` under way (or cancelled while its teardown goes on) keeps this
        True, and new operations raise ``RuntimeError``; it turns False once listener,
        links, worker threads and pools are released."""
        return self._manager is not None

    def _require(self, op: str) -> CacheManager:
        if self._manager is None:
            if self._finalized:
                raise RuntimeError(
                    f"{op}: LLMDataDist {self._cluster_id} was finalized; call init() to "
                    "start it again"
                )
            raise RuntimeError(
                f"{op}: LLMDataDist {self._cluster_id} is not initialized; call init() first"
            )
        if self._closing:
            raise RuntimeError(
                f"{op}: LLMDataDist {self._cluster_id} is being finalized; call init() once "
                "finalize() returned"
            )
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
            LLMException: ``LLM_PARAM_INVALID`` in legacy mode (use ``kv_cache_manager``),
                as llm_datadist.
        """
        mgr = self._require("cache_manager")
        if isinstance(mgr, KvCacheManager):
            param_invalid(
                "cache_manager",
                "enable_cache_manager is False (llm_datadist's legacy mode): use "
                "kv_cache_manager, or set LLMConfig.enable_cache_manager = True for "
                "cache_manager",
            )
        return mgr

    @property
    def kv_cache_manager(self) -> KvCacheManager:
        """The legacy ``KvCacheManager`` (``enable_cache_manager=False``), with role gates.

        Raises:
            RuntimeError: before ``init`` / after ``finalize``.
            LLMException: ``LLM_PARAM_INVALID`` when ``enable_cache_manager`` is True, as
                llm_datadist.
        """
        mgr = self._require("kv_cache_manager")
        if not isinstance(mgr, KvCacheManager):
            param_invalid("kv_cache_manager", "enable_cache_manager is True; use cache_manager")
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
            self._drop_engine(engine)
            await engine.aclose()
            raise
        self._started(engine)

    def _init_blocking(self, options: LLMConfig | dict[str, str]) -> None:
        """``init`` from a plain thread (``aiokv.sync``)."""
        started = self._start(options, blocking=True)
        if started is None:
            return
        config, engine = started
        try:
            engine.call(self._build, config, engine)
        except BaseException:
            if self._manager is not None and self._engine is engine:
                # interrupted as the build completed ("its effects stand"): initialized,
                # the interrupt raised after, as if it came just after init returned
                # (or, a finalize begun meanwhile undoing it, raised as it is)
                with contextlib.suppress(LLMException):
                    self._started(engine)
                raise
            self._drop_engine(engine)
            engine.stop()
            raise
        self._started(engine)

    def _start(self, options: Any, *, blocking: bool = False) -> tuple[LLMConfig, Engine] | None:
        """Check ``options`` and start the engine thread (the synchronous half of init;
        ``blocking``: of ``aiokv.sync``'s, which waits for the rest); ``None`` when
        already initialized."""
        op = "init"
        self._reap()
        if self._closing:
            raise RuntimeError(f"{op}: a finalize of this LLMDataDist is under way")
        if self.initialized:
            self._warn_reinit(options)
            return None
        if self._engine is not None:
            raise RuntimeError(f"{op}: an init or finalize of this LLMDataDist is under way")
        check_instance(op, "options", options, (LLMConfig, dict))
        # through the dict form, as llm_datadist: ge_options' keys meet the fields there
        config = LLMConfig._read_in(op, options)
        for key, value in config.ignored_options().items():
            log.debug("%s: option %s=%r accepted, not used by aiokv", op, key, value)
        loop = None
        if not config.engine_thread:
            if blocking or not on_asyncio():
                param_invalid(
                    op,
                    "engine_thread=False runs the engine on the asyncio loop that awaits "
                    "init(), and there is none here (aiokv.sync, trio): await init() in a "
                    "coroutine on asyncio, or keep engine_thread=True",
                )
            loop = asyncio.get_running_loop()
        with self._starting:  # from several threads at once (aiokv.sync): one wins
            if self.initialized and not self._closing:  # by another thread meanwhile
                self._warn_reinit(options)
                return None
            if self._closing or self._engine is not None:
                raise RuntimeError(f"{op}: an init or finalize of this LLMDataDist is under way")
            engine = Engine(f"aiokv-engine-{self._cluster_id}", loop)
            self._engine = engine  # taken now: a concurrent init fails instead of racing
        return config, engine

    def _warn_reinit(self, options: Any) -> None:
        """A second ``init`` is a no-op (as llm_datadist); warn when its options differ
        from the first's, which they do not change."""
        try:
            again = LLMConfig._read_in("init", options)
        except (LLMException, TypeError, ValueError):
            again = None
        first = self._config
        if again is not None and first is not None and _effective(again) == _effective(first):
            log.debug("LLMDataDist %d: already initialized, init ignored", self._cluster_id)
            return
        msg = (
            f"LLMDataDist {self._cluster_id} is already initialized: this init() and its "
            "different options are ignored (as llm_datadist); to apply them, call "
            "finalize() first, then init() with them"
        )
        warn(msg, RuntimeWarning)
        log.warning("%s", msg)

    def _drop_engine(self, engine: Engine) -> None:
        """A failed ``init``: forget its engine, and end a ``finalize`` that began
        meanwhile and waits for it (which would otherwise find no engine of its own to
        forget and leave this instance 'being finalized' for good)."""
        if self._engine is engine:
            self._engine = None
            self._finalized = self._closing
            self._closing = False

    def _started(self, engine: Engine) -> None:
        """``init`` built everything on ``engine``: initialized.

        Raises:
            LLMException: ``LLM_FAILED``, a ``finalize`` that began while init ran
                has undone it (the instance is finalized; ``init`` may be called again).
        """
        with self._starting:  # one step against _ended (a finalize on another thread)
            if self._engine is not engine or self._closing:
                raise LLMException(
                    "init: a finalize of this LLMDataDist, begun while init ran, undid it",
                    status_code=LLMStatusCode.LLM_FAILED,
                )
            self._finalized = False
            _warn_twins(self)
            _live.add(self)
        log.info(
            "LLMDataDist %d (%s) initialized on %s", self._cluster_id, self._role.name, self._device
        )

    async def _build(self, config: LLMConfig, engine: Engine) -> None:
        """On the engine: everything ``init`` promises, or nothing. A ``finalize`` that
        begins meanwhile waits for its end (:meth:`_tear_down`), then undoes it."""
        building: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._building = building
        try:
            await self._build_all(config, engine)
        finally:
            building.set_result(None)

    async def _build_all(self, config: LLMConfig, engine: Engine) -> None:
        op = "init"
        # first: a bad TLS file fails init before a byte of pool is reserved
        tls = load_tls(
            config.tls_cert_file, config.tls_key_file, config.tls_ca_file, config.tls_check_hostname
        )
        if tls is not None and config.transfer_backend not in ("tcp", "nixl"):
            raise LLMException(
                f"{op}: TLS needs transfer_backend 'tcp' or 'nixl', "
                f"not {config.transfer_backend!r}",
                status_code=LLMStatusCode.LLM_PARAM_INVALID,
            )
        extra: dict[str, Any] = {} if tls is None else {"tls": tls}
        device = resolve_device(config.device_type, config.device_id)
        scheduler = CopyScheduler(
            device,
            SchedulerConfig(
                swap_out_threads=config.swap_out_threads, swap_in_buffers=config.swap_in_buffers
            ),
            jobs=self._copy_jobs,
            inline=self._copy_inline,
        )
        device_cfg, touch = config.mem_pool_cfg, True
        if device_cfg is None and not config.enable_cache_manager:
            device_cfg, touch = LEGACY_POOL, False  # legacy mode reserves one, as llm_datadist
        transport: Transport | None = None
        try:  # from here every failure closes what was made: worker threads, transport
            device_pool = await self._make_pool(scheduler, device_cfg, device, True, touch)
            host_pool = await self._make_pool(scheduler, config.host_mem_pool_cfg, device, False)
            registry = CacheRegistry()
            links = LinkTable(self._counters)
            stager = Stager(scheduler)
            leases = Leases(registry, config)
            cls = CacheManager if config.enable_cache_manager else KvCacheManager
            mgr = cls(
                role=self._role,
                config=config,
                device=device,
                scheduler=scheduler,
                registry=registry,
                client=RemoteClient(links, config, stager, self._counters, leases),
                engine=engine,
                device_pool=device_pool,
                host_pool=host_pool,
            )
            secret = (
                None
                if config.link_secret is None
                else config.link_secret.get_secret_value().encode()
            )
            transport = get_transport(config.transfer_backend)(
                self._cluster_id,
                PeerService(
                    self._cluster_id, registry, config, stager, self._counters, leases, self._inbox
                ),
                secret=secret,
                handshake_timeout=config.handshake_timeout / 1000,
                on_link=_each(leases.on_link, links.add),
                on_link_lost=_each(leases.on_link_lost, links.lost, lambda k: stager.drop(k.peer)),
                **extra,
            )
            # memory that grants and requests use, registered once (NIXL needs it; a
            # transport that moves bytes over sockets ignores it)
            for pool in (device_pool, host_pool):
                if pool is not None:
                    region = pool.region
                    transport.register_memory(
                        region.data_ptr(), region.numel(), device=str(region.device)
                    )
            registry.on_register = lambda addr, n, dev: transport.register_memory(
                addr, n, device=dev
            )
            registry.on_deregister = lambda addr, n, dev: transport.deregister_memory(
                addr, n, device=dev
            )
            registry.outlived = lambda addr, n, dev: transport.outlived(addr, n, device=dev)
            if config.listen_address is not None:
                with map_errors(f"{op} (listen on {config.listen_ip_info})"):
                    self._listen = await transport.listen(*config.listen_address)
        except BaseException:
            if transport is not None:
                await transport.aclose()
            await scheduler.aclose()
            raise
        self._links = links
        self._config = config
        self._scheduler = scheduler
        self._transport = transport
        self._linker = Linker(links, transport, config, leases.end_link)
        self._device = device
        self._inbox.open()
        self._manager = mgr  # last: ``initialized`` (read from any thread) says it is all set

    @staticmethod
    async def _make_pool(
        scheduler: CopyScheduler,
        cfg: MemPoolConfig | None,
        device: Any,
        on_device: bool,
        touch: bool = True,
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
                if touch:
                    pre_touch(region)  # commit the pages now, not on the first transfer
                return region

            region = await scheduler.call(reserve)
        return MemPool(region, cfg.page_shift, name)

    async def finalize(self) -> None:
        """Stop links, listener and worker threads; release the pools; join the engine.

        Idempotent. Caches handed out before become unusable. Once called, the teardown
        runs to its end on the engine whatever happens to this call: cancelled (or
        timed out), the call stops waiting, the teardown goes on (the listener closes,
        the engine thread ends by itself), and ``initialized`` stays True until it is
        complete; calling ``finalize`` again waits for the end and returns with no
        thread of this instance left.
        """
        engine = self._engine
        if engine is None:
            return
        if engine.on_engine() and not engine.inline:  # refused before anything begins
            raise RuntimeError("finalize: called on the engine thread")
        self._begin_finalize(engine)
        await engine.wait_ended()
        self._ended(engine)

    def _finalize_blocking(self) -> None:
        """Finalize from a plain thread (``aiokv.sync``, the exit hook); an interrupt
        stops the wait, as a cancellation stops :meth:`finalize`'s."""
        engine = self._engine
        if engine is None:
            return
        if engine.on_engine():
            raise RuntimeError("finalize: called on the engine thread")
        self._begin_finalize(engine)
        engine.join()
        if engine.abandoned and self._scheduler is not None:
            # an inline engine's loop ended first: its teardown never ran; what needs no
            # loop is released here (the copy threads), the rest goes with the process
            self._scheduler.stop_nowait()
        self._ended(engine)

    def _begin_finalize(self, engine: Engine) -> None:
        """Synchronously (nothing to cancel): refuse new operations, and hand the
        engine its final task, the teardown, after which its loop stops."""
        self._closing = True
        if self._manager is not None:
            self._manager._closed = True  # now, not when the engine gets to it
        engine.close_soon(self._tear_down)

    def _ended(self, engine: Engine) -> None:
        """The engine thread has ended: forget it (once, whoever waited)."""
        with self._starting:  # one step against _started (an init on another thread)
            if self._engine is not engine:
                return
            self._engine = None
            self._closing = False
            self._finalized = True
            _live.discard(self)
        log.info("LLMDataDist %d finalized", self._cluster_id)

    def _reap(self) -> None:
        """Forget an engine whose teardown completed while nobody waited for it."""
        engine = self._engine
        if engine is not None and self._closing and engine.ended:
            engine.join()
            self._ended(engine)

    async def _tear_down(self) -> None:
        """On the engine, its final task: manager tasks, links, transport (listener
        included), copy workers, in that order; every step runs even if one fails.
        ``initialized`` turns False at the end."""

        def forget() -> None:  # drops the last references to the pools too
            if self._manager is not None:  # and those of caches the user still holds
                self._manager._registry.close()
            self._manager = self._linker = self._transport = self._scheduler = None
            self._listen = None

        building = self._building
        if building is not None and not building.done():
            await building  # an init under way: let it end, then undo what it made
        async with contextlib.AsyncExitStack() as steps:  # run in reverse order
            steps.callback(forget)
            for step in (self._scheduler, self._transport, self._links, self._linker):
                if step is not None:
                    steps.push_async_callback(step.aclose)
            if self._manager is not None:
                steps.push_async_callback(self._manager._close)
            steps.callback(self._inbox.close)  # first: ends the waits for notifications

    def __del__(self) -> None:
        if getattr(self, "_engine", None) is None or self._closing:
            return  # finalized, or its teardown under way: the engine ends by itself
        msg = f"{self!r} was dropped without finalize()"
        warn(msg, ResourceWarning)
        log.warning("%s: finalizing it now", msg)  # shown where ResourceWarning is not
        # Not here: a collection may run on any thread, even one the teardown waits for.
        threading.Thread(target=self._finalize_blocking, name="aiokv-finalize", daemon=True).start()

    # ---- links (the work runs on the engine, in ``_remote.Linker``) --------------------
    @staticmethod
    def _check_clusters(op: str, clusters: Any, timeout: Any) -> list[LLMClusterInfo]:
        check_instance(op, "clusters", clusters, (list, tuple))
        for i, c in enumerate(clusters):
            check_instance(op, f"clusters[{i}]", c, LLMClusterInfo)
            check_int(op, f"clusters[{i}].remote_cluster_id", c.remote_cluster_id, 0, 2**64 - 1)
        if check_int(op, "timeout", timeout, -(2**31), 2**31 - 1) <= 0:
            param_invalid(op, f"timeout must be > 0 ms, got {timeout}")
        return list(clusters)

    def _linker_on(self, op: str) -> tuple[Engine, Linker]:
        self._require(op)
        assert self._engine is not None and self._linker is not None
        return self._engine, self._linker

    async def link_clusters(
        self, clusters: Sequence[LLMClusterInfo], timeout: int = 3000
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Link to each cluster's listener, concurrently, within ``timeout`` milliseconds.

        Returns ``(overall, per_cluster)``: ``LLM_SUCCESS`` per linked cluster (also when
        the peer had already linked to us), ``LLM_ALREADY_LINK`` if this side already
        linked it (or an earlier entry of this call names it), ``LLM_PROCESSING_LINK``
        while another call links it, ``LLM_LINK_FAILED`` when the peer is unreachable,
        refuses, fails authentication or is not the cluster named. ``overall`` is
        ``LLM_SUCCESS`` or the code of the first cluster that failed; ``[]`` gives
        ``(LLM_PARAM_INVALID, [])``; more than 16 clusters give
        ``LLM_CLUSTER_NUM_EXCEED_LIMIT`` for all. ``link_retry_count`` attempts are
        spread over the call's time: ``timeout``, or ``link_total_time`` when set and
        shorter. A failed peer never raises.

        Raises:
            TypeError / ValueError: bad arguments (``timeout`` not an int32).
            LLMException: ``LLM_PARAM_INVALID`` for ``timeout <= 0``, and, as
                llm_datadist, in cache-manager mode without ``local_comm_res`` for a
                cluster with no ``local_ip_info`` (``append_local_ip_info``; aiokv does
                not use its content).
            RuntimeError: not initialized.
        """
        op = "link_clusters"
        engine, linker = self._linker_on(op)
        infos = self._check_clusters(op, clusters, timeout)
        cfg = self.config
        if cfg.enable_cache_manager and not cfg.local_comm_res:
            for i, c in enumerate(infos):
                if not c.local_ip_info:  # llm_datadist's check, and its words
                    param_invalid(
                        op,
                        f"clusters[{i}] (cluster {c.remote_cluster_id}): local_ip_info_list "
                        "is empty. Call append_local_ip_info to add local_ip_info when "
                        "local_comm_res option is unspecified or empty.",
                    )
        if not infos:
            return LLMStatusCode.LLM_PARAM_INVALID, []
        if len(infos) > 16:
            code = LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT
            return code, [code] * len(infos)
        return await engine.run(linker.link_all, infos, timeout)

    async def unlink_clusters(
        self, clusters: Sequence[LLMClusterInfo], timeout: int = 3000, force: bool = False
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Close every connection to each cluster; the peer sees its link end.

        Returns ``(overall, per_cluster)``: ``LLM_SUCCESS`` per cluster now unlinked,
        including one that was not (or no longer) linked, so both sides may unlink in
        any order. Without ``force``, this side's transfers in flight to a cluster may
        finish first; still running at ``timeout`` ms, they keep the cluster linked and
        its code is ``LLM_UNLINK_FAILED``. With ``force`` they fail at once
        (``LLM_LINK_FAILED``). ``overall`` and ``[]`` as ``link_clusters``.

        Raises:
            TypeError / ValueError / LLMException / RuntimeError: as ``link_clusters``.
        """
        op = "unlink_clusters"
        engine, linker = self._linker_on(op)
        infos = self._check_clusters(op, clusters, timeout)
        check_instance(op, "force", force, bool)
        if not infos:
            return LLMStatusCode.LLM_PARAM_INVALID, []
        return await engine.run(linker.unlink_all, infos, timeout, force)

    def statistics(self) -> DataDistStats:
        """A snapshot of this participant: per peer cluster its transfers (bytes, ops,
        failures by code, in flight, latency histogram) and what it served; links up
        and down; the copy engine (jobs, inline copies, queue depth); pool usage; the
        registry's caches, keys and pins. See :class:`DataDistStats`.

        Cheap (no hop to the engine, no I/O) and callable from any thread, also before
        ``init`` and after ``finalize`` (then the gauges of pools, caches and the copy
        queue are ``None`` / 0, the totals stay).
        """
        mgr = self._manager
        scheduler = self._scheduler
        if scheduler is not None and not scheduler.closed:
            copies = scheduler.statistics()
        else:
            copies = CopyStats(self._copy_jobs.snapshot(), self._copy_inline.snapshot(), 0, 0)
        pools: tuple[PoolStats | None, PoolStats | None] = (None, None)
        caches: RegistryStats | None = None
        if mgr is not None and not self._closing:
            with contextlib.suppress(RuntimeError):  # finalized meanwhile: no gauges
                pools = (mgr.get_pool_stats(Placement.DEVICE), mgr.get_pool_stats(Placement.HOST))
                caches = mgr.statistics()
        return DataDistStats(
            cluster_id=self._cluster_id,
            initialized=mgr is not None,
            links_up=self._counters.links_up,
            links_down=self._counters.links_down,
            links=self._counters.snapshot(self._links.clusters()),
            copies=copies,
            device_pool=pools[0],
            host_pool=pools[1],
            caches=caches,
            notifications=self._inbox.statistics(),
        )

    def linked_clusters(self) -> list[int]:
        """Cluster ids with a live link (either direction)."""
        self._require("linked_clusters")
        return self._links.clusters()

    def link_failure(self, remote_cluster_id: int) -> str | None:
        """Why the last attempt to link ``remote_cluster_id`` failed (``link_clusters``,
        or ``link``'s communicator), e.g. ``"127.0.0.1:26000: connection refused"``, else
        why its last link ended without this side unlinking it (``"link ended: closed
        by peer"``); ``None`` if neither, or a link to that cluster came up since. aiokv's
        addition: ``link_clusters`` returns only ``LLM_LINK_FAILED`` (llm_datadist's
        shape) and logs the reason at WARNING on the ``aiokv.links`` logger; operations
        on that cluster name it in their ``LLM_NOT_YET_LINK`` error.

        Raises:
            TypeError / ValueError: not a uint64.
        """
        cid = check_int("link_failure", "remote_cluster_id", remote_cluster_id, 0, 2**64 - 1)
        return self._links.failure(cid)

    async def check_link_status(self, remote_cluster_id: int) -> None:
        """Return if the link to ``remote_cluster_id`` is up, as the transport knows it.

        Raises:
            LLMException: ``LLM_NOT_YET_LINK`` when there is no live link to it.
            TypeError / ValueError: not a uint64.
        """
        op = "check_link_status"
        engine, _ = self._linker_on(op)
        cid = check_int(op, "remote_cluster_id", remote_cluster_id, 0, 2**64 - 1)
        await engine.run_sync(self._links.require, op, cid)

    # ---- notifications -----------------------------------------------------------------
    async def send_notification(self, cluster_id: int, payload: bytes) -> None:
        """Send ``payload`` to the linked cluster ``cluster_id``'s application: it arrives
        there, in the order sent, through ``notifications()`` / ``get_notifications()``.

        A notification travels on the link, authenticated as the link is (``link_secret``,
        TLS). It returns once the peer filed it (within ``sync_kv_timeout``). A link that
        breaks while it is sent may leave it delivered although this raised.

        Args:
            cluster_id: a cluster with a live link (either direction).
            payload: at most :data:`~aiokv._remote.MAX_NOTIFICATION_BYTES` (64 KiB).

        Raises:
            TypeError / ValueError: ``cluster_id`` not a uint64, ``payload`` not bytes.
            LLMException: ``LLM_PARAM_INVALID`` for a payload over 64 KiB,
                ``LLM_NOT_YET_LINK`` when not linked, ``LLM_LINK_BUSY`` when the peer's
                queue is full (:data:`~aiokv._remote.NOTIFICATION_QUEUE` waiting: take
                them there, then retry), ``LLM_TIMEOUT``, ``LLM_LINK_FAILED``.
            RuntimeError: not initialized.
        """
        op = "send_notification"
        engine, _ = self._linker_on(op)
        cid = check_int(op, "cluster_id", cluster_id, 0, 2**64 - 1)
        check_instance(op, "payload", payload, (bytes, bytearray))
        if len(payload) > MAX_NOTIFICATION_BYTES:
            param_invalid(op, f"payload of {len(payload)} bytes; at most {MAX_NOTIFICATION_BYTES}")
        meta = encode(NotifyReq(bytes(payload)))
        timeout = self.config.sync_kv_timeout / 1000

        async def send() -> None:
            link = self._links.require(op, cid)
            with self._links.request(cid), map_errors(op):
                await link.write(meta, [], timeout=timeout)
            self._inbox.sent()

        await engine.run(send)

    async def notifications(self) -> AsyncIterator[tuple[int, bytes]]:
        """Every notification received, as ``(cluster_id, payload)``, oldest first, as
        it arrives: ``async for cid, payload in dd.notifications():``. Ends when the
        instance is finalized. Several iterators share one queue (each notification
        goes to one of them, or to ``get_notifications``).

        Raises:
            RuntimeError: not initialized.
        """
        engine, _ = self._linker_on("notifications")
        inbox = self._inbox
        while True:
            item = inbox.pop()  # taken here, not on the engine: a cancelled wait loses none
            if item is not None:
                yield item
                continue
            try:
                if not await engine.run(inbox.wait):
                    return  # finalized
            except LLMException:
                if self._closing or self._engine is not engine:
                    return  # finalized while it waited
                raise

    def get_notifications(self) -> list[tuple[int, bytes]]:
        """Take the notifications received so far, ``(cluster_id, payload)`` oldest
        first; ``[]`` when none. Never blocks; callable from any thread at any time.

        At most :data:`~aiokv._remote.NOTIFICATION_QUEUE` (1024) wait at once; a
        notification beyond is refused (the sender gets ``LLM_LINK_BUSY``) and counted
        in ``statistics().notifications.refused``. Those waiting at ``finalize`` are
        dropped.
        """
        return self._inbox.drain()

    async def link(self, comm_name: str, cluster_rank_info: dict[int, int], rank_table: str) -> int:
        """Start linking with the other parties of a communicator; its ``comm_id``.

        Every party calls ``link`` with the same arguments at about the same time. It
        returns at once; poll ``query_register_mem_status(comm_id)`` until ``OK``
        (transfers on these links fail with ``LLM_NOT_YET_LINK`` until then) or
        ``FAILED`` (not completed within ``link_total_time``, 120 s when 0). Each party
        opens one link to every party of lower rank, found at the ``device_ip`` /
        ``device_port`` of that rank's entry in ``rank_table``; so every party but the
        highest rank must listen: at ``listen_ip_info``, or, when this side has no
        listener, ``link`` starts one at its own entry's ``device_ip``/``device_port``
        (kept until ``finalize`` or ``switch_role``).

        Args:
            comm_name: 1 to 127 characters.
            cluster_rank_info: ``{cluster_id: rank}`` of 2 to 4 parties, this one
                included, ranks ascending.
            rank_table: the HCCL rank-table JSON (``server_list[].device[]`` with
                ``rank_id``, ``device_ip``, ``device_port``).

        Raises:
            TypeError / ValueError: arguments of the wrong type or range.
            LLMException: ``LLM_PARAM_INVALID`` (see above, or this side must listen
                and neither listens nor has an address in ``rank_table``),
                ``LLM_LINK_FAILED`` (that address cannot be bound),
                ``LLM_ALREADY_LINK`` / ``LLM_PROCESSING_LINK`` when a party is linked
                or being linked already, ``LLM_PARAM_INVALID`` in legacy mode
                (``enable_cache_manager=False``), as llm_datadist.
        """
        op = "link"
        engine, linker = self._communicator(op)
        plan = parse_link(op, comm_name, cluster_rank_info, rank_table, self._cluster_id)
        reached = any(p.address is None for p in plan.parties)
        if reached and self._listen is None and plan.own_address is None:
            param_invalid(
                op, "higher ranks connect to this side: set listen_ip_info or its device_port"
            )

        async def start() -> int:
            assert self._transport is not None
            opened = None
            if reached and self._listen is None and plan.own_address is not None:
                with map_errors(f"{op} (listen on {plan.own_address[0]}:{plan.own_address[1]})"):
                    self._listen = opened = await self._transport.listen(*plan.own_address)
            try:
                return linker.link(plan.parties)
            except BaseException:
                if opened is not None:  # a failed call changes nothing: no listener kept
                    self._listen = None
                    await completing(self._transport.unlisten(opened))
                raise

        return await engine.run(start)

    async def query_register_mem_status(self, comm_id: int) -> RegisterMemStatus:
        """``PREPARING``, ``OK`` or ``FAILED``: the state of ``link``'s communicator.

        Raises:
            LLMException: ``LLM_PARAM_INVALID`` for an unknown ``comm_id``;
                ``LLM_PARAM_INVALID`` in legacy mode.
        """
        engine, linker = self._communicator("query_register_mem_status", comm_id)
        return await engine.run_sync(linker.status, comm_id)

    async def unlink(self, comm_id: int) -> None:
        """Close the links of ``link``'s communicator (or stop it linking) and forget it.

        The other parties see their links end; each still calls ``unlink`` for its own
        ``comm_id``, in any order.

        Raises:
            LLMException: ``LLM_PARAM_INVALID`` for an unknown ``comm_id``;
                ``LLM_PARAM_INVALID`` in legacy mode.
        """
        engine, linker = self._communicator("unlink", comm_id)
        await engine.run(linker.unlink, comm_id)

    def _communicator(self, op: str, comm_id: int | None = None) -> tuple[Engine, Linker]:
        """:meth:`_linker_on` for ``link`` and the calls on its ``comm_id`` (checked when
        given): they need cache-manager mode, as llm_datadist's."""
        found = self._linker_on(op)
        if isinstance(self._manager, KvCacheManager):  # llm_datadist's code and words
            param_invalid(
                op,
                f"{op} is not supported when llm.EnableCacheManager is not configured "
                "(set enable_cache_manager=True)",
            )
        if comm_id is not None:
            check_int(op, "comm_id", comm_id, 0, 2**64 - 1)
        return found

    async def switch_role(
        self, role: LLMRole, switch_options: dict[str, str] | None = None
    ) -> None:
        """Take ``role``, and start, move or stop the listener.

        With ``"llm.listenIpInfo"`` in ``switch_options`` this side listens there (a
        new listener first, then the old one closes; the same address keeps it);
        without it, it stops listening. Other option keys are checked as by ``init``
        and otherwise ignored (they are init-time options). Legacy mode
        (``enable_cache_manager=False``) adds llm_datadist's rules: the role must
        change, and ``PROMPT`` needs ``"llm.listenIpInfo"``; the role gates of
        ``kv_cache_manager`` follow the new role. Cancelling it does not stop it half
        way (new listener open, old one closed, role unchanged): it completes (a bind
        and a close) and returns; the cancellation comes at the caller's next await.

        Raises:
            TypeError / ValueError: bad ``role`` or options.
            LLMException: ``LLM_EXIST_LINK`` while any link is up or being made;
                ``LLM_PARAM_INVALID`` for the legacy rules; ``LLM_LINK_FAILED`` when
                the new address cannot be bound. Nothing changes on failure.
        """
        op = "switch_role"
        engine, linker = self._linker_on(op)
        check_instance(op, "role", role, LLMRole)
        if switch_options is not None:
            check_instance(op, "switch_options", switch_options, dict)
        options = dict(switch_options or {})
        parsed = LLMConfig._from_options_in(op, options)
        # the option itself, not an AIOKV_LISTEN_IP_INFO default: without it, stop listening
        listen = parsed.listen_address if options.get("llm.listenIpInfo") else None
        if isinstance(self._manager, KvCacheManager):
            if role == self._role:
                param_invalid(op, f"role not changed, role = {role.name}")
            if role == LLMRole.PROMPT and listen is None:
                param_invalid(op, 'switching to PROMPT needs "llm.listenIpInfo"')

        async def switch() -> None:
            assert self._transport is not None and self._manager is not None
            linking = self._links.attempting()
            if self._links.clusters() or linker.linking() or linking:
                raise LLMException(
                    f"{op}: unlink every cluster first ({self._links.clusters()} linked, "
                    f"{linking} being linked)",
                    status_code=LLMStatusCode.LLM_EXIST_LINK,
                )
            old = self._listen
            new = old if listen is None or listen == old else None
            if listen is not None and new is None:
                with map_errors(f"{op} (listen on {listen[0]}:{listen[1]})"):
                    new = await self._transport.listen(*listen)
            if old is not None and (listen is None or new != old):
                await self._transport.unlisten(old)
            self._listen = None if listen is None else new
            self._manager._role = role
            self._role = role

        await engine.finish(switch)  # never half done: bounded (a bind, a close)

    async def __aenter__(self) -> LLMDataDist:
        if self._manager is None and self._pending_config is not None:
            await self.init(self._pending_config)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.finalize()

    def __repr__(self) -> str:
        state = "initialized" if self.initialized else "not initialized"
        return f"LLMDataDist(role={self._role.name}, cluster_id={self._cluster_id}, {state})"


#: instances initialized and not yet finalized, finalized at interpreter exit
_live: weakref.WeakSet[LLMDataDist] = weakref.WeakSet()


def _warn_twins(dd: LLMDataDist) -> None:
    """Warn (``ResourceWarning`` and a log warning, which notebooks show) when another
    initialized instance has ``dd``'s cluster id: most often a notebook cell re-run
    without ``finalize``, whose old instance (kept alive by the output history) still
    holds its pools, listener and threads."""
    twin = next((o for o in _live if o._cluster_id == dd._cluster_id and not o._closing), None)
    if twin is None:
        return
    msg = (
        f"LLMDataDist {dd._cluster_id} initialized while another instance with cluster id "
        f"{dd._cluster_id} is still initialized, holding its pools, listener and threads: "
        "finalize the old one (its finalize(), or create it in a `with` / `async with` "
        "LLMDataDist(...) block)"
    )
    warn(msg, ResourceWarning)
    log.warning("%s", msg)


@atexit.register
def _finalize_forgotten() -> None:
    for dd in list(_live):
        try:
            dd._finalize_blocking()
        except Exception:  # exit goes on; say what could not be released
            log.exception("finalizing %r at exit failed", dd)


def _each(*callbacks: LinkCallback) -> LinkCallback:
    """One link callback that calls ``callbacks`` in order."""

    def call(link: Link) -> None:
        for callback in callbacks:
            callback(link)

    return call


def _effective(config: LLMConfig) -> dict[str, Any]:
    """What a config does: its values, ``""`` and ``None`` alike (both mean not set, as
    in llm_datadist: its dict form and an ``LLMConfig`` may say it either way)."""
    return {k: None if v == "" else v for k, v in config.model_dump().items()}
