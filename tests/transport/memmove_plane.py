"""``tcp+memmove``: the TCP transport with a data plane of the tests' own, which moves a
granted payload by address with ``memmove`` between two transports of one process.

It exists to show that a new medium is one plane run against the contract suite, with
no change to the link: the grant travels as an opaque ``PLANE_GRANT`` (a tag and the
granted memory as ``(address, length)`` rows), the requester's plane copies the bytes
itself, a chunk per loop step, and stops before the next chunk once either side's
operation is over (a revoked grant, a cancelled request, a link lost); a transfer moved
whole is left to the granter's confirmation (the link's ``PLANE_READ_CHECK`` /
``PLANE_WRITE_CHECK``): the granter's plane does nothing more.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
from collections.abc import Sequence
from typing import Any
from typing import TypeVar

import numpy as np

from aiokv.transport import Capability
from aiokv.transport import DeviceRuns
from aiokv.transport import Link
from aiokv.transport.tcp import TcpTransport
from aiokv.transport.tcp._ops import MyOp
from aiokv.transport.tcp._ops import PeerOp
from aiokv.transport.tcp._ops import State
from aiokv.transport.tcp._ops import Stream
from aiokv.transport.tcp._plane import DataPlane
from aiokv.transport.tcp._plane import PlaneHost

T = TypeVar("T")
#: bytes copied per loop step
CHUNK = 1 << 20
_TAGS = itertools.count(1)
# grants being served, by tag: process-wide (both ends live in this process)
_SERVED: dict[bytes, tuple[MemmovePlane, PeerOp]] = {}


def _rows(views: Sequence[memoryview]) -> np.ndarray:
    return np.array(
        [[np.frombuffer(v, np.uint8).ctypes.data, len(v)] for v in views], dtype=np.uint64
    ).reshape(-1, 2)


class MemmovePlane:
    name = "memmove"

    def __init__(self, transport: TcpTransport) -> None:
        self._t = transport
        self._link: PlaneHost | None = None
        self._peer_cap = 0  # 0: the peer has no memmove plane (yet)

    def bind(self, link: PlaneHost) -> None:
        self._link = link
        link._hello(b"")

    def hello(self, payload: bytes, cap: int) -> None:
        self._peer_cap = cap

    def closed(self) -> None:
        for tag in [t for t, (plane, _) in _SERVED.items() if plane is self]:
            del _SERVED[tag]

    def offer(self, views: Sequence[memoryview], total: int) -> Any:
        return _rows(views) if self._peer_cap else None

    def offer_device(self, dev: DeviceRuns) -> None:
        return None

    def direct(self, op: PeerOp) -> None:
        return None

    def answer(self, op: PeerOp, views: Sequence[memoryview], total: int) -> bytes | None:
        tag = next(_TAGS).to_bytes(8, "little")
        grant = tag + _rows(views).astype("<u8").tobytes()
        if len(grant) > min(self._peer_cap, self._t.max_meta_bytes):
            return None  # the peer could not read it: DATA
        _SERVED[tag] = (self, op)
        return grant

    def answer_device(self, op: PeerOp, dev: DeviceRuns) -> None:
        return None

    def accept(self, grant: bytes | bytearray, size: int) -> Any:
        if len(grant) < 8 or (len(grant) - 8) % 16:
            return None
        rows = np.frombuffer(grant, "<u8", offset=8).reshape(-1, 2).astype(np.uint64)
        if int(rows[:, 1].sum()) != size:
            return None
        return bytes(grant[:8]), rows

    async def move(self, op: MyOp, plan: Any) -> None:
        tag, far = op.remote
        served = _SERVED.get(tag)
        if served is None:
            return  # the grant is gone with the granter's link: ours ends the op
        _, peer_op = served
        local = [list(map(int, r)) for r in plan]
        remote = [list(map(int, r)) for r in far]
        i = j = step = 0
        while i < len(local):
            if op.result is not None or peer_op.state is State.OVER:
                return  # revoked, cancelled or lost: not one byte more
            n = min(local[i][1], remote[j][1], CHUNK - step)
            src, dst = (remote[j][0], local[i][0]) if op.is_read else (local[i][0], remote[j][0])
            ctypes.memmove(dst, src, n)
            for rows, k in ((local, i), (remote, j)):
                rows[k][0] += n
                rows[k][1] -= n
            i += not local[i][1]
            j += not remote[j][1]
            step += n
            if step >= CHUNK:
                step = 0
                await asyncio.sleep(0)
        _SERVED.pop(tag, None)
        self._t.moved += 1
        op.stream = Stream(op.rid, [], 0)  # moved whole: the granter's confirmation ends it
        op.stream.sent = True

    def extra(self, capability: Capability[T]) -> T | None:
        return None


class MemmoveTransport(TcpTransport):
    """A TCP transport whose links carry a :class:`MemmovePlane`; ``moved`` counts the
    transfers its planes moved."""

    moved = 0

    def _new_plane(self) -> DataPlane:
        return MemmovePlane(self)

    async def connect(self, host: str, port: int, *, timeout: float) -> Link:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        link = await super().connect(host, port, timeout=timeout)
        # the peer greets as the link comes up: once it answers a probe, its plane is known
        await link.probe(max(end - loop.time(), 0.001))
        return link
