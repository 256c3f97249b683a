"""The vLLM connector's scheduler side and params, with fake requests and blocks (no
vLLM needed): token counting, block mapping, holds, releases, bad params."""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest

from aiokv.integrations.vllm import ConnectorOptions
from aiokv.integrations.vllm import SchedulerSide
from aiokv.integrations.vllm._options import derive_cluster_id
from aiokv.integrations.vllm._options import load_deadline
from aiokv.integrations.vllm._params import Endpoint
from aiokv.integrations.vllm._params import parse_remote_prefill
from aiokv.integrations.vllm._plan import Cancel
from aiokv.integrations.vllm._plan import Hold
from aiokv.integrations.vllm._plan import Load
from aiokv.integrations.vllm._plan import Push
from aiokv.integrations.vllm._plan import Release
from aiokv.integrations.vllm._plan import Reserve
from aiokv.integrations.vllm._plan import Withdraw

BS = 32
RANKS = {0: Endpoint("127.0.0.1", 5000, 11), 1: Endpoint("127.0.0.1", 5001, 12)}


class Clock:
    """A fake monotonic clock: tests move it, no sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def side(
    tp: int = 1,
    lease: float = 480.0,
    clock: Clock | None = None,
    *,
    push: bool = False,
    wall: Clock | None = None,
) -> SchedulerSide:
    """The scheduler side of engine "engine-p" with ``tp`` ranks (``RANKS``) set
    (``wall``: its wall clock, else the real one)."""
    s = SchedulerSide(
        engine_id="engine-p",
        block_size=BS,
        tp_size=tp,
        lease_s=lease,
        push=push,
        clock=clock or Clock(),
        wall=wall or time.time,
    )
    s.set_ranks({r: RANKS[r] for r in range(tp)})
    return s


def prefill(s: SchedulerSide, blocks: list[int], tokens: int, rid: str = "p1") -> dict[str, Any]:
    """A finished prefill request's params, as its output carries them."""
    delay, params = s.finished(
        rid,
        {"do_remote_decode": True},
        completed=True,
        block_ids=blocks,
        num_computed_tokens=tokens,
    )
    assert delay and params is not None
    return params


# ---- prefill side --------------------------------------------------------------------------
def test_prefill_holds_its_blocks_and_returns_what_the_decode_needs() -> None:
    s = side(tp=2, lease=30)
    params = prefill(s, [7, 3, 9, 4], tokens=100)  # 100 tokens: 4 blocks of 32
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_block_ids"] == [7, 3, 9, 4]
    assert params["remote_num_tokens"] == 100
    assert params["remote_request_id"] == "p1"
    assert params["remote_ranks"] == [["127.0.0.1", 5000, 11], ["127.0.0.1", 5001, 12]]
    assert params["remote_lease_s"] == 30
    plan = s.take_plan()
    assert plan.holds == (Hold("p1", params["remote_token"], 30),)
    assert s.take_plan().holds == ()  # taken once


def test_prefill_sends_only_the_blocks_of_computed_tokens() -> None:
    s = side()
    params = prefill(s, [1, 2, 3, 4, 5], tokens=64)  # a block allocated beyond the prompt
    assert params["remote_block_ids"] == [1, 2]
    assert prefill(s, [1, 2, 3], tokens=65, rid="p2")["remote_block_ids"] == [1, 2, 3]


def test_aborted_or_plain_requests_free_at_once() -> None:
    s = side()
    assert s.finished(
        "a", {"do_remote_decode": True}, completed=False, block_ids=[1], num_computed_tokens=10
    ) == (False, None)
    assert s.finished("b", None, completed=True, block_ids=[1], num_computed_tokens=10) == (
        False,
        None,
    )
    assert s.finished("c", {}, completed=True, block_ids=[1], num_computed_tokens=10) == (
        False,
        None,
    )
    assert s.finished(
        "d", {"do_remote_decode": True}, completed=True, block_ids=[], num_computed_tokens=0
    ) == (False, None)
    assert s.take_plan().holds == ()


def test_no_endpoints_known_frees_at_once() -> None:
    s = SchedulerSide(engine_id="e", block_size=BS, tp_size=1, lease_s=1)
    assert s.finished(
        "a", {"do_remote_decode": True}, completed=True, block_ids=[1], num_computed_tokens=5
    ) == (False, None)
    with pytest.raises(ValueError, match="ranks"):
        s.set_ranks({1: RANKS[1]})


