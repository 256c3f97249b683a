"""The route table both halves of a remote transfer use (``aiokv._remote._route``), and
the requester deciding each part's route from the peer's grant (``RemoteClient.move``)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any
from typing import TypeVar
from typing import cast

import numpy as np
import pytest
import torch

from aiokv import CacheDesc
from aiokv import DataType
from aiokv import LLMConfig
from aiokv import LLMException
from aiokv import LLMStatusCode
from aiokv import Placement
from aiokv._cache import Cache
from aiokv._layout import ByteLayout
from aiokv._remote import LinkTable
from aiokv._remote import Move
from aiokv._remote import RemoteClient
from aiokv._remote import Transfer
from aiokv._remote import _client as client_mod
from aiokv._remote._protocol import BlocksReq
from aiokv._remote._protocol import KeyByBlocks
from aiokv._remote._protocol import Tensors
from aiokv._remote._protocol import decode
from aiokv._remote._route import Route
from aiokv._remote._route import part_route
from aiokv._remote._route import route
from aiokv.transport import BY_ADDRESS
from aiokv.transport import DIRECT_REFUSED
from aiokv.transport import Capability
from aiokv.transport import DeviceRuns
from aiokv.transport import Link
from aiokv.transport import PeerInfo

T = TypeVar("T")


def never_asked() -> bool:
    raise AssertionError("by_address must not be asked for host memory")


def test_host_memory_moves_as_views_without_asking_the_link() -> None:
    assert route(torch.device("cpu"), never_asked) is Route.HOST_VIEWS


@pytest.mark.parametrize("device", ["cuda:0", "meta"])
def test_accelerator_memory_moves_by_address_where_the_link_reaches_it(device: str) -> None:
    assert route(torch.device(device), lambda: True) is Route.BY_ADDRESS
    assert route(torch.device(device), lambda: False) is Route.STAGED


@pytest.mark.parametrize("way", list(Route))
def test_a_grant_by_address_the_link_cannot_reach_routes_the_parts_staged(way: Route) -> None:
    """The requester's part route: its transfer's route, but staged once the peer
    granted memory the link cannot reach by address (only a by-address route asks)."""
    unreachable = Route.STAGED if way is Route.BY_ADDRESS else way
    assert part_route(way, unreachable_grant=False) is way
    assert part_route(way, unreachable_grant=True) is unreachable


# ---- the requester, against a peer whose grants the link cannot reach by address ----------
class UnreachableGrants(Link):
    """A link that reaches this side's device memory by address, to a peer that grants
    memory it cannot reach so: a request by address comes back (a loop step later, as a
    grant does) refused as the transport refuses it (``DIRECT_REFUSED``, nothing moved);
    a request on host buffers moves. ``events``: each request asked and refused."""

    local_cluster_id = 2

    def __init__(self) -> None:
        self.peer = PeerInfo(1, ("127.0.0.1", 1))
        self.events: list[tuple[str, int, bool]] = []  # (what, bytes, release)

    @property
    def broken(self) -> bool:
        return False

    def extra(self, capability: Capability[T]) -> T | None:
        return cast("T", self) if capability is BY_ADDRESS else None

    def addressable(self, device: str, addr: int, nbytes: int) -> bool:
        return True

    async def read(
        self,
        meta: bytes,
        bufs: Sequence[memoryview] | DeviceRuns,
        *,
        timeout: float,
    ) -> None:
        """A read or a write alike: refused if by address, else moved."""
        req = decode(meta)
        release = bool(getattr(req, "release", False))
        if isinstance(bufs, DeviceRuns):
            self.events.append(("by address", int(bufs.total), release))
        else:
            self.events.append(("staged", sum(len(b) for b in bufs), release))
        await asyncio.sleep(0)  # the grant comes back later: other parts start meanwhile
        if isinstance(bufs, DeviceRuns):
            self.events.append(("refused", 0, release))
            raise LLMException(
                "granted memory this link cannot reach by address",
                status_code=LLMStatusCode.LLM_FAILED,
                context=DIRECT_REFUSED,
            )

    write = read

    async def aclose(self) -> None:
        return

    async def probe(self, timeout: float) -> bool:
        return True


class Box:
    def __init__(self, nbytes: int, lent: list[Box]) -> None:
        self.view = memoryview(bytearray(nbytes))
        self.lent = lent
        lent.append(self)

    def release(self) -> None:
        self.lent.remove(self)


class FakeStager:
    """Host staging without copies (the device memory here is ``meta``)."""

    def __init__(self) -> None:
        self.lent: list[Box] = []

    async def settle(self, device: torch.device) -> None:
        return

    async def gather(self, bufs: list[torch.Tensor], layout: ByteLayout, *_: Any) -> Box:
        return Box(layout.total(len(bufs)), self.lent)

    async def reserve(self, nbytes: int, *_: Any) -> Box:
        return Box(nbytes, self.lent)

    async def scatter(self, box: Box, bufs: list[torch.Tensor], layout: ByteLayout) -> None:
        return


@pytest.mark.parametrize("write", [False, True], ids=["pull", "push"])
async def test_parts_after_an_unreachable_grant_go_staged_on_their_first_try(
    write: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device transfer routed by address, in 8 parts, to a peer whose grants the link
    cannot reach by address: every part moves once, staged (the key's release with the
    last one only), and once the first refusal came back no part is asked by address —
    only those already in flight were."""
    monkeypatch.setattr(client_mod, "MAX_STAGED_BYTES", 512 << 10)  # 8 parts of 512 KiB
    desc = CacheDesc(4, [64, 8192], DataType.DT_FLOAT16, Placement.DEVICE)  # 16 KiB blocks
    tensors = [torch.empty(64, 8192, dtype=torch.float16, device="meta") for _ in range(4)]
    cache = Cache(desc, tensors, is_blocks_cache=True)
    blocks = np.arange(64, dtype=np.int64)
    req = BlocksReq(KeyByBlocks(1, 0), Tensors(4), blocks.tobytes(), 16384, release=not write)
    job = Transfer.of_blocks(req, range(4), blocks[::-1].copy(), blocks, 16384)
    link, stager = UnreachableGrants(), FakeStager()
    client = RemoteClient(LinkTable(), LLMConfig(), stager)  # type: ignore[arg-type]

    await client.move(Move("op", link, cache, job, write=write, about={}))

    staged = [e for e in link.events if e[0] == "staged"]
    assert len(staged) == 8 and sum(n for _, n, _ in staged) == job.nbytes
    assert [r for _, _, r in staged] == [False] * 7 + [not write]
    first_refusal = link.events.index(("refused", 0, False))
    assert all(what != "by address" for what, _, _ in link.events[first_refusal:])
    assert stager.lent == []
