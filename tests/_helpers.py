"""Helpers of this test suite that a user of aiokv would not need (those live in
``aiokv.testing``): asserting an ``LLMException``'s code, waiting for what a peer does on
its own thread, a raw-socket peer that asks and never reads, a fresh interpreter run from
the repository root, a TLS-only TCP transport, a raw listener that serves one connection,
an operation cancelled after so many loop steps, a mixed load of pulls and pushes, caches
filled and compared row by row, a round trip of scattered blocks, a peer handler that
refuses everything."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import multiprocessing as mp
import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Coroutine
from collections.abc import Iterator
from collections.abc import Mapping
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from aiokv import BlocksCacheKey
from aiokv import Cache
from aiokv import CacheDesc
from aiokv import CacheKey
from aiokv import CacheManager
from aiokv import DataType
from aiokv import LLMConfig
from aiokv import LLMException
from aiokv import LLMStatusCode
from aiokv._bench._pki import make_pki
from aiokv.testing import make_config
from aiokv.transport import Grant
from aiokv.transport import PeerInfo
from aiokv.transport import _wire as wire
from aiokv.transport._tls import load_tls
from aiokv.transport._wire import FrameType
from aiokv.transport.tcp import TcpTransport

#: the repository root (this checkout)
ROOT = Path(__file__).resolve().parents[1]


async def raises(code: LLMStatusCode, coro: Awaitable[Any], *says: str) -> LLMException:
    """Await ``coro``; it must raise ``LLMException`` with ``code`` whose message contains
    each of ``says``; the exception is returned."""
    with pytest.raises(LLMException) as ei:
        await coro
    assert ei.value.status_code == code, ei.value
    for text in says:
        assert text in str(ei.value), str(ei.value)
    return ei.value


async def until(cond: Callable[[], bool], seconds: float = 5.0, step: float = 0.005) -> None:
    """Wait (at most ``seconds``) for ``cond()``: something the peer's side or an engine
    thread does on its own."""
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(step)


def raw_link(port: int, cluster_id: int = 7) -> socket.socket:
    """A blocking socket linked (the handshake by hand, no secret) as ``cluster_id`` to
    the listener on 127.0.0.1 ``port``, with a 4 KiB receive buffer: a peer that can ask
    for more than it will ever read."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(5)
    s.connect(("127.0.0.1", port))
    hello = {"cluster_id": cluster_id, "nonce": "00" * 32}
    s.sendall(wire.encode_frame(wire.FrameType.HELLO, meta=json.dumps(hello).encode()))
    recv_frame(s)
    s.sendall(wire.encode_frame(wire.FrameType.AUTH, meta=b'{"mac":null}'))
    assert recv_frame(s).status == LLMStatusCode.LLM_SUCCESS
    return s


def recv_frame(s: socket.socket) -> wire.Header:
    """The next frame's header from the blocking socket ``s`` (its meta read and dropped)."""
    raw = b""
    while len(raw) < wire.HEADER_SIZE:
        got = s.recv(wire.HEADER_SIZE - len(raw))
        assert got, "the connection ended"
        raw += got
    h = wire.decode_header(raw)
    left = h.meta_len
    while left:
        left -= len(s.recv(left))
    return h


def checkout_env(**extra: str) -> dict[str, str]:
    """This environment with this checkout first on ``PYTHONPATH`` (what was there stays
    after it: where the dependencies come from ``PYTHONPATH``, a child still finds them),
    plus ``extra``: the environment of a subprocess that runs this checkout."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def run_python(
    *args: str, timeout: float, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python *args`` in a fresh interpreter (this one's executable) from the repository
    root, its output captured as text, killed after ``timeout`` seconds; ``env`` defaults to
    this environment with this checkout on ``PYTHONPATH``. The exit status is not checked."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=dict(env) if env is not None else checkout_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def run_code(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``python -c code`` run as :func:`run_python` runs it; it must exit 0 (else the test
    fails with the end of its stderr). Returns the finished process, to read its output."""
    out = run_python("-c", code, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def not_listening(**overrides: Any) -> LLMConfig:
    """``make_config`` over TCP for a participant that neither listens nor accepts pushes
    (llm_datadist's defaults); ``overrides`` (``pool``, ``host_pool``, any ``LLMConfig``
    option) win."""
    options = {"listen_ip_info": None, "enable_remote_cache_accessible": False}
    return make_config("tcp", **(options | overrides))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (free when asked)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def logged_errors(caplog: pytest.LogCaptureFixture, logger: str) -> Callable[[], list[str]]:
    """Capture ERROR records of ``logger`` and its children from now on; returns a
    function that lists their messages so far."""
    caplog.set_level(logging.ERROR, logger=logger)

    def errors() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name.startswith(logger)]

    return errors


