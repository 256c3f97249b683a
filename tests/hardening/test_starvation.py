"""Hangs and starvation: blocked synchronizers, finalize, the staging budget.

* Blocked ``def`` layer synchronizers take threads of their own lane only: an unrelated
  8 MiB NIXL pull and push (waited for off the loop) still finish within
  ``sync_kv_timeout``; a queued job whose waiter is cancelled never runs.
* A synchronizer that never returns: ``finalize`` returns within a bound, a warning
  names it, and the process exits 0.
* The staging budget is exact under any interleaving of grant, release, cancellation,
  timeout and a link going (a model, seeded random interleavings on a virtual clock),
  and shared per link: a peer that never reads cannot starve another's transfers.

Everything binds 127.0.0.1, port 0; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Hashable
from typing import Any

import numpy as np
import pytest
import torch
from _helpers import raw_link

from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import DataType
from aiokv import LLMConfig
from aiokv import LLMException
from aiokv import LLMStatusCode
from aiokv import TransferWithCacheKeyConfig
from aiokv._copy import CopyScheduler
from aiokv._copy import Stager
from aiokv._copy import _staging
from aiokv._copy._staging import Budget
from aiokv._remote import _service as service_mod
from aiokv._remote._protocol import BlocksReq
from aiokv._remote._protocol import KeyByBlocks
from aiokv._remote._protocol import Tensors
from aiokv._remote._protocol import encode
from aiokv._threads import Lane
from aiokv.testing import linked_pair
from aiokv.testing import make_config
from aiokv.testing import requires_transport
from aiokv.transport import _wire as wire

CODE = LLMStatusCode
MIB = 1 << 20

needs_nixl = requires_transport("nixl")


def config(backend: str, **kw: Any) -> LLMConfig:
    return make_config(backend, pool=32 * MIB, page_shift=16, **({"sync_kv_timeout": 2000} | kw))


# ---- 3: blocked synchronizers starve nothing else ----------------------------------------


class Blocked:
    """A ``def`` synchronizer that blocks (as on the model) until ``release`` is set."""

    def __init__(self, release: threading.Event) -> None:
        self.release = release
        self.calls = 0

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        self.calls += 1
        self.release.wait(60)
        return False


@needs_nixl
async def test_blocked_synchronizers_do_not_delay_an_unrelated_nixl_transfer() -> None:
    """More blocked synchronizers than the loop's default executor has threads; an 8 MiB
    pull and push (NIXL, waited for from a thread) still end within sync_kv_timeout."""
    blocked = min(32, (os.cpu_count() or 1) + 4) + 2  # the default executor's size, and more
    layer = CacheDesc(2, [16, 256 * 1024], DataType.DT_UINT8)  # 2 x 16 x 256 KiB = 8 MiB
    release = threading.Event()
    async with linked_pair(config("nixl")) as (p, d):
        pm, dm = p.cache_manager, d.cache_manager
        await pm.allocate_blocks_cache(layer, BlocksCacheKey(1, 0))
        src = await dm.allocate_blocks_cache(layer)
        dst = await dm.allocate_blocks_cache(layer)
        src.tensors[0].fill_(7)
        blocks = list(range(16))
        cfg = TransferWithCacheKeyConfig(BlocksCacheKey(1, 0))
        tasks = [
            dm.transfer_cache_async(src, Blocked(release), [cfg], blocks, blocks)
            for _ in range(blocked)
        ]
        try:
            await asyncio.sleep(0.3)  # the synchronizers are blocked now
            t0 = time.monotonic()
            await asyncio.wait_for(dm.push_blocks(BlocksCacheKey(1, 0), src, blocks, blocks), 6)
            await asyncio.wait_for(dm.pull_blocks(BlocksCacheKey(1, 0), dst, blocks, blocks), 6)
            took = time.monotonic() - t0
            assert torch.equal(dst.tensors[0], src.tensors[0])
            assert took < 2 * 2.0, f"{took:.2f} s"  # each within sync_kv_timeout (2 s)
        finally:
            release.set()
            for t in tasks:
                t.cancel()
            for t in tasks:
                await t.synchronize(10_000)


@needs_nixl
async def test_a_nixl_wait_no_thread_took_ends_at_the_deadline_and_never_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the transport's wait lane full, an 8 MiB NIXL pull fails with LLM_TIMEOUT at
    sync_kv_timeout (not when a thread frees up), and its transfer is never posted."""
    from aiokv.transport.nixl import _transport as nixl_transport

    monkeypatch.setattr(nixl_transport, "WAIT_THREADS", 1)
    layer = CacheDesc(2, [16, 256 * 1024], DataType.DT_UINT8)  # 8 MiB
    gate = threading.Event()
    async with linked_pair(config("nixl", sync_kv_timeout=1000)) as (p, d):
        await p.cache_manager.allocate_blocks_cache(layer, BlocksCacheKey(1, 0))
        dst = await d.cache_manager.allocate_blocks_cache(layer)
        transport = d._transport  # type: ignore[attr-defined]
        blocker = transport.wait_lane.submit(lambda: gate.wait(30), "blocker")
        blocks = list(range(16))
        try:
            t0 = time.monotonic()
            with pytest.raises(LLMException) as ei:
                await asyncio.wait_for(
                    d.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, blocks, blocks), 10
                )
            took = time.monotonic() - t0
            assert ei.value.status_code == CODE.LLM_TIMEOUT
            assert took < 4, f"{took:.2f} s"
            moved = transport.moved
        finally:
            gate.set()
        await asyncio.wrap_future(blocker)
        await asyncio.sleep(0.2)
        assert transport.moved == moved and transport.xfers == 0  # never posted later
        assert transport.wait_lane.running() == []


