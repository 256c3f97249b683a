"""The nixl transport's own promises: the install error, registration deciding the path
(NIXL vs the TCP fallback), and the descriptor lists built from grants."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
from _helpers import hide_nixl
from _helpers import until

from aiokv._enums import LLMStatusCode as Code
from aiokv._errors import LLMException
from aiokv.testing import requires_transport
from aiokv.testing import skip_unless_transport
from aiokv.transport import Grant
from aiokv.transport import PeerInfo
from aiokv.transport import get_transport


def test_missing_nixl_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    hide_nixl(monkeypatch)
    with pytest.raises(LLMException) as info:
        get_transport("nixl")
    assert info.value.status_code == Code.LLM_FEATURE_NOT_ENABLED
    assert "pip install 'aiokv[nixl]'" in str(info.value)
    assert "torch==2.13.0" in str(info.value)


needs_nixl = requires_transport("nixl")


def test_descriptors_coalesce_and_pair() -> None:
    np = pytest.importorskip("numpy")
    skip_unless_transport("nixl")
    descs = importlib.import_module("aiokv.transport.nixl._descs")
    buf = bytearray(100)
    mv = memoryview(buf)
    base = descs.address_of(mv)
    runs = descs.runs_of([mv[0:10], mv[10:30], mv[50:60]])
    assert runs.tolist() == [[base, 30], [base + 50, 10]]  # adjacent views merged
    local, far = descs.pair(runs, np.array([(7, 5), (100, 35)], dtype=np.uint64))
    assert local[:, 1].tolist() == [5, 25, 10] == far[:, 1].tolist()
    assert far[:, 0].tolist() == [7, 100, 125]
    assert local[:, 0].tolist() == [base, base + 5, base + 50]
    meta = descs.encode_grant(("VRAM", 3, runs))
    mem, dev, back = descs.decode_grant(meta, 40)
    assert back.tolist() == runs.tolist() and (mem, dev) == ("VRAM", 3)
    assert descs.decode_grant(meta, 41) is None  # totals must match
    assert descs.decode_grant(meta[:-1], 40) is None  # torn
    assert descs.decode_grant(bytes(8 + 16), 0) is None  # empty run
    assert descs.decode_grant((2).to_bytes(4, "little") + meta[4:], 40) is None  # no kind 2


class Regions:
    """Grants ``size`` bytes of ``buf`` from offset 0."""

    def __init__(self, buf: bytearray) -> None:
        self.buf = buf
        self.done: list[bool] = []

    async def grant_read(self, peer: PeerInfo, meta: bytes) -> Grant:
        return Grant(Code.LLM_SUCCESS, [memoryview(self.buf)[: int(meta)]], self.done.append)

    async def grant_write(self, peer: PeerInfo, meta: bytes, nbytes: int) -> Grant:
        return Grant(Code.LLM_SUCCESS, [memoryview(self.buf)[: int(meta)]], self.done.append)


@needs_nixl
async def test_registered_memory_moves_over_nixl_the_rest_over_tcp() -> None:
    from aiokv.transport.nixl._descs import address_of

    cls = get_transport("nixl")
    owner_buf, mine = bytearray(range(256)) * 256, bytearray(1 << 16)
    owner, me = cls(2, Regions(owner_buf)), cls(1, Regions(bytearray(1)))
    try:
        owner.register_memory(address_of(memoryview(owner_buf)), len(owner_buf))
        me.register_memory(address_of(memoryview(mine)), len(mine))
        link = await me.connect(*await owner.listen("127.0.0.1", 0), timeout=5)
        await link.read(b"40000", [memoryview(mine)[:40000]], timeout=5)
        assert mine[:40000] == owner_buf[:40000]
        assert me.moved == 1  # type: ignore[attr-defined]
        other = bytearray(40000)  # not registered: the TCP path, same bytes
        await link.read(b"40000", [memoryview(other)], timeout=5)
        assert other == owner_buf[:40000] and me.moved == 1  # type: ignore[attr-defined]
        mine[:1000] = b"\x01" * 1000
        await link.write(b"1000", [memoryview(mine)[:1000]], timeout=5)
        assert owner_buf[:1000] == b"\x01" * 1000 and me.moved == 2  # type: ignore[attr-defined]
        # deregistered on the owner: served over TCP from then on
        owner.deregister_memory(address_of(memoryview(owner_buf)), len(owner_buf))
        await link.read(b"500", [memoryview(mine)[:500]], timeout=5)
        assert mine[:500] == owner_buf[:500] and me.moved == 2  # type: ignore[attr-defined]
    finally:
        await me.aclose()
        await owner.aclose()
    assert me.xfers == 0 and owner.agent is None  # type: ignore[attr-defined]


class Revocable(Regions):
    """:class:`Regions` that keeps the grants it gives, to revoke them."""

    def __init__(self, buf: bytearray) -> None:
        super().__init__(buf)
        self.grants: list[Grant] = []

    async def grant_read(self, peer: PeerInfo, meta: bytes) -> Grant:
        grant = await super().grant_read(peer, meta)
        self.grants.append(grant)
        return grant

    async def grant_write(self, peer: PeerInfo, meta: bytes, nbytes: int) -> Grant:
        grant = await super().grant_write(peer, meta, nbytes)
        self.grants.append(grant)
        return grant


@needs_nixl
@pytest.mark.parametrize("write", [False, True], ids=["read", "write"])
@pytest.mark.parametrize("late", [False, True], ids=["check-races", "check-after"])
async def test_a_transfer_revoked_as_it_completes_fails(
    monkeypatch: pytest.MonkeyPatch, write: bool, late: bool
) -> None:
    """The owner revokes its grant (and reuses the memory) after the requester's NIXL
    READ or WRITE completed but before it heard the requester's check: a read must not
    report success (its bytes may be torn), nor a write (the owner did not take it);
    both fail with the revocation's code, whether the check crosses the revocation on
    the wire or leaves after it arrived (``late``), and the link goes on."""
    from aiokv.transport.nixl._descs import address_of
    from aiokv.transport.nixl._plane import NixlPlane

    cls = get_transport("nixl")
    owner_buf, mine = bytearray(b"\x11") * 4096, bytearray(b"\x33") * 4096
    handler = Revocable(owner_buf)
    owner, me = cls(2, handler), cls(1, Regions(bytearray(1)))
    run = NixlPlane._run

    async def revoked_as_it_completes(plane: NixlPlane, *args: Any) -> str:
        state = await run(plane, *args)
        if state == "DONE":  # every byte moved; the owner has not heard of it yet
            handler.grants[-1].abort(Code.LLM_TIMEOUT)
            owner_buf[:] = b"\x5a" * len(owner_buf)  # the owner's memory again
            if late:
                await asyncio.sleep(0.05)  # the revocation reaches us first
        return state

    monkeypatch.setattr(NixlPlane, "_run", revoked_as_it_completes)
    try:
        owner.register_memory(address_of(memoryview(owner_buf)), len(owner_buf))
        me.register_memory(address_of(memoryview(mine)), len(mine))
        link = await me.connect(*await owner.listen("127.0.0.1", 0), timeout=5)
        move = link.write if write else link.read
        with pytest.raises(LLMException) as info:
            await move(b"4096", [memoryview(mine)], timeout=5)
        assert info.value.status_code == Code.LLM_TIMEOUT
        assert handler.done == [False]
        monkeypatch.undo()  # the link stays usable
        mine[:] = b"\x44" * len(mine)
        await move(b"4096", [memoryview(mine)], timeout=5)
        assert mine == owner_buf
        await until(lambda: handler.done == [False, True])  # a read's on our READ_DONE
        assert me.moved == 2  # type: ignore[attr-defined]  # both over NIXL
    finally:
        await me.aclose()
        await owner.aclose()


class _Op:
    """A stand-in for a served request: only its state is read."""

    def __init__(self) -> None:
        from aiokv.transport.tcp._ops import State

        self.state = State.GRANTING


@contextlib.asynccontextmanager
async def _polled_owner(
    monkeypatch: pytest.MonkeyPatch, shortest: float, longest: float
) -> AsyncIterator[tuple[Any, list[str]]]:
    """A listening NIXL owner whose progress poll backs off from ``shortest`` to
    ``longest`` seconds, and the list each poll adds its thread's name to; closed after
    the block."""
    import aiokv.transport.nixl._transport as nt

    monkeypatch.setattr(nt, "POLL_MIN_S", shortest)
    monkeypatch.setattr(nt, "POLL_MAX_S", longest)
    owner: Any = get_transport("nixl")(2, Regions(bytearray(1)))
    try:
        await owner.listen("127.0.0.1", 0)
        await until(lambda: owner.agent is not None)
        polls: list[str] = []
        real = owner.agent.notifs

        def counted() -> dict[str, list[bytes]]:
            polls.append(threading.current_thread().name)
            got: dict[str, list[bytes]] = real()
            return got

        monkeypatch.setattr(owner.agent, "notifs", counted)
        yield owner, polls
    finally:
        await owner.aclose()


@needs_nixl
async def test_memory_lent_with_nothing_served_is_polled_at_the_longest_back_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Memory lent for one-sided transfers keeps the owner progressing UCX; with no grant
    served the back-off stays at its longest from one window of the poll to the next,
    instead of starting again from the shortest each window (which cost an idle owner
    12.6% of a core while it lent a lease, measured)."""
    import aiokv.transport.nixl._transport as nt

    monkeypatch.setattr(nt, "_LEND_WATCH_S", 0.01)
    async with _polled_owner(monkeypatch, 0.001, 0.02) as (owner, polls):
        release = owner.lend()
        await asyncio.sleep(0.6)
        release()
        await until(lambda: owner._pump_task is None, seconds=5)
    # from the first poll: 1, 2, 4, 8 ms, then 20 ms apart (and once more as each 10 ms
    # window opens): ~60 in 0.6 s; restarting the back-off every window gives ~200
    assert 10 <= len(polls) <= 100, len(polls)