def hide_nixl(monkeypatch: pytest.MonkeyPatch) -> None:
    """For the rest of the test, importing NIXL fails (as where it is not installed) and
    aiokv's NIXL transport is imported afresh."""
    for name in [m for m in sys.modules if m.startswith("aiokv.transport.nixl")]:
        monkeypatch.delitem(sys.modules, name)
    for name in ("nixl_cu12", "nixl_cu12._api", "nixl", "nixl._api"):
        monkeypatch.setitem(sys.modules, name, None)  # None: "import fails"


@contextlib.contextmanager
def spawned(target: Callable[..., None], *args: Any) -> Iterator[tuple[Connection, Any]]:
    """A fresh process (``spawn``) running ``target(conn, *args)``; yields the parent's end
    of ``conn`` and the first thing the process sent (its port, say), which must come
    within 60 s. On exit the process is told ``"stop"``, joined for 10 s, then killed."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    try:
        assert parent.poll(60), "peer process did not start"
        yield parent, parent.recv()
    finally:
        with contextlib.suppress(OSError):
            parent.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def tls_tcp_transport(directory: Path) -> type[TcpTransport]:
    """A ``TcpTransport`` subclass with TLS on every link: throwaway certificates made
    under ``directory`` (by the ``openssl`` command; the test is skipped without it), the
    same certificate on both ends."""
    if shutil.which("openssl") is None:  # pragma: no cover - there wherever aiokv is tested
        pytest.skip("the openssl command makes the TLS certificates")
    files = make_pki(directory).leaves["a"]
    tls = load_tls(files.cert_file, files.key_file, files.ca_file, False)

    class TlsTcpTransport(TcpTransport):
        """TcpTransport with TLS on every link."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, tls=tls, **kwargs)

    return TlsTcpTransport


@contextlib.asynccontextmanager
async def serving_once(serve: Callable[[socket.socket], Awaitable[None]]) -> AsyncIterator[int]:
    """A raw TCP listener on 127.0.0.1 (port 0) that hands its first connection to
    ``serve`` (and closes it after); yields the port. On exit ``serve`` is cancelled (an
    error it raised is raised here) and the listener closed."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    loop = asyncio.get_running_loop()

    async def accept() -> None:
        conn, _ = await loop.sock_accept(listener)
        with conn:
            await serve(conn)

    task = asyncio.create_task(accept())
    try:
        yield listener.getsockname()[1]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        listener.close()


Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def fake_peer(serve: Serve) -> AsyncIterator[int]:
    """A raw-frame TCP peer on 127.0.0.1 (port 0; the port is yielded): each connection is
    handed to ``serve`` (a connection error or early EOF there ends it quietly), then closed;
    on exit every connection is cancelled, closed and awaited."""
    handlers: list[asyncio.Task[None]] = []

    async def run(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
                await serve(reader, writer)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    def spawn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handlers.append(asyncio.ensure_future(run(reader, writer)))

    server = await asyncio.start_server(spawn, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        await server.wait_closed()


async def fake_peer_hello(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """The accepting side of a link's handshake (as cluster 9, no secret) from raw frames,
    and the connecting side's greeting PING after it."""
    h = wire.decode_header(await reader.readexactly(wire.HEADER_SIZE))
    await reader.readexactly(h.meta_len)
    meta = wire.encode_meta({"cluster_id": 9, "nonce": secrets.token_hex(32), "mac": None}, 4096)
    writer.write(wire.encode_frame(FrameType.HELLO, meta=meta))
    h = wire.decode_header(await reader.readexactly(wire.HEADER_SIZE))
    await reader.readexactly(h.meta_len)
    writer.write(wire.encode_frame(FrameType.AUTH, status=0))
    # the connecting side greets with one PING as soon as it linked (its PONG is optional)
    h = wire.decode_header(await reader.readexactly(wire.HEADER_SIZE))
    assert h.type is FrameType.PING and not h.meta_len


