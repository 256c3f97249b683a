"""``aiokv bench transfer`` across two hosts: ``--listen`` serves, ``--connect`` drives.

The listening side (:func:`serve_peer`) is the prompt peer of the loopback benchmark
run in this process, with a control port in front of it: on ``HOST:PORT`` it accepts

* a control connection (first byte ``c``): JSON lines. The listener greets with
  ``{"data_port": P}``, the port of its aiokv participant (on the same host, ``HOST:0``
  unless ``--data-port`` says otherwise); each request ``[op, *args]`` (``cache``,
  ``clear``, ``digest``: :class:`~._harness.PromptPeer`'s methods) gets one reply,
  ``{"ok": value}`` or ``{"error": why}``. One control connection at a time; its cache
  is freed when it closes.
* a raw stream (first byte ``r``, then 8 bytes little-endian: the largest round): the
  baseline's sender, as :class:`~.raw.RawStream`'s child — every 9-byte request
  (``g`` + 8-byte size) is answered with that many bytes.

The driving side (:class:`RemotePeer`, :class:`RemoteRawStream`) plugs these into the
same benchmark in place of the spawned processes. The control port has no
authentication and the participant's pool is readable and writable by any peer: listen
on a trusted network only; the listener holds random bytes only, at most ``POOL_BYTES``
of them, and checks every request's sizes.

What a connection that never sends a request costs the listener is bounded: it must say
what it is within :data:`GREETING_TIMEOUT_S`; a control connection silent for
:data:`CONTROL_IDLE_S` and a raw stream silent for :data:`RAW_IDLE_S` are closed. Raw
streams are served by threads of their own pool (:data:`MAX_RAW_STREAMS` at once; one
more is closed at once), never the loop's default executor, so idle ones cannot starve
the control path. Every raw stream sends from one shared buffer of at most
:data:`RAW_CHUNK_BYTES`, allocated at the first real request: announcing a big round
commits nothing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import socket
import threading
from typing import Any
from typing import Final

from .. import BlocksCacheKey
from .. import Cache
from .. import CacheDesc
from .. import DataType
from .. import LLMDataDist
from .. import LLMRole
from .._errors import LLMException
from ._harness import PEER_ID
from ._harness import POOL_BYTES
from ._harness import PromptPeer
from ._harness import digest
from ._harness import participant_config
from ._harness import random_fill
from .raw import RawStream
from .raw import _filled

__all__ = ["RemotePeer", "RemoteRawStream", "parse_address", "serve_peer"]

#: The largest raw round a listener serves (bytes).
MAX_RAW_BYTES = 1 << 30
#: The longest control line a listener reads (bytes).
MAX_LINE = 1 << 20
#: Raw streams a listener serves at once (a driver uses one); one more is closed.
MAX_RAW_STREAMS: Final = 4
#: Seconds a new connection has to send its kind (and a raw stream its round size).
GREETING_TIMEOUT_S = 10.0
#: Seconds a raw stream may wait for its next request (or a send may stall).
RAW_IDLE_S = 120.0
#: Seconds a control connection may stay silent before it is closed (its cache freed).
CONTROL_IDLE_S = 600.0
#: The shared buffer raw rounds are sent from, in pieces (bytes, at most).
RAW_CHUNK_BYTES: Final = 64 << 20


def parse_address(text: str) -> tuple[str, int]:
    """``"HOST:PORT"`` (``"[v6]:PORT"`` too) as ``(host, port)``.

    Raises:
        ValueError: not ``HOST:PORT`` with a port in ``[0, 65535]``.
    """
    host, sep, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def _encode_desc(desc: CacheDesc) -> dict[str, Any]:
    return {
        "num_tensors": desc.num_tensors,
        "shape": list(desc.shape),
        "data_type": desc.data_type.name,
    }


def _decode_desc(raw: Any) -> CacheDesc:
    if not isinstance(raw, dict) or set(raw) != {"num_tensors", "shape", "data_type"}:
        raise ValueError(f"bad cache description {raw!r}")
    return CacheDesc(raw["num_tensors"], raw["shape"], DataType[raw["data_type"]])


# ------------------------------------------------------------------------ listening side


class _Session:
    """One control connection's state: the cache it asked for."""

    def __init__(self, dd: LLMDataDist) -> None:
        self._dd = dd
        self.cache: Cache | None = None

    async def free(self) -> None:
        if self.cache is not None:
            await self._dd.cache_manager.deallocate_blocks_cache(self.cache)
            self.cache = None

    def _held(self) -> Cache:
        if self.cache is None:
            raise ValueError("no cache: send 'cache' first")
        return self.cache

    async def handle(self, op: Any, args: list[Any]) -> Any:
        if op == "cache" and len(args) == 1:
            desc = _decode_desc(args[0])
            await self.free()
            self.cache = await self._dd.cache_manager.allocate_blocks_cache(
                desc, BlocksCacheKey(PEER_ID, 0)
            )
            await asyncio.to_thread(random_fill, self.cache)
            return self.cache.tensor_addrs
        if op == "clear" and not args:
            held = self._held()
            await asyncio.to_thread(lambda: [t.zero_() for t in held.tensors])
            return None
        if op == "digest" and len(args) == 1:
            blocks, held = args[0], self._held()
            if not isinstance(blocks, list) or not all(
                isinstance(b, int) and 0 <= b < held.num_blocks for b in blocks
            ):
                raise ValueError("digest: blocks must be block indices of the cache")
            return await asyncio.to_thread(digest, held, blocks)
        raise ValueError(f"unknown request {op!r} with {len(args)} arguments")