async def test_a_queued_synchronizer_whose_transfer_is_cancelled_never_runs() -> None:
    """Transfers beyond the synchronizer lane's threads wait for one; cancelled while
    they wait, their synchronizer is never called (not when a thread frees up either)."""
    from aiokv._engine import SYNC_THREADS

    layer = CacheDesc(2, [4, 4096], DataType.DT_UINT8)
    release = threading.Event()
    async with linked_pair(config("tcp")) as (p, d):
        await p.cache_manager.allocate_blocks_cache(layer, BlocksCacheKey(1, 0))
        src = await d.cache_manager.allocate_blocks_cache(layer)
        cfg = TransferWithCacheKeyConfig(BlocksCacheKey(1, 0))
        syncs = [Blocked(release) for _ in range(SYNC_THREADS + 4)]
        tasks = [d.cache_manager.transfer_cache_async(src, s, [cfg]) for s in syncs]
        try:
            for _ in range(2000):
                if sum(s.calls for s in syncs) == SYNC_THREADS:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            assert sum(s.calls for s in syncs) == SYNC_THREADS  # the rest wait for a thread
            queued = [t for t, s in zip(tasks, syncs, strict=True) if not s.calls]
            for t in queued:
                t.cancel()
            for t in queued:
                assert await t.synchronize(5000) != CODE.LLM_TIMEOUT
        finally:
            release.set()
        for t in tasks:
            assert await t.synchronize(10_000) != CODE.LLM_TIMEOUT
        await asyncio.sleep(0.2)
        assert sum(s.calls for s in syncs) == SYNC_THREADS  # the cancelled ones never ran


def test_a_lane_never_runs_a_cancelled_job_and_names_what_it_abandons() -> None:
    lane = Lane("aiokv-test", 1)
    gate, ran = threading.Event(), []
    first = lane.submit(lambda: gate.wait(30), "the blocker")
    second = lane.submit(lambda: ran.append(2), "queued")
    for _ in range(500):
        if first.running():
            break
        time.sleep(0.01)
    assert first.running() and second.cancel()  # queued: cancelled, never runs
    third = lane.submit(lambda: ran.append(3), "also queued")
    t0 = time.monotonic()
    assert lane.close(0.2) == ["the blocker"]  # abandoned, named
    assert time.monotonic() - t0 < 5
    assert third.cancelled()
    gate.set()
    first.result(5)
    assert ran == []
    with pytest.raises(RuntimeError):
        lane.submit(lambda: None)