@contextlib.asynccontextmanager
async def loop_turns() -> AsyncIterator[Callable[[], int]]:
    """Count the running loop's turns while the block runs (a task that adds one per
    turn): yields the count so far, to show the loop was not held."""
    turns = 0

    async def ticker() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    try:
        yield lambda: turns
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def cancel_after(
    coro: Coroutine[Any, Any, Any], steps: int, delay: float = 0.0
) -> asyncio.Task[Any]:
    """Run ``coro`` as a task, cancel it after ``steps`` loop steps (then ``delay``
    seconds, if positive) and wait until it has ended (cancelled, or done first);
    returns the task, to ask how it ended."""
    task = asyncio.create_task(coro)
    for _ in range(steps):
        await asyncio.sleep(0)
    if delay > 0:
        await asyncio.sleep(delay)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return task


async def mixed_block_ops(
    cm: CacheManager,
    key: BlocksCacheKey,
    back: Cache,
    mine: Cache,
    *,
    ops: int,
    in_flight: int,
    rng: random.Random,
    seconds: float,
) -> tuple[set[int], set[int]]:
    """``ops`` pulls (odd ``i``) and pushes (even ``i``) of 1-40 blocks drawn by ``rng``,
    ``in_flight`` at a time, all within ``seconds``: a pull reads blocks of 0..255 of the
    peer's cache ``key`` into the same blocks of ``back``, a push writes blocks of
    256..511 of ``mine`` into the same blocks of ``key``. Asserts that none failed;
    returns the block indices pulled and those pushed."""
    failures: list[LLMException] = []
    pulled: set[int] = set()
    pushed: set[int] = set()

    async def worker(w: int) -> None:
        for i in range(w, ops, in_flight):
            blocks = rng.sample(range(256), rng.randint(1, 40))
            try:
                if i % 2:
                    await cm.pull_blocks(key, back, blocks, blocks)
                    pulled.update(blocks)
                else:
                    hi = [256 + b for b in blocks]
                    await cm.push_blocks(key, mine, hi, hi)
                    pushed.update(hi)
            except LLMException as exc:
                failures.append(exc)

    async with asyncio.timeout(seconds), asyncio.TaskGroup() as group:
        for w in range(in_flight):
            group.create_task(worker(w))
    assert failures == [], f"{len(failures)} spurious failures: {failures[:3]}"
    return pulled, pushed


def fill_bytes(cache: Cache, seed: int) -> None:
    """Random bytes in every tensor of ``cache`` (any dtype, any device)."""
    rng = np.random.default_rng(seed)
    for t in cache.tensors:
        raw = np.frombuffer(rng.bytes(t.numel() * t.element_size()), dtype=np.uint8)
        t.view(torch.uint8).copy_(torch.from_numpy(raw.copy()).view(t.view(torch.uint8).shape))


def host(cache: Cache) -> list[torch.Tensor]:
    """A host copy of every tensor of ``cache``."""
    return [t.cpu() for t in cache.tensors]


async def same_rows(dst: Cache, drows: Any, src: Cache | list[torch.Tensor], srows: Any) -> None:
    """``dst[drows] == src[srows]`` byte for byte in every tensor (compared off the event
    loop)."""

    def check() -> None:
        ts_all = src if isinstance(src, list) else host(src)
        for td, ts in zip(host(dst), ts_all, strict=True):
            assert torch.equal(td.view(torch.uint8)[drows], ts.view(torch.uint8)[srows])

    await asyncio.to_thread(check)


async def pull_and_push_blocks(
    p_cm: CacheManager, d_cm: CacheManager, src: Cache, dst: Cache
) -> None:
    """A round trip of scattered blocks between two 96-block caches: ``d_cm`` pulls 80
    blocks of ``src`` (``BlocksCacheKey(1, 0)`` of ``p_cm``) into 80 others of ``dst``
    (``BlocksCacheKey(2, 0)``), leaving the rest of ``dst`` untouched; then ``p_cm`` pushes
    40 refilled blocks of ``src`` back into other blocks of ``dst``."""
    fill_bytes(src, 1)
    fill_bytes(dst, 2)
    rng = np.random.default_rng(0)
    srcs = rng.permutation(96)[:80].tolist()  # 80 scattered blocks: many parts
    dsts = rng.permutation(96)[:80].tolist()
    untouched = sorted(set(range(96)) - set(dsts))
    before = host(dst)
    await d_cm.pull_blocks(BlocksCacheKey(1, 0), dst, srcs, dsts)
    await same_rows(dst, dsts, src, srcs)
    await same_rows(dst, untouched, before, untouched)
    fill_bytes(src, 3)
    await p_cm.push_blocks(BlocksCacheKey(2, 0), src, srcs[:40], dsts[40:])
    await same_rows(dst, dsts[40:], src, srcs[:40])


