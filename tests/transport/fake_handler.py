"""A fake cache layer for the transport tests: named bytearrays served by grants, every
``Grant.done`` call recorded."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from aiokv._enums import LLMStatusCode as Code
from aiokv._errors import LLMException
from aiokv.transport import Grant
from aiokv.transport import PeerInfo


@dataclass
class FakeHandler:
    """A cache layer over named bytearrays.

    meta: ``{"region": name, "spans": [[offset, length], ...], "tag": t}`` grants those
    spans; ``{"refuse": code}`` refuses (with a ``done`` when tagged), ``{"raise": code}``
    raises ``LLMException(code)``, ``{"crash": true}`` raises a foreign error,
    ``{"hang": true}`` never answers, ``{"stubborn": s}`` ignores cancellation, then grants
    after ``s`` seconds, ``{"bad": kind}`` answers with a broken grant.

    With ``now``, it answers what needs no waiting (all but ``hang`` and ``stubborn``)
    from ``grant_now`` (an ``ImmediateHandler``: a TCP link serves those in its reader).
    """

    regions: dict[str, bytearray] = field(default_factory=dict)
    calls: dict[Any, list[bool]] = field(default_factory=dict)  # tag -> done(ok) calls
    first: dict[Any, asyncio.Future[bool]] = field(default_factory=dict)  # tag -> first call
    peers: list[PeerInfo] = field(default_factory=list)
    grants: int = 0
    hanging: asyncio.Event = field(default_factory=asyncio.Event)
    hung_cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    granted: dict[Any, Grant] = field(default_factory=dict)  # tag -> the Grant handed out
    now: bool = False  # answer from grant_now what needs no waiting

    def _done(self, tag: Any) -> Callable[[bool], None]:
        fut = self.first.setdefault(tag, asyncio.get_running_loop().create_future())
        calls = self.calls.setdefault(tag, [])

        def done(ok: bool) -> None:
            calls.append(ok)
            if not fut.done():
                fut.set_result(ok)

        return done

    async def _grant(self, peer: PeerInfo, raw: bytes) -> Any:
        self.grants += 1
        self.peers.append(peer)
        meta = json.loads(raw)
        if meta.get("hang"):
            self.hanging.set()
            try:
                await asyncio.Event().wait()
            finally:
                self.hung_cancelled.set()
        if "stubborn" in meta:
            self.hanging.set()
            end = time.monotonic() + meta["stubborn"]
            while (left := end - time.monotonic()) > 0:
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(left)
        return self._answer(meta)

    def grant_now(
        self, peer: PeerInfo, raw: bytes, nbytes: int, *, write: bool, direct: object
    ) -> Any:
        meta = json.loads(raw)
        if not self.now or meta.get("hang") or "stubborn" in meta:
            return None
        self.grants += 1
        self.peers.append(peer)
        return self._answer(meta)

    def _answer(self, meta: dict[str, Any]) -> Any:
        tag = meta.get("tag", object())
        if "refuse" in meta:
            return Grant(Code(meta["refuse"]), [], self._done(tag) if "tag" in meta else None)
        if "raise" in meta:
            raise LLMException("refused by test", status_code=Code(meta["raise"]))
        if meta.get("crash"):
            raise KeyError("a bug in the cache layer")
        if "bad" in meta:
            return {
                "not-a-grant": "not a grant",
                "unknown-status": Grant(0xDEAD),  # type: ignore[arg-type]
                "not-a-buffer": Grant(Code.LLM_SUCCESS, [object()]),  # type: ignore[list-item]
                "read-only": Grant(Code.LLM_SUCCESS, [memoryview(b"read-only")]),
            }[meta["bad"]]
        buf = memoryview(self.regions[meta.get("region", "r")])
        views = [buf[off : off + n] for off, n in meta.get("spans", [])]
        grant = Grant(Code.LLM_SUCCESS, views, self._done(tag))
        self.granted[tag] = grant
        if "abort_first" in meta:  # revoked before the transport even answered
            grant.abort(Code(meta["abort_first"]))
        return grant

    async def grant_read(self, peer: PeerInfo, meta: bytes) -> Any:
        return await self._grant(peer, meta)

    async def grant_write(self, peer: PeerInfo, meta: bytes, nbytes: int) -> Any:
        return await self._grant(peer, meta)

    async def done(self, tag: Any) -> bool:
        """How the grant ``tag`` ends (its first ``done`` call), waiting up to 5 s."""
        fut = self.first.setdefault(tag, asyncio.get_running_loop().create_future())
        return await asyncio.wait_for(asyncio.shield(fut), 5)

    async def ended_as(self, tag: Any, op: str, task: asyncio.Task[Any]) -> bool:
        """How the granted ``op`` ("read" or "write") ``tag``, whose caller's ``task`` was
        cancelled or not, ended here (:meth:`done`), checked against how it ended there."""
        ok = await self.done(tag)
        if op == "read":  # a pull counts as done exactly when read() returned
            assert ok is (not task.cancelled())
        else:  # a push may land just before its confirmation is awaited
            assert ok or task.cancelled()
        return ok
