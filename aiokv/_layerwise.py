"""Layer-wise transfer: send layer ``i`` while the model computes layer ``i + 1``.

``CacheManager.transfer_cache_async`` validates everything, then :func:`plan` turns each
destination into a :class:`LayerPlan` ONCE: validated block lists, the source
:class:`~aiokv._layout.ByteLayout`, the encoded block list and the link. Sending a
run of layers then costs one request and one slice per run — no re-validation and no
per-block objects (device memory: one staged copy per layer, see
:mod:`aiokv._copy._staging`). :func:`run_layers` walks the layers in order:
it awaits ``layer_synchronizer.synchronize_layer(i, None)`` (the model saying "layer i
is written"; waited for as long as it takes, as llm_datadist), starts layer i's sends in
its task group, and goes on to wait for layer i + 1 while they run; layers released
together (already written when asked for) go to a destination in one request. Each send
is bounded by ``sync_kv_timeout``. Each destination gets one result code.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import inspect
import itertools
import logging
from collections.abc import AsyncGenerator
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Coroutine
from collections.abc import Generator
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from typing import Protocol
from typing import runtime_checkable

import numpy as np

from ._cache import Cache
from ._checks import Blocks
from ._checks import check_index
from ._checks import param_invalid
from ._engine import Engine
from ._engine import Portal
from ._enums import LLMStatusCode
from ._errors import LLMException
from ._errors import status_of
from ._layout import ByteLayout
from ._models import BlocksCacheKey
from ._models import CacheKeyByIdAndIndex
from ._models import TransferConfig
from ._models import TransferWithCacheKeyConfig
from ._remote import Move
from ._remote import RemoteClient
from ._remote import Transfer
from ._remote._client import payload
from ._remote._protocol import AddrsReq
from ._remote._protocol import BlocksReq
from ._remote._protocol import KeyByBlocks
from ._remote._protocol import KeyById
from ._remote._protocol import Request
from ._remote._protocol import SlotReq
from ._remote._protocol import Tensors
from ._remote._protocol import pack_blocks
from ._remote._protocol import wire_key
from ._stats import OpCounter
from ._stats import code_name
from ._stats import failure_name
from ._threads import Lane

__all__ = ["CacheTask", "LayerPlan", "LayerSynchronizer", "plan", "run_layers"]

log = logging.getLogger("aiokv.layerwise")

Code = LLMStatusCode


@runtime_checkable
class LayerSynchronizer(Protocol):
    """Tells a layer-wise transfer when layer ``layer_index`` may be sent.

    Implement ``async def synchronize_layer(self, layer_index, timeout_in_millis) -> bool``
    or a plain blocking ``def`` returning ``bool``. Return ``True`` once the layer's KV is
    complete; ``False`` fails the destinations that need that layer with
    ``LLM_PARAM_INVALID``. numpy's ``bool_`` counts as a ``bool`` (``return
    np.all(flags)``); any other value (``1``, ``None``, an event object) is no ``True``
    and fails the layer as ``False`` does. ``timeout_in_millis`` is ``None`` (as
    llm_datadist passes it): the transfer waits for as long as the synchronizer takes;
    ``CacheTask.cancel()`` stops a wait that never ends.

    Where it runs: an ``async def`` on the loop that called ``transfer_cache_async`` (so
    it may wait on that loop's events; from ``aiokv.sync``, on the engine loop); a
    ``def`` on a thread of the engine's synchronizer lane (at most
    :data:`~aiokv._engine.SYNC_THREADS` block at once; more wait for a thread), never on
    any event loop, so it may block (e.g. on a device event) without delaying any other
    operation. One still blocked when ``finalize`` ends its transfer is abandoned after
    :data:`~aiokv._engine.SYNC_GRACE_S` with a warning naming it (its thread never keeps
    the process from exiting).
    """

    def synchronize_layer(
        self, layer_index: int, timeout_in_millis: int | None
    ) -> bool | Awaitable[bool]:
        """Wait until layer ``layer_index`` may be sent."""
        ...


@dataclass(slots=True)
class LayerPlan:
    """One destination: which source layers it needs, and how to send a run of
    consecutive ones of them in one request.

    Attributes (after those two):
        counter: looks up (on the engine) the peer's ``requests`` counter, where the
            destination is counted as ONE operation of ``nbytes`` (its sends are not
            counted one by one); ``None``: not counted.
        nbytes: the payload of all its layers.
    """

    layers: range
    send: Callable[[range], Coroutine[Any, Any, None]]
    counter: Callable[[], OpCounter] | None = None
    nbytes: int = 0


@dataclass(frozen=True, slots=True)
class Source:
    """What every destination of one transfer shares, validated once.

    Attributes:
        cache: the source cache (pinned by the caller for the transfer's life).
        nlayers: K,V layers of the cache (2 tensors each).
        srcs / dsts: the block lists of a paged transfer (empty for a contiguous one).
        dst_block_bytes: bytes between destination blocks (``dst_block_memory_size``).
    """

    cache: Cache
    nlayers: int
    srcs: Blocks
    dsts: Blocks
    dst_block_bytes: int


def plan(
    op: str,
    client: RemoteClient,
    source: Source,
    cfg: TransferConfig | TransferWithCacheKeyConfig,
) -> LayerPlan:
    """Validate one destination of ``transfer_cache_async`` and prepare its sends.

    Raises:
        LLMException: ``LLM_PARAM_INVALID`` (layer ranges, address counts, a key that
            cannot name this destination), ``LLM_NOT_YET_LINK``.
    """
    src = source.cache
    layers = cfg.src_layer_range or range(source.nlayers)
    if layers.stop > source.nlayers:
        param_invalid(op, f"src_layer_range {layers} exceeds {source.nlayers} layers")
    batch = check_index(op, "src_batch_index", cfg.src_batch_index, src.cache_desc.batch_size)
    paged = src.is_blocks_cache
    if not paged and not src.slots_contiguous:
        param_invalid(op, "remote slot transfers need batch_dim_index 0")
    layout = (
        ByteLayout.of_blocks(source.srcs, src.block_bytes)
        if paged
        else ByteLayout.of_span(batch * src.slot_bytes, src.slot_bytes)
    )

    def transfer(req: Request, tensors: range) -> Transfer:
        if paged:
            return Transfer.of_blocks(
                req, tensors, source.srcs, source.dsts, src.block_bytes, layout
            )
        return Transfer(req, tensors, layout, None, None, src.slot_bytes, batch * src.slot_bytes)

    if isinstance(cfg, TransferWithCacheKeyConfig):
        key = cfg.cache_key
        dst_layers = cfg.dst_layer_range or layers
        if len(dst_layers) != len(layers):
            param_invalid(op, "src_layer_range and dst_layer_range differ in length")
        if isinstance(key, BlocksCacheKey) != paged or not isinstance(
            key, BlocksCacheKey | CacheKeyByIdAndIndex
        ):
            param_invalid(op, f"{type(key).__name__} cannot name a destination of this cache")
        link = client.link(op, key.cluster_id)
        wkey = wire_key(key)
        packed = pack_blocks(source.dsts) if paged else b""
        shift = dst_layers.start - layers.start

        dtype = int(src.cache_desc.data_type)

        def request(run: range) -> Request:
            sel = Tensors(2 * len(run), (run.start + shift, run.stop + shift), 2, dtype)
            if isinstance(wkey, KeyByBlocks):
                return BlocksReq(wkey, sel, packed, src.block_bytes)
            assert isinstance(wkey, KeyById)
            return SlotReq(wkey, sel, src.slot_bytes, exact=True)

        about: dict[str, Any] = {"cluster": key.cluster_id, "key": key}
    else:
        link = client.link(op, cfg.dst_cluster_id)
        if len(cfg.dst_addrs) != 2 * len(layers):
            param_invalid(
                op, f"{len(cfg.dst_addrs)} dst_addrs for {len(layers)} layers (need 2 per layer)"
            )
        addrs = list(cfg.dst_addrs)
        # what the peer writes from each address: checked here, for the whole transfer
        # (the peer checks one request, and layers released together are one request)
        if paged:
            extent = (
                int(source.dsts.max()) * source.dst_block_bytes + src.block_bytes
                if source.dsts.size
                else 0
            )
        else:
            extent = src.slot_bytes
        if extent:
            for a, b in itertools.pairwise(sorted(addrs)):
                if b - a < extent:
                    param_invalid(
                        op, f"the regions of dst_addrs {a} and {b} overlap ({extent} bytes each)"
                    )
        packed = pack_blocks(source.dsts)

        def request(run: range) -> Request:
            bases = addrs[2 * (run.start - layers.start) : 2 * (run.stop - layers.start)]
            if paged:
                return AddrsReq(bases, src.block_bytes, source.dst_block_bytes, packed)
            return AddrsReq(bases, src.slot_bytes, src.slot_bytes)

        about = {"cluster": cfg.dst_cluster_id}

    async def send(run: range) -> None:
        job = transfer(request(run), range(2 * run.start, 2 * run.stop))
        await client.move(Move(op, link, src, job, write=True, about=about, counted=False))

    whole = transfer(request(layers), range(2 * layers.start, 2 * layers.stop))
    counter = functools.partial(client.requests, link.peer.cluster_id)
    return LayerPlan(layers, send, counter, payload(whole))


def _code_of(got: Any) -> LLMStatusCode:
    return Code.LLM_SUCCESS if got is True else Code.LLM_PARAM_INVALID


def _why(layer: int, got: Any, raised: bool) -> str | None:
    """Why a synchronizer's outcome for ``layer`` fails its destinations, for a person
    (:meth:`CacheTask.errors`); None for ``True``. Cut to 300 characters."""
    if raised:
        why = f"synchronize_layer({layer}) raised {type(got).__name__}: {got}"
    elif got is True:
        return None
    else:
        why = f"synchronize_layer({layer}) returned {got!r}, not True"
    return why if len(why) <= 300 else why[:297] + "..."


def _label(sync: LayerSynchronizer, layer: int) -> str:
    """How a warning names a synchronizer's call (its repr, cut to 200 characters; its
    type's name where its ``__repr__`` raises: a label never fails the transfer)."""
    try:
        name = repr(sync)
    except Exception:
        name = f"<{type(sync).__qualname__} object>"
    if len(name) > 200:
        name = name[:197] + "..."
    return f"{name}.synchronize_layer({layer})"


def _answer(got: Any) -> Any:
    """A synchronizer's answer with numpy's ``bool_`` read as the ``bool`` it is
    (``np.all(flags)``: ``np.True_`` is not ``True``, and failed its layer); any other
    value as it is."""
    return bool(got) if isinstance(got, np.bool_) else got


async def _awaited(aw: Awaitable[Any]) -> tuple[Any, bool]:
    """``(what aw returned, False)`` (:func:`_answer`), or ``(what it raised, True)``:
    anything but a cancellation stays here, on the loop that awaits it (a ``SystemExit``
    raised out of a task stops its event loop: the caller's, or the engine's)."""
    try:
        return _answer(await aw), False
    except (Exception, KeyboardInterrupt, SystemExit) as exc:
        return exc, True


#: (layer, the destinations that wanted it when its synchronizer was called, its code,
#: why it failed them: None for success)
Released = tuple[int, list[int], LLMStatusCode, str | None]


class _Feed:
    """A synchronizer called for consecutive layers by ONE job, which calls it for layer
    ``i + 1`` as soon as it returned for layer ``i`` and posts each outcome to the
    engine loop: no round trip through the engine per layer (on a busy engine each one
    waited for the loop, and delayed every later layer's send). A ``def`` one is called
    by a job on the engine's synchronizer lane (:meth:`feed`); an ``async def`` one by a
    coroutine on the caller's loop (:meth:`feed_async`, run through the portal).

    The job (:meth:`feed`) decides which layers are wanted as the engine did: a layer
    no destination still needs (each one failed: a synchronizer's ``False`` or error,
    which it tracks itself, or a send's failure, read from ``results``) is not asked
    for. It stops before its next call once :attr:`stopped` is set (the transfer ended
    or was cancelled: a call running then is abandoned, as before), and after an
    outcome that is an awaitable (a ``def`` returning one: the engine awaits it on the
    caller's loop, then starts a new job from the next layer).
    """

    def __init__(
        self,
        sync: LayerSynchronizer,
        lane: Lane,
        plans: list[LayerPlan],
        results: list[Code | None],
    ) -> None:
        self._sync = sync
        self._fn: Any = sync.synchronize_layer
        self._lane = lane
        self._plans = plans
        self._results = results
        self._loop = asyncio.get_running_loop()
        self.failed: set[int] = set()  # destinations a synchronizer failed (engine: after a job)
        self.stopped = False
        self.job: concurrent.futures.Future[None] | asyncio.Future[None] | None = None
        self.error: BaseException | None = None  # what ended an async feed early
        self.queue: asyncio.Queue[tuple[int, list[int], Any, bool] | None] = asyncio.Queue()

    def wanting(self, layer: int) -> list[int]:
        """The destinations that still need ``layer``."""
        return [
            j
            for j, p in enumerate(self._plans)
            if layer in p.layers and self._results[j] is None and j not in self.failed
        ]

    def _to_ask(self, start: int, stop: int) -> Iterator[tuple[int, list[int]]]:
        """The layers of ``[start, stop)`` to ask for, in order, each with the
        destinations that want it (found just before it is asked), until stopped."""
        for layer in range(start, stop):
            if self.stopped:
                return
            if wanting := self.wanting(layer):
                yield layer, wanting

    def feed(self, start: int, stop: int) -> None:
        """On a lane thread: call the synchronizer for the wanted layers of
        ``[start, stop)`` in order, posting ``(layer, wanting, outcome, raised)`` for
        each, then ``None`` (unless it stopped early)."""
        for layer, wanting in self._to_ask(start, stop):
            self._lane.relabel(_label(self._sync, layer))
            raised = False
            try:
                got = _answer(self._fn(layer, None))
            except BaseException as exc:  # a failure of its layer, whatever it is
                got, raised = exc, True
            waits = not raised and inspect.isawaitable(got)
            if not waits and (raised or got is not True):
                self.failed.update(wanting)
            self._post((layer, wanting, got, raised))
            if waits:
                return
        if not self.stopped:
            self._post(None)

    async def feed_async(self, start: int, stop: int) -> None:
        """On the caller's loop: await the ``async def`` synchronizer for the wanted
        layers of ``[start, stop)`` in order, posting ``(layer, wanting, got, False)``
        (an awaitable ``got`` replaced by its type's name), or ``(layer, wanting, exc,
        True)``, for each; the job running it
        posts the end (:meth:`start_async`)."""
        for layer, wanting in self._to_ask(start, stop):
            try:
                got = _answer(await self._fn(layer, None))
            # handed to the engine (SystemExit too: raised out of this task, it would stop
            # the loop running it); a cancellation ends the feed
            except (Exception, KeyboardInterrupt, SystemExit) as exc:
                self.failed.update(wanting)
                self._post((layer, wanting, exc, True))
                continue
            if got is not True:
                self.failed.update(wanting)
                if inspect.isawaitable(got):  # awaited once only: an awaitable is no answer
                    got = type(got).__name__
            self._post((layer, wanting, got, False))

    def start_async(self, portal: Portal, first: int, stop: int) -> RuntimeError | None:
        """Start, on the engine loop, the job awaiting :meth:`feed_async` through
        ``portal``; it posts ``None`` when that ends, and keeps in :attr:`error` what
        ended it early (the portal's loop closed, a cancellation). Returns None: it
        always starts (the signature of :meth:`start`)."""

        async def job() -> None:
            try:
                await portal.run(self.feed_async, first, stop)
            except BaseException as exc:  # fails the layers it never asked: see error
                self.error = exc
            finally:
                self._post(None)

        self.job = asyncio.ensure_future(job())
        return None

    def never_asked(self, start: int, stop: int, exc: BaseException) -> list[Released]:
        """The wanted layers of ``[start, stop)`` that no synchronizer call will
        release (``exc`` ended the feeding): each fails its destinations with
        ``exc``'s code."""
        out: list[Released] = []
        for layer in range(start, stop):
            if wanting := self.wanting(layer):
                self.failed.update(wanting)
                code = status_of(exc, log, f"synchronize_layer({layer})")
                why = f"synchronize_layer({layer}) was not called: {type(exc).__name__}: {exc}"
                out.append((layer, wanting, code, why))
        return out

    def _post(self, item: tuple[int, list[int], Any, bool] | None) -> None:
        with contextlib.suppress(RuntimeError):  # the engine loop is closed: nobody waits
            self._loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def start(self, first: int, stop: int) -> RuntimeError | None:
        """Start a job feeding ``[first, stop)``; the lane's error if it is closed."""
        try:
            self.job = self._lane.submit(
                functools.partial(self.feed, first, stop), _label(self._sync, first)
            )
        except RuntimeError as exc:  # the lane is closed: the engine is ending
            return exc
        return None

    def stop(self) -> None:
        """No further call: the job stops before its next one (or never starts)."""
        self.stopped = True
        if self.job is not None:
            self.job.cancel()

    async def code(
        self, portal: Portal, item: tuple[int, list[int], Any, bool]
    ) -> tuple[Code, str | None]:
        """On the engine: the code of one posted outcome and why it fails (None when it
        does not); an awaitable one awaited on the caller's loop through ``portal`` (its
        job has ended then)."""
        layer, wanting, got, raised = item
        if raised:  # anything (SystemExit, KeyboardInterrupt too) fails its destinations
            return status_of(got, log, f"synchronize_layer({layer})"), _why(layer, got, True)
        if not inspect.isawaitable(got):
            return _code_of(got), _why(layer, got, False)
        try:
            got, raised = await portal.run(_awaited, got)
        except Exception as exc:  # the portal's: e.g. the caller's loop has closed
            got, raised = exc, True
        if raised:
            code, why = status_of(got, log, f"synchronize_layer({layer})"), _why(layer, got, True)
        else:
            code, why = _code_of(got), _why(layer, got, False)
        if code != Code.LLM_SUCCESS:
            self.failed.update(wanting)
        return code, why


async def _released(
    sync: LayerSynchronizer,
    portal: Portal,
    plans: list[LayerPlan],
    results: list[Code | None],
) -> AsyncGenerator[tuple[int, list[int], LLMStatusCode, str | None, bool], None]:
    """Each layer some destination still needs, in order, once its synchronizer
    released it (or failed it): ``(layer, wanting, code, why, more)``; ``why``: why it
    failed them (None when it did not); ``more``: the outcome of a later layer is
    already here (the next one comes without waiting)."""
    first = min(p.layers.start for p in plans)
    last = max(p.layers.stop for p in plans)
    feed = _Feed(sync, portal.lane, plans, results)
    is_async = inspect.iscoroutinefunction(sync.synchronize_layer)
    try:
        start: int | None = first
        while start is not None:
            closed = feed.start_async(portal, start, last) if is_async else feed.start(start, last)
            if closed is not None:
                for released in feed.never_asked(start, last, closed):
                    yield *released, False
                return
            after, start = start, None
            while (item := await feed.queue.get()) is not None:
                after = item[0] + 1
                code, why = await feed.code(portal, item)
                yield item[0], item[1], code, why, not feed.queue.empty()
                if inspect.isawaitable(item[2]):  # its job has ended: a new one goes on
                    start = after
                    break
            if feed.error is not None and not feed.stopped:  # an async feed ended early
                for released in feed.never_asked(after, last, feed.error):
                    yield *released, False
    finally:
        feed.stop()


async def run_layers(
    sync: LayerSynchronizer,
    portal: Portal,
    plans: list[LayerPlan],
    results: list[Code | None],
    errors: list[str | None],
) -> None:
    """Walk the layers in order, overlapping each layer's sends with the next wait.

    Layers released together go together: the consecutive layers a destination needs
    whose outcomes the engine takes in one go (nothing to wait for in between: their
    synchronizer returned before the engine got to them) are sent to it in ONE request,
    started once no further outcome is waiting. A layer released on its own (the model
    still computing the next one) is sent at once, alone.

    ``results[j]`` gets plan j's code as soon as it is known (the first failure, or
    ``LLM_SUCCESS`` as soon as its last layer landed: a destination that completed is
    reported so even if the transfer is cancelled afterwards), and ``errors[j]`` why it
    failed, for a person. A failure does not take
    back the layers released before it: they are sent as they would have been. The
    sends run in a task group owned by this coroutine: cancelling it cancels them and
    waits for them to end; layers released but not sent yet are then never sent. A
    ``def`` synchronizer is called by one job on the synchronizer lane for consecutive
    layers (:class:`_Feed`).
    """
    counted = _Counted(plans, results, errors)
    try:
        await _run_layers(sync, portal, plans, counted)
    except BaseException as exc:
        counted.ended(exc)
        raise
    counted.ended(None)


class _Counted:
    """The outcome of each destination of :func:`run_layers` (``results``, ``errors``),
    and each destination as ONE operation in its peer's statistics, in flight from its
    start until its result is known (counted under that code), however many requests
    it takes."""

    def __init__(
        self, plans: list[LayerPlan], results: list[Code | None], errors: list[str | None]
    ) -> None:
        self.results, self.errors = results, errors
        self._ops = [None if p.counter is None else p.counter().start(p.nbytes) for p in plans]

    def decided(self, j: int) -> None:
        """``results[j]`` is known: end destination ``j``'s operation (once)."""
        m, code = self._ops[j], self.results[j]
        if m is not None and code is not None:
            m.end(None if code == Code.LLM_SUCCESS else code_name(code))

    def ended(self, exc: BaseException | None) -> None:
        """The transfer is over; the destinations not decided by then were ended by
        ``exc`` (when it raised)."""
        for j, m in enumerate(self._ops):
            if exc is None:
                self.decided(j)
            elif m is not None:
                m.end(failure_name(exc))


async def _run_layers(
    sync: LayerSynchronizer, portal: Portal, plans: list[LayerPlan], counted: _Counted
) -> None:
    """The body of :func:`run_layers`; ``counted.decided(j)`` is called once
    ``results[j]`` is set (maybe more than once)."""
    results, errors, decided = counted.results, counted.errors, counted.decided
    left = [len(p.layers) for p in plans]  # layers of each plan not landed yet
    runs: dict[int, range] = {}  # destination -> layers released together, not sent yet

    async def send(j: int, run: range) -> None:
        try:
            await plans[j].send(run)
        except Exception as exc:
            if results[j] is None:
                what = f"layers {run.start}-{run.stop - 1} to destination {j}"
                results[j] = status_of(exc, log, what)
                errors[j] = f"{what}: {type(exc).__name__}: {exc}"
                decided(j)
            return
        left[j] -= len(run)
        if not left[j] and results[j] is None:
            results[j] = Code.LLM_SUCCESS
            decided(j)

    async with asyncio.TaskGroup() as group:

        def flush() -> None:
            for j, run in runs.items():
                group.create_task(send(j, run))
            runs.clear()

        released = _released(sync, portal, plans, results)
        try:
            async for layer, wanting, code, why, more in released:
                for j in wanting:
                    run = runs.get(j)
                    if code != Code.LLM_SUCCESS:
                        if results[j] is None:  # the first failure stays
                            results[j], errors[j] = code, why
                            decided(j)
                    elif run is not None and run.stop == layer:
                        runs[j] = range(run.start, layer + 1)
                    else:
                        if run is not None:
                            group.create_task(send(j, run))
                        runs[j] = range(layer, layer + 1)
                if not more:
                    flush()
            flush()
        finally:
            await released.aclose()
    for j, r in enumerate(results):
        if r is None and left[j]:  # never a success by default: every layer landed, or not
            results[j] = Code.LLM_FAILED
            errors[j] = f"{left[j]} layer(s) to destination {j} were never sent"
        elif r is None:
            results[j] = Code.LLM_SUCCESS


#: the longest wait :meth:`CacheTask.synchronize` takes (a uint64 of ms, as
#: llm_datadist's); one more is a ``ValueError``, not an ``OverflowError`` from the
#: conversion to seconds
_MAX_WAIT_MS = 2**64 - 1


class CacheTask:
    """A running layer-wise transfer (``transfer_cache_async``'s result).

    Created already started: ``spawn`` is called on the engine (at once when created
    there, else as the engine's next callback) and returns the engine-owned task, or
    ``None`` when the transfer may no longer start (the ``LLMDataDist`` is finalizing).
    This handle may be awaited from any loop or thread (``aiokv.sync`` blocks on the
    same handle). ``await task`` yields the per-destination results. ``synchronize``
    and ``get_results`` take an optional timeout in ms; a timeout returns
    ``LLM_TIMEOUT`` (per unfinished destination for ``get_results``) and does NOT
    cancel the transfer. ``cancel()`` cancels it; destinations not finished then
    report ``None`` (one whose every layer had landed reports ``LLM_SUCCESS``).

    Raises (at creation):
        LLMException: ``LLM_FAILED`` when the engine has stopped (``spawn`` not called).
    """

    def __init__(
        self,
        engine: Engine,
        spawn: Callable[[], asyncio.Task[None] | None],
        results: list[Code | None],
        errors: list[str | None],
    ) -> None:
        self._engine = engine
        self._results = results
        self._errors = errors
        self._task: asyncio.Task[None] | None = None
        self._cancelled = False
        self._ended = False  # set on the engine; read from any thread
        self._spawn: Callable[[], asyncio.Task[None] | None] | None = spawn
        if engine.on_engine():
            self._start()
        else:
            try:
                engine.loop.call_soon_threadsafe(self._start)
            except RuntimeError:  # the engine loop is closed
                raise LLMException(
                    "transfer_cache_async: the LLMDataDist was finalized",
                    status_code=Code.LLM_FAILED,
                ) from None

    def _start(self) -> None:  # on the engine; runs before any later engine call
        spawn, self._spawn = self._spawn, None
        assert spawn is not None
        task = spawn()
        if task is None:
            self._ended = True
            return
        self._task = task
        task.add_done_callback(self._end)
        if self._cancelled:
            task.cancel()  # never started: its body does not run

    def _end(self, task: asyncio.Task[None]) -> None:
        self._ended = True

    async def _wait(self, timeout_in_millis: int | None) -> bool:
        if timeout_in_millis is not None and (
            isinstance(timeout_in_millis, bool) or not isinstance(timeout_in_millis, int)
        ):
            raise TypeError("timeout_in_millis must be int or None")
        if timeout_in_millis is not None and not 0 <= timeout_in_millis <= _MAX_WAIT_MS:
            raise ValueError(f"timeout_in_millis must be in [0, {_MAX_WAIT_MS}]")
        if self._ended:
            return True
        timeout = None if timeout_in_millis is None else timeout_in_millis / 1000

        async def wait() -> bool:  # on the engine, which owns the task (started by now)
            if self._task is None:
                return True
            done, _ = await asyncio.wait({self._task}, timeout=timeout)
            return bool(done)

        return await self._engine.run(wait)

    async def synchronize(self, timeout_in_millis: int | None = None) -> LLMStatusCode:
        """Wait for the transfer: ``LLM_SUCCESS`` if every destination succeeded, else the
        first failure code; ``LLM_TIMEOUT`` if still running after ``timeout_in_millis``."""
        if not await self._wait(timeout_in_millis):
            return Code.LLM_TIMEOUT
        for r in self._results:
            if r != Code.LLM_SUCCESS:
                return Code.LLM_FAILED if r is None else r
        return Code.LLM_SUCCESS

    async def get_results(self, timeout_in_millis: int | None = None) -> list[LLMStatusCode | None]:
        """Per-destination codes, in ``transfer_configs`` order (``LLM_TIMEOUT`` for those
        still running after the timeout; ``None`` for those cut short by ``cancel()``,
        ``LLM_SUCCESS`` for those that had completed before it)."""
        finished = await self._wait(timeout_in_millis)
        if finished:
            return list(self._results)
        return [Code.LLM_TIMEOUT if r is None else r for r in self._results]

    def cancel(self) -> None:
        """Stop the transfer; in-flight sends are cancelled, the links stay usable.

        Returns at once (from any thread); :meth:`synchronize` waits for the end."""
        if self._engine.on_engine():
            self._cancel()
        else:
            with contextlib.suppress(RuntimeError):  # the engine has stopped: it is over
                self._engine.loop.call_soon_threadsafe(self._cancel)

    def _cancel(self) -> None:
        self._cancelled = True
        if self._task is not None:
            self._task.cancel()

    def done(self) -> bool:
        """Whether the transfer finished (or was cancelled)."""
        return self._ended

    def errors(self) -> list[str | None]:
        """Per destination, in ``transfer_configs`` order, why it failed so far, for a
        person (e.g. ``"synchronize_layer(3) raised RuntimeError: ..."``, ``"layers 0-3
        to destination 1: LLMException: ..."``); None where it has not failed. aiokv's
        addition: the codes alone (:meth:`get_results`) do not say what went wrong, and
        the log line that does is silent by default. Does not wait; call it after
        :meth:`synchronize`."""
        return list(self._errors)

    def __await__(self) -> Generator[Any, None, list[LLMStatusCode | None]]:
        return self.get_results().__await__()