# ---- 4: a synchronizer that never returns --------------------------------------------------

_FOREVER = """
import asyncio, sys, threading, time
from aiokv import *

class Forever:
    def __repr__(self):
        return "<Forever synchronizer>"
    def synchronize_layer(self, layer_index, timeout_in_millis):
        threading.Event().wait()  # never returns
        return True

async def main():
    cfg = LLMConfig(device_type="cpu", enable_cache_manager=True, listen_ip_info="127.0.0.1:0",
                    mem_pool_cfg='{"memory_size": 4194304, "page_shift": 16}')
    p = LLMDataDist(LLMRole.PROMPT, 1)
    d = LLMDataDist(LLMRole.DECODER, 2)
    await p.init(cfg)
    await d.init(cfg)
    desc = CacheDesc(2, [4, 4096], DataType.DT_UINT8)
    await p.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(1, 0))
    info = LLMClusterInfo(
        remote_cluster_id=1,
        remote_ip_info=[p.listen_address],
        local_ip_info=[("127.0.0.1", 0)],
    )
    assert (await d.link_clusters([info]))[0] == LLMStatusCode.LLM_SUCCESS
    src = await d.cache_manager.allocate_blocks_cache(desc)
    task = d.cache_manager.transfer_cache_async(
        src, Forever(), [TransferWithCacheKeyConfig(BlocksCacheKey(1, 0))])
    await asyncio.sleep(0.5)
    if sys.argv[1] == "exit":  # no finalize: the exit hook finalizes both
        print("FINALIZED 0", flush=True)
        return
    t0 = time.monotonic()
    await d.finalize()
    print(f"FINALIZED {time.monotonic() - t0:.2f}", flush=True)
    await p.finalize()

asyncio.run(main())
"""