@needs_nixl
async def test_a_new_grant_wakes_the_progress_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner progresses UCX (a poll of NIXL notifications) with a back-off while it
    serves grants; a grant served while that poll sleeps has it poll again at once. Here
    every sleep of the poll is a minute: only the wake can make a second poll."""
    from aiokv.transport.tcp._ops import State

    async with _polled_owner(monkeypatch, 60.0, 60.0) as (owner, polls):
        first, second = _Op(), _Op()
        owner.serve(first)  # the first grant starts the poll
        await until(lambda: len(polls) >= 1)
        # a first poll longer than the poll's window (_WATCH_S) starts a second window
        # at once, which then sleeps: let it fall asleep
        await asyncio.sleep(0.1)
        asleep = len(polls)
        await asyncio.sleep(0.05)
        assert len(polls) == asleep  # asleep, for a minute
        owner.serve(second)  # a second grant while it sleeps
        await until(lambda: len(polls) > asleep, seconds=5)
        # polled from the transport's wait threads, whose sleeps last as long as asked
        assert all(name.startswith("aiokv-nixl-wait") for name in polls)
        first.state = second.state = State.OVER
    assert owner._pump_task is None  # the close ended the poll: its thread woke, returned


class _Link:
    """A link stand-in for a plane that moves nothing over it."""

    broken = False


class _SlowXfer:
    """A NIXL agent stand-in whose transfers stay in progress for ``polls`` polls."""

    def __init__(self, polls: int) -> None:
        self.left = polls
        self.threads: list[str] = []

    def post(self, xfer: object) -> str:
        return "PROC"

    def state(self, xfer: object) -> str:
        self.threads.append(threading.current_thread().name)
        self.left -= 1
        return "PROC" if self.left > 0 else "DONE"


@needs_nixl
async def test_a_small_transfer_left_in_flight_is_not_waited_for_in_loop_sleeps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A transfer under 1 MiB that its post leaves in flight is polled a few times on the
    loop, then from a wait thread: a loop's sleeps last at least ~1 ms, which every such
    transfer waited for (a 4 KiB pull by request: ~1 ms of ~3). Here the loop's sleeps
    would be a minute each."""
    import aiokv.transport.nixl._plane as plane_module
    from aiokv.transport.nixl._plane import NixlPlane

    monkeypatch.setattr(plane_module, "POLL_MAX_S", 1e-3)
    real_sleep = asyncio.sleep

    async def minute_sleeps(delay: float) -> None:
        await real_sleep(0 if delay == 0 else 60)

    monkeypatch.setattr(plane_module.asyncio, "sleep", minute_sleeps)
    transport: Any = get_transport("nixl")(1, Regions(bytearray(1)))
    try:
        plane = NixlPlane(transport)
        plane.bind(_Link())  # type: ignore[arg-type]
        agent = _SlowXfer(polls=10)
        state = await asyncio.wait_for(plane._run(agent, object(), 4096, lambda: False), 10)
        assert state == "DONE"
        assert agent.threads[0] == threading.current_thread().name  # first on the loop
        assert agent.threads[-1].startswith("aiokv-nixl-wait")  # then from a wait thread
    finally:
        await transport.aclose()
