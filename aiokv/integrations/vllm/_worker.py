"""``WorkerSide``: one vLLM worker rank's aiokv instance, free of vLLM types.

It registers vLLM's own KV tensors with aiokv (zero copy: the blocks cache *is*
vLLM's KV memory), listens for decode workers, and per step (:meth:`WorkerSide.step`,
never blocking):

* decode side: starts each :class:`~._plan.Load` — link to the prefill worker of the
  same rank, pull its blocks into this side's blocks, then send it a *done notice*
  (an aiokv notification) so it frees them;
* prefill side: holds each :class:`~._plan.Hold` until the decode side's done notice
  names it (with its token) or its lease ends.

Push mode (``mode="push"``; docs/vllm.md):

* decode side: each :class:`~._plan.Reserve` links to the prefill worker of the same
  rank and sends it a :class:`ReserveNotice` (the transfer id and this side's block
  ids); the load ends when the prefill's :class:`PushedNotice` arrives (failed if it
  says so, if the link drops, or after ``lease_timeout_s``);
* prefill side: reservations received are reported to the scheduler
  (:meth:`WorkerSide.take_reserved`, vLLM's worker metadata), which then schedules the
  prefill request; in the step that computes it, :meth:`WorkerSide.save_layer` pushes
  each layer's blocks into the reserved blocks as soon as vLLM computed that layer
  (:class:`~._pusher.Pusher`: within the decode side's lease less a margin); when
  every layer is in, the decode side gets its :class:`PushedNotice` and the request's
  blocks are released (its :class:`~._plan.Hold` has ``pushed``).

:meth:`WorkerSide.results` reports what finished since the last call: held requests
released (``finished_sending``), loads ended (``finished_recving``) and, among those,
loads that failed (``failed_recving``).

Threads: an anyio blocking portal starts and finalizes aiokv; loads, pushes, notices,
releases, reservations and links are tasks on aiokv's own engine loop (their calls into
aiokv need no thread hop). Over NIXL with the KV in host memory, loads run on the
*pump* instead (:mod:`._pump`): an asyncio loop of the worker's own that vLLM's thread
runs a few turns in :meth:`WorkerSide.step` and :meth:`WorkerSide.results` (an aiokv
caller on its own loop). A pull under a NIXL lease is then posted and polled from
vLLM's thread, as vLLM's ``NixlConnector`` does it, and its end is seen there, with no
hop to another thread and back; a pull without a lease (the first on a link) is awaited
on the engine. vLLM's step never waits for the network (except an idle step, up to
``idle_wait_ms``); vLLM steps while a request waits for its KV, which keeps the pump
turning.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from collections.abc import Coroutine
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import Final
from typing import Literal
from typing import TypeVar

import anyio
import msgspec
import torch
from anyio.from_thread import BlockingPortal
from anyio.from_thread import start_blocking_portal

from ... import BlocksCacheKey
from ... import Cache
from ... import CacheDesc
from ... import LLMConfig
from ... import LLMDataDist
from ... import LLMException
from ... import LLMRole
from ... import LLMStatusCode
from ._layout import blocks_desc
from ._layout import logical_blocks
from ._layout import split_kv
from ._linker import Linker
from ._notices import CancelNotice
from ._notices import DoneNotice
from ._notices import PushedNotice
from ._notices import ReserveNotice
from ._notices import notice_decoder
from ._notices import notice_encoder
from ._notices import push_decoder
from ._options import ConnectorOptions
from ._options import load_deadline
from ._params import Endpoint
from ._plan import Cancel
from ._plan import Load
from ._plan import Push
from ._plan import Release
from ._plan import Reserve
from ._plan import StepPlan
from ._pump import Pump
from ._pump import loop_running
from ._pusher import Pusher
from ._pusher import Reservation

__all__ = [
    "CancelNotice",
    "DoneNotice",
    "PushedNotice",
    "ReserveNotice",
    "TransferResults",
    "WorkerSide",
]

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


_Item = TypeVar("_Item", Load, Release, Reserve, Cancel)

#: ``send_notification`` errors after which the peer surely did not file the notice.
_NOT_SENT: Final = frozenset(
    {LLMStatusCode.LLM_NOT_YET_LINK, LLMStatusCode.LLM_LINK_BUSY, LLMStatusCode.LLM_PARAM_INVALID}
)


def _may_have_arrived(exc: Exception) -> bool:
    """Whether a notice whose ``send_notification`` raised ``exc`` may still have been
    filed by the peer (a timeout, a link that broke while it was sent)."""
    return isinstance(exc, LLMException) and exc.status_code not in _NOT_SENT


@dataclass(slots=True)
class _Awaiting:
    """Decode side: a reservation sent, waiting for its PushedNotice."""

    request_id: str
    cluster_id: int
    deadline: float


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
        self.options = options
        self._rank = rank
        self.cluster_id = options.worker_cluster_id(engine_id, rank)
        self._portal_cm: Any = None
        self._portal: BlockingPortal | None = None  # starts and ends aiokv
        self._loop: asyncio.AbstractEventLoop | None = None  # aiokv's engine loop: the rest
        self._dd: LLMDataDist | None = None
        self._cache: Cache | None = None
        self.endpoint: Endpoint | None = None
        self._lock = threading.Lock()  # the sets below: vLLM's thread and the engine loop's
        self._done = TransferResults()
        self._holds: dict[str, tuple[str, float]] = {}  # request -> (token, deadline)
        self._early: collections.OrderedDict[tuple[str, str], float] = collections.OrderedDict()
        self._linker = Linker(options)  # engine loop only
        self._pending: set[Any] = set()  # futures of loads and notices in flight
        self._pump: Pump | None = None  # decode side: the loads (see the module docstring)
        self._loads = 0  # loads started and not ended
        self._wake = threading.Event()  # set when a load ends
        # push mode
        self._per_layer = 1  # tensors of the blocks cache per layer (2: K and V apart)
        self._awaiting: dict[str, _Awaiting] = {}  # decode: transfer -> load waiting
        self._reservations: dict[str, Reservation] = {}  # prefill: transfer -> where to
        self._new_reserved: dict[str, int] = {}  # prefill: reported to the scheduler next
        self._push_ended: dict[str, float] = {}  # prefill: request -> forget after
        # prefill: held until their push ends, or a lease at most (request -> deadline)
        self._push_holds: dict[str, float] = {}
        self._pusher = Pusher(self)

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
        self._pusher.layers = {name: i for i, name in enumerate(kv_caches)}
        halves, self._per_layer = split_kv(list(kv_caches.values()), num_blocks)
        tensors = logical_blocks(halves, num_blocks)
        desc = blocks_desc(tensors, num_blocks)
        device = tensors[0].device
        if device.type not in _DEVICES:
            raise ValueError(f"AiokvConnector: KV cache on {device}; aiokv moves {_DEVICES}")
        opts = self.options
        config = LLMConfig(
            device_type=_DEVICES[device.type],
            device_id=device.index or 0,
            enable_cache_manager=True,
            listen_ip_info=f"{opts.host}:{opts.listen_port(self._rank)}",
            transfer_backend=opts.transfer_backend,
            sync_kv_timeout=opts.transfer_timeout_ms,
            link_secret=opts.link_secret,
            # push mode: peers may push into our blocks, and we into theirs
            enable_remote_cache_accessible=opts.mode == "push",
        )
        self._portal_cm = start_blocking_portal()
        self._portal = self._portal_cm.__enter__()
        # closed at the interpreter's exit at the latest: left to the collector, the
        # portal's cleanup then waits for ever on its loop thread (the process hangs)
        atexit.register(self.close)
        try:
            self._portal.call(self._start, config, desc, tensors)
        except BaseException:
            self.close()
            raise
        assert self._dd is not None and self._dd.listen_address is not None
        if opts.transfer_backend == "nixl" and device.type == "cpu":
            self._pump = Pump()  # its leased pulls move on vLLM's thread (others: no gain)
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
        # loads, pushes and notices run on aiokv's own engine loop: their calls into
        # aiokv then run there at once, with no hop to another thread and back
        assert dd._engine is not None
        self._loop = dd._engine.loop

    def close(self) -> None:
        """Stop loads in flight, finalize aiokv and the loop thread. Idempotent."""
        portal, self._portal = self._portal, None
        if portal is None:
            return
        atexit.unregister(self.close)
        if self._pump is not None:
            self._pump.close()
        self._loop = None
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
        """Start the plan's loads, releases, reservations and cancels, file its holds;
        returns at once (its pushes go through :meth:`save_layer` and :meth:`saved`)."""
        now = time.monotonic()
        with self._lock:
            for hold in plan.holds:
                if hold.pushed:
                    if self._push_ended.pop(hold.request_id, None) is not None:
                        self._done.finished_sending.add(hold.request_id)
                    else:  # its push ends by its reservation's deadline, before this
                        self._push_holds[hold.request_id] = now + hold.lease_s
                elif self._early.pop((hold.request_id, hold.token), None) is not None:
                    self._done.finished_sending.add(hold.request_id)  # its notice came first
                else:
                    self._holds[hold.request_id] = (hold.token, now + hold.lease_s)
        for load in plan.loads:
            if load.error is not None:
                self._ended(load.request_id, ok=False)
            else:  # on the pump, unless this thread runs an asyncio loop (it cannot)
                self._spawn(self._load, load, None if loop_running() else self._pump)
        if self._pump is not None:
            self._pump.run()
        for release in plan.releases:
            self._spawn(self._release, release)
        for reserve in plan.reserves:
            with self._lock:
                taken = reserve.transfer_id in self._awaiting
            if taken:
                log.error(
                    "request %s: transfer id %r is already in use",
                    reserve.request_id,
                    reserve.transfer_id,
                )
                self._ended(reserve.request_id, ok=False)
            else:
                self._spawn(self._reserve, reserve)
        for cancel in plan.cancels:
            self._spawn(self._cancel, cancel)
        for withdraw in plan.withdrawals:
            with self._lock:
                waiting = self._awaiting.get(withdraw.transfer_id)
            if waiting is not None and waiting.request_id == withdraw.request_id:
                self._spawn_send(waiting.cluster_id, CancelNotice(withdraw.transfer_id))

    def results(self, *, idle: bool = False) -> TransferResults:
        """What ended since the last call (see the module docstring).

        Args:
            idle: vLLM's step ran no model. Then, while this worker has transfers in
                flight or blocks held for a peer, it first waits up to ``idle_wait_ms``
                for a load to end (running the pump meanwhile), releasing the GIL: vLLM
                steps again at once when a step is empty, and that loop would otherwise
                starve the threads that move the bytes. Otherwise it never blocks (it
                runs the pump's ready work).
        """
        wait_s = self.options.idle_wait_ms / 1000 if idle and self._busy() else 0.0
        if self._pump:
            self._pump.run(wait_s)  # a load ending wakes it
        elif wait_s:
            self._wake.wait(wait_s)
        self._wake.clear()  # a load ending from here on is in this call's results or wakes the next
        notices = self._dd.get_notifications() if self._dd is not None else []
        now = time.monotonic()
        with self._lock:  # waits registered (each after its link came up) before ...
            known = dict(self._awaiting)
        linked = self._linked_clusters() if known else set()  # ... the links are read
        expired: list[tuple[int, PushedNotice | CancelNotice]] = []  # notices to send
        with self._lock:
            for cluster_id, payload in notices:
                if payload.startswith(b'{"push":'):
                    self._push_noticed(cluster_id, payload, now, expired)
                else:
                    self._noticed(cluster_id, payload, now)
            self._expire_pushes(now, linked, known, expired)
            self._expire_holds(now)
            done, self._done = self._done, TransferResults()
        for cluster_id, message in expired:
            self._spawn_send(cluster_id, message)
        return done

    def _expire_pushes(
        self,
        now: float,
        linked: set[int],
        known: dict[str, _Awaiting],
        expired: list[tuple[int, PushedNotice | CancelNotice]],
    ) -> None:
        """Push mode, under the lock: fail the decode waits whose push did not come in
        time or whose prefill's link broke, drop the reservations no prefill claimed in
        time (the notices to send go to ``expired``), forget old ended pushes.

        ``linked``: the clusters linked, read after ``known`` (the waits registered
        then): only those waits are judged by it. A wait registered since (on the
        engine loop, once its link came up) is not in ``linked`` although its link is
        live: failing it would free blocks its prefill may still push into."""
        for transfer, waiting in list(self._awaiting.items()):
            why = None
            if now >= waiting.deadline:
                why = f"no push came within {self.options.lease_timeout_s:g} s"
                expired.append((waiting.cluster_id, CancelNotice(transfer)))
            elif known.get(transfer) is waiting and waiting.cluster_id not in linked:
                why = "the link to the prefill broke"
            if why is not None:
                log.error("request %s: push under %s failed: %s", waiting.request_id, transfer, why)
                del self._awaiting[transfer]
                self._done.finished_recving.add(waiting.request_id)
                self._done.failed_recving.add(waiting.request_id)
        for transfer, reservation in list(self._reservations.items()):
            if now >= reservation.deadline:
                del self._reservations[transfer]
                why = "no prefill request claimed the reservation in time"
                expired.append((reservation.cluster_id, PushedNotice(transfer, False, why)))
        for request_id, forget in list(self._push_ended.items()):
            if now >= forget:
                del self._push_ended[request_id]

    def _expire_holds(self, now: float) -> None:
        """Under the lock: free the held blocks whose lease ran out, forget old early
        done notices."""
        late = [r for r, (_, deadline) in self._holds.items() if now >= deadline]
        for request_id in late:
            del self._holds[request_id]
            self._freed(request_id, "no decode side took its blocks")
        # a push's writes ended by its reservation's deadline, before a hold's: one that
        # ended unseen (forgotten: it ended a lease before its hold came) or never started
        late = [r for r, deadline in self._push_holds.items() if now >= deadline]
        for request_id in late:
            del self._push_holds[request_id]
            self._freed(request_id, "its push did not report its end")
        while self._early and next(iter(self._early.values())) < now:
            self._early.popitem(last=False)

    def _freed(self, request_id: str, why: str) -> None:
        """Under the lock: release the held blocks of ``request_id`` whose lease ran out."""
        log.warning(
            "request %s: %s within %.0f s; freed", request_id, why, self.options.lease_timeout_s
        )
        self._done.finished_sending.add(request_id)

    def _busy(self) -> bool:
        """Loads in flight, or pushes awaited, or blocks held for a decode side."""
        return bool(self._loads or self._awaiting or self._holds or self._push_holds)

    def _linked_clusters(self) -> set[int]:
        return set(self._dd.linked_clusters()) if self._dd is not None else set()

    def take_reserved(self) -> dict[str, int]:
        """Push mode, prefill side: the transfer ids whose reservations arrived since the
        last call (each counted once: this rank), for the scheduler side."""
        with self._lock:
            reserved, self._new_reserved = self._new_reserved, {}
        return reserved

    def _push_noticed(
        self,
        cluster_id: int,
        payload: bytes,
        now: float,
        replies: list[tuple[int, PushedNotice | CancelNotice]],
    ) -> None:
        """A push-mode notice (under the lock); answers to send go to ``replies``."""
        try:
            message = push_decoder.decode(payload)
        except msgspec.MsgspecError:
            log.warning("ignored a malformed notification from cluster %d", cluster_id)
            return
        if self.options.mode != "push":
            log.warning("ignored a push-mode notice from cluster %d: mode is pull", cluster_id)
            return
        if isinstance(message, PushedNotice):
            waiting = self._awaiting.get(message.transfer)
            if waiting is None or waiting.cluster_id != cluster_id:
                return  # not ours, or late: its load already ended
            del self._awaiting[message.transfer]
            self._done.finished_recving.add(waiting.request_id)
            if not message.ok:
                log.error(
                    "request %s: the prefill pushed nothing: %s", waiting.request_id, message.error
                )
                self._done.failed_recving.add(waiting.request_id)
        elif isinstance(message, ReserveNotice):
            if message.transfer in self._reservations or len(self._reservations) >= _EARLY_CAP:
                log.warning(
                    "ignored a reservation %r from cluster %d", message.transfer, cluster_id
                )
                return
            # the decode side gives its blocks up after its own lease: the shorter one
            # bounds the push
            lease = self.options.lease_timeout_s
            if message.lease_s is not None:
                lease = min(lease, message.lease_s)
            deadline = now + load_deadline(lease)
            self._reservations[message.transfer] = Reservation(
                cluster_id, message.blocks, message.first, message.num_tokens, deadline, lease
            )
            self._new_reserved[message.transfer] = 1
        else:  # withdrawn: unless a push already took it, tell the decode side it is over
            reservation = self._reservations.get(message.transfer)
            if reservation is not None and reservation.cluster_id == cluster_id:
                del self._reservations[message.transfer]
                self._new_reserved.pop(message.transfer, None)
                why = "the decode side withdrew its reservation"
                replies.append((cluster_id, PushedNotice(message.transfer, False, why)))

    def _noticed(self, cluster_id: int, payload: bytes, now: float) -> None:
        """A done notice (under the lock): release its hold, or remember it a lease long."""
        try:
            notice = notice_decoder.decode(payload)
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
        self._early[(notice.request, notice.token)] = now + self.options.lease_timeout_s
        while len(self._early) > _EARLY_CAP:
            self._early.popitem(last=False)

    # ---- push mode, prefill side ------------------------------------------------------------
    def save_layer(self, layer_name: str, pushes: tuple[Push, ...], kv_layer: Any = None) -> None:
        """``save_kv_layer``: see :meth:`Pusher.save_layer`. Never blocks."""
        self._pusher.save_layer(layer_name, pushes, kv_layer)

    def saved(self, pushes: tuple[Push, ...]) -> None:
        """``wait_for_save``: see :meth:`Pusher.saved`. Never blocks."""
        self._pusher.saved(pushes)

    def claim(self, transfer_id: str) -> Reservation | None:
        """The reservation ``transfer_id`` (a push takes it: no one else can), if any."""
        with self._lock:
            return self._reservations.pop(transfer_id, None)

    async def push_layer(
        self, cluster_id: int, src: tuple[int, ...], dst: tuple[int, ...], layer: int
    ) -> None:
        """Push layer ``layer`` of blocks ``src`` into cluster ``cluster_id``'s ``dst``."""
        assert self._dd is not None and self._cache is not None
        await self._dd.cache_manager.push_blocks(
            BlocksCacheKey(cluster_id, _MODEL_ID),
            self._cache,
            src,
            dst,
            src_layer_range=range(layer, layer + 1),
            dst_layer_range=range(layer, layer + 1),
            tensor_num_per_layer=self._per_layer,
        )

    def pushed(self, request_id: str) -> None:
        """The push of ``request_id`` ended (its decode side told): release its blocks
        once held (now, if they are)."""
        with self._lock:
            if self._push_holds.pop(request_id, None) is not None:
                self._done.finished_sending.add(request_id)
            else:
                self._push_ended[request_id] = time.monotonic() + self.options.lease_timeout_s

    def run_soon(self, fn: Callable[..., Coroutine[Any, Any, None]], *args: Any) -> bool:
        """Run ``fn(*args)`` on aiokv's engine loop, tracked as in flight; False (nothing
        started) once closed. Thread-safe."""
        loop = self._loop
        if loop is None:
            return False
        fut = asyncio.run_coroutine_threadsafe(fn(*args), loop)
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(self._forget)
        return True

    async def _cancel(self, cancel: Cancel) -> None:
        """Nothing will be pushed under ``cancel.transfer_id``: tell its decode side."""
        with self._lock:
            reservation = self._reservations.pop(cancel.transfer_id, None)
            self._new_reserved.pop(cancel.transfer_id, None)
        if reservation is not None:
            await self.send(
                reservation.cluster_id, PushedNotice(cancel.transfer_id, False, cancel.reason)
            )

    # ---- push mode, decode side -------------------------------------------------------------
    async def _reserve(self, reserve: Reserve) -> None:
        """Link to the prefill worker of this rank and send it the reservation; the load
        then waits for its PushedNotice (see :meth:`results`)."""
        source = reserve.ranks[self._rank]
        notice = ReserveNotice(
            reserve.transfer_id,
            list(reserve.local_blocks),
            reserve.first_block,
            reserve.num_tokens,
            self.options.lease_timeout_s,
        )
        registered = False
        try:
            with anyio.fail_after(self.options.link_timeout_ms / 1000):
                await self._link(source)
            deadline = time.monotonic() + self.options.lease_timeout_s
            mine = _Awaiting(reserve.request_id, source.cluster_id, deadline)
            with self._lock:  # before sending: its answer may come at once
                if reserve.transfer_id in self._awaiting:  # another load's, meanwhile
                    raise LLMException(
                        f"transfer id {reserve.transfer_id!r} is already in use",
                        status_code=LLMStatusCode.LLM_PARAM_INVALID,
                    )
                self._awaiting[reserve.transfer_id] = mine
            registered = True
            assert self._dd is not None
            await self._dd.send_notification(source.cluster_id, notice_encoder.encode(notice))
        except Exception as exc:
            if registered and _may_have_arrived(exc):
                # the prefill may have filed it (aiokv: a send that raised may still be
                # delivered) and push into the blocks: withdraw it and keep the wait,
                # which ends with the prefill's answer, the link's end or the lease,
                # never while the prefill may still push into the blocks
                with self._lock:
                    if self._awaiting.get(reserve.transfer_id) is not mine:
                        return  # its answer came anyway (and ended the load)
                log.warning(
                    "request %s: sending its reservation to cluster %d failed (%s); withdrawing it",
                    reserve.request_id,
                    source.cluster_id,
                    exc,
                )
                await self.send(source.cluster_id, CancelNotice(reserve.transfer_id))
                return
            if registered:
                with self._lock:
                    if self._awaiting.get(reserve.transfer_id) is not mine:
                        return  # its answer came anyway (and ended the load)
                    del self._awaiting[reserve.transfer_id]
            log.error(
                "request %s: reserving its push from %s:%d (cluster %d) failed: %s",
                reserve.request_id,
                source.host,
                source.port,
                source.cluster_id,
                exc,
            )
            self._ended(reserve.request_id, ok=False)

    def _spawn_send(self, cluster_id: int, message: PushedNotice | CancelNotice) -> None:
        self.run_soon(self.send, cluster_id, message)

    async def send(
        self, cluster_id: int, message: PushedNotice | CancelNotice | ReserveNotice
    ) -> None:
        """Send a push-mode notice, best effort (the other side's bound covers a loss)."""
        if self._dd is None:
            return
        try:
            await self._dd.send_notification(cluster_id, notice_encoder.encode(message))
        except (LLMException, RuntimeError) as exc:
            log.warning(
                "could not send %s to cluster %d: %s", type(message).__name__, cluster_id, exc
            )

    # ---- loads ----------------------------------------------------------------------------
    def _spawn(
        self,
        fn: Callable[[_Item], Coroutine[Any, Any, None]],
        item: _Item,
        pump: Pump | None = None,
    ) -> None:
        """Run ``fn(item)`` on ``pump``, else on the engine loop; a load that cannot start
        (closed) ends failed."""
        with self._lock:
            self._loads += isinstance(item, Load)  # counted before it can end, until it ends
        started = pump.start(fn(item)) if pump is not None else self.run_soon(fn, item)
        if not started and isinstance(item, Load):
            with self._lock:
                self._loads -= 1
            self._ended(item.request_id, ok=False)

    def _forget(self, fut: Any) -> None:
        with self._lock:
            self._pending.discard(fut)

    def _ended(self, request_id: str, *, ok: bool) -> None:
        with self._lock:
            self._done.finished_recving.add(request_id)
            if not ok:
                self._done.failed_recving.add(request_id)
        self._wake.set()

    async def _load(self, load: Load) -> None:
        """Pull the load's blocks within the link and transfer bounds; report it ended
        (failed on any error), then have the engine loop send the prefill its done
        notice. Runs on the pump, or on the engine loop where there is none."""
        source = load.ranks[self._rank]
        ok = False
        try:
            budget = (self.options.link_timeout_ms + self.options.transfer_timeout_ms) / 1000
            if load.within_s is not None:  # never read the prefill's blocks after its lease
                budget = min(budget, max(load.within_s, 0.0))
            with anyio.fail_after(budget):
                await self._linked(source)
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
            with self._lock:
                self._loads -= 1
            self._ended(load.request_id, ok=ok)
        self.run_soon(self._notify, source, load.remote_request_id, load.token)

    async def _linked(self, source: Endpoint) -> None:
        """:meth:`_link`, run on the engine loop (where its locks live) unless linked."""
        assert self._dd is not None and self._loop is not None
        if source.cluster_id in self._dd.linked_clusters():
            return
        if asyncio.get_running_loop() is self._loop:
            await self._link(source)
        else:
            await asyncio.wrap_future(
                asyncio.run_coroutine_threadsafe(self._link(source), self._loop)
            )

    async def _release(self, release: Release) -> None:
        source = release.ranks[self._rank]
        with contextlib.suppress(Exception):
            with anyio.fail_after(self.options.link_timeout_ms / 1000):
                await self._link(source)
        await self._notify(source, release.remote_request_id, release.token)

    async def _notify(self, source: Endpoint, request: str, token: str) -> None:
        """Tell the prefill worker it may free ``request``'s blocks (best effort: if it
        cannot be told, its lease frees them)."""
        if self._dd is None:
            return
        payload = notice_encoder.encode(DoneNotice(request, token))
        try:
            await self._dd.send_notification(source.cluster_id, payload)
        except (LLMException, RuntimeError) as exc:
            log.warning(
                "could not tell cluster %d that %s is done: %s", source.cluster_id, request, exc
            )

    async def _link(self, source: Endpoint) -> None:
        """Link to ``source`` unless linked (:class:`Linker`).

        Raises:
            LLMException: the link failed (its code).
        """
        assert self._dd is not None
        await self._linker.link(self._dd, source)
