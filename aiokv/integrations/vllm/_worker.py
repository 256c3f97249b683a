"""``WorkerSide``: one vLLM worker rank's aiokv instance, free of vLLM types.

It registers vLLM's own KV tensors with aiokv (zero copy: the blocks cache *is*
vLLM's KV memory), listens for decode workers, and per step (:meth:`WorkerSide.step`,
never blocking):

* decode side: starts each :class:`~._plan.Load` — link to the prefill worker of the
  same rank, pull its blocks into this side's blocks, then send it a *done notice*
  (an aiokv notification) so it frees them;
* prefill side: holds each :class:`~._plan.Hold` until the decode side's done notice
  names it (with its token) or its lease ends.

:meth:`WorkerSide.results` reports what finished since the last call: held requests
released (``finished_sending``), loads ended (``finished_recving``) and, among those,
loads that failed (``failed_recving``). The aiokv work runs on an event loop thread
of its own (an anyio blocking portal), so vLLM's step never waits for the network.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeVar

import anyio
import msgspec
import torch
from anyio.from_thread import BlockingPortal, start_blocking_portal

from ... import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from ._options import ConnectorOptions
from ._params import Endpoint
from ._plan import Load, Release, StepPlan

__all__ = ["DoneNotice", "TransferResults", "WorkerSide", "blocks_desc", "logical_blocks"]

log = logging.getLogger("aiokv.vllm")

#: Most done notices remembered that arrived before their hold (bounded: they are
#: untrusted input), each for at most one lease.
_EARLY_CAP: Final = 65536
_MODEL_ID: Final = 0  # the blocks cache's BlocksCacheKey.model_id
_DEVICES: Final[dict[str, Literal["cpu", "cuda", "npu"]]] = {
    "cpu": "cpu",
    "cuda": "cuda",
    "npu": "npu",
}


_Item = TypeVar("_Item", Load, Release)


class DoneNotice(msgspec.Struct, frozen=True):
    """The decode side's notification: it has the blocks of ``request``, the prefill may
    free them (``token``: the one in the params, so that no other peer can)."""

    request: str
    token: str


_notice_decoder = msgspec.json.Decoder(DoneNotice)
_notice_encoder = msgspec.json.Encoder()


@dataclass(slots=True)
class TransferResults:
    """What ended since the last :meth:`WorkerSide.results`."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


