"""``aiokv bench transfer --listen`` under connections that never send a request: idle
raw streams cannot starve the control path, announcing big rounds commits no memory,
and silent connections are closed (the listener runs in this process, on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import socket
import time
from collections.abc import AsyncIterator
from collections.abc import Callable
from typing import TypeVar

import pytest
from _helpers import free_port

from aiokv import CacheDesc
from aiokv import DataType
from aiokv._bench import remote

pytestmark = pytest.mark.timeout(120)
T = TypeVar("T")
DESC = CacheDesc(1, [4, 256], DataType.DT_UINT8)


@contextlib.asynccontextmanager
async def listener(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[int]:
    """``serve_peer`` on a free loopback port with a 16 MiB pool; its port."""
    monkeypatch.setattr(remote, "POOL_BYTES", 16 << 20)
    port = free_port()
    task = asyncio.create_task(remote.serve_peer("127.0.0.1", port, announce=False))
    deadline = time.monotonic() + 60
    while True:  # wait until it accepts (it builds a participant first)
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if task.done() or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)
    try:
        yield port
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


# The driver runs on threads of its own: the test must not depend on the default executor
_DRIVER = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="test-driver")


async def off_loop(fn: Callable[[], T]) -> T:
    return await asyncio.get_running_loop().run_in_executor(_DRIVER, fn)


def _raw(port: int, announced: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"r" + announced.to_bytes(8, "little"))
    return sock


def _drive(port: int) -> str:
    peer = remote.RemotePeer("127.0.0.1", port, timeout=10)
    try:
        peer._sock.settimeout(20)  # an answer within 20 s, or the test fails
        peer._call(("cache", DESC))
        return str(peer._call(("digest", [0, 3])))
    finally:
        peer.stop()


def _rss() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def test_idle_raw_streams_do_not_starve_the_control_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with listener(monkeypatch) as port:
        idle = [await off_loop(lambda: _raw(port, 1 << 20)) for _ in range(40)]
        try:
            t0 = time.monotonic()
            assert len(await asyncio.wait_for(off_loop(lambda: _drive(port)), 30)) > 0
            assert time.monotonic() - t0 < 20
            # only MAX_RAW_STREAMS of them are served: the others were closed
            await asyncio.sleep(0.2)
            closed = 0
            for s in idle:
                s.settimeout(0.01)
                with contextlib.suppress(TimeoutError):
                    closed += s.recv(1) == b""
            assert closed == len(idle) - remote.MAX_RAW_STREAMS
        finally:
            for s in idle:
                s.close()


async def test_announcing_big_rounds_commits_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    async with listener(monkeypatch) as port:
        before = _rss()
        idle = [await off_loop(lambda: _raw(port, 64 << 20)) for _ in range(4)]
        try:
            await asyncio.sleep(1.0)  # the old listener allocated 64 MiB per stream here
            assert _rss() - before < 32 << 20
            # a real round is still served, in pieces of the shared buffer
            monkeypatch.setattr(remote, "RAW_CHUNK_BYTES", 4096)
            idle[0].sendall(b"g" + (10_000).to_bytes(8, "little"))
            got = bytearray()
            while len(got) < 10_000:
                chunk = await off_loop(lambda: idle[0].recv(65536))
                assert chunk
                got += chunk
            assert got == b"\xa5" * 10_000
        finally:
            for s in idle:
                s.close()


async def test_silent_connections_are_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote, "GREETING_TIMEOUT_S", 0.5)
    monkeypatch.setattr(remote, "RAW_IDLE_S", 0.5)
    monkeypatch.setattr(remote, "CONTROL_IDLE_S", 0.5)

    def closed_within(sock: socket.socket, seconds: float) -> bool:
        sock.settimeout(seconds)
        try:
            while sock.recv(65536):
                pass  # a control connection's greeting
            return True
        except TimeoutError:
            return False

    async with listener(monkeypatch) as port:
        mute = await off_loop(lambda: socket.create_connection(("127.0.0.1", port), timeout=5))
        raw = await off_loop(lambda: _raw(port, 1 << 20))
        control = await off_loop(lambda: socket.create_connection(("127.0.0.1", port)))
        control.sendall(b"c")
        with mute, raw, control:
            for sock in (mute, raw, control):
                assert await off_loop(lambda s=sock: closed_within(s, 10))  # type: ignore[misc]
        # the idle driver's slot is free again: an honest driver gets in
        assert len(await off_loop(lambda: _drive(port))) > 0
