"""The TCP link's answers to a peer: an ERROR frame's reason is kept, a handler's
failure is answered under the code a caller would see, and a refused certificate is
logged where an operator looks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import socket
from pathlib import Path

import pytest
from _helpers import raises
from _helpers import raw_link
from _helpers import recv_frame
from _helpers import until

from aiokv import LLMStatusCode
from aiokv._bench._pki import Pki
from aiokv._bench._pki import make_pki
from aiokv.transport import Grant
from aiokv.transport import PeerInfo
from aiokv.transport import TlsContexts
from aiokv.transport import _wire as wire
from aiokv.transport import load_tls
from aiokv.transport.tcp import TcpTransport

HOST = "127.0.0.1"
_F = wire.FrameType
Code = LLMStatusCode


class Refuse:
    """A handler that refuses everything (``LLM_KV_CACHE_NOT_EXIST``)."""

    async def grant_read(self, peer: PeerInfo, meta: bytes) -> Grant:
        return Grant(Code.LLM_KV_CACHE_NOT_EXIST)

    async def grant_write(self, peer: PeerInfo, meta: bytes, nbytes: int) -> Grant:
        return Grant(Code.LLM_KV_CACHE_NOT_EXIST)


class OutOfMemory:
    """A handler that runs out of host memory while deciding."""

    async def grant_read(self, peer: PeerInfo, meta: bytes) -> Grant:
        raise MemoryError

    async def grant_write(self, peer: PeerInfo, meta: bytes, nbytes: int) -> Grant:
        raise MemoryError


def _next_of(s: socket.socket, kinds: set[wire.FrameType]) -> wire.Header:
    """The next frame of one of ``kinds`` from the blocking socket ``s`` (others dropped)."""
    for _ in range(16):
        h = recv_frame(s)
        if h.type in kinds:
            return h
    raise AssertionError(f"no frame of {kinds}")


async def test_an_error_frame_after_the_handshake_keeps_the_peers_reason() -> None:
    """The wire's ``ERROR`` frame is "link-level failure, reason in meta {"reason": str};
    the link closes". A user whose link a peer closes with an error relies on the error
    naming the peer's reason; the reason was dropped and the request failed with only
    "link ... broke (closed by peer)", as for an orderly ``CLOSE``."""
    server = TcpTransport(2, Refuse())
    loop = asyncio.get_running_loop()
    try:
        port = (await server.listen(HOST, 0))[1]
        s = await loop.run_in_executor(None, raw_link, port)
        try:
            await until(lambda: len(server.links()) == 1, 10)
            link = server.links()[0]
            read = asyncio.ensure_future(link.read(b"m", [memoryview(bytearray(4))], timeout=30))
            await loop.run_in_executor(None, _next_of, s, {_F.READ_REQ, _F.PLANE_READ_REQ})
            meta = json.dumps({"reason": "shutting down for maintenance"}).encode()
            frame = wire.encode_frame(_F.ERROR, status=Code.LLM_LINK_FAILED, meta=meta)
            await loop.run_in_executor(None, s.sendall, frame)
            await raises(Code.LLM_LINK_FAILED, read, "shutting down for maintenance")
        finally:
            s.close()
    finally:
        await server.aclose()


async def test_a_handler_out_of_memory_is_answered_out_of_memory() -> None:
    """A requester relies on the code of a refusal to decide what to do (retry later on
    ``LLM_OUT_OF_MEMORY``); aiokv reports a ``MemoryError`` as ``LLM_OUT_OF_MEMORY``
    everywhere (``map_errors``, and the staging path of the peer service), but a
    handler that raised one while deciding was answered ``LLM_FAILED``."""
    server = TcpTransport(2, OutOfMemory())
    client = TcpTransport(1, Refuse())
    try:
        address = await server.listen(HOST, 0)
        link = await client.connect(*address, timeout=10)
        exc = await raises(
            Code.LLM_OUT_OF_MEMORY, link.read(b"m", [memoryview(bytearray(4))], timeout=10)
        )
        assert "handler failed" in str(exc)  # still no local exception text
    finally:
        await client.aclose()
        await server.aclose()


@pytest.fixture(scope="module")
def pkis(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Pki]:
    if shutil.which("openssl") is None:  # pragma: no cover - present wherever aiokv is tested
        pytest.skip("the openssl command makes the test certificates")
    root = Path(tmp_path_factory.mktemp("pki"))
    return {"main": make_pki(root / "main"), "other": make_pki(root / "other", ("x",), ca="other")}


def _contexts(pki: Pki, name: str, ca_file: str | None = None) -> TlsContexts:
    files = pki.leaves[name]
    tls = load_tls(files.cert_file, files.key_file, ca_file or files.ca_file, False)
    assert tls is not None
    return tls


async def test_a_listener_warns_of_a_certificate_it_refused(
    pkis: dict[str, Pki], caplog: pytest.LogCaptureFixture
) -> None:
    """docs/tls.md: a certificate from another CA is refused and "the message says TLS
    failed ... on the side that checked it". On a listener that side is only its log,
    and a wrong ``link_secret`` is logged there at WARNING; a refused certificate was
    logged at INFO only, which a deployment at the default WARNING level never sees:
    an operator with a misconfigured CA file learnt nothing on the listening host."""
    caplog.set_level(logging.INFO, logger="aiokv.transport.tcp")
    main = pkis["main"]
    server = TcpTransport(2, Refuse(), tls=_contexts(main, "b"))
    # trusts the server's CA, but presents another CA's certificate
    client = TcpTransport(1, Refuse(), tls=_contexts(pkis["other"], "x", main.ca_file))
    try:
        address = await server.listen(HOST, 0)
        await raises(Code.LLM_LINK_FAILED, client.connect(*address, timeout=10), "TLS failed")

        def warned() -> bool:
            return any(
                r.levelno >= logging.WARNING and "TLS failed" in r.getMessage()
                for r in caplog.records
            )

        await until(warned, 10)
    finally:
        await client.aclose()
        await server.aclose()
