"""``SchedulerSide``: the connector's scheduler-side bookkeeping, free of vLLM types.

The vLLM facade (:mod:`._connector`) reads what it needs from vLLM's ``Request`` and
``KVCacheBlocks`` and calls these methods in vLLM's order:

0. :meth:`~SchedulerSide.arrived` (``on_new_request``): when a decode request came in
   (its prefill's lease counts from about then).
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
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

from ._params import Endpoint, RemotePrefill, parse_remote_prefill, producer_params
from ._plan import Hold, Load, Release, StepPlan

__all__ = ["SchedulerSide", "load_deadline"]

log = logging.getLogger("aiokv.vllm")


def load_deadline(lease_s: float) -> float:
    """Seconds after a decode request came in within which its load must begin: the
    prefill's lease less a margin (a tenth of it, plus a second) for the time between
    the prefill's end and the decode request's arrival."""
    return lease_s - (lease_s / 10 + 1.0)


class SchedulerSide:
    """Plans loads (decode side) and holds (prefill side) of one vLLM engine.

    Args:
        engine_id: this engine's id (``KVTransferConfig.engine_id``).
        block_size: tokens per KV block.
        tp_size: tensor-parallel size (workers, one aiokv instance each).
        lease_s: how long a finished prefill request's blocks wait for a decode side.
        clock: seconds, monotonic (tests pass a fake one).
    """

    def __init__(
        self,
        *,
        engine_id: str,
        block_size: int,
        tp_size: int,
        lease_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engine_id = engine_id
        self._block_size = block_size
        self._tp_size = tp_size
        self._lease_s = lease_s
        self._clock = clock
        self._arrivals: dict[str, float] = {}  # decode request -> when it came in
        self._ranks: list[Endpoint] | None = None
        self._loads: list[Load] = []
        self._releases: list[Release] = []
        self._holds: list[Hold] = []

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
    def _remote(self, params: dict[str, Any] | None) -> RemotePrefill | str | None:
        if not params or not params.get("do_remote_prefill"):
            return None
        return parse_remote_prefill(params, block_size=self._block_size, tp_size=self._tp_size)

    def arrived(self, request_id: str, params: dict[str, Any] | None) -> None:
        """``on_new_request``: note when a decode request came in (the proxy sends it
        right after its prefill finished, so the prefill's lease ends no sooner than
        about :func:`load_deadline` after this)."""
        if params and params.get("do_remote_prefill"):
            self._arrivals[request_id] = self._clock()

    def matched_tokens(
        self, params: dict[str, Any] | None, num_prompt_tokens: int, num_computed: int
    ) -> tuple[int, bool]:
        """``get_num_new_matched_tokens``: ``(tokens to load, True)`` for a decode request
        whose params name a prefill, else ``(0, False)``. Unusable params still load
        asynchronously — the load then fails at once, and vLLM's
        ``kv_load_failure_policy`` applies to that request alone."""
        remote = self._remote(params)
        if remote is None:
            return 0, False
        have = (
            num_prompt_tokens
            if isinstance(remote, str)
            else min(remote.num_tokens, num_prompt_tokens)
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
            self._releases.append(Release(remote.request_id, remote.token, remote.ranks))
            return
        first = cached_blocks
        stop = -(-(first * self._block_size + num_external_tokens) // self._block_size)
        local = new_blocks[: stop - first]
        remote_blocks = remote.block_ids[first:stop]
        error = None
        if arrived is not None and self._clock() > arrived + load_deadline(remote.lease_s):
            # the prefill may have freed (and reused) its blocks: never load them
            error = f"the prefill's lease of {remote.lease_s:g} s ran out before the load began"
            log.error("request %s: %s", request_id, error)
        elif len(local) != stop - first or len(remote_blocks) != len(local):
            error = (
                f"{stop - first} blocks to load, {len(local)} allocated here and "
                f"{len(remote_blocks)} named by the prefill"
            )
            log.error("request %s: %s", request_id, error)
        self._loads.append(
            Load(
                request_id,
                tuple(local),
                tuple(remote_blocks),
                remote.request_id,
                remote.token,
                remote.ranks,
                error,
            )
        )

    # ---- prefill side ---------------------------------------------------------------------
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
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # a decode request that finished before it was scheduled (aborted): let the
            # prefill free its blocks now rather than at the end of its lease
            remote = self._remote(params)
            params["do_remote_prefill"] = False
            if isinstance(remote, RemotePrefill):
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
        )

    def take_plan(self) -> StepPlan:
        """``build_connector_meta``: the step's plan; the next one starts empty."""
        plan = StepPlan(tuple(self._loads), tuple(self._releases), tuple(self._holds))
        self._loads.clear()
        self._releases.clear()
        self._holds.clear()
        return plan