async def pull_every_other_block(
    p_cm: CacheManager, d_cm: CacheManager, src_desc: CacheDesc, dst_desc: CacheDesc
) -> None:
    """``d_cm`` pulls the even blocks of a filled 96-block cache ``src_desc`` of ``p_cm``
    (``BlocksCacheKey(1, 0)``) into a new blocks cache ``dst_desc``, in reverse order; the
    pulled rows must match byte for byte."""
    src = await p_cm.allocate_blocks_cache(src_desc, BlocksCacheKey(1, 0))
    dst = await d_cm.allocate_blocks_cache(dst_desc)
    fill_bytes(src, 4)
    blocks = list(range(0, 96, 2))
    await d_cm.pull_blocks(BlocksCacheKey(1, 0), dst, blocks, blocks[::-1])
    await same_rows(dst, blocks[::-1], src, blocks)


async def pull_a_slot_by_key(p_cm: CacheManager, d_cm: CacheManager, dst_desc: CacheDesc) -> None:
    """``d_cm`` pulls, block by block in reverse order, a contiguous cache of ``p_cm`` (4
    fp16 tensors, one slot of 96 blocks of 8192 elements, ``CacheKey(1, req_id=7)``) into a
    new blocks cache ``dst_desc`` (96 such blocks): the rows must match byte for byte, and
    the key must be released with the last part (a second pull finds nothing)."""
    key = CacheKey(1, req_id=7)
    src = await p_cm.allocate_cache(CacheDesc(4, [1, 96 * 8192], DataType.DT_FLOAT16), [key])
    fill_bytes(src, 5)
    dst = await d_cm.allocate_blocks_cache(dst_desc)
    chunks = list(range(96))
    await d_cm.pull_blocks(key, dst, chunks, chunks[::-1])
    await same_rows(dst, chunks[::-1], [t.view(96, 8192) for t in host(src)], chunks)
    await raises(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, d_cm.pull_blocks(key, dst, [0], [0]))


class Refusing:
    """A transport ``RequestHandler`` that serves nothing: every read and write a peer
    asks for is refused with ``code`` (the requesting end of a raw link, a fuzzer)."""

    def __init__(self, code: LLMStatusCode = LLMStatusCode.LLM_FEATURE_NOT_ENABLED) -> None:
        self.code = code

    async def grant_read(self, peer: PeerInfo, meta: bytes) -> Grant:
        return Grant(self.code)

    async def grant_write(self, peer: PeerInfo, meta: bytes, nbytes: int) -> Grant:
        return Grant(self.code)


def fill_randn(cache: Cache, seed: int = 0) -> None:
    """Seeded normal random values in every tensor of ``cache`` (cast to its dtype)."""
    g = torch.Generator().manual_seed(seed)
    for t in cache.tensors:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))


def snapshot(*caches: Cache) -> list[torch.Tensor]:
    """A copy of every tensor of ``caches``, in order."""
    return [t.clone() for c in caches for t in c.tensors]


def held_at(
    monkeypatch: pytest.MonkeyPatch, owner: object, name: str, timeout: float = 30.0
) -> tuple[threading.Event, threading.Event]:
    """Replace the function ``owner.name`` with one that, called (on any thread), sets
    ``entered``, waits for ``go`` (at most ``timeout`` s), then runs the original:
    ``(entered, go)``, to hold a step of aiokv at a known point."""
    entered, go = threading.Event(), threading.Event()
    real = getattr(owner, name)

    def held(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        go.wait(timeout)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, held)
    return entered, go


async def slow_to_cancel(ran: list[str], started: threading.Event | None = None) -> None:
    """An operation that runs 30 s and takes 0.2 s to unwind once cancelled: ``ran``
    gets ``"started"``, then ``"ended"`` once it unwound; ``started`` is set as it
    starts (for a thread to wait on)."""
    ran.append("started")
    if started is not None:
        started.set()
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        await asyncio.sleep(0.2)  # unwinding takes a while
        ran.append("ended")
        raise