def test_tokens_are_random_per_request() -> None:
    s = side()
    assert prefill(s, [1], 5, "a")["remote_token"] != prefill(s, [1], 5, "b")["remote_token"]


# ---- decode side ---------------------------------------------------------------------------
def test_decode_loads_the_whole_prompt_asynchronously() -> None:
    p, d = side(), side()
    params = prefill(p, [7, 3, 9, 4], tokens=100)
    assert d.matched_tokens(params, 100, 0) == (100, True)
    assert d.matched_tokens(params, 100, 0) == (100, True)  # no side effect
    assert d.take_plan().loads == ()
    d.after_alloc(
        "d1", params, cached_blocks=0, new_blocks=[20, 21, 22, 23], num_external_tokens=100
    )
    assert params["do_remote_prefill"] is False  # once
    (load,) = d.take_plan().loads
    assert load == Load(
        "d1", (20, 21, 22, 23), (7, 3, 9, 4), "p1", params["remote_token"], (RANKS[0],)
    )
    d.after_alloc("d1", params, cached_blocks=0, new_blocks=[20, 21, 22, 23], num_external_tokens=0)
    assert d.take_plan().loads == ()
    assert d.matched_tokens(params, 100, 0) == (0, False)


def test_a_load_that_begins_after_the_prefills_lease_fails() -> None:
    clock = Clock()
    p, d = side(lease=100), side(clock=clock)
    params = prefill(p, [7, 3], tokens=64)
    assert load_deadline(100) == 89
    assert load_deadline(1.0) == 0.5  # a short lease: the margin is at most half of it
    d.arrived("late", params)
    d.arrived("soon", copy.deepcopy(params))
    clock.now += 88  # still within the deadline: loads
    d.after_alloc(
        "soon", copy.deepcopy(params), cached_blocks=0, new_blocks=[1, 2], num_external_tokens=64
    )
    clock.now += 2  # past it: the blocks may be gone, the load fails
    d.after_alloc("late", params, cached_blocks=0, new_blocks=[3, 4], num_external_tokens=64)
    soon, late = d.take_plan().loads
    assert soon.error is None
    assert late.error is not None and "lease" in late.error
    assert d._arrivals == {}  # nothing kept


def test_the_lease_counts_from_when_the_prefill_made_the_params() -> None:
    """A proxy that holds a prefill's output a while before it sends the decode
    request: the prefill's lease began when it finished, so the decode side has that
    much less time to begin its load (the params say when they were made, by the
    prefill's wall clock). Counted from the decode request's arrival, a load began after
    the prefill had freed its blocks and vLLM had reused them: another prompt's KV,
    loaded without an error."""
    wall_p, wall_d, clock = Clock(), Clock(), Clock()
    p, d = side(lease=100, wall=wall_p), side(clock=clock, wall=wall_d)
    params = prefill(p, [7, 3], tokens=64)
    wall_d.now += 60  # the proxy held them a minute
    skewed = {**copy.deepcopy(params), "remote_issued_at": wall_d.now + 5}  # a clock ahead
    d.arrived("held", params)
    d.arrived("skewed", skewed)  # counts from now
    clock.now += 30  # 90 s after the prefill finished: past load_deadline(100) = 89
    for rid, given in (("held", params), ("skewed", skewed)):
        d.after_alloc(rid, given, cached_blocks=0, new_blocks=[1, 2], num_external_tokens=64)
    late, soon = d.take_plan().loads
    assert late.error is not None and "lease" in late.error
    assert soon.error is None and soon.within_s == pytest.approx(89 - 30)


def test_params_used_twice_load_once() -> None:
    """A proxy that sends one prefill's params with two decode requests (a retry, a
    fan-out): both would pull the same prefill blocks, and the first to end tells the
    prefill, which frees them — the second load could read them reused by then, another
    prompt's KV with no error. The second request's load fails at once, naming the
    first (its ``kv_load_failure_policy`` applies); a full local prefix hit that comes
    second does not release the prefill's blocks the first still loads."""
    p, d = side(), side()
    params = prefill(p, [7, 3], tokens=64)
    for rid in ("d1", "d2"):
        given = copy.deepcopy(params)
        d.arrived(rid, given)
        d.after_alloc(rid, given, cached_blocks=0, new_blocks=[1, 2], num_external_tokens=64)
    first, second = d.take_plan().loads
    assert first.error is None and first.remote_blocks == (7, 3)
    assert second.error is not None and "already used by request d1" in second.error
    d.after_alloc(
        "d3", copy.deepcopy(params), cached_blocks=2, new_blocks=[], num_external_tokens=0
    )
    assert d.take_plan().releases == ()


