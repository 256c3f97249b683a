"""``SchedulerSide``: the connector's scheduler-side bookkeeping, free of vLLM types.

The vLLM facade (:mod:`._connector`) reads what it needs from vLLM's ``Request`` and
``KVCacheBlocks`` and calls these methods in vLLM's order:

0. :meth:`~SchedulerSide.arrived` (``on_new_request``): when a decode request came in
   (its prefill's lease counts from then, less the age of its params by the wall
   clocks: how long the proxy held them).
1. :meth:`~SchedulerSide.matched_tokens` (``get_num_new_matched_tokens``, maybe
   several times, no side effect): a decode request whose params name a prefill loads
   its prompt's KV asynchronously.
2. :meth:`~SchedulerSide.after_alloc` (``update_state_after_alloc``): the blocks vLLM
   allocated are known; a :class:`~._plan.Load` is planned (once per request).
3. :meth:`~SchedulerSide.finished` (``request_finished``): a finished prefill request
   keeps its blocks for the decode side (a :class:`~._plan.Hold`) and returns the
   params the decode side needs.
4. :meth:`~SchedulerSide.take_plan` (``build_connector_meta``): the step's plan, for
   every worker.

Push mode (``push=True``) adds, on the prefill side: :meth:`~SchedulerSide.reserved`
(``update_connector_output``: which decode reservations the workers received; a push
prefill request is not scheduled — ``matched_tokens`` answers ``None`` — until every
rank has its reservation, or ``lease_s`` passed), and :meth:`~SchedulerSide.scheduled`
(``build_connector_meta``, before ``take_plan``: the step that computes the rest of a
push request's prompt plans its :class:`~._plan.Push`). On the decode side a request
with push params plans a :class:`~._plan.Reserve` instead of a load.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

from ._options import load_deadline
from ._params import PARAMS_VERSION
from ._params import Endpoint
from ._params import PushPrefill
from ._params import RemotePrefill
from ._params import check_transfer_id
from ._params import endpoint_params
from ._params import issued_at
from ._params import parse_push_prefill
from ._params import parse_remote_prefill
from ._params import producer_params
from ._plan import Cancel
from ._plan import Hold
from ._plan import Load
from ._plan import Push
from ._plan import Release
from ._plan import Reserve
from ._plan import StepPlan
from ._plan import Withdraw

__all__ = ["SchedulerSide"]

log = logging.getLogger("aiokv.vllm")


class SchedulerSide:
    """Plans loads (decode side) and holds (prefill side) of one vLLM engine.

    Args:
        engine_id: this engine's id (``KVTransferConfig.engine_id``).
        block_size: tokens per KV block.
        tp_size: tensor-parallel size (workers, one aiokv instance each).
        lease_s: how long a finished prefill request's blocks wait for a decode side
            (push mode: also how long a prefill request waits for its reservation).
        push: push mode on (``mode="push"``): requests may use the push flow.
        clock: seconds, monotonic (tests pass a fake one).
        wall: seconds, the wall clock (tests pass a fake one): the params a prefill
            returns say when they were made, by it.
    """

    def __init__(
        self,
        *,
        engine_id: str,
        block_size: int,
        tp_size: int,
        lease_s: float,
        push: bool = False,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._engine_id = engine_id
        self._block_size = block_size
        self._tp_size = tp_size
        self._lease_s = lease_s
        self._clock = clock
        self._wall = wall
        self._arrivals: dict[str, float] = {}  # decode request -> when it came in
        # decode: params' (token, prefill ranks) -> (the request that took them, forget
        # after)
        self._claimed: dict[tuple[str, tuple[Endpoint, ...]], tuple[str, float]] = {}
        self._ranks: list[Endpoint] | None = None
        self._loads: list[Load] = []
        self._releases: list[Release] = []
        self._holds: list[Hold] = []
        # push mode, prefill side
        self._push = push
        self._push_since: dict[str, float] = {}  # transfer -> when its prefill came in
        self._reported: dict[str, tuple[int, float]] = {}  # transfer -> (ranks, first seen)
        self._admitted: dict[str, tuple[str, str | None]] = {}  # request -> (transfer, why not)
        self._pushing: dict[str, str] = {}  # request -> transfer (its Push is planned)
        self._reserves: list[Reserve] = []
        self._pushes: list[Push] = []
        self._cancels: list[Cancel] = []
        # push mode, decode side
        self._reserving: dict[str, str] = {}  # request -> transfer (a Reserve planned)
        self._withdrawals: list[Withdraw] = []

    def set_ranks(self, ranks: dict[int, Endpoint]) -> None:
        """Where each worker rank listens (from the workers' handshake metadata).

        Raises:
            ValueError: not exactly one endpoint per rank ``0 .. tp_size - 1``.
        """
        if sorted(ranks) != list(range(self._tp_size)):
            expected = f"0..{self._tp_size - 1}"
            raise ValueError(f"AiokvConnector: endpoints of ranks {sorted(ranks)}, not {expected}")
        self._ranks = [ranks[r] for r in range(self._tp_size)]

    # ---- decode side ----------------------------------------------------------------------
    def _remote(self, params: dict[str, Any] | None) -> RemotePrefill | PushPrefill | str | None:
        if not params or not params.get("do_remote_prefill"):
            return None
        if "transfer_id" in params:
            if not self._push:
                return (
                    "push-mode params, but this instance runs mode 'pull' (set "
                    '"mode": "push" in kv_connector_extra_config on both instances)'
                )
            return parse_push_prefill(params, block_size=self._block_size, tp_size=self._tp_size)
        return parse_remote_prefill(params, block_size=self._block_size, tp_size=self._tp_size)

    def _push_transfer(self, params: dict[str, Any] | None) -> str | None:
        """The transfer id of a push-mode prefill request (``None``: not one)."""
        if not self._push or not params or not params.get("do_remote_decode"):
            return None
        transfer = params.get("transfer_id")
        if not isinstance(transfer, str) or check_transfer_id(transfer) is not None:
            return None
        return transfer

    def arrived(self, request_id: str, params: dict[str, Any] | None) -> None:
        """``on_new_request``: note when a decode request came in, less the age of its
        params (``remote_issued_at`` by this side's wall clock: a proxy may hold them a
        while): the prefill's lease ends no sooner than about :func:`load_deadline`
        after that. Params without the field count from now (an earlier aiokv)."""
        if params and params.get("do_remote_prefill"):
            issued = issued_at(params)
            age = 0.0 if issued is None else max(0.0, self._wall() - issued)
            self._arrivals[request_id] = self._clock() - age
        transfer = self._push_transfer(params)
        if transfer is not None:
            self._push_since.setdefault(transfer, self._clock())

    def matched_tokens(
        self, params: dict[str, Any] | None, num_prompt_tokens: int, num_computed: int
    ) -> tuple[int | None, bool]:
        """``get_num_new_matched_tokens``: ``(tokens to load, True)`` for a decode request
        whose params name a prefill, else ``(0, False)``. Unusable params still load
        asynchronously — the load then fails at once, and vLLM's
        ``kv_load_failure_policy`` applies to that request alone.

        Push mode: a decode request loads its whole prompt (the prefill pushes it); a
        prefill request gets ``(None, False)`` (not scheduled yet) until every worker
        rank received its decode side's reservation, or it waited ``lease_s``."""
        transfer = self._push_transfer(params)
        if transfer is not None:
            ready = self._reported.get(transfer, (0, 0.0))[0] >= self._tp_size
            since = self._push_since.get(transfer)
            if ready or since is None or self._clock() - since > self._lease_s:
                return 0, False
            return None, False
        remote = self._remote(params)
        if remote is None:
            return 0, False
        have = (
            min(remote.num_tokens, num_prompt_tokens)
            if isinstance(remote, RemotePrefill)
            else num_prompt_tokens
        )
        count = have - num_computed
        return (count, True) if count > 0 else (0, False)

    def after_alloc(
        self,
        request_id: str,
        params: dict[str, Any] | None,
        *,
        cached_blocks: int,
        new_blocks: list[int],
        num_external_tokens: int,
    ) -> None:
        """``update_state_after_alloc``: plan the load of a decode request (once: its
        ``do_remote_prefill`` is cleared).

        Args:
            cached_blocks: blocks of the request's prefix found in the local prefix cache.
            new_blocks: the other blocks allocated for it, in order.
            num_external_tokens: tokens to load (0: nothing; the prefill is released).
        """
        transfer = self._push_transfer(params)
        if transfer is not None:
            self._admit(request_id, transfer)
            return
        remote = self._remote(params)
        arrived = self._arrivals.pop(request_id, None)
        if remote is None:
            return
        assert params is not None
        params["do_remote_prefill"] = False  # one transfer per request
        if isinstance(remote, str):
            log.error("request %s: bad kv_transfer_params: %s", request_id, remote)
            if num_external_tokens > 0:
                self._loads.append(Load(request_id, (), (), "", "", (), error=remote))
            return
        if num_external_tokens <= 0:  # e.g. a full local prefix-cache hit
            if isinstance(remote, RemotePrefill) and self._claim(request_id, remote) is None:
                self._releases.append(Release(remote.request_id, remote.token, remote.ranks))
            # push mode: no reservation made, the prefill computes without pushing
            return
        first = cached_blocks
        stop = -(-(first * self._block_size + num_external_tokens) // self._block_size)
        local = new_blocks[: stop - first]
        if isinstance(remote, PushPrefill):
            if len(local) != stop - first:
                short = f"{stop - first} blocks to load, {len(local)} allocated here"
                log.error("request %s: %s", request_id, short)
                self._loads.append(Load(request_id, (), (), "", "", (), error=short))
                return
            self._reserving[request_id] = remote.transfer_id
            self._reserves.append(
                Reserve(
                    request_id,
                    remote.transfer_id,
                    tuple(local),
                    first,
                    first * self._block_size + num_external_tokens,
                    remote.ranks,
                )
            )
            return
        self._loads.append(self._load(request_id, remote, arrived, local, first, stop))

    def _load(
        self,
        request_id: str,
        remote: RemotePrefill,
        arrived: float | None,
        local: list[int],
        first: int,
        stop: int,
    ) -> Load:
        """The load of ``remote``'s blocks ``first:stop`` into ``local`` (``arrived``:
        when its lease began here, see :meth:`arrived`), or a failed one saying why."""
        remote_blocks = remote.block_ids[first:stop]
        error: str | None = None
        left = None if arrived is None else arrived + load_deadline(remote.lease_s) - self._clock()
        if left is not None and left < 0:
            # the prefill may have freed (and reused) its blocks: never load them
            error = f"the prefill's lease of {remote.lease_s:g} s ran out before the load began"
        elif len(local) != stop - first or len(remote_blocks) != len(local):
            error = (
                f"{stop - first} blocks to load, {len(local)} allocated here and "
                f"{len(remote_blocks)} named by the prefill"
            )
        else:
            error = self._claim(request_id, remote)
        if error is not None:
            log.error("request %s: %s", request_id, error)
        return Load(
            request_id,
            tuple(local),
            tuple(remote_blocks),
            remote.request_id,
            remote.token,
            remote.ranks,
            error,
            left,
        )

    def _claim(self, request_id: str, remote: RemotePrefill) -> str | None:
        """Take ``remote``'s params for ``request_id``, or say why not: they were taken
        by another request (a proxy that sent one prefill's params twice). The first one
        to end tells the prefill (its ``ranks``), which frees the blocks: a second load
        from there could read them reused by then (another prompt's KV, no error)."""
        claim = (remote.token, remote.ranks)
        taken = self._claimed.get(claim)
        if taken is not None:
            why = f"its kv_transfer_params were already used by request {taken[0]}"
            log.error("request %s: %s", request_id, why)
            return why
        self._claimed[claim] = (request_id, self._clock() + remote.lease_s)
        return None

    # ---- prefill side ---------------------------------------------------------------------
    def reserved(self, transfers: dict[str, int]) -> None:
        """``update_connector_output``: worker ranks received decode reservations
        (transfer id -> how many ranks, this step)."""
        now = self._clock()
        for transfer, count in transfers.items():
            have, first = self._reported.get(transfer, (0, now))
            self._reported[transfer] = (have + count, first)

    def _admit(self, request_id: str, transfer: str) -> None:
        """A push prefill request is scheduled: with its reservation on every rank it
        will push; without (it waited ``lease_s``) it computes and hands nothing over."""
        if request_id in self._admitted or request_id in self._pushing:
            return  # scheduled again after a preemption: decided the first time
        have, _ = self._reported.pop(transfer, (0, 0.0))
        self._push_since.pop(transfer, None)
        why = None
        if have < self._tp_size:
            why = f"no decode side reserved blocks for it within {self._lease_s:g} s"
            log.error("request %s (transfer %s): %s", request_id, transfer, why)
        self._admitted[request_id] = (transfer, why)

    def push_requests(self) -> list[str]:
        """Push prefill requests scheduled whose :class:`~._plan.Push` is not planned
        yet (the facade tells :meth:`scheduled` about those in each step)."""
        return [r for r, (_, why) in self._admitted.items() if why is None]

    def scheduled(
        self, request_id: str, *, completes: bool, block_ids: list[int], num_tokens: int
    ) -> None:
        """``build_connector_meta``: push request ``request_id`` is in this step; if the
        step computes the rest of its prompt (``completes``, ``num_tokens`` tokens in
        ``block_ids``), plan its :class:`~._plan.Push`."""
        admitted = self._admitted.get(request_id)
        if admitted is None or admitted[1] is not None or not completes:
            return
        del self._admitted[request_id]
        transfer = admitted[0]
        blocks = tuple(block_ids[: -(-num_tokens // self._block_size)])
        self._pushes.append(Push(request_id, transfer, blocks, num_tokens))
        self._pushing[request_id] = transfer

    def _finished_push(
        self, request_id: str, transfer: str, completed: bool
    ) -> tuple[bool, dict[str, Any] | None]:
        out: dict[str, Any] = {"aiokv": PARAMS_VERSION, "transfer_id": transfer}
        self._push_since.pop(transfer, None)
        if self._pushing.pop(request_id, None) is not None:
            # its KV is being pushed from its blocks: hold them until the push ended
            self._holds.append(Hold(request_id, "", self._lease_s, pushed=True))
            return True, {**out, "pushed": True}
        _, why = self._admitted.pop(request_id, (transfer, None))
        if why is None:
            why = "the prefill request ended before its KV was pushed"
        self._reported.pop(transfer, None)
        self._cancels.append(Cancel(transfer, why))
        return False, {**out, "pushed": False, "error": why}

    def finished(
        self,
        request_id: str,
        params: dict[str, Any] | None,
        *,
        completed: bool,
        block_ids: list[int],
        num_computed_tokens: int,
    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished``: ``(True, params for the decode side)`` for a prefill
        request that completed (``completed``: stopped or length-capped, not aborted):
        its blocks are held until the decode side's done notice or the lease; else
        ``(False, None)`` (its blocks are freed now)."""
        self._arrivals.pop(request_id, None)
        reserved = self._reserving.pop(request_id, None)
        if reserved is not None and not completed:
            # an aborted decode request may still wait for its push: withdraw it
            self._withdrawals.append(Withdraw(request_id, reserved))
        if not params:
            return False, None
        transfer = self._push_transfer(params)
        if transfer is not None:  # before a discovery: its push state must end here
            return self._finished_push(request_id, transfer, completed)
        if params.get("aiokv_discover"):
            if self._ranks is None:
                return False, None
            mode = "push" if self._push else "pull"
            return False, endpoint_params(
                engine_id=self._engine_id,
                block_size=self._block_size,
                ranks=self._ranks,
                mode=mode,
            )
        if params.get("do_remote_decode") and "transfer_id" in params:
            why = (
                "push-mode params, but this instance runs mode 'pull'"
                if not self._push
                else check_transfer_id(params["transfer_id"])
            )
            return False, {"aiokv": PARAMS_VERSION, "pushed": False, "error": why}
        if params.get("do_remote_prefill"):
            # a decode request that finished before it was scheduled (aborted): let the
            # prefill free its blocks now rather than at the end of its lease — unless
            # another request took these params (it may be pulling the blocks); taken
            # here, a retry with them fails its load rather than read freed blocks
            remote = self._remote(params)
            params["do_remote_prefill"] = False
            if isinstance(remote, RemotePrefill) and self._claim(request_id, remote) is None:
                self._releases.append(Release(remote.request_id, remote.token, remote.ranks))
            return False, None
        if not params.get("do_remote_decode") or not completed:
            return False, None
        if self._ranks is None:
            log.error(
                "request %s: no worker endpoints known; its KV is not handed over", request_id
            )
            return False, None
        blocks = block_ids[: -(-num_computed_tokens // self._block_size)]
        if not blocks:
            return False, None
        token = secrets.token_hex(16)
        self._holds.append(Hold(request_id, token, self._lease_s))
        return True, producer_params(
            engine_id=self._engine_id,
            request_id=request_id,
            block_ids=blocks,
            num_tokens=num_computed_tokens,
            block_size=self._block_size,
            ranks=self._ranks,
            token=token,
            lease_s=self._lease_s,
            issued_at=self._wall(),
        )

    def take_plan(self) -> StepPlan:
        """``build_connector_meta``: the step's plan; the next one starts empty."""
        plan = StepPlan(
            tuple(self._loads),
            tuple(self._releases),
            tuple(self._holds),
            tuple(self._reserves),
            tuple(self._pushes),
            tuple(self._cancels),
            tuple(self._withdrawals),
        )
        for items in (
            self._loads,
            self._releases,
            self._holds,
            self._reserves,
            self._pushes,
            self._cancels,
            self._withdrawals,
        ):
            items.clear()
        # reservations no prefill request claimed within a lease: forget them (the
        # workers told their decode sides when they dropped them)
        now = self._clock()
        old = now - self._lease_s
        for transfer in [t for t, (_, first) in self._reported.items() if first < old]:
            del self._reported[transfer]
        for claim in [c for c, (_, until) in self._claimed.items() if until < now]:
            del self._claimed[claim]  # the prefill's lease ended: no load may begin now
        return plan