@pytest.mark.parametrize("how", ["finalize", "exit"])
def test_finalize_and_exit_do_not_wait_for_a_synchronizer_that_never_returns(how: str) -> None:
    """Measured bound: finalize within SYNC_GRACE_S (1 s) plus teardown; the whole
    process exits 0 well within the subprocess timeout (also when it leaves the
    finalizing to the exit hook)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    t0 = time.monotonic()
    try:
        out = subprocess.run(
            [sys.executable, "-c", _FOREVER, how],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the process did not exit: {exc.stderr!r}")
    took = time.monotonic() - t0
    assert out.returncode == 0, out.stderr
    line = [x for x in out.stdout.splitlines() if x.startswith("FINALIZED")]
    assert line, out.stdout
    assert float(line[0].split()[1]) < 5.0
    assert "<Forever synchronizer>.synchronize_layer(0)" in out.stderr
    assert "abandoned" in out.stderr
    assert took < 45


# ---- 5: the staging budget is exact ------------------------------------------------------


async def test_a_waiter_cancelled_in_the_turn_of_a_release_loses_no_room() -> None:
    """The room a release hands to a waiter whose task is cancelled in the same loop turn
    comes back (it was lost for good, with InvalidStateError, before)."""
    sched = CopyScheduler(torch.device("cpu"))
    try:
        st = Stager(sched, limit=4 * MIB)
        cpu = torch.device("cpu")
        for timeout_too in (False, True):
            held = await st.reserve(4 * MIB, cpu, 5.0)
            waiter = asyncio.ensure_future(st.reserve(2 * MIB, cpu, 0.05 if timeout_too else 5))
            await asyncio.sleep(0.01 if not timeout_too else 0.0)
            if timeout_too:  # the deadline and the release in one turn
                await asyncio.sleep(0.06)
            else:
                waiter.cancel()  # cancelled, then the release, in one turn
            held.release()
            got = await asyncio.gather(waiter, return_exceptions=True)
            if not isinstance(got[0], BaseException):
                got[0].release()
            assert st.in_use == 0
        assert (await st.reserve(4 * MIB, cpu, 1.0)).host.numel() == 4 * MIB
    finally:
        await sched.aclose()


class _Clock:
    """A loop time the test moves (timeouts fire when it says, not when the VM does)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _model_run(seed: int, steps: int = 250) -> None:
    """Random takes, releases, cancellations, timeouts and drops on a Budget, several in
    a loop turn, checked against a model after each turn:

    * ``free + held == limit``, every owner's holding as the model counts it;
    * nothing is granted beyond the fair share or overtakes the owner in turn;
    * no claim waits that the rules would grant (no lost wake-up).
    """
    rng = random.Random(seed)
    loop = asyncio.new_event_loop()
    clock = _Clock()
    loop.time = clock  # type: ignore[method-assign]
    limit = 16
    owners: list[Hashable] = [f"link{i}" for i in range(rng.randint(1, 4))]
    budget = Budget(limit)
    holding: dict[Hashable, list[int]] = {o: [] for o in owners}
    tasks: list[tuple[asyncio.Task[None], Hashable, int]] = []
    outcomes: list[str] = []

    async def take(owner: Hashable, n: int, timeout: float) -> None:
        try:
            await budget.take(owner, n, timeout)
        except LLMException as exc:
            outcomes.append(exc.status_code.name)
            raise
        holding[owner].append(n)

    def check() -> None:
        held = {o: sum(v) for o, v in holding.items() if sum(v)}
        assert budget.held == held, (seed, budget.held, held)
        assert budget.free + sum(held.values()) == limit and budget.free >= 0
        # no lost wake-up: the owner first in turn and within its share does not fit
        for owner, queue in budget._queues.items():
            live = [c for c in queue if not c.fut.done()]
            if not live:
                continue
            if budget._within(owner, live[0].nbytes):
                assert live[0].nbytes > budget.free, (seed, owner, live[0].nbytes, budget.free)
                break

    async def drive() -> None:
        for _ in range(steps):
            for _ in range(rng.randint(1, 3)):  # several actions in ONE loop turn
                act = rng.random()
                if act < 0.45:
                    owner = rng.choice(owners)
                    n = rng.randint(1, limit)
                    timeout = rng.choice([0.5, 1.0, 3.0, 100.0])
                    tasks.append((loop.create_task(take(owner, n, timeout)), owner, n))
                elif act < 0.7:
                    owner = rng.choice(owners)
                    if holding[owner]:
                        n = holding[owner].pop(rng.randrange(len(holding[owner])))
                        budget.give(owner, n)
                elif act < 0.85:
                    waiting = [t for t, _, _ in tasks if not t.done()]
                    if waiting:
                        rng.choice(waiting).cancel()
                elif act < 0.95:
                    clock.now += rng.choice([0.3, 0.6, 1.5])  # some deadlines pass
                else:
                    budget.drop(rng.choice(owners))
            for _ in range(4):  # let cancelled and timed-out waiters run their cleanup
                await asyncio.sleep(0)
            check()
        # the end: everything waiting gives up, everything held comes back
        for t, _, _ in tasks:
            t.cancel()
        await asyncio.gather(*(t for t, _, _ in tasks), return_exceptions=True)
        check()
        for owner, ns in holding.items():
            while ns:
                budget.give(owner, ns.pop())
        assert budget.free == limit and budget.held == {} and budget._queues == {}

    try:
        loop.run_until_complete(drive())
    finally:
        loop.close()
    assert outcomes  # the run exercised timeouts or drops


@pytest.mark.parametrize("seed", range(60))
def test_the_budget_is_exact_under_random_interleavings(seed: int) -> None:
    _model_run(seed)


def test_a_big_request_is_not_overtaken_by_small_ones_of_other_owners() -> None:
    async def run() -> None:
        b = Budget(8)
        await b.take("a", 4, 1)
        big = asyncio.ensure_future(b.take("b", 8, 10))
        await asyncio.sleep(0)
        small = asyncio.ensure_future(b.take("c", 2, 10))
        await asyncio.sleep(0)
        assert not big.done() and not small.done()  # c waits behind b's turn
        b.give("a", 4)
        await asyncio.sleep(0)
        assert big.done() and not small.done()
        b.give("b", 8)
        await asyncio.wait_for(small, 1)
        b.give("c", 2)
        assert b.free == 8

    asyncio.run(run())


# ---- 6: one peer that never reads does not starve the others -------------------------------