def test_decode_with_a_local_prefix_hit_loads_the_rest() -> None:
    p, d = side(), side()
    params = prefill(p, [7, 3, 9, 4], tokens=100)
    assert d.matched_tokens(params, 100, 64) == (36, True)
    d.after_alloc("d1", params, cached_blocks=2, new_blocks=[30, 31], num_external_tokens=36)
    (load,) = d.take_plan().loads
    assert (load.local_blocks, load.remote_blocks, load.error) == ((30, 31), (9, 4), None)


def test_decode_prompt_longer_than_the_prefill_computes_the_rest() -> None:
    p, d = side(), side()
    params = prefill(p, [7, 3], tokens=40)
    assert d.matched_tokens(params, 90, 0) == (40, True)
    d.after_alloc("d1", params, cached_blocks=0, new_blocks=[5, 6, 8], num_external_tokens=40)
    (load,) = d.take_plan().loads
    assert (load.local_blocks, load.remote_blocks) == ((5, 6), (7, 3))


def test_full_local_hit_releases_the_prefill() -> None:
    p, d = side(), side()
    params = prefill(p, [7, 3], tokens=64)
    assert d.matched_tokens(params, 64, 64) == (0, False)
    d.after_alloc("d1", params, cached_blocks=2, new_blocks=[], num_external_tokens=0)
    plan = d.take_plan()
    assert plan.loads == ()
    assert plan.releases == (Release("p1", params["remote_token"], (RANKS[0],)),)


def test_decode_aborted_before_scheduling_releases_the_prefill() -> None:
    p, d = side(), side()
    params = prefill(p, [7], tokens=5)
    assert d.finished("d1", params, completed=False, block_ids=[], num_computed_tokens=0) == (
        False,
        None,
    )
    assert d.take_plan().releases == (Release("p1", params["remote_token"], (RANKS[0],)),)
    # the decode request's own end (params now cleared) asks nothing more
    assert d.finished("d1", params, completed=True, block_ids=[1], num_computed_tokens=5) == (
        False,
        None,
    )
    assert d.take_plan().holds == ()


def test_too_few_allocated_blocks_is_a_failed_load() -> None:
    p, d = side(), side()
    params = prefill(p, [7, 3, 9], tokens=70)
    d.after_alloc("d1", params, cached_blocks=0, new_blocks=[1, 2], num_external_tokens=70)
    (load,) = d.take_plan().loads
    assert load.error is not None and "3 blocks to load" in load.error


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"aiokv": 2}, "version"),
        ({"remote_block_ids": []}, "remote_block_ids"),
        ({"remote_block_ids": [1, -2, 3, 4]}, "remote_block_ids"),
        ({"remote_block_ids": [1, True, 3, 4]}, "remote_block_ids"),
        ({"remote_block_ids": "1,2"}, "remote_block_ids"),
        ({"remote_block_ids": [1]}, "more than the 1"),
        ({"remote_num_tokens": 0}, "remote_num_tokens"),
        ({"remote_num_tokens": "100"}, "remote_num_tokens"),
        ({"remote_block_size": 16}, "remote_block_size"),
        ({"remote_ranks": []}, "remote_ranks"),
        ({"remote_ranks": [["h", 70000, 1]]}, "remote_ranks"),
        ({"remote_ranks": [["h", 1, -1]]}, "remote_ranks"),
        ({"remote_ranks": [["h", 1, 1], ["h", 2, 2]]}, "tensor-parallel"),
        ({"remote_request_id": ""}, "remote_request_id"),
        ({"remote_token": None}, "remote_token"),
        ({"remote_engine_id": "x" * 5000}, "remote_engine_id"),
        ({"remote_lease_s": 0}, "remote_lease_s"),
        ({"remote_lease_s": "480"}, "remote_lease_s"),
        ({"remote_issued_at": "now"}, "remote_issued_at"),
        ({"remote_issued_at": -1}, "remote_issued_at"),
    ],
)
def test_bad_params_fail_that_request_only(change: dict[str, Any], why: str) -> None:
    p, d = side(), side()
    params = {**prefill(p, [7, 3, 9, 4], tokens=100), **change}
    reason = parse_remote_prefill(params, block_size=BS, tp_size=1)
    assert isinstance(reason, str) and why in reason
    # still loaded asynchronously, so that vLLM's kv_load_failure_policy applies
    assert d.matched_tokens(copy.deepcopy(params), 100, 0) == (100, True)
    d.after_alloc("d1", params, cached_blocks=0, new_blocks=[1, 2, 3, 4], num_external_tokens=100)
    (load,) = d.take_plan().loads
    assert load.request_id == "d1" and load.error is not None and why in load.error