class WorkerSide:
    """One worker rank's aiokv instance and its loads and holds.

    Args:
        options: the connector's options.
        engine_id: the vLLM engine id (for the default cluster id).
        rank: this worker's tensor-parallel rank.
    """

    def __init__(self, options: ConnectorOptions, *, engine_id: str, rank: int) -> None:
        self._options = options
        self._rank = rank
        self.cluster_id = options.worker_cluster_id(engine_id, rank)
        self._portal_cm: Any = None
        self._portal: BlockingPortal | None = None
        self._dd: LLMDataDist | None = None
        self._cache: Cache | None = None
        self.endpoint: Endpoint | None = None
        self._lock = threading.Lock()  # the sets below: vLLM's thread and the portal's
        self._done = TransferResults()
        self._holds: dict[str, tuple[str, float]] = {}  # request -> (token, deadline)
        self._early: collections.OrderedDict[tuple[str, str], float] = collections.OrderedDict()
        self._linking: dict[int, asyncio.Lock] = {}  # cluster -> lock (portal loop only)
        self._pending: set[Any] = set()  # futures of loads and notices in flight

    # ---- life -----------------------------------------------------------------------------
    def start(
        self, kv_caches: Mapping[str, torch.Tensor], num_blocks: int | None = None
    ) -> Endpoint:
        """Start aiokv (listening), register ``kv_caches`` (one tensor per layer, in
        the mapping's order) as one blocks cache, and return where it listens.

        Args:
            kv_caches: vLLM's KV tensors by layer name.
            num_blocks: vLLM's block count, when known: the first dimension must be it.

        Raises:
            ValueError: tensors that are not one blocks cache: different shapes, dtypes
                or devices, not contiguous, or a first dimension that is not the blocks.
            LLMException: aiokv could not start (address in use, ...).
        """
        tensors = logical_blocks(list(kv_caches.values()), num_blocks)
        desc = blocks_desc(tensors, num_blocks)
        device = tensors[0].device
        if device.type not in _DEVICES:
            raise ValueError(f"AiokvConnector: KV cache on {device}; aiokv moves {_DEVICES}")
        opts = self._options
        config = LLMConfig(
            device_type=_DEVICES[device.type],
            device_id=device.index or 0,
            enable_cache_manager=True,
            listen_ip_info=f"{opts.host}:{opts.listen_port(self._rank)}",
            transfer_backend=opts.transfer_backend,
            sync_kv_timeout=opts.transfer_timeout_ms,
            link_secret=opts.link_secret,
        )
        self._portal_cm = start_blocking_portal()
        self._portal = self._portal_cm.__enter__()
        try:
            self._portal.call(self._start, config, desc, tensors)
        except BaseException:
            self.close()
            raise
        assert self._dd is not None and self._dd.listen_address is not None
        self.endpoint = Endpoint(opts.public_host, self._dd.listen_address[1], self.cluster_id)
        log.info(
            "aiokv worker rank %d: cluster %d at %s:%d, %d layers of %d blocks",
            self._rank,
            self.cluster_id,
            self.endpoint.host,
            self.endpoint.port,
            len(tensors),
            desc.shape[0],
        )
        return self.endpoint

    async def _start(self, config: LLMConfig, desc: CacheDesc, tensors: list[torch.Tensor]) -> None:
        dd = LLMDataDist(LLMRole.MIX, self.cluster_id)
        await dd.init(config)
        try:
            self._cache = await dd.cache_manager.register_blocks_cache(
                desc, tensors, BlocksCacheKey(self.cluster_id, _MODEL_ID)
            )
        except BaseException:
            await dd.finalize()
            raise
        self._dd = dd

    def close(self) -> None:
        """Stop loads in flight, finalize aiokv and the loop thread. Idempotent."""
        portal, self._portal = self._portal, None
        if portal is None:
            return
        dd, self._dd = self._dd, None
        for fut in list(self._pending):
            fut.cancel()
        try:
            if dd is not None:
                portal.call(dd.finalize)
        finally:
            self._portal_cm.__exit__(None, None, None)

    # ---- per step -------------------------------------------------------------------------
    def step(self, plan: StepPlan) -> None:
        """Start the plan's loads and releases, file its holds; returns at once."""
        now = time.monotonic()
        with self._lock:
            for hold in plan.holds:
                if self._early.pop((hold.request_id, hold.token), None) is not None:
                    self._done.finished_sending.add(hold.request_id)  # its notice came first
                else:
                    self._holds[hold.request_id] = (hold.token, now + hold.lease_s)
        for load in plan.loads:
            if load.error is not None:
                self._ended(load.request_id, ok=False)
            else:
                self._spawn(self._load, load)
        for release in plan.releases:
            self._spawn(self._release, release)

    def results(self) -> TransferResults:
        """What ended since the last call (see the module docstring); never blocks."""
        notices = self._dd.get_notifications() if self._dd is not None else []
        now = time.monotonic()
        with self._lock:
            for cluster_id, payload in notices:
                self._noticed(cluster_id, payload, now)
            for request_id, (_, deadline) in list(self._holds.items()):
                if now >= deadline:
                    log.warning(
                        "request %s: no decode side took its blocks within %.0f s; freed",
                        request_id,
                        self._options.lease_timeout_s,
                    )
                    del self._holds[request_id]
                    self._done.finished_sending.add(request_id)
            while self._early and next(iter(self._early.values())) < now:
                self._early.popitem(last=False)
            done, self._done = self._done, TransferResults()
        return done

    def _noticed(self, cluster_id: int, payload: bytes, now: float) -> None:
        """A done notice (under the lock): release its hold, or remember it a lease long."""
        try:
            notice = _notice_decoder.decode(payload)
        except msgspec.MsgspecError:
            log.warning("ignored a malformed notification from cluster %d", cluster_id)
            return
        held = self._holds.get(notice.request)
        if held is not None:
            if held[0] != notice.token:
                log.warning(
                    "ignored a done notice for %s with a wrong token (cluster %d)",
                    notice.request,
                    cluster_id,
                )
                return
            del self._holds[notice.request]
            self._done.finished_sending.add(notice.request)
            return
        self._early[(notice.request, notice.token)] = now + self._options.lease_timeout_s
        while len(self._early) > _EARLY_CAP:
            self._early.popitem(last=False)

    # ---- loads ----------------------------------------------------------------------------
    def _spawn(self, fn: Callable[[_Item], Awaitable[None]], item: _Item) -> None:
        if self._portal is None:
            if isinstance(item, Load):
                self._ended(item.request_id, ok=False)
            return
        fut = self._portal.start_task_soon(fn, item)
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(self._forget)

    def _forget(self, fut: Any) -> None:
        with self._lock:
            self._pending.discard(fut)

    def _ended(self, request_id: str, *, ok: bool) -> None:
        with self._lock:
            self._done.finished_recving.add(request_id)
            if not ok:
                self._done.failed_recving.add(request_id)

    async def _load(self, load: Load) -> None:
        """Pull the load's blocks within the link and transfer bounds; report it ended
        (failed on any error), then send the prefill its done notice."""
        source = load.ranks[self._rank]
        ok = False
        try:
            budget = (self._options.link_timeout_ms + self._options.transfer_timeout_ms) / 1000
            with anyio.fail_after(budget):
                await self._link(source)
                assert self._dd is not None and self._cache is not None
                await self._dd.cache_manager.pull_blocks(
                    BlocksCacheKey(source.cluster_id, _MODEL_ID),
                    self._cache,
                    load.remote_blocks,
                    load.local_blocks,
                )
            ok = True
        except Exception as exc:
            log.error(
                "request %s: loading its KV from %s:%d (cluster %d) failed: %s",
                load.request_id,
                source.host,
                source.port,
                source.cluster_id,
                exc,
            )
        finally:
            self._ended(load.request_id, ok=ok)
        await self._notify(source, load.remote_request_id, load.token)

    async def _release(self, release: Release) -> None:
        source = release.ranks[self._rank]
        with contextlib.suppress(Exception):
            with anyio.fail_after(self._options.link_timeout_ms / 1000):
                await self._link(source)
        await self._notify(source, release.remote_request_id, release.token)

    async def _notify(self, source: Endpoint, request: str, token: str) -> None:
        """Tell the prefill worker it may free ``request``'s blocks (best effort: if it
        cannot be told, its lease frees them)."""
        if self._dd is None:
            return
        payload = _notice_encoder.encode(DoneNotice(request, token))
        try:
            await self._dd.send_notification(source.cluster_id, payload)
        except (LLMException, RuntimeError) as exc:
            log.warning(
                "could not tell cluster %d that %s is done: %s", source.cluster_id, request, exc
            )

    async def _link(self, source: Endpoint) -> None:
        """Link to ``source`` unless linked (one attempt at a time per cluster).

        Raises:
            LLMException: the link failed (its code).
        """
        assert self._dd is not None
        lock = self._linking.setdefault(source.cluster_id, asyncio.Lock())
        async with lock:
            if source.cluster_id in self._dd.linked_clusters():
                return
            info = LLMClusterInfo(
                remote_cluster_id=source.cluster_id, remote_ip_info=[(source.host, source.port)]
            )
            _, codes = await self._dd.link_clusters([info], timeout=self._options.link_timeout_ms)
            if codes[0] not in (LLMStatusCode.LLM_SUCCESS, LLMStatusCode.LLM_ALREADY_LINK):
                raise LLMException(
                    f"link to {source.host}:{source.port} (cluster {source.cluster_id}) failed",
                    status_code=codes[0],
                )


