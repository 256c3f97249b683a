"""Cluster linking: a cancelled ``link_clusters`` / ``unlink_clusters`` / ``unlink`` leaves
nothing half done, and a cluster named twice in one call is linked once.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import pytest
from _helpers import Refusing

from aiokv import LLMConfig
from aiokv import LLMException
from aiokv import LLMStatusCode
from aiokv._remote import LinkTable
from aiokv._remote._linker import Linker
from aiokv._stats import PeerCounters
from aiokv.testing import cluster_info as info
from aiokv.transport import Link
from aiokv.transport import PeerInfo
from aiokv.transport._local import LocalTransport


@dataclass
class _Link:
    """What the link table and the linker read of a link; ``aclose`` may be held."""

    peer: PeerInfo
    initiator: bool = False  # True: this side opened it (the fake transport's connect)
    broken: bool = False
    why_broken: str | None = None
    gate: asyncio.Event | None = None  # aclose breaks it, then waits for this
    closing: asyncio.Event = field(default_factory=asyncio.Event)

    async def aclose(self) -> None:
        self.broken = True
        self.why_broken = "closed locally"
        self.closing.set()
        if self.gate is not None:
            await self.gate.wait()


@dataclass
class _Transport:
    """Connects at once to a link of cluster 2, reported to ``on_link`` first (as a real
    transport does), then ``after_connect`` is called."""

    on_link: Callable[[Any], None]
    after_connect: Callable[[], None] = lambda: None
    made: list[_Link] = field(default_factory=list)

    async def connect(self, host: str, port: int, *, timeout: float) -> _Link:
        link = _Link(PeerInfo(2, (host, port)), initiator=True)
        self.made.append(link)
        self.on_link(link)
        self.after_connect()
        return link

    def links(self) -> list[_Link]:
        return [x for x in self.made if not x.broken]


async def test_a_cancelled_link_clusters_leaves_no_link() -> None:
    """docs/cancellation.md: "an operation that raises its cancellation did not happen".
    A ``link_clusters`` cancelled just after its link came up (its engine task cancelled
    while its task group collected the per-cluster results) raised the cancellation but
    left the link open, filed and counted as linked by this side: the caller, told it did
    not happen, never unlinks; the link stays up (``switch_role`` refuses with
    ``LLM_EXIST_LINK``, the peer lists it). The link it opened must be closed and
    unfiled before the cancellation is raised."""
    counters = PeerCounters()
    table = LinkTable(counters)
    transport = _Transport(table.add)
    linker = Linker(table, transport, LLMConfig())  # type: ignore[arg-type]
    task: asyncio.Task[Any] | None = None

    def cancel_soon() -> None:  # before the task group hears its child ended
        assert task is not None
        asyncio.get_running_loop().call_soon(task.cancel)

    transport.after_connect = cancel_soon
    task = asyncio.create_task(linker.link_all([info(2, ("127.0.0.1", 1))], 3000))
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(transport.made) == 1 and transport.made[0].broken  # closed
    assert table.clusters() == [] and not table.ours(2) and table.live(2) is None
    assert counters.links_up == counters.links_down == 1
    assert table.attempting() == []


async def test_a_cancelled_link_clusters_gives_back_the_peers_link() -> None:
    """Both sides linking each other: the peer's link arrived while this side's was being
    made, and this side's own replaced it. Cancelled then, the call did not happen: this
    side's link closes and the peer's link (still up) holds the cluster again, as
    before the call, counted up once."""
    counters = PeerCounters()
    table = LinkTable(counters)
    transport = _Transport(lambda link: None)
    theirs = _Link(PeerInfo(2, ("127.0.0.1", 50001)))
    linker = Linker(table, transport, LLMConfig())  # type: ignore[arg-type]
    task: asyncio.Task[Any] | None = None

    def peer_links_and_cancel_soon() -> None:
        assert task is not None
        transport.made.insert(0, theirs)
        table.add(theirs)  # type: ignore[arg-type]  # filed; ours replaces it
        asyncio.get_running_loop().call_soon(task.cancel)

    transport.after_connect = peer_links_and_cancel_soon
    task = asyncio.create_task(linker.link_all([info(2, ("127.0.0.1", 1))], 3000))
    with pytest.raises(asyncio.CancelledError):
        await task
    ours = transport.made[1]
    assert ours.broken and not theirs.broken
    assert table.live(2) is theirs  # type: ignore[comparison-overlap]
    assert not table.ours(2)
    assert counters.links_up - counters.links_down == 1


async def test_a_cancelled_unlink_closes_every_connection_of_the_cluster() -> None:
    """``unlink_clusters`` unfiles the cluster's link at once, then closes each of its
    connections (both sides linked each other: two). Cancelled while the first one
    closed, it stopped there: the cluster was no longer listed as linked, yet the other
    connection stayed open (the peer still linked, this side still serving it), and a
    ``switch_role`` then went ahead with a link up. Once begun, an unlink closes every
    connection of the cluster."""
    table = LinkTable(PeerCounters())
    transport = _Transport(table.add)
    gate = asyncio.Event()
    ours = _Link(PeerInfo(2, ("127.0.0.1", 40000)), gate=gate)
    theirs = _Link(PeerInfo(2, ("127.0.0.1", 50001)))
    transport.made += [ours, theirs]  # closed in this order
    table.add(theirs)  # type: ignore[arg-type]
    table.add(ours, ours=True)  # type: ignore[arg-type]
    linker = Linker(table, transport, LLMConfig())  # type: ignore[arg-type]
    task = asyncio.create_task(linker.unlink_all([info(2, ("127.0.0.1", 1))], 3000, True))
    await asyncio.wait_for(ours.closing.wait(), 5)  # the first one is closing
    assert not theirs.broken
    task.cancel()
    await asyncio.sleep(0)
    gate.set()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    assert ours.broken and theirs.broken
    assert transport.links() == [] and table.clusters() == []


@pytest.mark.parametrize("end", ["cancelled", "timed out"])
async def test_a_given_up_local_connect_leaves_no_link_at_the_listener(end: str) -> None:
    """``transfer_backend="local"`` between two ``LLMDataDist`` (each on its own engine
    loop): ``connect`` waits for the listener's loop to file its end. Cancelled then (a
    cancelled ``link_clusters``), the connecting end was dropped but the listener's end
    stayed filed and live forever: the listener listed the cluster as linked, and the
    connecting side's ``unlink_clusters`` could not close it (its transport never knew
    the link). Cancelled, ``connect`` must end the listener's end too. Cancelled or timed
    out, the listener's loop then logged an error ("Exception in callback ...
    InvalidStateError": its end was filed for a connect that had given up)."""
    sloop = asyncio.new_event_loop()
    errors: list[dict[str, Any]] = []
    sloop.set_exception_handler(lambda loop, context: errors.append(context))
    thread = threading.Thread(target=sloop.run_forever, daemon=True)
    thread.start()

    async def on_server(fn: Callable[[], Any]) -> Any:
        async def call() -> Any:
            result = fn()
            return await result if inspect.isawaitable(result) else result

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call(), sloop))

    server = LocalTransport(1, Refusing())
    client = LocalTransport(2, Refusing())
    try:
        host, port = await on_server(lambda: server.listen("127.0.0.1", 0))
        gate = threading.Event()
        sloop.call_soon_threadsafe(gate.wait, 10)  # the listener's loop is busy a while
        if end == "cancelled":
            connecting = asyncio.create_task(client.connect(host, port, timeout=10))
            for _ in range(5):
                await asyncio.sleep(0)  # waits for the listener to file its end
            assert not connecting.done()
            connecting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await connecting
        else:
            with pytest.raises(LLMException) as raised:
                await client.connect(host, port, timeout=0.05)
            assert raised.value.status_code == LLMStatusCode.LLM_TIMEOUT
        gate.set()
        links: list[Link] = []
        for _ in range(500):
            links = await on_server(server.links)
            if not links:
                break
            await asyncio.sleep(0.01)
        assert links == [] and client.links() == []
        await on_server(lambda: None)  # what the listener's loop had queued has run
        assert errors == []
    finally:
        await client.aclose()
        await on_server(server.aclose)
        sloop.call_soon_threadsafe(sloop.stop)
        thread.join(10)
        sloop.close()


