"""The vLLM connector's layer-wise push mode over real aiokv instances (no vLLM needed):
the decode worker reserves its blocks with the prefill worker, the prefill worker pushes
each layer as vLLM computes it, and every failure ends the decode's load (failed) and
releases the prefill's blocks."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
from _vllm_sides import BLOCKS
from _vllm_sides import BS
from _vllm_sides import Pair
from _vllm_sides import assert_copied
from _vllm_sides import blockwise
from _vllm_sides import kv
from _vllm_sides import options
from _vllm_sides import reserve
from _vllm_sides import reserved
from _vllm_sides import stuck_pushes
from _vllm_sides import wait_for
from _vllm_sides import worker_pair

from aiokv.integrations.vllm import ConnectorOptions
from aiokv.integrations.vllm import WorkerSide
from aiokv.integrations.vllm._options import load_deadline
from aiokv.integrations.vllm._params import Endpoint
from aiokv.integrations.vllm._plan import Cancel
from aiokv.integrations.vllm._plan import Hold
from aiokv.integrations.vllm._plan import Push
from aiokv.integrations.vllm._plan import Reserve
from aiokv.integrations.vllm._plan import StepPlan
from aiokv.integrations.vllm._plan import Withdraw


@pytest.fixture(params=["tcp", "nixl", "tcp-flash"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    """A prefill and a decode worker in push mode over ``tcp`` or ``nixl``, vLLM's CPU
    KV layout (``-flash``: FlashAttention's, two tensors per layer)."""
    backend, _, layout = request.param.partition("-")
    with worker_pair(options(backend), layout=layout or "blocks") as pair:
        yield pair


def test_each_layer_is_pushed_into_the_reserved_blocks(pair: Pair) -> None:
    p, pkv, d, dkv = pair
    src, dst = [5, 0, 17, 3], [9, 10, 2, 23]
    untouched = {n: t.clone() for n, t in dkv.items()}
    d.step(StepPlan(reserves=(reserve(p, "d1", "T1", dst, tokens=100),)))
    reserved(p, "T1")
    push = Push("p1", "T1", tuple(src), 100)
    # the plan reaches start_load_kv, which may run before the forward: nothing moves
    p.step(StepPlan(pushes=(push,)))
    assert p._pusher.jobs == {}
    # vLLM computes layer by layer: each is pushed as save_kv_layer names it
    for i, name in enumerate(pkv):
        p.save_layer(name, (push,))
        assert p._pusher.jobs["p1"].started == set(range(i + 1))
    p.saved((push,))  # after the forward: nothing left to start
    done = wait_for(d, lambda a: "d1" in a.finished_recving)
    assert done.failed_recving == set()
    assert_copied(pkv, src, dkv, dst, untouched)
    assert p.results().finished_sending == set()  # not held yet: nothing to release
    p.step(StepPlan(holds=(Hold("p1", "", 60.0, pushed=True),)))
    # the push job ends on aiokv's loop, maybe just after the decode heard of it: the
    # release is reported at that step or a later one (vLLM polls every step)
    assert wait_for(p, lambda a: "p1" in a.finished_sending).finished_sending == {"p1"}
    assert p._push_ended == {} and p._push_holds == {} and p._reservations == {}


def test_the_hold_waits_for_the_push_to_end(pair: Pair) -> None:
    p, _, d, _ = pair
    d.step(StepPlan(reserves=(reserve(p, "d2", "T2", [1, 2]),)))
    reserved(p, "T2")
    push = Push("p2", "T2", (3, 4), 2 * BS)
    p.save_layer("layer.0", (push,))  # one layer pushed during the forward ...
    p.saved((push,))
    p.step(StepPlan(holds=(Hold("p2", "", 60.0, pushed=True),)))
    # ... the rest after it; the blocks stay held until every layer is in
    sent = wait_for(p, lambda a: "p2" in a.finished_sending)
    assert sent.finished_sending == {"p2"}
    done = wait_for(d, lambda a: "d2" in a.finished_recving)
    assert done.failed_recving == set()


def test_a_prefix_hit_on_the_decode_side_gets_the_rest(pair: Pair) -> None:
    p, pkv, d, dkv = pair
    # the decode already has the prompt's first block: it reserves blocks 1..2 only
    d.step(StepPlan(reserves=(reserve(p, "d3", "T3", [20, 21], first=1, tokens=90),)))
    reserved(p, "T3")
    push = Push("p3", "T3", (7, 8, 11), 90)
    p.saved((push,))
    p.step(StepPlan(holds=(Hold("p3", "", 60.0, pushed=True),)))
    assert wait_for(d, lambda a: "d3" in a.finished_recving).failed_recving == set()
    for name in pkv:
        assert torch.equal(blockwise(dkv[name])[[20, 21]], blockwise(pkv[name])[[8, 11]])


@pytest.mark.parametrize(
    ("local", "reserved_tokens", "src", "pushed_tokens"),
    [
        # the prefill computed 60 tokens, not the 64 the decode reserved for
        pytest.param([1, 2], 64, (3, 4), 60, id="a-prompt-of-another-length"),
        pytest.param([1, BLOCKS + 7], 2 * BS, (3, 4), 2 * BS, id="a-wrong-block-id"),
    ],
)
def test_a_push_that_cannot_land_fails_the_load_and_releases(
    pair: Pair, local: list[int], reserved_tokens: int, src: tuple[int, ...], pushed_tokens: int
) -> None:
    p, _, d, _ = pair
    d.step(StepPlan(reserves=(reserve(p, "d4", "T4", local, tokens=reserved_tokens),)))
    reserved(p, "T4")
    push = Push("p4", "T4", src, pushed_tokens)
    p.saved((push,))
    p.step(StepPlan(holds=(Hold("p4", "", 60.0, pushed=True),)))
    assert wait_for(d, lambda a: "d4" in a.finished_recving).failed_recving == {"d4"}
    wait_for(p, lambda a: "p4" in a.finished_sending)


def test_a_cancelled_prefill_fails_the_decode_at_once(pair: Pair) -> None:
    p, _, d, _ = pair
    d.step(StepPlan(reserves=(reserve(p, "d6", "T6", [1]),)))
    reserved(p, "T6")
    p.step(StepPlan(cancels=(Cancel("T6", "aborted"),)))
    assert wait_for(d, lambda a: "d6" in a.finished_recving).failed_recving == {"d6"}
    assert p._reservations == {}


def test_an_aborted_decode_withdraws_and_ends_when_the_prefill_answers(pair: Pair) -> None:
    p, _, d, _ = pair
    d.step(StepPlan(reserves=(reserve(p, "d13", "T13", [1]),)))
    reserved(p, "T13")
    d.step(StepPlan(withdrawals=(Withdraw("d13", "T13"),)))
    time.sleep(0.3)
    assert d.results().finished_recving == set()  # its blocks stay taken ...
    # ... until the prefill (at its next engine step) drops the reservation and answers
    done = wait_for(d, lambda a: "d13" in a.finished_recving, also=p)
    assert done.failed_recving == {"d13"}
    assert p._reservations == {}


def test_a_withdrawal_after_the_push_began_waits_for_the_push(pair: Pair) -> None:
    p, pkv, d, dkv = pair
    d.step(StepPlan(reserves=(reserve(p, "d14", "T14", [6]),)))
    reserved(p, "T14")
    push = Push("p14", "T14", (2,), BS)
    p.save_layer("layer.0", (push,))  # the push took the reservation
    d.step(StepPlan(withdrawals=(Withdraw("d14", "T14"),)))
    p.saved((push,))
    done = wait_for(d, lambda a: "d14" in a.finished_recving)
    assert done.failed_recving == set()  # the push ended: the blocks are whole
    for name in pkv:
        assert torch.equal(blockwise(dkv[name])[[6]], blockwise(pkv[name])[[2]])


def test_a_push_without_reservation_releases_the_blocks(pair: Pair) -> None:
    p, _, _, _ = pair
    push = Push("p7", "nobody", (3,), BS)
    p.saved((push,))
    p.step(StepPlan(holds=(Hold("p7", "", 60.0, pushed=True),)))
    wait_for(p, lambda a: "p7" in a.finished_sending)


def test_a_transfer_id_in_use_fails_the_second_decode(pair: Pair) -> None:
    p, _, d, _ = pair
    d.step(StepPlan(reserves=(reserve(p, "d8", "T8", [1]),)))
    reserved(p, "T8")
    d.step(StepPlan(reserves=(reserve(p, "d8b", "T8", [2]),)))
    assert d.results().failed_recving == {"d8b"}
    p.saved((Push("p8", "T8", (4,), BS),))
    assert wait_for(d, lambda a: "d8" in a.finished_recving).failed_recving == set()


def test_reservations_and_waits_end_with_the_lease() -> None:
    with worker_pair(options(lease_timeout_s=0.5)) as (p, _, d, _):
        d.step(StepPlan(reserves=(reserve(p, "d9", "T9", [1]),)))
        reserved(p, "T9")
        start = time.monotonic()
        # no prefill request claims it: the prefill drops it and tells the decode side
        done = wait_for(d, lambda a: "d9" in a.finished_recving, timeout=10)
        assert done.failed_recving == {"d9"}
        assert 0.3 < time.monotonic() - start < 5
        wait_for(p, lambda _: not p._reservations, timeout=5)


def test_dead_prefill_fails_the_reservation_within_the_link_bound() -> None:
    d = WorkerSide(options(link_timeout_ms=1000), engine_id="D", rank=0)
    d.start(kv(5))
    try:
        nobody = Endpoint("127.0.0.1", 9, 1234)  # discard port: nothing listens
        start = time.monotonic()
        d.step(StepPlan(reserves=(Reserve("d10", "T10", (1,), 0, BS, (nobody,)),)))
        done = wait_for(d, lambda a: "d10" in a.finished_recving, timeout=10)
        assert done.failed_recving == {"d10"}
        assert time.monotonic() - start < 3
    finally:
        d.close()


def test_prefill_gone_while_the_decode_waits_fails_the_load() -> None:
    with worker_pair(options()) as (p, _, d, _):
        d.step(StepPlan(reserves=(reserve(p, "d11", "T11", [1]),)))
        reserved(p, "T11")
        p.close()  # the prefill dies before it pushes
        done = wait_for(d, lambda a: "d11" in a.finished_recving, timeout=10)
        assert done.failed_recving == {"d11"}


def test_a_pull_mode_instance_refuses_pushes() -> None:
    pull = ConnectorOptions.parse({"link_timeout_ms": 2000})
    p = WorkerSide(pull, engine_id="P", rank=0)
    d = WorkerSide(options(), engine_id="D", rank=0)
    p.start(kv(8))
    d.start(kv(9))
    try:
        d.step(StepPlan(reserves=(reserve(p, "d12", "T12", [1]),)))
        time.sleep(0.5)
        p.results()
        assert p.take_reserved() == {} and p._reservations == {}
    finally:
        d.close()
        p.close()


def test_a_transfer_id_reused_in_one_step_fails_the_second_load_only() -> None:
    """Two decode requests with the same (client-chosen) transfer id in one step: the
    first waits for the push, the second fails at once (``failed_recving``) instead of
    taking over the first's wait — where it was reported loaded with the other's
    blocks' data, and the first never ended."""
    with worker_pair(options(lease_timeout_s=1.0)) as (p, pkv, d, dkv):
        d.step(StepPlan(reserves=(reserve(p, "a", "TD", [1]), reserve(p, "b", "TD", [2]))))
        reserved(p, "TD")
        p.saved((Push("p", "TD", (4,), BS),))
        acc = wait_for(d, lambda a: {"a", "b"} <= a.finished_recving, timeout=4, also=p)
        assert acc.failed_recving == {"b"}
        for name in pkv:  # a's block holds the prefill's block 4
            assert torch.equal(blockwise(dkv[name])[1], blockwise(pkv[name])[4])


def test_the_decode_fails_a_load_only_once_the_prefills_writes_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A push still moving as the decode side's lease ends: the prefill ends its writes
    within the lease less a margin (``load_deadline``), then tells the decode side,
    which reports the load failed only then. (Both sides timed the whole lease: the
    decode side reported failed, and vLLM could reuse the blocks, while the prefill
    still wrote into them until ``transfer_timeout_ms``.)"""
    lease = 3.0  # a push must end within load_deadline(3.0) = 1.7 s of the reservation
    assert load_deadline(lease) == pytest.approx(1.7)
    with worker_pair(options(lease_timeout_s=lease, transfer_timeout_ms=20_000)) as pair:
        p, _, d, dkv = pair
        writing = stuck_pushes(monkeypatch, p)  # pushes in flight
        untouched = {n: t.clone() for n, t in dkv.items()}
        d.step(StepPlan(reserves=(reserve(p, "d13", "T13", [1]),)))
        reserved(p, "T13")
        start = time.monotonic()
        p.saved((Push("p13", "T13", (4,), BS),))
        done = wait_for(d, lambda a: "d13" in a.finished_recving, timeout=10, also=p)
        assert done.failed_recving == {"d13"}
        assert writing == []  # every write ended before the load was reported failed
        assert time.monotonic() - start < lease  # the prefill said so: not the lease's end
        assert all(torch.equal(dkv[n], untouched[n]) for n in dkv)


def test_a_reservation_is_not_pushed_into_past_its_deadline() -> None:
    """A prefill request that comes to push after the reservation's deadline (its
    lease less the margin) pushes nothing and tells the decode side at once."""
    lease = 3.0
    with worker_pair(options(lease_timeout_s=lease)) as (p, _, d, dkv):
        untouched = {n: t.clone() for n, t in dkv.items()}
        d.step(StepPlan(reserves=(reserve(p, "d14", "T14", [1]),)))
        reserved(p, "T14")  # p steps no more: its reservation is not dropped by a step
        time.sleep(load_deadline(lease) + 0.2)
        start = time.monotonic()
        p.saved((Push("p14", "T14", (4,), BS),))
        done = wait_for(d, lambda a: "d14" in a.finished_recving, timeout=10)
        assert done.failed_recving == {"d14"} and time.monotonic() - start < 1.0
        assert all(torch.equal(dkv[n], untouched[n]) for n in dkv)
