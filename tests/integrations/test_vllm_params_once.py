"""vLLM pull mode: params one request took are never released or loaded by another, and
the done notices a prefill keeps for later are bounded in size.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import msgspec

from aiokv.integrations.vllm import ConnectorOptions
from aiokv.integrations.vllm import SchedulerSide
from aiokv.integrations.vllm import WorkerSide
from aiokv.integrations.vllm._params import Endpoint
from aiokv.integrations.vllm._plan import Release
from aiokv.integrations.vllm._worker import DoneNotice

BS = 32
RANK = Endpoint("127.0.0.1", 5000, 11)


def side() -> SchedulerSide:
    s = SchedulerSide(engine_id="engine", block_size=BS, tp_size=1, lease_s=480.0)
    s.set_ranks({0: RANK})
    return s


def prefill(s: SchedulerSide) -> dict[str, Any]:
    """A finished prefill request's params (blocks 7, 3; 64 tokens)."""
    delay, params = s.finished(
        "p1", {"do_remote_decode": True}, completed=True, block_ids=[7, 3], num_computed_tokens=64
    )
    assert delay and params is not None
    return params


def test_a_duplicate_aborted_before_scheduling_keeps_the_first_loads_blocks() -> None:
    """docs/vllm.md: params are good for one decode request; a second one carrying them
    fails its load, "since the first one's done notification frees the blocks it would
    read". A second request with the same params (a proxy's retry or fan-out) that is
    aborted before it was scheduled sent the prefill a release at once: the prefill
    freed the blocks the first request was still pulling, vLLM reused them, and the
    first request loaded another prompt's KV without an error."""
    p, d = side(), side()
    params = prefill(p)
    first, second = copy.deepcopy(params), copy.deepcopy(params)
    d.arrived("d1", first)
    d.arrived("d2", second)
    d.after_alloc("d1", first, cached_blocks=0, new_blocks=[1, 2], num_external_tokens=64)
    (load,) = d.take_plan().loads
    assert load.error is None  # d1 pulls blocks 7, 3 of the prefill
    assert d.finished("d2", second, completed=False, block_ids=[], num_computed_tokens=0) == (
        False,
        None,
    )
    assert d.take_plan().releases == (), "a duplicate's abort freed blocks d1 still pulls"


def test_params_released_by_an_aborted_request_are_not_loaded_again() -> None:
    """A decode request aborted before it was scheduled releases the prefill's blocks
    (they are freed at once); a retry with the same params then loaded them: blocks the
    prefill had freed, maybe reused by another prompt (wrong KV, no error). The retry
    must fail its load, as docs/vllm.md says of params used twice."""
    p, d = side(), side()
    params = prefill(p)
    aborted, retry = copy.deepcopy(params), copy.deepcopy(params)
    d.arrived("d1", aborted)
    d.finished("d1", aborted, completed=False, block_ids=[], num_computed_tokens=0)
    assert d.take_plan().releases == (Release("p1", params["remote_token"], (RANK,)),)
    d.arrived("d2", retry)
    d.after_alloc("d2", retry, cached_blocks=0, new_blocks=[1, 2], num_external_tokens=64)
    (load,) = d.take_plan().loads
    assert load.error is not None and "already used by request d1" in load.error


def test_done_notices_kept_for_later_are_bounded_in_size() -> None:
    """docs/security.md: done notices for requests not known yet are remembered (at
    most 65536, a lease each) — untrusted input from any linked peer. Their fields were
    unbounded: a notice is up to 64 KiB, so a peer could make a prefill worker keep
    about 4 GiB. A notice whose request id or token no params could carry (at most 1024
    characters each, as the decode side checks them) is ignored."""
    w = WorkerSide(ConnectorOptions.parse({}), engine_id="P", rank=0)
    big = msgspec.json.encode(DoneNotice("r" * 60_000, "t"))
    also = msgspec.json.encode(DoneNotice("r", "t" * 60_000))
    fine = msgspec.json.encode(DoneNotice("r" * 1024, "t" * 32))
    now = time.monotonic()
    with w._lock:
        for payload in (big, also, fine):
            w._noticed(5, payload, now)
    assert [(len(r), len(t)) for r, t in w._early] == [(1024, 32)]
