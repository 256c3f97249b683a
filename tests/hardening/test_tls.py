"""Issue #9 item 16: optional TLS for links (mutual certificates, configured in LLMConfig).

Throwaway CAs and certificates are made with the ``openssl`` command in a temporary
directory. Everything binds 127.0.0.1, port 0, and stops what it starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import shutil
import socket
import ssl
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers import raises

from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import DataType
from aiokv import LLMConfig
from aiokv import LLMDataDist
from aiokv import LLMException
from aiokv import LLMRole
from aiokv import LLMStatusCode
from aiokv._bench._pki import Pki
from aiokv._bench._pki import TlsFiles
from aiokv._bench._pki import make_pki
from aiokv.testing import cluster_info
from aiokv.testing import linked_pair
from aiokv.testing import make_config
from aiokv.transport import Grant
from aiokv.transport import PeerInfo
from aiokv.transport import TlsContexts
from aiokv.transport import load_tls
from aiokv.transport.tcp import TcpTransport
from aiokv.transport.tcp._tls_io import TlsSock

if shutil.which("openssl") is None:  # pragma: no cover - present wherever aiokv is tested
    pytest.skip("the openssl command makes the test certificates", allow_module_level=True)

CODE = LLMStatusCode
HOST = "127.0.0.1"


@pytest.fixture(scope="module")
def pkis(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Pki]:
    """``main``: leaves a, b; ``other``: another CA's leaf x; ``far``: a CA whose leaves
    name only ``elsewhere.invalid``."""
    root = tmp_path_factory.mktemp("pki")
    return {
        "main": make_pki(root / "main"),
        "other": make_pki(root / "other", ("x",), ca="other"),
        "far": make_pki(root / "far", ("f", "g"), ca="far", san="DNS:elsewhere.invalid"),
    }


def leaf(pkis: dict[str, Pki], pki: str, name: str) -> TlsFiles:
    return pkis[pki].leaves[name]


def contexts(files: TlsFiles, *, ca_file: str | None = None, check: bool = False) -> TlsContexts:
    tls = load_tls(files.cert_file, files.key_file, ca_file or files.ca_file, check)
    assert tls is not None
    return tls


def config(tls: TlsFiles | None, **kw: Any) -> LLMConfig:
    """A participant over TCP (``tls``: its files, ``None``: plain), accepting pushes."""
    tls_options = tls.options() if tls is not None else {}
    return make_config("tcp", pool=8 << 20, **(tls_options | kw))


def participants(
    prompt: LLMConfig, decoder: LLMConfig
) -> contextlib.AbstractAsyncContextManager[tuple[LLMDataDist, LLMDataDist]]:
    return linked_pair(prompt, decoder, link=False)


async def link(d: LLMDataDist, p: LLMDataDist) -> LLMStatusCode:
    assert p.listen_address is not None
    info = cluster_info(1, p.listen_address)
    code, codes = await d.link_clusters([info], timeout=5000)
    assert codes == [code]
    return code


class Region:
    """A transport-level handler over one bytearray: a read of meta ``b"n"`` sends its
    first n bytes (all of it for other metas), a write fills it from the start."""

    def __init__(self, size: int) -> None:
        self.data = bytearray(size)
        self.peers: list[PeerInfo] = []

    async def grant_read(self, peer: PeerInfo, meta: bytes) -> Grant:
        self.peers.append(peer)
        n = int(meta) if meta.isdigit() else len(self.data)
        return Grant(CODE.LLM_SUCCESS, [memoryview(self.data)[:n]])

    async def grant_write(self, peer: PeerInfo, meta: bytes, nbytes: int) -> Grant:
        self.peers.append(peer)
        return Grant(CODE.LLM_SUCCESS, [memoryview(self.data)[:nbytes]])


async def refused(client: TcpTransport, address: tuple[str, int]) -> str:
    """Connect ``client`` to ``address``; the link must be refused. Returns the message."""
    exc = await raises(CODE.LLM_LINK_FAILED, client.connect(*address, timeout=5))
    assert client.links() == []
    return str(exc)


# ---------------------------------------------------------------- LLMDataDist over TLS


@pytest.mark.parametrize("secret", [None, "s3cret"], ids=["tls", "tls+secret"])
async def test_pull_and_push_real_bytes_over_tls(pkis: dict[str, Pki], secret: str | None) -> None:
    a, b = leaf(pkis, "main", "a"), leaf(pkis, "main", "b")
    kw = {} if secret is None else {"link_secret": secret}
    async with participants(config(a, **kw), config(b, **kw)) as (p, d):
        assert await link(d, p) == CODE.LLM_SUCCESS
        desc = CacheDesc(2, [16, 64 << 10], DataType.DT_UINT8)  # 2 MiB per side
        src = await p.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(1))
        dst = await d.cache_manager.allocate_blocks_cache(desc)
        for i, t in enumerate(src.tensors):
            t.copy_((torch.arange(t.numel()) * (i + 3)).to(torch.uint8).view(t.shape))
        await d.cache_manager.pull_blocks(BlocksCacheKey(1), dst, [0, 5, 9, 15], [1, 2, 3, 4])
        for t_src, t_dst in zip(src.tensors, dst.tensors, strict=True):
            assert bytes(t_dst[1:5].numpy()) == bytes(t_src[[0, 5, 9, 15]].numpy())
        # and back: a push lands in the prompt's cache byte for byte
        for t in dst.tensors:
            t[7].fill_(0xA5)
        await d.cache_manager.push_blocks(BlocksCacheKey(1), dst, [7, 1], [11, 12])
        for t_src, t_dst in zip(src.tensors, dst.tensors, strict=True):
            assert bytes(t_src[11].numpy()) == b"\xa5" * (64 << 10)
            assert bytes(t_src[12].numpy()) == bytes(t_dst[1].numpy())


async def test_a_participant_without_tls_is_refused_both_ways(
    pkis: dict[str, Pki], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="aiokv")
    tls = config(leaf(pkis, "main", "a"))
    async with participants(tls, config(None)) as (p, d):
        assert await link(d, p) == CODE.LLM_LINK_FAILED  # plain decoder -> TLS prompt
    assert "this listener requires TLS" in caplog.text
    caplog.clear()
    async with participants(config(None), tls) as (p, d):
        assert await link(d, p) == CODE.LLM_LINK_FAILED  # TLS decoder -> plain prompt
    assert "TLS failed" in caplog.text


async def test_a_certificate_from_another_ca_is_refused(pkis: dict[str, Pki]) -> None:
    main, x = leaf(pkis, "main", "a"), leaf(pkis, "other", "x")
    async with participants(config(main), config(x)) as (p, d):
        assert await link(d, p) == CODE.LLM_LINK_FAILED
    # the decoder trusts the prompt's CA, but its own certificate is another CA's
    sneaky = TlsFiles(x.cert_file, x.key_file, main.ca_file)
    async with participants(config(main), config(sneaky)) as (p, d):
        assert await link(d, p) == CODE.LLM_LINK_FAILED


# ---------------------------------------------------------------- the transport's messages


async def test_refusals_say_that_tls_failed(pkis: dict[str, Pki]) -> None:
    a, b, x = leaf(pkis, "main", "a"), leaf(pkis, "main", "b"), leaf(pkis, "other", "x")
    server = TcpTransport(2, Region(4), tls=contexts(b))
    plain_server = TcpTransport(3, Region(4))
    clients = [
        TcpTransport(1, Region(4)),  # no TLS
        TcpTransport(1, Region(4), tls=contexts(x)),  # distrusts the server's CA
        TcpTransport(1, Region(4), tls=contexts(x, ca_file=a.ca_file)),  # untrusted cert
        TcpTransport(1, Region(4), tls=contexts(a)),  # TLS against a plain listener
    ]
    try:
        address = await server.listen(HOST, 0)
        plain = await plain_server.listen(HOST, 0)
        assert "this listener requires TLS" in await refused(clients[0], address)
        assert "TLS failed: [SSL: CERTIFICATE_VERIFY_FAILED]" in await refused(clients[1], address)
        assert "TLS failed: [SSL: TLSV1_ALERT_UNKNOWN_CA]" in await refused(clients[2], address)
        message = await refused(clients[3], plain)
        assert "TLS failed" in message and "does it use TLS" in message
        assert server.links() == [] and plain_server.links() == []
        # a good client still links afterwards
        good = TcpTransport(1, Region(4), tls=contexts(a))
        clients.append(good)
        assert not (await good.connect(*address, timeout=5)).broken
    finally:
        for t in (*clients, server, plain_server):
            await t.aclose()


async def test_hostname_check(pkis: dict[str, Pki]) -> None:
    f, g = leaf(pkis, "far", "f"), leaf(pkis, "far", "g")  # name only elsewhere.invalid
    a, b = leaf(pkis, "main", "a"), leaf(pkis, "main", "b")  # name 127.0.0.1, localhost
    far, near = (
        TcpTransport(2, Region(4), tls=contexts(f)),
        TcpTransport(3, Region(4), tls=contexts(b)),
    )
    strict_far = TcpTransport(1, Region(4), tls=contexts(g, check=True))
    strict_near = TcpTransport(1, Region(4), tls=contexts(a, check=True))
    lax = TcpTransport(1, Region(4), tls=contexts(g))
    try:
        far_address, near_address = await far.listen(HOST, 0), await near.listen(HOST, 0)
        message = await refused(strict_far, far_address)
        assert "TLS failed" in message and "127.0.0.1" in message
        assert not (await lax.connect(*far_address, timeout=5)).broken
        assert not (await strict_near.connect(*near_address, timeout=5)).broken
        assert not (await strict_near.connect("localhost", near_address[1], timeout=5)).broken
    finally:
        for t in (strict_far, strict_near, lax, far, near):
            await t.aclose()


async def test_big_transfers_both_ways_at_once_over_tls(pkis: dict[str, Pki]) -> None:
    """Many concurrent reads and writes, small and large: no byte lost or stranded."""
    size = 8 << 20
    ha, hb = Region(size), Region(size)
    hb.data[:] = bytes(range(256)) * (size // 256)
    ha.data[:] = bytes(reversed(range(256))) * (size // 256)
    a = TcpTransport(1, ha, tls=contexts(leaf(pkis, "main", "a")))
    b = TcpTransport(2, hb, tls=contexts(leaf(pkis, "main", "b")))
    try:
        address = await b.listen(HOST, 0)
        link_a = await a.connect(*address, timeout=5)
        for _ in range(500):
            if b.links():
                break
            await asyncio.sleep(0.01)
        (link_b,) = b.links()
        sizes = [size, 1, 30, 16 << 10, (16 << 10) + 1, 300_000, size // 2]
        dsts = [bytearray(n) for n in sizes]
        srcs = [bytes([i + 1]) * n for i, n in enumerate(sizes)]
        reads = [link_a.read(b"%d" % len(x), [memoryview(x)], timeout=20) for x in dsts]
        back = [bytearray(n) for n in sizes]
        reads_b = [link_b.read(b"%d" % len(x), [memoryview(x)], timeout=20) for x in back]
        await asyncio.gather(*reads, *reads_b)
        for dst in dsts:
            assert dst == hb.data[: len(dst)]
        for x in back:
            assert x == ha.data[: len(x)]
        # writes one at a time (they share the peer's region), scattered sources
        for src in srcs:
            views = [memoryview(src)[i : i + 70_001] for i in range(0, len(src), 70_001)]
            await link_a.write(b"w", views, timeout=20)
            assert hb.data[: len(src)] == src
    finally:
        await a.aclose()
        await b.aclose()


def _tls_pair(pkis: dict[str, Pki], buf: int) -> tuple[TlsSock, TlsSock]:
    """Two ends of a loopback TCP connection with small kernel buffers (``buf``), their TLS
    handshake done, both non-blocking: (sender, receiver)."""
    with socket.create_server((HOST, 0)) as server:
        raw_s = socket.socket()
        raw_s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buf)
        raw_s.connect(server.getsockname())
        raw_r, _ = server.accept()
    raw_r.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buf)
    for raw in (raw_s, raw_r):
        raw.setblocking(False)
    ends = [
        TlsSock(contexts(leaf(pkis, "main", "a")).wrap(raw_s, server_side=False, host=HOST)),
        TlsSock(contexts(leaf(pkis, "main", "b")).wrap(raw_r, server_side=True, host=HOST)),
    ]
    waiting = set(ends)
    deadline = time.monotonic() + 5
    while waiting and time.monotonic() < deadline:
        for end in list(waiting):
            with contextlib.suppress(ssl.SSLWantReadError, ssl.SSLWantWriteError):
                end.handshake()
                waiting.discard(end)
    assert not waiting, "the TLS handshake did not finish within 5 s"
    return ends[0], ends[1]


def _drain(end: TlsSock, into: bytearray) -> None:
    """Append every byte ``end`` can decrypt now."""
    chunk = bytearray(64 << 10)
    while True:
        try:
            k = end.recv_into(chunk)
        except BlockingIOError:
            return
        if not k:
            return
        into += chunk[:k]


def test_a_tls_send_that_would_block_counts_exactly_what_the_peer_can_read(
    pkis: dict[str, Pki],
) -> None:
    """A link counts a stream sent once ``sendmsg`` took its last byte, and a peer's
    confirmation of bytes not counted sent fails the op (CI stop 31: four pushes of 200
    over TLS failed so). So ``sendmsg`` must never have handed the peer more than it
    reports: not on a send that would block, and the stream resumes exactly."""
    sender, receiver = _tls_pair(pkis, 32 << 10)
    payload = random.Random(5).randbytes(2 << 20)
    got = bytearray()
    taken = short = 0
    try:
        for _ in range(100_000):
            if taken == len(payload):
                break
            try:
                k = sender.sendmsg([memoryview(payload)[taken:]])
            except BlockingIOError:
                k = 0
            short += k < min(len(payload) - taken, 256 << 10)  # the kernel was full
            taken += k
            _drain(receiver, got)
            assert len(got) <= taken, f"the peer read {len(got)} bytes of {taken} sent"
        deadline = time.monotonic() + 5
        while len(got) < len(payload) and time.monotonic() < deadline:
            _drain(receiver, got)
        assert short, "the kernel buffers never filled: the test proved nothing"
        assert got == payload
    finally:
        sender.close()
        receiver.close()


# ------------------------------------------------------------------ before authentication


async def test_a_silent_or_partial_tls_handshake_is_dropped_within_the_timeout(
    pkis: dict[str, Pki],
) -> None:
    server = TcpTransport(
        2, Region(4), tls=contexts(leaf(pkis, "main", "b")), handshake_timeout=0.3
    )
    try:
        address = await server.listen(HOST, 0)
        loop = asyncio.get_running_loop()
        for first in (b"", b"\x16\x03\x01\x02\x00"):  # nothing; a ClientHello's record header
            sock = socket.socket()
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, address)
                if first:
                    await loop.sock_sendall(sock, first)
                t0 = time.monotonic()
                async with asyncio.timeout(5):
                    assert await loop.sock_recv(sock, 64) == b""  # closed by the listener
                assert time.monotonic() - t0 < 3
            finally:
                sock.close()
        assert server.links() == []
    finally:
        await server.aclose()


# ------------------------------------------------------------------------- configuration


def test_options_round_trip_through_the_dict_form(tmp_path: Path) -> None:
    cfg = LLMConfig(
        tls_cert_file="/c.pem",
        tls_key_file="/k.pem",
        tls_ca_file="/ca.pem",
        tls_check_hostname=True,
    )
    options = cfg.generate_options()
    assert {k: v for k, v in options.items() if "tls" in k} == {
        "aiokv.tlsCertFile": "/c.pem",
        "aiokv.tlsKeyFile": "/k.pem",
        "aiokv.tlsCaFile": "/ca.pem",
        "aiokv.tlsCheckHostname": "1",
    }
    assert LLMConfig.from_options(options) == cfg
    assert cfg.ignored_options() == {}
    with pytest.raises(LLMException) as info:
        LLMConfig(tls_cert_file="")
    assert info.value.status_code == CODE.LLM_PARAM_INVALID


def _bad_options(pkis: dict[str, Pki], tmp_path: Path) -> dict[str, dict[str, Any]]:
    a, x = leaf(pkis, "main", "a"), leaf(pkis, "other", "x")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    return {
        "cert without ca": {"tls_cert_file": a.cert_file, "tls_key_file": a.key_file},
        "ca without cert": {"tls_ca_file": a.ca_file},
        "key alone": {"tls_key_file": a.key_file},
        "check_hostname alone": {"tls_check_hostname": True},
        "missing cert": {**a.options(), "tls_cert_file": str(tmp_path / "nope.pem")},
        "missing ca": {**a.options(), "tls_ca_file": str(tmp_path / "nope.pem")},
        "garbage ca": {**a.options(), "tls_ca_file": str(garbage)},
        "garbage cert": {**a.options(), "tls_cert_file": str(garbage)},
        "key of another cert": {**a.options(), "tls_key_file": x.key_file},
        "a directory": {**a.options(), "tls_key_file": str(tmp_path)},
        "local backend": {**a.options(), "transfer_backend": "local"},
    }


async def test_bad_tls_options_fail_init_and_change_nothing(
    pkis: dict[str, Pki], tmp_path: Path
) -> None:
    for what, options in _bad_options(pkis, tmp_path).items():
        dd = LLMDataDist(LLMRole.PROMPT, 1)
        with pytest.raises(LLMException) as info:
            await dd.init(config(None, **options))
        assert info.value.status_code == CODE.LLM_PARAM_INVALID, what
        assert "tls" in str(info.value).lower() or "TLS" in str(info.value), what
        assert not dd.initialized, what
        await dd.finalize()  # a no-op


async def test_a_certificate_without_its_key_says_to_set_tls_key_file(
    pkis: dict[str, Pki],
) -> None:
    a = leaf(pkis, "main", "a")
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    with pytest.raises(LLMException) as info:
        await dd.init(config(None, tls_cert_file=a.cert_file, tls_ca_file=a.ca_file))
    assert info.value.status_code == CODE.LLM_PARAM_INVALID
    assert "it holds no private key: set tls_key_file" in str(info.value)
    assert not dd.initialized


@pytest.fixture
def cert_with_key(pkis: dict[str, Pki], tmp_path: Path) -> str:
    """Leaf a's certificate and key in one file."""
    a = leaf(pkis, "main", "a")
    both = tmp_path / "a-with-key.pem"
    both.write_text(Path(a.cert_file).read_text() + Path(a.key_file).read_text())
    return str(both)


async def test_the_key_may_live_in_the_certificate_file(
    pkis: dict[str, Pki], cert_with_key: str
) -> None:
    a, b = leaf(pkis, "main", "a"), leaf(pkis, "main", "b")
    one_file = config(None, tls_cert_file=cert_with_key, tls_ca_file=a.ca_file)
    async with participants(config(b), one_file) as (p, d):
        assert await link(d, p) == CODE.LLM_SUCCESS
