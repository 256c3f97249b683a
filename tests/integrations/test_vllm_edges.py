"""The vLLM connector's scheduler side on paths found wanting in review (each test
fails before its fix): push params that also ask for discovery, a lease no decode
side accepts, and a pull that outlives the prefill's lease."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch
from _vllm_sides import wait_for
from _vllm_sides import worker_pair

from aiokv.integrations.vllm import ConnectorOptions
from aiokv.integrations.vllm import SchedulerSide
from aiokv.integrations.vllm._params import Endpoint
from aiokv.integrations.vllm._params import RemotePrefill
from aiokv.integrations.vllm._params import parse_remote_prefill
from aiokv.integrations.vllm._plan import Push

BS = 32
RANK = Endpoint("127.0.0.1", 5000, 11)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def side(*, push: bool = False, lease: float = 30.0, clock: Clock | None = None) -> SchedulerSide:
    s = SchedulerSide(
        engine_id="engine-p",
        block_size=BS,
        tp_size=1,
        lease_s=lease,
        push=push,
        clock=clock or Clock(),
    )
    s.set_ranks({0: RANK})
    return s


def _state(s: SchedulerSide) -> dict[str, Any]:
    return {
        "arrivals": dict(s._arrivals),
        "push_since": dict(s._push_since),
        "reported": dict(s._reported),
        "admitted": dict(s._admitted),
        "pushing": dict(s._pushing),
        "reserving": dict(s._reserving),
    }


EMPTY = {
    "arrivals": {},
    "push_since": {},
    "reported": {},
    "admitted": {},
    "pushing": {},
    "reserving": {},
}

# A push prefill request whose (client-made) params also carry "aiokv_discover".
HOSTILE = {"aiokv_discover": True, "do_remote_decode": True, "transfer_id": "T"}


def test_discover_flag_on_a_push_prefill_aborted_while_waiting_leaks_nothing() -> None:
    """Aborted while it waits for its reservation: nothing of it may stay behind."""
    s = side(push=True)
    for i in range(3):
        params = {**HOSTILE, "transfer_id": f"T{i}"}
        s.arrived(f"p{i}", params)
        assert s.matched_tokens(params, 64, 0) == (None, False)  # waits for its reservation
        s.finished(f"p{i}", params, completed=False, block_ids=[], num_computed_tokens=0)
        s.take_plan()
    assert _state(s) == EMPTY


def test_discover_flag_on_a_push_prefill_keeps_its_blocks_while_pushed() -> None:
    """Its Push is planned (its blocks are being read by the workers): request_finished
    must hold the blocks until the push ended, and forget the request."""
    s = side(push=True)
    params = dict(HOSTILE)
    s.arrived("p1", params)
    s.reserved({"T": 1})
    assert s.matched_tokens(params, 64, 0) == (0, False)
    s.after_alloc("p1", params, cached_blocks=0, new_blocks=[1, 2], num_external_tokens=0)
    s.scheduled("p1", completes=True, block_ids=[1, 2], num_tokens=64)
    assert s.take_plan().pushes == (Push("p1", "T", (1, 2), 64),)
    delay, _ = s.finished("p1", params, completed=True, block_ids=[1, 2], num_computed_tokens=64)
    assert delay, "blocks freed by vLLM while the workers still push them"
    assert _state(s) == EMPTY


def test_an_accepted_lease_option_gives_params_the_decode_side_accepts() -> None:
    """``lease_timeout_s`` that no decode side would accept in the params (1e9: "hold
    for ever") stops the engine at start-up, by name (it started, then every request
    failed, blamed on its params); the largest accepted one gives usable params."""
    with pytest.raises(ValueError, match="lease_timeout_s"):
        ConnectorOptions.parse({"lease_timeout_s": 1e9})
    opts = ConnectorOptions.parse({"lease_timeout_s": 1e9 - 1})
    p = side(lease=opts.lease_timeout_s)
    delay, params = p.finished(
        "p1", {"do_remote_decode": True}, completed=True, block_ids=[7, 3], num_computed_tokens=64
    )
    assert delay and params is not None
    parsed = parse_remote_prefill(params, block_size=BS, tp_size=1)
    assert isinstance(parsed, RemotePrefill), parsed


def test_a_pull_never_reads_blocks_after_the_prefills_lease() -> None:
    """docs/vllm.md: a decode whose prefill's lease may have run out fails its load,
    "it never reads blocks the prefill may have reused". The scheduler side checked the
    lease only when it planned the load; the pull then could take link_timeout_ms +
    transfer_timeout_ms more. Here the link takes 2 s (within link_timeout_ms): the
    prefill's 2 s lease ends, vLLM reuses its blocks, and the decode's load still
    succeeded with the new request's bytes."""
    opts = ConnectorOptions.parse({"transfer_timeout_ms": 3000, "link_timeout_ms": 4000})
    with worker_pair(opts) as (pw, pkv, dw, dkv):
        assert pw.endpoint is not None
        ps = SchedulerSide(engine_id="P", block_size=32, tp_size=1, lease_s=2.0)
        ps.set_ranks({0: pw.endpoint})
        ds = SchedulerSide(engine_id="D", block_size=32, tp_size=1, lease_s=2.0)
        ds.set_ranks({0: Endpoint("127.0.0.1", 1, 1)})
        _, params = ps.finished(
            "p1",
            {"do_remote_decode": True},
            completed=True,
            block_ids=[5, 6],
            num_computed_tokens=64,
        )
        assert params is not None
        pw.step(ps.take_plan())  # the prefill holds blocks 5, 6 for 2 s
        ds.arrived("d1", params)  # the proxy passes the params on at once
        time.sleep(0.8)  # within the load deadline (1 s for a 2 s lease)
        ds.after_alloc("d1", params, cached_blocks=0, new_blocks=[9, 10], num_external_tokens=64)
        plan = ds.take_plan()
        assert plan.loads[0].error is None

        linked = dw._linked

        async def slow_link(source: Endpoint) -> None:
            await asyncio.sleep(2.0)  # a slow network: well within link_timeout_ms
            await linked(source)

        dw._linked = slow_link  # type: ignore[method-assign]
        dw.step(plan)
        wait_for(pw, lambda a: "p1" in a.finished_sending, timeout=10)  # lease over: freed
        for t in pkv.values():  # vLLM gives blocks 5, 6 to another request
            t[5:7] = 7.0
        done = wait_for(dw, lambda a: "d1" in a.finished_recving, timeout=20)
        if "d1" not in done.failed_recving:
            for t in dkv.values():
                assert not torch.all(t[9:11] == 7.0), "the load read reused blocks and succeeded"