def test_one_owner_holds_at_most_half_while_others_get_room() -> None:
    async def run() -> None:
        b = Budget(16)
        hog = [asyncio.ensure_future(b.take("hog", 4, 10)) for _ in range(8)]
        await asyncio.sleep(0)
        assert b.held == {"hog": 8}  # half the budget, the rest of its requests wait
        await asyncio.wait_for(b.take("honest", 4, 0.5), 1)  # room at once
        await asyncio.wait_for(b.take("honest", 4, 0.5), 1)
        assert b.held == {"hog": 8, "honest": 8}
        b.drop("hog")  # its link went: its queued requests fail
        got = await asyncio.gather(*hog, return_exceptions=True)
        assert sum(isinstance(g, LLMException) for g in got) == 6
        assert all(
            g.status_code == CODE.LLM_LINK_FAILED for g in got if isinstance(g, LLMException)
        )
        b.give("hog", 8)
        b.give("honest", 8)
        assert b.free == 16 and b._queues == {}

    asyncio.run(run())


def _hog(port: int, meta: bytes, size: int, count: int) -> socket.socket:
    """Link as cluster 7, ask for ``count`` staged reads of ``size`` bytes, read none."""
    s = raw_link(port)
    for i in range(count):
        s.sendall(wire.encode_frame(wire.FrameType.READ_REQ, 2 * i, meta=meta, size=size))
    return s


async def test_a_peer_that_never_reads_does_not_starve_staged_pulls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A raw peer asks for many staged reads it never consumes; an honest decoder's
    staged pulls still get room (they waited behind it, FIFO, before); once the hog's
    link goes, all of its room comes back."""
    monkeypatch.setattr(_staging, "_STAGE_HOST", True)  # CPU caches take the staged path
    monkeypatch.setattr(_staging, "STAGE_LIMIT", 8 * MIB)
    monkeypatch.setattr(service_mod, "MAX_STAGED_BYTES", 4 * MIB)
    layer = CacheDesc(2, [16, 128 * 1024], DataType.DT_UINT8)  # 2 x 2 MiB
    async with linked_pair(config("tcp", sync_kv_timeout=1500)) as (p, d):
        stager: Stager = p.cache_manager._client._stager  # type: ignore[attr-defined]
        await p.cache_manager.allocate_blocks_cache(layer, BlocksCacheKey(1, 0))
        assert stager.budget.limit == 8 * MIB
        blocks = np.arange(16, dtype="<i8")
        req = BlocksReq(KeyByBlocks(1, 0), Tensors(2), blocks.tobytes(), 128 * 1024)
        assert p.listen_address is not None
        sock = await asyncio.to_thread(_hog, p.listen_address[1], encode(req), 4 * MIB, 6)
        try:
            for _ in range(500):
                if stager.in_use >= 4 * MIB and stager.budget.waiting:
                    break
                await asyncio.sleep(0.01)
            assert stager.in_use == 4 * MIB  # half the budget, its other requests wait
            dst = await d.cache_manager.allocate_blocks_cache(layer)
            blocks16 = list(range(16))
            for _ in range(3):
                await asyncio.wait_for(
                    d.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, blocks16, blocks16), 5
                )
        finally:
            sock.close()
        for _ in range(500):
            if stager.in_use == 0 and not stager.budget.waiting:
                break
            await asyncio.sleep(0.01)
        assert stager.in_use == 0 and not stager.budget.waiting and stager.budget.held == {}


def test_a_lane_whose_thread_cannot_start_queues_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Out of threads, ``submit`` raises and the job never runs (it was left queued, for
    a later thread to run after the caller saw the error); the lane works on after, and
    closes (a thread that never started was kept, and joining it raised)."""
    lane = Lane("aiokv-test", 2)
    ran: list[int] = []
    start = threading.Thread.start

    def no_thread(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    with pytest.raises(RuntimeError, match="can't start"):
        lane.submit(lambda: ran.append(1))
    monkeypatch.setattr(threading.Thread, "start", start)
    assert lane.threads == 0
    lane.submit(lambda: ran.append(2)).result(5)
    assert ran == [2]
    assert lane.close(5) == []