def test_plain_requests_are_left_alone() -> None:
    d = side()
    for params in (None, {}, {"do_remote_prefill": False}, {"do_remote_decode": True}):
        assert d.matched_tokens(params, 50, 0) == (0, False)
        d.after_alloc("x", params, cached_blocks=0, new_blocks=[1, 2], num_external_tokens=0)
    plan = d.take_plan()
    assert (plan.loads, plan.releases, plan.holds) == ((), (), ())


# ---- options -------------------------------------------------------------------------------
def test_options_defaults_and_overrides() -> None:
    o = ConnectorOptions.parse({})
    assert (o.mode, o.transfer_backend, o.host, o.port, o.lease_timeout_s) == (
        "pull",
        "tcp",
        "127.0.0.1",
        None,
        480.0,
    )
    assert o.listen_port(3) == 0
    assert ConnectorOptions.parse({}, kv_port=6000).listen_port(2) == 6002
    assert ConnectorOptions.parse({"port": 7000}, kv_port=6000).listen_port(1) == 7001
    assert o.worker_cluster_id("e", 0) == derive_cluster_id("e", 0) != derive_cluster_id("e", 1)
    assert ConnectorOptions.parse({"cluster_id": 40}).worker_cluster_id("e", 2) == 42
    assert (
        ConnectorOptions.parse({"host": "0.0.0.0", "advertise_host": "10.0.0.2"}).public_host
        == "10.0.0.2"
    )
    assert (
        ConnectorOptions.parse({"transfer_backend": "nixl", "lease_timeout_s": 5}).lease_timeout_s
        == 5
    )


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({"prot": 1}, "prot"),
        ({"port": 70000}, "port"),
        ({"port": "80"}, "port"),
        ({"transfer_backend": "rdma"}, "transfer_backend"),
        ({"lease_timeout_s": 0}, "lease_timeout_s"),
        ({"idle_wait_ms": -1}, "idle_wait_ms"),
        ({"idle_wait_ms": 5000}, "idle_wait_ms"),
        ({"mode": "teleport"}, "mode"),
        ({"host": "0.0.0.0"}, "advertise_host"),
    ],
)
def test_bad_options_are_refused_by_name(extra: dict[str, Any], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        ConnectorOptions.parse(extra)


# ---- push mode -----------------------------------------------------------------------------
def push_side(tp: int = 1, lease: float = 30.0, clock: Clock | None = None) -> SchedulerSide:
    """``side()`` in push mode (30 s leases unless told)."""
    return side(tp, lease, clock, push=True)


def discovered(s: SchedulerSide) -> dict[str, Any]:
    """What the proxy learns from a discovery request to the prefill instance."""
    delay, params = s.finished(
        "probe", {"aiokv_discover": True}, completed=True, block_ids=[4], num_computed_tokens=1
    )
    assert not delay and params is not None  # a discovery holds nothing
    return params


def test_discovery_names_the_prefill_ranks_and_mode() -> None:
    params = discovered(push_side(tp=2))
    assert params == {
        "aiokv": 1,
        "mode": "push",
        "remote_engine_id": "engine-p",
        "remote_block_size": BS,
        "remote_ranks": [["127.0.0.1", 5000, 11], ["127.0.0.1", 5001, 12]],
    }
    assert discovered(side())["mode"] == "pull"
    assert not side().take_plan().holds and not side().take_plan().cancels


def test_push_prefill_waits_for_every_rank_to_have_its_reservation() -> None:
    s = push_side(tp=2)
    params = {"do_remote_decode": True, "transfer_id": "T"}
    s.arrived("p1", params)
    assert s.matched_tokens(params, 100, 0) == (None, False)  # not scheduled yet
    s.reserved({"T": 1})
    assert s.matched_tokens(params, 100, 0) == (None, False)  # one rank of two
    s.reserved({"T": 1, "other": 2})
    assert s.matched_tokens(params, 100, 0) == (0, False)  # computes locally now
    s.after_alloc("p1", params, cached_blocks=0, new_blocks=[7, 3, 9, 4], num_external_tokens=0)
    assert s.push_requests() == ["p1"]
    # a first chunk of the prompt: nothing to push yet
    s.scheduled("p1", completes=False, block_ids=[7, 3, 9, 4], num_tokens=100)
    assert s.take_plan().pushes == ()
    s.scheduled("p1", completes=True, block_ids=[7, 3, 9, 4, 8], num_tokens=100)
    plan = s.take_plan()
    assert plan.pushes == (Push("p1", "T", (7, 3, 9, 4), 100),)
    assert s.push_requests() == []
    delay, out = s.finished(
        "p1", params, completed=True, block_ids=[7, 3, 9, 4, 8], num_computed_tokens=100
    )
    assert delay and out == {"aiokv": 1, "transfer_id": "T", "pushed": True}
    assert s.take_plan().holds == (Hold("p1", "", 30.0, pushed=True),)


def test_push_prefill_preempted_and_scheduled_again_still_pushes() -> None:
    s = push_side()
    params = {"do_remote_decode": True, "transfer_id": "T"}
    s.arrived("p1", params)
    s.reserved({"T": 1})
    s.after_alloc("p1", params, cached_blocks=0, new_blocks=[1, 2], num_external_tokens=0)
    s.after_alloc("p1", params, cached_blocks=0, new_blocks=[5, 6], num_external_tokens=0)
    assert s.push_requests() == ["p1"]
    s.scheduled("p1", completes=True, block_ids=[5, 6], num_tokens=64)
    assert s.take_plan().pushes == (Push("p1", "T", (5, 6), 64),)


def test_push_prefill_without_reservation_gives_up_after_the_lease() -> None:
    clock = Clock()
    s = push_side(lease=30, clock=clock)
    params = {"do_remote_decode": True, "transfer_id": "T"}
    s.arrived("p1", params)
    clock.now += 29
    assert s.matched_tokens(params, 64, 0) == (None, False)
    clock.now += 2
    assert s.matched_tokens(params, 64, 0) == (0, False)  # computes, hands nothing over
    s.after_alloc("p1", params, cached_blocks=0, new_blocks=[1, 2], num_external_tokens=0)
    assert s.push_requests() == []
    s.scheduled("p1", completes=True, block_ids=[1, 2], num_tokens=64)
    assert s.take_plan().pushes == ()
    delay, out = s.finished("p1", params, completed=True, block_ids=[1, 2], num_computed_tokens=64)
    assert not delay and out is not None and out["pushed"] is False
    assert "no decode side reserved" in out["error"]
    assert s.take_plan().cancels == (Cancel("T", out["error"]),)


def test_push_prefill_aborted_before_its_push_cancels_the_reservation() -> None:
    s = push_side()
    params = {"do_remote_decode": True, "transfer_id": "T"}
    s.arrived("p1", params)
    s.reserved({"T": 1})
    delay, out = s.finished("p1", params, completed=False, block_ids=[], num_computed_tokens=0)
    assert not delay and out is not None and out["pushed"] is False
    assert s.take_plan().cancels == (Cancel("T", out["error"]),)
    # its reservation is forgotten: a later request with that id waits again
    s.arrived("p2", params)
    assert s.matched_tokens(params, 10, 0) == (None, False)


def test_push_prefill_aborted_during_its_push_holds_until_it_ends() -> None:
    s = push_side()
    params = {"do_remote_decode": True, "transfer_id": "T"}
    s.arrived("p1", params)
    s.reserved({"T": 1})
    s.after_alloc("p1", params, cached_blocks=0, new_blocks=[1], num_external_tokens=0)
    s.scheduled("p1", completes=True, block_ids=[1], num_tokens=20)
    s.take_plan()
    delay, _ = s.finished("p1", params, completed=False, block_ids=[1], num_computed_tokens=20)
    assert delay  # the push reads its blocks: they are freed when it ended
    assert s.take_plan().holds == (Hold("p1", "", 30.0, pushed=True),)


def test_unclaimed_reservation_reports_are_forgotten_after_the_lease() -> None:
    clock = Clock()
    s = push_side(lease=30, clock=clock)
    s.reserved({"T": 1})
    clock.now += 31
    s.take_plan()
    params = {"do_remote_decode": True, "transfer_id": "T"}
    s.arrived("p1", params)
    assert s.matched_tokens(params, 10, 0) == (None, False)


def decode_push_params(s: SchedulerSide, transfer: str = "T") -> dict[str, Any]:
    """The proxy's decode params in push mode: discovery + do_remote_prefill + id."""
    return {**discovered(s), "do_remote_prefill": True, "transfer_id": transfer}


def test_push_decode_reserves_its_own_blocks() -> None:
    s = push_side(tp=2)
    params = decode_push_params(push_side(tp=2))
    s.arrived("d1", params)
    assert s.matched_tokens(params, 100, 0) == (100, True)
    s.after_alloc("d1", params, cached_blocks=0, new_blocks=[5, 6, 7, 8], num_external_tokens=100)
    plan = s.take_plan()
    ranks = (RANKS[0], RANKS[1])
    assert plan.reserves == (Reserve("d1", "T", (5, 6, 7, 8), 0, 100, ranks),)
    assert plan.loads == ()
    assert params["do_remote_prefill"] is False  # once per request
    assert s.matched_tokens(params, 100, 0) == (0, False)


def test_push_decode_aborted_withdraws_its_reservation() -> None:
    s = push_side()
    for rid, completed in (("d1", False), ("d2", True)):
        params = decode_push_params(push_side(), transfer=rid + "-T")
        s.after_alloc(rid, params, cached_blocks=0, new_blocks=[1, 2], num_external_tokens=40)
        assert s.finished(
            rid, params, completed=completed, block_ids=[1, 2], num_computed_tokens=40
        ) == (False, None)
    plan = s.take_plan()
    assert plan.withdrawals == (Withdraw("d1", "d1-T"),)  # the completed one had its KV
    assert s.finished("d1", {}, completed=False, block_ids=[], num_computed_tokens=0)[0] is False
    assert s.take_plan().withdrawals == ()  # once


def test_push_decode_with_a_local_prefix_hit_reserves_the_rest() -> None:
    s = push_side()
    params = decode_push_params(push_side())
    assert s.matched_tokens(params, 100, 32) == (68, True)
    s.after_alloc("d1", params, cached_blocks=1, new_blocks=[6, 7, 8], num_external_tokens=68)
    (res,) = s.take_plan().reserves
    assert (res.local_blocks, res.first_block, res.num_tokens) == ((6, 7, 8), 1, 100)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"mode": "pull"}, "not 'push'"),
        ({"transfer_id": ""}, "transfer_id"),
        ({"transfer_id": 5}, "transfer_id"),
        ({"remote_engine_id": ""}, "remote_engine_id"),
        ({"remote_block_size": 16}, "remote_block_size"),
        ({"remote_ranks": [["h", 1, 2]] * 3}, "tensor-parallel"),
        ({"remote_ranks": "x"}, "remote_ranks"),
        ({"aiokv": 9}, "version"),
    ],
)
def test_bad_push_params_fail_that_request_only(change: dict[str, Any], why: str) -> None:
    s = push_side()
    params = {**decode_push_params(push_side()), **change}
    assert s.matched_tokens(params, 40, 0) == (40, True)  # loads, and fails at once
    s.after_alloc("d1", params, cached_blocks=0, new_blocks=[1, 2], num_external_tokens=40)
    plan = s.take_plan()
    assert plan.reserves == () and len(plan.loads) == 1
    assert plan.loads[0].error is not None and why in plan.loads[0].error


def test_push_params_on_a_pull_instance_fail_with_a_clear_error() -> None:
    s = side()
    params = decode_push_params(push_side())
    s.after_alloc("d1", params, cached_blocks=0, new_blocks=[1, 2], num_external_tokens=40)
    (load,) = s.take_plan().loads
    assert load.error is not None and "mode 'pull'" in load.error
    prefill_params = {"do_remote_decode": True, "transfer_id": "T"}
    assert s.matched_tokens(prefill_params, 40, 0) == (0, False)  # never waits
    delay, out = s.finished(
        "p1", prefill_params, completed=True, block_ids=[1], num_computed_tokens=4
    )
    assert not delay and out is not None and "mode 'pull'" in out["error"]
