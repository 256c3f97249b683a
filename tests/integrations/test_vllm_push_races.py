"""vLLM connector, push mode: a decode load reported over means nothing more lands in its
blocks, a prefill's pushed blocks are always released, and a process that never closes
its worker still exits.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from _vllm_sides import BLOCKS
from _vllm_sides import BS
from _vllm_sides import kv
from _vllm_sides import options
from _vllm_sides import reserve
from _vllm_sides import stuck_pushes
from _vllm_sides import wait_for
from _vllm_sides import worker_pair

from aiokv import LLMException
from aiokv import LLMStatusCode
from aiokv.integrations.vllm import ConnectorOptions
from aiokv.integrations.vllm import WorkerSide
from aiokv.integrations.vllm import _worker
from aiokv.integrations.vllm._plan import Hold
from aiokv.integrations.vllm._plan import Push
from aiokv.integrations.vllm._plan import StepPlan
from aiokv.integrations.vllm._worker import _Awaiting


class _FakeDataDist:
    """What ``WorkerSide.results`` reads of aiokv: no notifications, and the live links
    (``on_links`` runs when they are read: what another thread did meanwhile)."""

    def __init__(self, linked: set[int]) -> None:
        self.linked = linked
        self.on_links: Any = None

    def get_notifications(self) -> list[tuple[int, bytes]]:
        return []

    def linked_clusters(self) -> list[int]:
        out = sorted(self.linked)
        if self.on_links is not None:
            self.on_links()
            self.on_links = None
        return out


def test_a_push_wait_registered_after_the_link_check_is_not_failed() -> None:
    """A decode request waiting for its push fails (and vLLM reuses its blocks) only if
    the link to its prefill broke: a wait that the engine loop registers just after
    ``results`` read the live links (its link came up after that read) must not be
    failed as "the link to the prefill broke" — the prefill would then push into
    blocks vLLM already gave back."""
    w = WorkerSide(ConnectorOptions(mode="push"), engine_id="D", rank=0)
    fake = _FakeDataDist({7})
    w._dd = fake  # type: ignore[assignment]
    deadline = time.monotonic() + 60
    w._awaiting["T1"] = _Awaiting("d1", 7, deadline)

    def reserve_meanwhile() -> None:  # the engine loop's _reserve, between two bytecodes
        fake.linked.add(8)  # its link came up after the read
        with w._lock:
            w._awaiting["T2"] = _Awaiting("d2", 8, deadline)

    fake.on_links = reserve_meanwhile
    done = w.results()
    assert done.finished_recving == set() and done.failed_recving == set()
    assert set(w._awaiting) == {"T1", "T2"}
    # the next call sees its link: still waiting for its push
    assert w.results().failed_recving == set()
    assert set(w._awaiting) == {"T1", "T2"}


def test_a_pushed_hold_filed_after_a_lease_is_still_released(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A push-mode prefill request that keeps generating for longer than
    ``lease_timeout_s`` after its push ended gets its ``Hold(pushed=True)`` late: its
    blocks must still be released (``finished_sending``), not held forever."""
    now = [1000.0]
    monkeypatch.setattr(_worker, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    w = WorkerSide(ConnectorOptions(mode="push", lease_timeout_s=5.0), engine_id="P", rank=0)
    w.pushed("p1")  # every layer pushed, the decode side told
    now[0] += 6.0  # the request generates on; results() runs each step meanwhile
    assert w.results().finished_sending == set()
    w.step(StepPlan(holds=(Hold("p1", "", 5.0, pushed=True),)))  # it finished
    released: set[str] = set()
    for _ in range(3):  # vLLM's next steps, within and past a lease
        released |= w.results().finished_sending
        now[0] += 3.0
    assert released == {"p1"}
    assert not w._busy()


def test_a_reservation_whose_send_may_have_arrived_is_not_given_up_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Push mode, decode side: ``send_notification`` may raise (a timeout) although the
    prefill filed the reservation (aiokv documents it). The decode must then not report
    the load over (vLLM would free or reuse its blocks) while the prefill may still push
    into them: it withdraws the reservation and ends the load once the prefill answers.
    A user relies on a failed load meaning no bytes will land in its blocks."""
    with worker_pair(options()) as (p, _, d, dkv):
        assert d._dd is not None
        send = d._dd.send_notification
        calls = []

        async def delivered_but_timed_out(cluster_id: int, payload: bytes) -> None:
            await send(cluster_id, payload)
            calls.append(payload)
            if len(calls) == 1:  # the reservation: filed there, reported as a timeout here
                raise LLMException("timed out", status_code=LLMStatusCode.LLM_TIMEOUT)

        monkeypatch.setattr(d._dd, "send_notification", delivered_but_timed_out)
        d.step(StepPlan(reserves=(reserve(p, "d2", "T2", [9], tokens=BS),)))
        # the prefill filed the reservation; it must not be able to push into the
        # blocks once the decode reported the load over: step both sides until then
        done = wait_for(d, lambda a: "d2" in a.finished_recving, also=p)
        assert done.failed_recving == {"d2"}
        p.results()  # every notice the decode sent is filed there: take them
        assert "T2" not in p._reservations, "the prefill may still push into freed blocks"
        untouched = {n: t.clone() for n, t in dkv.items()}
        push = Push("p2", "T2", (4,), BS)
        p.saved((push,))
        wait_for(p, lambda _: not p._pusher.jobs and p._push_ended, timeout=10)
        assert all(torch.equal(dkv[n], untouched[n]) for n in dkv)


def test_a_push_ends_its_writes_within_the_decode_sides_lease_not_the_prefills(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Push mode with a decode instance whose ``lease_timeout_s`` is shorter than the
    prefill's (each instance sets its own; nothing says they must match): the decode
    side gives its blocks up after its own lease, so the prefill must end every write
    within that lease less the margin, not within its own. A user relies on a failed
    load meaning no bytes will land in its blocks (vLLM frees or recomputes them)."""
    decode_lease = 3.0  # the decode gives its blocks up 3 s after its reservation
    p = WorkerSide(options(lease_timeout_s=60.0, transfer_timeout_ms=20_000), engine_id="P", rank=0)
    d = WorkerSide(options(lease_timeout_s=decode_lease), engine_id="D", rank=0)
    p.start(kv(1), BLOCKS)
    try:
        d.start(kv(2), BLOCKS)
        try:
            writing = stuck_pushes(monkeypatch, p)  # pushes in flight
            d.step(StepPlan(reserves=(reserve(p, "d3", "T3", [1], tokens=BS),)))
            end = time.monotonic() + 20
            while "T3" not in p.take_reserved():
                p.results()
                assert time.monotonic() < end, "no reservation"
                time.sleep(0.01)
            p.saved((Push("p3", "T3", (4,), BS),))
            done = wait_for(d, lambda a: "d3" in a.finished_recving, timeout=15, also=p)
            assert done.failed_recving == {"d3"}
            assert writing == [], "the prefill still writes into blocks the decode gave up"
        finally:
            d.close()
    finally:
        p.close()


def test_a_process_that_never_closes_its_worker_still_exits(tmp_path: Path) -> None:
    """A process whose started ``WorkerSide`` is never closed (vLLM skipped the
    connector's ``shutdown()``, or an application forgot ``close()``) must still exit
    at its end: it hung for ever, its interpreter waiting at exit on the worker's
    loop thread (the blocking portal's cleanup, run when the worker is collected)."""
    root = Path(__file__).resolve().parents[2]
    script = tmp_path / "never_closed.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(root / 'tests' / 'integrations')!r})\n"
        "from _vllm_sides import BLOCKS, kv\n"
        "from aiokv.integrations.vllm import ConnectorOptions, WorkerSide\n"
        "w = WorkerSide(ConnectorOptions.parse({}), engine_id='E', rank=0)\n"
        "w.start(kv(1), BLOCKS)\n"
        "print('started', flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(root)}
    try:
        out = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=90
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the process never exited")
    assert out.returncode == 0, out.stderr
    assert "started" in out.stdout
