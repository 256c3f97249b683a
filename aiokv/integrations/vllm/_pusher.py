"""Push mode, prefill side: :class:`Pusher` pushes each prefill request's KV, layer by
layer as vLLM computes it, into the blocks its decode side reserved (docs/vllm.md).

vLLM's thread calls :meth:`Pusher.save_layer` / :meth:`Pusher.saved`, which never
block: each layer's ``push_blocks`` runs on aiokv's engine loop. A push claims its
:class:`Reservation` and ends every write within the reservation's ``deadline`` (the
decode side's lease less a margin, :func:`~._options.load_deadline`), then the decode
side gets its :class:`~._notices.PushedNotice` and the request's blocks are released.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from collections.abc import Coroutine
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import Protocol

import anyio
import torch

from ._notices import PushedNotice
from ._options import ConnectorOptions
from ._plan import Push

__all__ = ["PushJob", "Pusher", "Reservation"]

log = logging.getLogger("aiokv.vllm")


@dataclass(slots=True)
class Reservation:
    """Where a decode side wants a prompt's KV pushed; ``deadline``: by when a push
    must have claimed it and ended its writes (:func:`~._options.load_deadline` of
    ``lease_s`` after it arrived: the decode side gives the blocks up its
    ``lease_timeout_s`` after it sent it; ``lease_s`` is the shorter of the two sides')."""

    cluster_id: int
    blocks: list[int]
    first: int
    num_tokens: int
    deadline: float
    lease_s: float = 0.0


@dataclass(slots=True)
class PushJob:
    """One request's layer-wise push. ``started`` is touched by vLLM's thread only;
    ``remaining`` and ``error`` by the loop thread only."""

    request_id: str
    transfer_id: str
    cluster_id: int | None
    src: tuple[int, ...]
    dst: tuple[int, ...]
    remaining: int
    error: str | None = None
    started: set[int] = field(default_factory=set)
    deadline: float = float("inf")  # its writes end by then (its reservation's)
    lease_s: float = 0.0  # the lease that deadline comes from


class Worker(Protocol):
    """What a :class:`Pusher` needs of its worker (``WorkerSide``)."""

    options: ConnectorOptions

    def claim(self, transfer_id: str) -> Reservation | None: ...

    def run_soon(self, fn: Callable[..., Coroutine[Any, Any, None]], *args: Any) -> bool: ...

    async def push_layer(
        self, cluster_id: int, src: tuple[int, ...], dst: tuple[int, ...], layer: int
    ) -> None: ...

    async def send(self, cluster_id: int, message: PushedNotice) -> None: ...

    def pushed(self, request_id: str) -> None: ...


class Pusher:
    """The prefill side's pushes of one worker rank.

    Args:
        worker: the worker rank (its reservations, engine loop and blocks cache).
    """

    def __init__(self, worker: Worker) -> None:
        self._worker = worker
        self.layers: dict[str, int] = {}  # vLLM layer name -> layer of the blocks cache
        self.jobs: dict[str, PushJob] = {}  # request -> push of this step (vLLM's thread)

    def save_layer(self, layer_name: str, pushes: tuple[Push, ...], kv_layer: Any = None) -> None:
        """``save_kv_layer``: vLLM computed layer ``layer_name`` of this step; start
        pushing it for every request of ``pushes`` (this step's plan). Never blocks.

        ``kv_layer``: the layer's tensor; on a GPU its pushes wait for the work vLLM
        queued on the current stream (an event), not for the stream to drain."""
        layer = self.layers.get(layer_name)
        if layer is None or not pushes:
            return
        event = None
        if isinstance(kv_layer, torch.Tensor) and kv_layer.is_cuda:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
        for push in pushes:
            self._push_layer_soon(self._job(push), layer, event)

    def saved(self, pushes: tuple[Push, ...]) -> None:
        """``wait_for_save`` (after the step's forward): push the layers of ``pushes``
        that :meth:`save_layer` was not called for (normally none), then forget the
        step's jobs (they end on their own). Never blocks."""
        for push in pushes:
            job = self._job(push)
            late = [i for i in range(len(self.layers)) if i not in job.started]
            if late:
                log.warning(
                    "request %s: layers %s were not named by save_kv_layer; pushed after "
                    "the forward",
                    push.request_id,
                    late,
                )
            for layer in late:
                self._push_layer_soon(job, layer)
        self.jobs.clear()

    def _job(self, push: Push) -> PushJob:
        """This step's job of ``push`` (made on first use: its reservation checked)."""
        job = self.jobs.get(push.request_id)
        if job is not None:
            return job
        reservation = self._worker.claim(push.transfer_id)
        error = None
        if reservation is None:
            error = "its reservation was withdrawn or expired"
        elif time.monotonic() >= reservation.deadline:
            error = _too_late(reservation.lease_s)
        elif (
            reservation.num_tokens != push.num_tokens
            or reservation.first + len(reservation.blocks) != len(push.blocks)
            or reservation.first < 0
        ):
            error = (
                f"the decode side expects {reservation.num_tokens} tokens from block "
                f"{reservation.first} in {len(reservation.blocks)} blocks; the prefill "
                f"computed {push.num_tokens} tokens in {len(push.blocks)} blocks"
            )
        src = push.blocks[reservation.first :] if reservation is not None else ()
        job = PushJob(
            push.request_id,
            push.transfer_id,
            None if reservation is None else reservation.cluster_id,
            tuple(src),
            tuple(reservation.blocks) if reservation is not None else (),
            remaining=len(self.layers),
            error=error,
            deadline=reservation.deadline if reservation is not None else float("inf"),
            lease_s=reservation.lease_s if reservation is not None else 0.0,
        )
        self.jobs[push.request_id] = job
        if error is not None:
            log.error("request %s: no push: %s", push.request_id, error)
            job.started.update(range(len(self.layers)))
            self._worker.run_soon(self._push_ended_now, job)
        return job

    def _push_layer_soon(self, job: PushJob, layer: int, event: Any = None) -> None:
        if layer in job.started:
            return
        job.started.add(layer)
        self._worker.run_soon(self._push_layer, job, layer, event)

    async def _push_layer(self, job: PushJob, layer: int, event: Any) -> None:
        """Push one layer of ``job`` (on the loop thread); the last one to end sends the
        decode side its PushedNotice."""
        try:
            if event is not None:  # the GPU work that computed the layer
                await anyio.to_thread.run_sync(event.synchronize)
            if job.error is None and job.src:
                await self._push_layer_by(job, layer, job.deadline - time.monotonic())
        except Exception as exc:
            if job.error is None:
                job.error = f"pushing layer {layer} failed: {exc}"
                log.error("request %s: %s", job.request_id, job.error)
        finally:
            job.remaining -= 1
            if job.remaining == 0:
                await self._push_ended_now(job)

    async def _push_layer_by(self, job: PushJob, layer: int, left: float) -> None:
        """Push one layer of ``job`` within ``transfer_timeout_ms`` and the ``left``
        seconds of its decode side's lease (less a margin): its writes end by then."""
        assert job.cluster_id is not None
        bound = self._worker.options.transfer_timeout_ms / 1000
        if left <= 0:
            raise TimeoutError(_too_late(job.lease_s))
        try:
            with anyio.fail_after(min(bound, left)):
                await self._worker.push_layer(job.cluster_id, job.src, job.dst, layer)
        except TimeoutError:
            lease = left <= bound
            why = _too_late(job.lease_s) if lease else f"not done in {bound:g} s"
            raise TimeoutError(why) from None

    async def _push_ended_now(self, job: PushJob) -> None:
        """``job`` ended: tell its decode side, then release its held blocks."""
        if job.cluster_id is not None:
            notice = PushedNotice(job.transfer_id, job.error is None, job.error or "")
            await self._worker.send(job.cluster_id, notice)
        self._worker.pushed(job.request_id)


def _too_late(lease_s: float) -> str:
    return (
        f"the decode side's lease ({lease_s:g} s from its reservation, less a margin) "
        "ran out: its blocks may be given up"
    )
