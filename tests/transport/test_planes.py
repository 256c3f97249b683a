"""Data planes: a TCP link moves granted payload by the plane its transport hands it
where both ends have that plane, else as DATA frames; a new medium is one plane (here
the tests' ``memmove`` plane, also run through the whole contract suite as
``tcp+memmove``)."""

from __future__ import annotations

import pytest
from fake_handler import FakeHandler
from memmove_plane import MemmoveTransport
from spans import js

from aiokv.transport import BY_ADDRESS
from aiokv.transport import ONE_SIDED
from aiokv.transport import Transport
from aiokv.transport.tcp import TcpTransport

HOST = "127.0.0.1"
SIZE = 3 << 20  # three of the plane's chunks


async def _round_trip(a: Transport, b: Transport) -> None:
    """Pull from ``b`` and push to it over a link ``a`` opened; exact bytes both ways."""
    hb = FakeHandler()
    b.handler = hb
    try:
        link = await a.connect(*(await b.listen(HOST, 0)), timeout=5)
        hb.regions["r"] = bytearray(range(256)) * (SIZE // 256)
        mine = bytearray(SIZE)
        await link.read(js({"spans": [[0, SIZE]], "tag": "pull"}), [memoryview(mine)], timeout=10)
        assert mine == hb.regions["r"]
        src = bytearray(b"\x5a") * SIZE
        await link.write(js({"spans": [[0, SIZE]], "tag": "push"}), [memoryview(src)], timeout=10)
        assert hb.regions["r"] == src
        assert hb.calls == {"pull": [True], "push": [True]}
        assert link.extra(BY_ADDRESS) is None and link.extra(ONE_SIDED) is None
        assert not link.one_sided and not link.addressable("cpu", 0, 1)
    finally:
        await a.aclose()
        await b.aclose()


async def test_two_ends_with_the_plane_move_by_it() -> None:
    a, b = MemmoveTransport(1, FakeHandler()), MemmoveTransport(2, FakeHandler())
    await _round_trip(a, b)
    assert a.moved == 2  # the requester's plane moved the pull and the push
    assert b.moved == 0


@pytest.mark.parametrize("planed", ["requester", "granter"])
async def test_a_peer_without_the_plane_talks_data(planed: str) -> None:
    """A plain TCP end ignores the other's plane greeting and never offers or grants by
    a plane: both directions move as DATA, with the same results."""
    with_plane = MemmoveTransport(1 if planed == "requester" else 2, FakeHandler())
    plain = TcpTransport(2 if planed == "requester" else 1, FakeHandler())
    a, b = (with_plane, plain) if planed == "requester" else (plain, with_plane)
    await _round_trip(a, b)
    assert with_plane.moved == 0