def logical_blocks(tensors: list[torch.Tensor], num_blocks: int | None) -> list[torch.Tensor]:
    """``tensors`` viewed with vLLM's (logical) blocks first: a contiguous tensor of
    ``r * num_blocks`` kernel blocks (a kernel block size ``r`` times smaller than the
    scheduler's) becomes ``[num_blocks, r, ...]`` over the same memory; others are
    returned as they are (and checked by :func:`blocks_desc`)."""
    if num_blocks is None or num_blocks <= 0:
        return tensors
    out = []
    for t in tensors:
        rows = t.shape[0] if t.dim() else 0
        if t.is_contiguous() and rows > num_blocks and rows % num_blocks == 0:
            t = t.view(num_blocks, rows // num_blocks, *t.shape[1:])
        out.append(t)
    return out


def blocks_desc(tensors: list[torch.Tensor], num_blocks: int | None = None) -> CacheDesc:
    """The ``CacheDesc`` of vLLM's per-layer KV tensors as one blocks cache: every
    tensor the same shape, dtype and device, contiguous, blocks along dimension 0
    (vLLM's CPU layout ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``, or
    any other whose first dimension is the blocks).

    Raises:
        ValueError: no tensors, or tensors that do not form one blocks cache (with
            ``num_blocks``: whose first dimension is not ``num_blocks``).
    """
    if not tensors:
        raise ValueError("AiokvConnector: no KV cache tensors to register")
    first = tensors[0]
    if num_blocks is not None and first.shape[0] != num_blocks:
        raise ValueError(
            f"AiokvConnector: KV tensors of shape {tuple(first.shape)} for {num_blocks} "
            "blocks: this KV layout does not put the blocks first (supported: vLLM's CPU "
            "layout, [num_blocks, ...] per layer)"
        )
    for i, t in enumerate(tensors):
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise ValueError(
                f"AiokvConnector: KV tensor {i} is {tuple(t.shape)} {t.dtype} on {t.device}, "
                f"tensor 0 {tuple(first.shape)} {first.dtype} on {first.device}: layers of "
                "different shapes (hybrid models) are not supported"
            )
        if not t.is_contiguous() or t.dim() < 2:
            raise ValueError(
                f"AiokvConnector: KV tensor {i} ({tuple(t.shape)}, strides {t.stride()}) is "
                "not a contiguous tensor whose first dimension is the blocks"
            )
    return CacheDesc(len(tensors), list(first.shape), first.dtype, Placement.DEVICE)
