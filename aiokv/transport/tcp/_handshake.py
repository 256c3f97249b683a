"""The link handshake: cluster ids, nonces and an optional mutual HMAC proof.

HELLO →, ← HELLO (+ server MAC), AUTH (+ client MAC) →, ← AUTH verdict. The secret
never travels; each side proves it holds it over both nonces and both cluster ids.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import secrets
from collections.abc import Callable
from typing import Any
from typing import Final

from ..._enums import LLMStatusCode
from .. import _wire as wire
from .._base import auth_mismatch
from .._base import decode_reason
from ._io import SockIO
from ._ops import code_of

__all__ = [
    "ACCEPTED",
    "AuthError",
    "HandshakeError",
    "client_handshake",
    "mac",
    "server_handshake",
]

_S = LLMStatusCode
_F = wire.FrameType
_NONCE_BYTES: Final = 32
# The first bytes of a TLS handshake record (a ClientHello): a peer that speaks TLS.
_TLS_RECORD: Final = b"\x16\x03"


def mac(secret: bytes, role: bytes, nonce_c: bytes, nonce_s: bytes, cid_c: int, cid_s: int) -> str:
    """HMAC-SHA256 binding the role, both nonces and both cluster ids (no reflection)."""
    msg = (
        b"aiokv-v1|"
        + role
        + nonce_c
        + nonce_s
        + cid_c.to_bytes(8, "big")
        + cid_s.to_bytes(8, "big")
    )
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


class HandshakeError(Exception):
    """The peer failed or refused the handshake."""


class AuthError(HandshakeError):
    """Authentication failed: the two sides' ``link_secret`` differ (or one has none).

    The side that finds out tells the other in an ``ERROR`` frame (``{"reason", "auth":
    true, "secret": whether it holds one}``), so both can say which it is."""

    def __init__(self, why: str) -> None:
        super().__init__(f"authentication failed: {why}")


def _hs_int(meta: dict[str, Any], key: str) -> int:
    v = meta.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**64:
        raise HandshakeError(f"bad {key!r} in handshake")
    return v


def _hs_nonce(meta: dict[str, Any]) -> bytes:
    v = meta.get("nonce")
    try:
        nonce = bytes.fromhex(v) if isinstance(v, str) else b""
    except ValueError:
        nonce = b""
    if len(nonce) != _NONCE_BYTES:
        raise HandshakeError("bad nonce in handshake")
    return nonce


def _hs_mac(meta: dict[str, Any]) -> str | None:
    v = meta.get("mac")
    if v is not None and not isinstance(v, str):
        raise HandshakeError("bad mac in handshake")
    return v


def _mac_ok(expected: str, got: str | None) -> bool:
    # a MAC is hex: anything else (a lone surrogate included) is simply wrong
    return got is not None and got.isascii() and hmac.compare_digest(expected, got)


async def _recv_frame(
    io: SockIO, expect: wire.FrameType, secret: bytes | None, *, first: bool = False
) -> tuple[wire.Header, dict[str, Any]]:
    """One handshake frame of type ``expect``; an ``ERROR`` frame raises its reason
    (:class:`AuthError` when it reports a failed authentication).

    ``first``: the connection's first frame, on the accepting side: a peer of another
    wire version is answered with an ``ERROR`` frame of this side's version, which
    that peer's header check reports as the version it met (it would only read the
    connection closing)."""
    hbuf = bytearray(wire.HEADER_SIZE)
    await io.recv_exact(memoryview(hbuf))
    if hbuf.startswith(_TLS_RECORD):  # never an aiokv header: those start b"AIKV"
        raise HandshakeError(
            "the peer speaks TLS and this side does not: set the tls_* options on every "
            "participant, or on none"
        )
    if first and hbuf.startswith(wire.MAGIC) and hbuf[len(wire.MAGIC)] != wire.VERSION:
        why = f"this listener speaks aiokv wire version {wire.VERSION}"
        with contextlib.suppress(OSError):
            io.sock.send(_hs_frame(_F.ERROR, {"reason": why}, _S.LLM_LINK_FAILED))
    h = wire.decode_header(hbuf)
    # Checked before a byte of meta is read or allocated: before authentication only
    # handshake frames, whose metas the header decoder caps at HANDSHAKE_META_CAP.
    if (h.type is not expect and h.type is not _F.ERROR) or h.size:
        raise HandshakeError(f"expected {expect.name} in handshake, got {h.type.name}")
    raw = bytearray(h.meta_len)
    await io.recv_exact(memoryview(raw))
    meta = wire.decode_meta(raw)
    if h.type is _F.ERROR:
        if meta.get("auth") is True:
            raise AuthError(auth_mismatch(secret is not None, meta.get("secret") is True))
        why = decode_reason(str(meta.get("reason", "")))
        raise HandshakeError(f"peer refused the link: {why or 'no reason'}")
    return h, meta


def _hs_frame(kind: wire.FrameType, meta: dict[str, Any], status: int = 0) -> bytes:
    return wire.encode_frame(
        kind, status=status, meta=wire.encode_meta(meta, wire.HANDSHAKE_META_CAP)
    )


#: the accepting side's last handshake frame (see :func:`server_handshake`)
ACCEPTED: Final = _hs_frame(_F.AUTH, {}, _S.LLM_SUCCESS)


def _auth_failed(io: SockIO, secret: bytes | None, mine: bool, theirs: bool) -> AuthError:
    """Tell the peer, best effort and without waiting, that authentication failed; the
    error to raise here."""
    meta = {"reason": "authentication failed", "auth": True, "secret": secret is not None}
    with contextlib.suppress(OSError):
        io.sock.send(_hs_frame(_F.ERROR, meta, _S.LLM_LINK_FAILED))
    return AuthError(auth_mismatch(mine, theirs))


async def client_handshake(io: SockIO, me: int, secret: bytes | None) -> int:
    """Run the connecting side's handshake; returns the peer's cluster id."""
    nonce_c = secrets.token_bytes(_NONCE_BYTES)
    await io.send_all(_hs_frame(_F.HELLO, {"cluster_id": me, "nonce": nonce_c.hex()}))
    _, hello = await _recv_frame(io, _F.HELLO, secret)
    peer_id, nonce_s, mac_s = _hs_int(hello, "cluster_id"), _hs_nonce(hello), _hs_mac(hello)
    if secret is not None:
        if not _mac_ok(mac(secret, b"server", nonce_c, nonce_s, me, peer_id), mac_s):
            raise _auth_failed(io, secret, True, mac_s is not None)
        mac_c: str | None = mac(secret, b"client", nonce_c, nonce_s, me, peer_id)
    elif mac_s is not None:
        raise _auth_failed(io, secret, False, True)
    else:
        mac_c = None
    await io.send_all(_hs_frame(_F.AUTH, {"mac": mac_c}))
    h, _ = await _recv_frame(io, _F.AUTH, secret)
    if h.status != _S.LLM_SUCCESS:
        raise HandshakeError(f"peer refused the link ({code_of(h.status).name})")
    return peer_id


async def server_handshake(
    io: SockIO, me: int, secret: bytes | None, admit: Callable[[int], str | None] | None = None
) -> int:
    """Run the accepting side's handshake up to its last frame; returns the peer's
    cluster id.

    The last frame, :data:`ACCEPTED`, is the caller's to send, as the new link's first
    frame: the link is registered before the connecting side can see it accepted, so a
    ``connect`` that returned never races the accepting side's registration.

    ``admit``, called with the peer's cluster id once it authenticated, may refuse the
    link: its reason goes to the peer in an ``ERROR`` frame (the connecting side's
    ``connect`` fails with it) and :class:`HandshakeError` is raised here."""
    _, hello = await _recv_frame(io, _F.HELLO, secret, first=True)
    peer_id, nonce_c = _hs_int(hello, "cluster_id"), _hs_nonce(hello)
    nonce_s = secrets.token_bytes(_NONCE_BYTES)
    mac_s = None if secret is None else mac(secret, b"server", nonce_c, nonce_s, peer_id, me)
    await io.send_all(_hs_frame(_F.HELLO, {"cluster_id": me, "nonce": nonce_s.hex(), "mac": mac_s}))
    _, auth = await _recv_frame(io, _F.AUTH, secret)
    mac_c = _hs_mac(auth)
    if secret is not None:
        ok = _mac_ok(mac(secret, b"client", nonce_c, nonce_s, peer_id, me), mac_c)
    else:
        ok = mac_c is None
    if not ok:
        raise _auth_failed(io, secret, secret is not None, mac_c is not None)
    refusal = None if admit is None else admit(peer_id)
    if refusal is not None:
        meta = {"reason": refusal}
        with contextlib.suppress(OSError):
            io.sock.send(_hs_frame(_F.ERROR, meta, _S.LLM_LINK_FAILED))
        raise HandshakeError(f"refused: {refusal}")
    return peer_id
