"""The vLLM connector's worker side over real aiokv instances (no vLLM needed): vLLM's
KV tensors registered in place, pulls into different block ids, done notices, leases,
and failures reported within their bound."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import torch
from _vllm_sides import BLOCKS
from _vllm_sides import FLASH_SHAPE
from _vllm_sides import Pair
from _vllm_sides import assert_copied
from _vllm_sides import kv
from _vllm_sides import wait_for
from _vllm_sides import worker_pair

from aiokv.integrations.vllm import ConnectorOptions
from aiokv.integrations.vllm import WorkerSide
from aiokv.integrations.vllm._layout import blocks_desc
from aiokv.integrations.vllm._layout import logical_blocks
from aiokv.integrations.vllm._layout import split_kv
from aiokv.integrations.vllm._params import Endpoint
from aiokv.integrations.vllm._plan import Hold
from aiokv.integrations.vllm._plan import Load
from aiokv.integrations.vllm._plan import Release
from aiokv.integrations.vllm._plan import StepPlan
from aiokv.integrations.vllm._worker import DoneNotice


@pytest.fixture(params=["tcp", "nixl", "tcp-flash"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    """A prefill and a decode worker over ``tcp`` or ``nixl``, vLLM's CPU KV layout
    (``-flash``: FlashAttention's)."""
    backend, _, layout = request.param.partition("-")
    opts = ConnectorOptions.parse(
        {"transfer_timeout_ms": 3000, "link_timeout_ms": 2000, "transfer_backend": backend}
    )
    with worker_pair(opts, layout=layout or "blocks") as pair:
        yield pair


def load(p: WorkerSide, rid: str, local: list[int], remote: list[int], token: str = "t") -> Load:
    assert p.endpoint is not None
    return Load(rid, tuple(local), tuple(remote), "p-" + rid, token, (p.endpoint,))


def test_registers_vllm_tensors_in_place(pair: Any) -> None:
    p, pkv, _, _ = pair
    cache = p._cache
    assert cache is not None
    halves = [h for t in pkv.values() for h in (t.unbind(0) if p._per_layer == 2 else [t])]
    assert [t.data_ptr() for t in cache.tensors] == [h.data_ptr() for h in halves]
    assert len(cache.tensors) == len(pkv) * (2 if tuple(pkv["layer.0"].shape) == FLASH_SHAPE else 1)
    assert p.endpoint is not None and p.endpoint.port > 0 and p.endpoint.host == "127.0.0.1"


def test_pull_into_other_block_ids_then_the_prefill_frees(pair: Any) -> None:
    p, pkv, d, dkv = pair
    remote, local = [5, 0, 17, 3], [9, 10, 2, 23]
    untouched = {n: t.clone() for n, t in dkv.items()}
    p.step(StepPlan(holds=(Hold("p-r1", "tok", 60.0),)))
    d.step(StepPlan(loads=(load(p, "r1", local, remote, "tok"),)))
    done = wait_for(d, lambda a: "r1" in a.finished_recving)
    assert done.failed_recving == set()
    assert_copied(pkv, remote, dkv, local, untouched)
    sent = wait_for(p, lambda a: "p-r1" in a.finished_sending)
    assert sent.finished_sending == {"p-r1"}
    assert p.results().finished_sending == set()  # reported once


def test_notice_before_the_hold_still_frees(pair: Any) -> None:
    p, _, d, _ = pair
    d.step(StepPlan(loads=(load(p, "r2", [1], [2], "early"),)))
    wait_for(d, lambda a: "r2" in a.finished_recving)
    deadline = time.monotonic() + 10
    while not p._early and time.monotonic() < deadline:  # the notice arrives, nothing held yet
        p.results()
        time.sleep(0.01)
    p.step(StepPlan(holds=(Hold("p-r2", "early", 60.0),)))
    assert p.results().finished_sending == {"p-r2"}


def test_a_notice_with_a_wrong_token_frees_nothing(pair: Any) -> None:
    p, _, d, _ = pair
    p.step(StepPlan(holds=(Hold("p-r3", "right", 60.0), Hold("p-r3b", "b", 60.0))))
    d.step(StepPlan(loads=(load(p, "r3", [1], [2], "wrong"),)))
    wait_for(d, lambda a: "r3" in a.finished_recving)
    assert d._dd is not None and d._portal is not None
    d._portal.call(d._dd.send_notification, p.cluster_id, b"not json")  # malformed: ignored
    valid = msgspec.json.encode(DoneNotice("p-r3b", "b"))
    d._portal.call(d._dd.send_notification, p.cluster_id, valid)
    # notifications arrive in order: once the last one freed p-r3b, the others were seen
    done = wait_for(p, lambda a: "p-r3b" in a.finished_sending)
    assert done.finished_sending == {"p-r3b"}
    assert "p-r3" in p._holds


def test_lease_frees_what_no_decode_takes(pair: Any) -> None:
    p, _, _, _ = pair
    p.step(StepPlan(holds=(Hold("p-r4", "x", 0.2),)))
    assert p.results().finished_sending == set()
    done = wait_for(p, lambda a: "p-r4" in a.finished_sending, timeout=5)
    assert done.finished_sending == {"p-r4"}
    assert p._holds == {}


def test_release_without_load_frees_the_prefill(pair: Any) -> None:
    p, _, d, _ = pair
    p.step(StepPlan(holds=(Hold("p-r5", "k", 60.0),)))
    assert p.endpoint is not None
    d.step(StepPlan(releases=(Release("p-r5", "k", (p.endpoint,)),)))
    wait_for(p, lambda a: "p-r5" in a.finished_sending)
    assert d.results().finished_recving == set()  # nothing loaded, nothing reported


def test_wrong_block_id_fails_the_load(pair: Any) -> None:
    p, _, d, _ = pair
    p.step(StepPlan(holds=(Hold("p-r6", "t", 60.0),)))
    d.step(StepPlan(loads=(load(p, "r6", [1, 2], [3, BLOCKS + 5]),)))
    done = wait_for(d, lambda a: "r6" in a.finished_recving)
    assert done.failed_recving == {"r6"}
    wait_for(p, lambda a: "p-r6" in a.finished_sending)  # released all the same


def test_params_error_fails_at_once(pair: Any) -> None:
    _, _, d, _ = pair
    d.step(StepPlan(loads=(Load("r7", (), (), "", "", (), error="bad params"),)))
    done = d.results()
    assert (done.finished_recving, done.failed_recving) == ({"r7"}, {"r7"})


def test_dead_prefill_fails_within_the_link_bound() -> None:
    opts = ConnectorOptions.parse({"link_timeout_ms": 1000, "transfer_timeout_ms": 1000})
    d = WorkerSide(opts, engine_id="D", rank=0)
    d.start(kv(3))
    try:
        nobody = Endpoint("127.0.0.1", 9, 1234)  # discard port: nothing listens
        start = time.monotonic()
        d.step(StepPlan(loads=(Load("r8", (1,), (1,), "p", "t", (nobody,)),)))
        done = wait_for(d, lambda a: "r8" in a.finished_recving, timeout=10)
        assert done.failed_recving == {"r8"}
        assert time.monotonic() - start < 2 + 1  # link + transfer bound, plus slack
    finally:
        d.close()


def test_step_never_blocks(pair: Any) -> None:
    _, _, d, _ = pair
    slow = Endpoint("10.255.255.1", 9, 99)  # unroutable: the link attempt hangs until its bound
    start = time.monotonic()
    d.step(StepPlan(loads=(Load("r9", (1,), (1,), "p", "t", (slow,)),)))
    d.results()
    assert time.monotonic() - start < 0.5
    wait_for(d, lambda a: "r9" in a.failed_recving, timeout=10)


def test_close_is_idempotent_and_stops_loads() -> None:
    before = {t.ident for t in threading.enumerate()}
    d = WorkerSide(ConnectorOptions.parse({}), engine_id="D", rank=0)
    d.start(kv(4))
    hung = Endpoint("10.255.255.1", 9, 99)  # unroutable: this load would wait its bound
    d.step(StepPlan(loads=(Load("r10", (1,), (1,), "p", "t", (hung,)),)))
    start = time.monotonic()
    d.close()
    d.close()
    assert time.monotonic() - start < 3  # the load was stopped, not waited for
    assert {t.ident for t in threading.enumerate()} <= before  # no thread left behind
    assert d.results().finished_recving <= {"r10"}


def test_a_leased_nixl_load_ends_on_vllms_thread() -> None:
    """Over NIXL, once the decode holds a lease on the prefill's blocks, its loads are
    posted and seen done from vLLM's own thread (step / results), as NixlConnector's
    READs are: a load ends while aiokv's engine loop is busy (here: blocked for 3 s)."""
    opts = ConnectorOptions.parse({"transfer_backend": "nixl", "transfer_timeout_ms": 3000})
    with worker_pair(opts) as (p, pkv, d, dkv):
        d.step(StepPlan(loads=(load(p, "n0", [0], [0], "-"),)))  # links, asks for a lease
        wait_for(d, lambda a: "n0" in a.finished_recving)
        assert d._dd is not None and d._loop is not None
        leases = d._dd.cache_manager._client.leases  # type: ignore[attr-defined]
        deadline = time.monotonic() + 10
        while leases.holding() != 1:
            assert time.monotonic() < deadline, "no lease within 10 s"
            time.sleep(0.01)
        untouched = {n: t.clone() for n, t in dkv.items()}
        p.step(StepPlan(holds=(Hold("p-n1", "tok", 60.0),)))
        busy = threading.Event()
        d._loop.call_soon_threadsafe(lambda: (busy.set(), time.sleep(3.0)))
        assert busy.wait(5)
        start = time.monotonic()
        d.step(StepPlan(loads=(load(p, "n1", [4, 6], [1, 2], "tok"),)))
        done = wait_for(d, lambda a: "n1" in a.finished_recving, timeout=5)
        assert time.monotonic() - start < 2.0  # not after the engine loop's 3 s
        assert done.failed_recving == set()
        assert_copied(pkv, [1, 2], dkv, [4, 6], untouched)
        wait_for(p, lambda a: "p-n1" in a.finished_sending)  # its done notice, later


def test_done_notice_is_small_json() -> None:
    raw = msgspec.json.encode(DoneNotice("req-1", "abc"))
    assert raw == b'{"request":"req-1","token":"abc"}'


def test_blocks_desc_refuses_other_layouts() -> None:
    t = torch.zeros(4, 2, 8, 16)
    desc = blocks_desc([t, t.clone()])
    assert desc.num_tensors == 2 and desc.shape == (4, 2, 8, 16)
    with pytest.raises(ValueError, match="hybrid"):
        blocks_desc([t, torch.zeros(4, 2, 8, 8)])
    with pytest.raises(ValueError, match="contiguous"):
        blocks_desc([torch.zeros(2, 4, 8, 16).transpose(0, 1)])
    with pytest.raises(ValueError, match="no KV"):
        blocks_desc([])
    assert blocks_desc([t], num_blocks=4).shape == (4, 2, 8, 16)
    with pytest.raises(ValueError, match="blocks first"):  # e.g. [2, num_blocks, ...]
        blocks_desc([torch.zeros(2, 4, 8, 16)], num_blocks=4)


def test_prefill_gone_after_linking_fails_the_next_load() -> None:
    opts = ConnectorOptions.parse({"link_timeout_ms": 1000, "transfer_timeout_ms": 1000})
    p, d = WorkerSide(opts, engine_id="P", rank=0), WorkerSide(opts, engine_id="D", rank=0)
    p.start(kv(5))
    d.start(kv(6))
    try:
        d.step(StepPlan(loads=(load(p, "first", [1], [1]),)))
        assert wait_for(d, lambda a: "first" in a.finished_recving).failed_recving == set()
        p.close()  # the prefill dies; the decode's link to it breaks
        start = time.monotonic()
        d.step(StepPlan(loads=(load(p, "second", [2], [2]),)))
        done = wait_for(d, lambda a: "second" in a.finished_recving, timeout=10)
        assert done.failed_recving == {"second"}
        assert time.monotonic() - start < 3
    finally:
        d.close()
        p.close()


def test_kernel_blocks_smaller_than_vllm_blocks_are_grouped() -> None:
    t = torch.arange(8 * 3 * 4, dtype=torch.float32).reshape(8, 3, 4)  # 8 kernel blocks
    (v,) = logical_blocks([t], num_blocks=4)  # 4 vLLM blocks of 2 kernel blocks each
    assert v.shape == (4, 2, 3, 4) and v.data_ptr() == t.data_ptr()
    assert torch.equal(v[1], t[2:4])
    assert logical_blocks([t], None)[0] is t
    assert logical_blocks([t], 8)[0] is t


def test_flash_attention_layout_gives_k_and_v_halves_per_layer() -> None:
    flash = [torch.zeros(2, 8, 4, 2, 3) for _ in range(2)]  # 8 blocks, K and V first
    halves, per_layer = split_kv(flash, 8)
    assert per_layer == 2 and [h.shape for h in halves] == [(8, 4, 2, 3)] * 4
    assert [h.data_ptr() for h in halves[:2]] == [flash[0].data_ptr(), flash[0][1].data_ptr()]
    assert all(h.is_contiguous() for h in halves)
    blocks_first = [torch.zeros(8, 2, 4, 6)]  # FlashInfer's [blocks, 2, ...]: as it is
    assert split_kv(blocks_first, 8) == (blocks_first, 1)
    assert split_kv(flash, None) == (flash, 1)  # no block count: blocks first
    two = [torch.zeros(2, 2, 4)]  # 2 blocks: the blocks come first, not K/V
    assert split_kv(two, 2) == (two, 1)
    with pytest.raises(ValueError, match="blocks first or second"):
        blocks_desc(logical_blocks([torch.zeros(4, 2, 8, 3)], 8), 8)


# ---- idle steps: the GIL goes to the transfer ----------------------------------------------
def idle_pair(wait_ms: float, backend: str = "tcp") -> Any:
    return worker_pair(
        ConnectorOptions.parse(
            {"transfer_timeout_ms": 3000, "idle_wait_ms": wait_ms, "transfer_backend": backend}
        )
    )


@pytest.mark.parametrize("backend", ["tcp", "nixl"])  # nixl: the load runs on the pump
def test_an_idle_step_waits_for_the_load_in_flight(backend: str) -> None:
    """In a step that ran no model, results() blocks until the load ends (woken by it,
    long before ``idle_wait_ms``), so vLLM's empty steps stop competing for the GIL."""
    with idle_pair(1000, backend) as (p, pkv, d, dkv):
        d.step(StepPlan(loads=(load(p, "i0", [0], [0], "-"),)))  # links the pair
        wait_for(d, lambda a: "i0" in a.finished_recving)
        untouched = {n: t.clone() for n, t in dkv.items()}
        p.step(StepPlan(holds=(Hold("p-i1", "tok", 60.0),)))
        d.step(StepPlan(loads=(load(p, "i1", [4, 6], [1, 2], "tok"),)))
        t0 = time.monotonic()
        done = d.results(idle=True)
        assert time.monotonic() - t0 < 0.9  # woken by the load, not by the 1 s bound
        assert (done.finished_recving, done.failed_recving) == ({"i1"}, set())
        assert_copied(pkv, [1, 2], dkv, [4, 6], untouched)
        assert d._loads == 0
        wait_for(p, lambda a: "p-i1" in a.finished_sending)


def test_an_idle_step_with_blocks_held_waits_at_most_idle_wait_ms() -> None:
    with idle_pair(200) as (p, _, _, _):
        p.step(StepPlan(holds=(Hold("p-i2", "tok", 60.0),)))
        t0 = time.monotonic()
        assert p.results(idle=True).finished_sending == set()
        assert 0.19 <= time.monotonic() - t0 < 5


def test_no_wait_when_nothing_is_in_flight_or_the_step_ran_the_model() -> None:
    with idle_pair(1000) as (p, _, d, _):
        t0 = time.monotonic()
        assert d.results(idle=True).finished_recving == set()  # nothing in flight
        p.step(StepPlan(holds=(Hold("p-i3", "tok", 60.0),)))
        assert p.results().finished_sending == set()  # a step with a forward pass
        assert time.monotonic() - t0 < 0.9
    with idle_pair(0) as (p, _, _, _):  # 0: never wait
        p.step(StepPlan(holds=(Hold("p-i4", "tok", 60.0),)))
        t0 = time.monotonic()
        p.results(idle=True)
        assert time.monotonic() - t0 < 0.9


def test_link_locks_go_with_their_last_user() -> None:
    """A lock per prefill cluster named in requests' params (untrusted): it goes once no
    load links to that cluster, so failed loads leave nothing behind."""
    d = WorkerSide(ConnectorOptions.parse({"link_timeout_ms": 500}), engine_id="D", rank=0)
    d.start(kv(3))
    try:
        n = 40
        loads = tuple(
            Load(f"r{i}", (1,), (1,), "x", "tok", (Endpoint("127.0.0.1", 9, 1000 + i),))
            for i in range(n)
        )
        d.step(StepPlan(loads=loads))
        wait_for(d, lambda a: len(a.finished_recving) == n, timeout=60)
        assert len(d._linker) == 0
    finally:
        d.close()
