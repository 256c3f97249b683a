"""The vLLM connector's worker side with vLLM's KV tensors on a CUDA device (no vLLM
needed; skipped without CUDA): pulls between device caches, and layer-wise pushes of
layers that a forward is still computing on its own CUDA stream when ``save_kv_layer``
names them (the push must wait for that work, not read the layer before it lands)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from _vllm_sides import Pair
from _vllm_sides import assert_copied
from _vllm_sides import options
from _vllm_sides import reserve
from _vllm_sides import reserved
from _vllm_sides import wait_for
from _vllm_sides import worker_pair

from aiokv.integrations.vllm import ConnectorOptions
from aiokv.integrations.vllm._plan import Hold
from aiokv.integrations.vllm._plan import Load
from aiokv.integrations.vllm._plan import Push
from aiokv.integrations.vllm._plan import StepPlan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GPU_CYCLES = 200_000_000  # ~0.1 s of one SM spinning: the layer's "compute"


#: backend, and KV layout: vLLM's blocks-first one or FlashAttention's [2, blocks, ...]
SETUPS = ["tcp", "nixl", "tcp-flash", "nixl-flash"]


@pytest.fixture(params=SETUPS)
def pull_pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    """Pull-mode prefill and decode workers, KV on ``cuda:0``, over tcp or nixl."""
    backend, _, layout = request.param.partition("-")
    opts = ConnectorOptions.parse(
        {"transfer_timeout_ms": 5000, "link_timeout_ms": 3000, "transfer_backend": backend}
    )
    with worker_pair(opts, "cuda:0", layout or "blocks") as pair:
        yield pair


@pytest.fixture(params=SETUPS)
def push_pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    """Push-mode prefill and decode workers, KV on ``cuda:0``, over tcp or nixl."""
    backend, _, layout = request.param.partition("-")
    opts = options(backend, transfer_timeout_ms=5000)
    with worker_pair(opts, "cuda:0", layout or "blocks") as pair:
        yield pair


def test_the_device_tensors_are_registered_in_place(pull_pair: Pair) -> None:
    p, pkv, _, _ = pull_pair
    assert p._cache is not None
    halves = [h for t in pkv.values() for h in (t.unbind(0) if p._per_layer == 2 else [t])]
    assert [t.data_ptr() for t in p._cache.tensors] == [h.data_ptr() for h in halves]
    assert all(t.is_cuda for t in p._cache.tensors)


def test_a_pull_between_device_caches_lands_in_the_decode_blocks(pull_pair: Pair) -> None:
    p, pkv, d, dkv = pull_pair
    remote, local = [5, 0, 17, 3], [9, 10, 2, 23]
    untouched = {n: t.clone() for n, t in dkv.items()}
    assert p.endpoint is not None
    p.step(StepPlan(holds=(Hold("p-r1", "tok", 60.0),)))
    load = Load("r1", tuple(local), tuple(remote), "p-r1", "tok", (p.endpoint,))
    d.step(StepPlan(loads=(load,)))
    done = wait_for(d, lambda a: "r1" in a.finished_recving)
    assert done.failed_recving == set()
    torch.cuda.synchronize()
    assert_copied(pkv, remote, dkv, local, untouched)
    assert wait_for(p, lambda a: "p-r1" in a.finished_sending).finished_sending == {"p-r1"}


def test_a_layer_still_computed_on_a_side_stream_is_pushed_once_it_lands(
    push_pair: Pair,
) -> None:
    p, pkv, d, dkv = push_pair
    src, dst = [5, 0, 17, 3], [9, 10, 2, 23]
    untouched = {n: t.clone() for n, t in dkv.items()}
    computed = {n: torch.randn_like(t) for n, t in pkv.items()}  # what the forward writes
    d.step(StepPlan(reserves=(reserve(p, "d1", "T1", dst, tokens=100),)))
    reserved(p, "T1")
    push = Push("p1", "T1", tuple(src), 100)
    p.step(StepPlan(pushes=(push,)))
    torch.cuda.synchronize()
    forward = torch.cuda.Stream()
    with torch.cuda.stream(forward):
        for name, layer in pkv.items():
            torch.cuda._sleep(GPU_CYCLES)  # the layer's attention, still running ...
            layer.copy_(computed[name])  # ... then its KV lands in the cache
            p.save_layer(name, (push,), layer)  # vLLM names the layer before it lands
    p.saved((push,))
    done = wait_for(d, lambda a: "d1" in a.finished_recving)
    assert done.failed_recving == set()
    torch.cuda.synchronize()
    assert_copied(computed, src, dkv, dst, untouched)
    p.step(StepPlan(holds=(Hold("p1", "", 60.0, pushed=True),)))
    assert wait_for(p, lambda a: "p1" in a.finished_sending).finished_sending == {"p1"}