async def test_a_cancelled_unlink_of_a_communicator_still_linking_forgets_it() -> None:
    """``unlink(comm_id)`` of a two-sided ``link`` still linking stops its linking task,
    then forgets it. Cancelled while the task ended, it raised the cancellation with the
    linking stopped but the communicator kept, ``PREPARING`` for ever: no task would
    ever make it ``OK`` or ``FAILED``, and ``switch_role`` refused with
    ``LLM_EXIST_LINK`` ("being linked") until ``unlink`` was called again. Once begun,
    the unlink completes."""
    from aiokv._enums import RegisterMemStatus
    from aiokv._remote._ranktable import Party

    table = LinkTable(PeerCounters())
    linker = Linker(table, _Transport(table.add), LLMConfig())  # type: ignore[arg-type]
    comm_id = linker.link([Party(2, 1, None)])  # waits for cluster 2 to link to us
    await asyncio.sleep(0)
    assert linker.status(comm_id) == RegisterMemStatus.PREPARING and linker.linking()
    unlinking = asyncio.create_task(linker.unlink(comm_id))
    await asyncio.sleep(0)  # it waits for the linking task to end
    unlinking.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(unlinking, 5)
    assert not linker.linking() and table.attempting() == []
    with pytest.raises(LLMException) as raised:
        linker.status(comm_id)  # forgotten
    assert raised.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    await linker.aclose()


async def test_a_cluster_named_twice_in_one_link_clusters_is_linked_once() -> None:
    """SPEC §1.6: "linking twice → ``LLM_ALREADY_LINK`` for that cluster"; docs/links.md:
    ``LLM_PROCESSING_LINK`` only "while another call ... is linking it". A cluster named
    twice in one call got ``LLM_PROCESSING_LINK`` for its second entry (it raced the
    first), so ``overall`` said the call was still linking although the cluster was
    linked and nothing else went wrong. The second entry is ``LLM_ALREADY_LINK``."""
    from aiokv import LLMDataDist
    from aiokv import LLMRole
    from aiokv.testing import make_config

    code = LLMStatusCode
    async with (
        LLMDataDist(LLMRole.PROMPT, 1, make_config("tcp", pool=1 << 20)) as p,
        LLMDataDist(LLMRole.DECODER, 2, make_config("tcp", pool=1 << 20)) as d,
    ):
        c = info(1, p.listen_address)
        assert await d.link_clusters([c, info(1, p.listen_address), c]) == (
            code.LLM_ALREADY_LINK,
            [code.LLM_SUCCESS, code.LLM_ALREADY_LINK, code.LLM_ALREADY_LINK],
        )
        assert d.linked_clusters() == [1] and len(d._transport.links()) == 1  # type: ignore[union-attr]
        wrong = info(9, p.listen_address)  # a failure is the same for every entry
        assert await d.link_clusters([wrong, wrong]) == (
            code.LLM_LINK_FAILED,
            [code.LLM_LINK_FAILED, code.LLM_LINK_FAILED],
        )