class _Payload:
    """The bytes every raw stream of one listener sends: one buffer, shared by all,
    allocated at the first request and grown (up to :data:`RAW_CHUNK_BYTES`) only as
    requests ask for more (any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buf = memoryview(b"")

    @property
    def committed(self) -> int:
        """Bytes allocated now."""
        return len(self._buf)

    def view(self, nbytes: int) -> memoryview:
        """At least ``min(nbytes, RAW_CHUNK_BYTES)`` bytes of payload."""
        want = min(nbytes, RAW_CHUNK_BYTES)
        with self._lock:
            if len(self._buf) < want:
                self._buf = memoryview(_filled(want, 0xA5))
            return self._buf


def _serve_raw(sock: socket.socket, max_bytes: int, payload: _Payload) -> None:
    """In a thread: answer raw-stream requests on ``sock`` until it closes, sends a bad
    request, or stays silent (or stalls a send) for :data:`RAW_IDLE_S`."""
    request = bytearray(9)
    with sock:
        sock.settimeout(RAW_IDLE_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with contextlib.suppress(OSError):  # TimeoutError included
            while sock.recv_into(request, 9, socket.MSG_WAITALL) == 9:
                n = int.from_bytes(request[1:], "little")
                if request[0] != ord("g") or n > max_bytes:
                    return
                buf = payload.view(n)
                for off in range(0, n, len(buf) or 1):
                    sock.sendall(buf[: min(len(buf), n - off)])


async def _recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    got = b""
    while len(got) < n:
        chunk = await loop.sock_recv(sock, n - len(got))
        if not chunk:
            raise ConnectionError("closed during the greeting")
        got += chunk
    return got


async def serve_peer(
    host: str, port: int, *, data_port: int = 0, once: bool = False, announce: bool = True
) -> None:
    """Serve as the benchmark's prompt peer on ``host``: control and raw streams on
    ``port`` (0: any; the bound one is printed), the aiokv participant on ``data_port``.

    Runs until cancelled (Ctrl-C), or with ``once`` until the first control connection
    closes. With ``announce``, prints ``listening on HOST:PORT (data port P)`` on stdout.
    """
    loop = asyncio.get_running_loop()
    config = participant_config(POOL_BYTES, listen=f"{host}:{data_port}")
    busy = asyncio.Lock()
    finished = asyncio.Event()
    payload = _Payload()
    raw_slots = threading.BoundedSemaphore(MAX_RAW_STREAMS)  # released by the thread
    raw_pool = concurrent.futures.ThreadPoolExecutor(
        MAX_RAW_STREAMS, thread_name_prefix="aiokv-bench-raw"
    )

    def raw_stream(sock: socket.socket, size: int) -> None:
        try:
            _serve_raw(sock, size, payload)
        finally:
            raw_slots.release()

    async with LLMDataDist(LLMRole.PROMPT, PEER_ID, config) as dd:
        assert dd.listen_address is not None
        data = dd.listen_address[1]
        lsock = socket.create_server((host, port), family=_family(host))
        lsock.setblocking(False)
        tasks: set[asyncio.Task[None]] = set()

        async def control(sock: socket.socket) -> None:
            if busy.locked():
                sock.sendall(json.dumps({"error": "busy: one driver at a time"}).encode() + b"\n")
                return
            async with busy:
                reader, writer = await asyncio.open_connection(sock=sock, limit=MAX_LINE)
                session = _Session(dd)
                try:
                    writer.write(json.dumps({"data_port": data}).encode() + b"\n")
                    while line := await asyncio.wait_for(reader.readline(), CONTROL_IDLE_S):
                        try:
                            op, *args = json.loads(line)
                            reply = {"ok": await session.handle(op, args)}
                        except (LLMException, ValueError, TypeError, KeyError) as exc:
                            reply = {"error": f"{type(exc).__name__}: {exc}"}
                        writer.write(json.dumps(reply).encode() + b"\n")
                        await writer.drain()
                finally:
                    await session.free()
                    writer.close()
                    if once:
                        finished.set()

        async def connection(sock: socket.socket) -> None:
            try:
                async with asyncio.timeout(GREETING_TIMEOUT_S):
                    kind = await _recv_exactly(loop, sock, 1)
                    if kind == b"r":
                        size = int.from_bytes(await _recv_exactly(loop, sock, 8), "little")
                if kind == b"c":
                    await control(sock)
                elif kind == b"r" and 0 < size <= MAX_RAW_BYTES:
                    if not raw_slots.acquire(blocking=False):
                        return  # closed: MAX_RAW_STREAMS are being served
                    try:
                        fut = raw_pool.submit(raw_stream, sock, size)
                    except BaseException:
                        raw_slots.release()
                        raise
                    await asyncio.wrap_future(fut)
            except (ConnectionError, OSError, TimeoutError):
                pass
            finally:  # shutdown first: it wakes a raw sender's thread blocked in recv
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

        async def accept() -> None:
            while True:
                sock, _ = await loop.sock_accept(lsock)
                task = asyncio.create_task(connection(sock))
                tasks.add(task)
                task.add_done_callback(tasks.discard)

        with lsock:
            bound = lsock.getsockname()[1]
            if announce:
                print(f"listening on {host}:{bound} (data port {data})", flush=True)
            acceptor = asyncio.create_task(accept())
            try:
                await finished.wait()
            finally:
                acceptor.cancel()
                for task in list(tasks):
                    task.cancel()
                await asyncio.gather(acceptor, *tasks, return_exceptions=True)
                raw_pool.shutdown(wait=False)  # their sockets are shut: the threads end


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


# ------------------------------------------------------------------------- driving side


def _connect(host: str, port: int, timeout: float) -> socket.socket:
    """A connection to the listener at ``host:port``; if it cannot be made, an
    ``OSError`` that names the address and says to start the listener there first."""
    try:
        return socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        why = exc.strerror or str(exc) or type(exc).__name__
        raise ConnectionError(
            f"--connect {host}:{port}: {why[:1].lower()}{why[1:]}: start "
            "'aiokv bench transfer --listen HOST:PORT' on that host first"
        ) from exc


class RemotePeer(PromptPeer):
    """A :class:`~._harness.PromptPeer` served by ``aiokv bench transfer --listen`` on
    another host: the same requests over its control connection (blocking to start,
    as a spawned peer is: start it with :func:`~._harness.spawned`).

    Raises:
        OSError: the listener cannot be reached.
        RuntimeError: the listener refused (another driver is connected).
    """

    def __init__(self, host: str, port: int, timeout: float = 30) -> None:
        # no child process: Peer.__init__ is not called; request/stop are replaced
        self.host = host
        self._sock = _connect(host, port, timeout)
        self._sock.settimeout(None)
        self._sock.sendall(b"c")
        self._file = self._sock.makefile("rb")
        hello = self._read()
        self.port = int(hello["data_port"])

    def _read(self) -> dict[str, Any]:
        line = self._file.readline(MAX_LINE)
        if not line:
            raise ConnectionError("the listener closed the control connection")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"the listener refused: {reply['error']}")
        return reply

    def _call(self, message: tuple[Any, ...]) -> Any:
        name, *args = message
        if name == "cache":
            args = [_encode_desc(args[0])]
        self._sock.sendall(json.dumps([name, *args]).encode() + b"\n")
        return self._read()["ok"]

    async def request(self, *message: Any) -> Any:
        """Send one request and await its reply (off the loop)."""
        return await asyncio.to_thread(self._call, message)

    def stop(self) -> None:
        """Close the control connection: the listener frees this driver's cache."""
        with contextlib.suppress(OSError):
            self._file.close()
            self._sock.close()


class RemoteRawStream(RawStream):
    """A :class:`~.raw.RawStream` whose sender is the listener on ``host:port``."""

    def __init__(self, host: str, port: int, max_bytes: int) -> None:
        self._buf = memoryview(_filled(max_bytes, 0x5A))
        self._sock = _connect(host, port, 30)
        self._sock.settimeout(None)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.sendall(b"r" + max_bytes.to_bytes(8, "little"))

    def stop(self) -> None:
        """Close the stream."""
        self._sock.close()
