"""Wire format of the TCP transport: a fixed binary header, optional meta, raw payload.

Every frame starts with one 30-byte little-endian header::

    offset  size  field
    0       4     magic      b"AIKV"
    4       1     version    8
    5       1     type       FrameType
    6       4     status     LLMStatusCode of a reply (0 elsewhere)
    10      4     meta_len   bytes of meta that follow the header
    14      8     req_id     request id (0 for link-level frames)
    22      8     size       see below

followed by ``meta_len`` bytes of meta and, for ``DATA`` frames only, ``size`` bytes of
payload. Handshake and ``ERROR`` meta is a UTF-8 JSON object (:func:`encode_meta`);
request meta is the layer above's opaque bytes, which the transport only caps.
A reply that refuses (``READ_RESP``, ``WRITE_GRANT``, ``WRITE_DONE`` and
``PLANE_GRANT`` with a status other than ``LLM_SUCCESS``) may carry the refuser's
reason as meta: UTF-8 text of at most :data:`REASON_CAP` bytes (version 4; a longer
one is a framing violation), which the receiver sanitizes and shows, never parses.
``size`` is the payload length of a ``DATA`` frame, the total number of bytes of a
transfer in ``READ_REQ`` (bytes the reader expects), ``READ_RESP`` (bytes granted; 0
when it confirms a plane read) and ``WRITE_REQ`` (bytes to push), their plane variants
and ``PLANE_GRANT``, the meta cap in ``PLANE_HELLO``, and 0 elsewhere.

Every ``CANCEL`` is answered with a ``CANCEL_ACK`` for the same id. Frames of one link
are read in order, so when the granter reads ``CANCEL`` every ``DATA`` byte the
requester sent for that request has already been read (and landed, or been dropped);
the ``CANCEL_ACK`` therefore tells the requester that no byte of it lands any more.

``PING`` / ``PONG`` (liveness probes, ``Link.probe``) carry no meta and no payload; the
``req_id`` of a ``PONG`` is that of the ``PING`` it answers, numbered by the prober in a
space of its own (not request ids).

Plane frames (version 6), for a link whose payload may move on another medium than the
socket (its *data plane*, ``tcp/_plane.py``; the link stays the control plane):
``PLANE_HELLO`` carries the sender's plane greeting as meta (a u8 length and the plane's
ASCII name, then the plane's opaque payload) and, in ``size``, the largest meta the
sender accepts; it is sent when a link comes up and again whenever the plane has news
for the peer (before a grant that needs it). A side whose plane has another name (or
none: every payload as ``DATA``) ignores it and so never receives the other plane
frames. ``PLANE_READ_REQ`` / ``PLANE_WRITE_REQ`` are ``READ_REQ`` / ``WRITE_REQ`` from a
requester whose plane can move the buffers; the granter answers either as for the plain
request (``READ_RESP`` / ``WRITE_GRANT``, the bytes then move as ``DATA``) or with
``PLANE_GRANT``: status, ``size`` granted bytes, and meta = the granter plane's opaque
grant (e.g. the granted memory as address runs). The requester's plane then moves the
bytes itself, and the requester reports when it has. A write (version 8): once its
plane's transfer completed (every byte in the granter's memory: the medium's remote
completion, such as an RDMA write's after a flush), the requester sends
``PLANE_WRITE_CHECK``, and the granter, while it still serves the grant, treats the
bytes as landed and confirms with ``WRITE_DONE`` as over ``DATA``; its own medium need
not tell it anything. A read (version 7) is confirmed too, since the granter cannot stop
a one-sided READ it did not post: once its plane has read every byte, the requester
sends ``PLANE_READ_CHECK`` and succeeds only on the granter's ``READ_RESP`` with
``LLM_SUCCESS`` and ``size`` 0, which the granter sends only while it still serves the
grant. A revoked grant's ``READ_RESP`` (or ``WRITE_DONE``) left before that, and frames
of one link are read in order, so a transfer that raced a revocation fails with its
code. Then, as over ``DATA``, the requester acknowledges a read with ``READ_DONE``. A
``PLANE_GRANT`` answering a request that was not a plane request fails that request
(``LLM_PARAM_INVALID``).

Request ids name the side that started the request: the connecting side numbers its
requests 0, 2, 4, ..., the accepting side 1, 3, 5, ...; ids are never reused on a link,
so late frames of a finished request can always be told apart and dropped.

Violations come in two kinds. A header that cannot be trusted to find the next frame
(bad magic, version or type, a ``DATA`` chunk over :data:`MAX_CHUNK`, meta on a
frame type that carries none) raises :class:`WireError`: the connection must be closed.
A request whose meta exceeds the receiver's cap is answered ``LLM_PARAM_INVALID`` by the
link (its meta is skipped, not read). Handshake meta that is not a JSON object raises
:class:`MetaError`: the handshake fails.
"""

from __future__ import annotations

import enum
import json
import struct
from typing import Any
from typing import NamedTuple

from ._base import REASON_CAP

__all__ = [
    "HANDSHAKE_META_CAP",
    "HEADER",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_CHUNK",
    "REASON_CAP",
    "VERSION",
    "FrameType",
    "Header",
    "MetaError",
    "WireError",
    "decode_header",
    "decode_meta",
    "encode_frame",
    "encode_header",
    "encode_meta",
]

MAGIC = b"AIKV"
#: 6: generic data-plane frames (``PLANE_*``) with an opaque plane payload;
#: 7: a plane read succeeds only once the granter confirmed its grant (``PLANE_READ_CHECK``);
#: 8: a plane write lands when the requester says its transfer completed (``PLANE_WRITE_CHECK``)
VERSION = 8
HEADER = struct.Struct("<4sBBIIQQ")
HEADER_SIZE = HEADER.size
#: Protocol cap on one DATA frame's payload. Big transfers are cut into chunks no larger,
#: so one huge transfer cannot hold a connection for long and the reader never has to
#: trust a length beyond it.
MAX_CHUNK = 4 << 20
#: Meta cap for the handshake, before the peer is authenticated.
HANDSHAKE_META_CAP = 4096

_U64_MAX = 2**64 - 1
_U32_MAX = 2**32 - 1


class FrameType(enum.IntEnum):
    """Frame types; the direction is from the side that sends the frame."""

    HELLO = 1  # handshake: cluster id and nonce (both ways), server MAC (accept side)
    AUTH = 2  # handshake: client MAC (connect side), verdict (accept side)
    READ_REQ = 3  # "send me `size` bytes described by meta"
    READ_RESP = 4  # status; on success `size` granted bytes follow as DATA; else reason
    WRITE_REQ = 5  # "accept `size` bytes described by meta"
    WRITE_GRANT = 6  # status; on success the requester sends DATA frames; else reason
    DATA = 7  # `size` payload bytes of request `req_id`
    WRITE_DONE = 8  # status: the pushed bytes landed (or why not, the reason in meta)
    READ_DONE = 9  # the reader received the whole payload; the granter may release it
    CANCEL = 10  # the requester gave up on `req_id`; the granter drops it
    ERROR = 11  # link-level failure, reason in meta {"reason": str}; the link closes
    CLOSE = 12  # orderly close of the link
    CANCEL_ACK = 13  # answer to CANCEL: the granter dropped `req_id`; nothing more lands
    PING = 14  # liveness probe `req_id` (the prober's own numbering); answer PONG at once
    PONG = 15  # the answer to PING `req_id`
    PLANE_HELLO = 16  # the sender's plane name and greeting in meta; `size`: its meta cap
    PLANE_READ_REQ = 17  # READ_REQ from a requester whose data plane can move the bytes
    PLANE_WRITE_REQ = 18  # WRITE_REQ from a requester whose data plane can move the bytes
    PLANE_GRANT = 19  # status; on success meta = the plane's opaque grant, else the reason
    PLANE_READ_CHECK = 20  # the requester's plane read it all: still granted? (READ_RESP)
    PLANE_WRITE_CHECK = 21  # the requester's plane wrote it all: landed? (WRITE_DONE)


# Frame types allowed to carry meta, with the cap that applies (None: the owner's cap).
_META_TYPES = {
    FrameType.HELLO: HANDSHAKE_META_CAP,
    FrameType.AUTH: HANDSHAKE_META_CAP,
    FrameType.ERROR: HANDSHAKE_META_CAP,
    FrameType.READ_RESP: REASON_CAP,
    FrameType.WRITE_GRANT: REASON_CAP,
    FrameType.WRITE_DONE: REASON_CAP,
    FrameType.READ_REQ: None,
    FrameType.WRITE_REQ: None,
    FrameType.PLANE_HELLO: None,
    FrameType.PLANE_READ_REQ: None,
    FrameType.PLANE_WRITE_REQ: None,
    FrameType.PLANE_GRANT: None,
}


# a frame type by its byte: a look-up, where FrameType(byte) costs an enum call per frame
_KINDS: dict[int, FrameType] = {int(t): t for t in FrameType}


class WireError(Exception):
    """A framing-level violation: the byte stream can no longer be trusted."""


class MetaError(Exception):
    """A well-framed request whose meta is unacceptable."""


class Header(NamedTuple):
    """A decoded, framing-valid header (a named tuple: one is made per frame read)."""

    type: FrameType
    status: int
    meta_len: int
    req_id: int
    size: int


def encode_header(
    type: FrameType,
    req_id: int = 0,
    *,
    status: int = 0,
    meta_len: int = 0,
    size: int = 0,
) -> bytes:
    """Pack one header.

    Raises:
        struct.error: a field does not fit its width (a bug on the sending side).
    """
    return HEADER.pack(MAGIC, VERSION, type, status, meta_len, req_id, size)


def decode_header(buf: bytes | bytearray | memoryview) -> Header:
    """Unpack and check one header of exactly :data:`HEADER_SIZE` bytes.

    Only framing is checked here; meta length caps of requests are the reader's business
    (an oversized request meta is skipped and answered, not fatal).

    Raises:
        WireError: the header is malformed; close the connection.
    """
    if len(buf) != HEADER_SIZE:
        raise WireError(f"header of {len(buf)} bytes, expected {HEADER_SIZE}")
    magic, version, ftype, status, meta_len, req_id, size = HEADER.unpack(buf)
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r}")
    if version != VERSION:
        raise WireError(f"unsupported protocol version {version}")
    kind = _KINDS.get(ftype)
    if kind is None:
        raise WireError(f"unknown frame type {ftype}")
    if meta_len:
        if kind not in _META_TYPES:
            raise WireError(f"{kind.name} frame with {meta_len} bytes of meta")
        cap = _META_TYPES[kind]
        if cap is not None and meta_len > cap:
            raise WireError(f"{kind.name} meta of {meta_len} bytes exceeds {cap}")
    if kind is FrameType.DATA and not 0 < size <= MAX_CHUNK:  # no sender sends an empty one
        raise WireError(f"DATA chunk of {size} bytes is not within 1..{MAX_CHUNK}")
    return Header(kind, status, meta_len, req_id, size)


def encode_meta(meta: dict[str, Any], cap: int) -> bytes:
    """Serialise ``meta`` as compact UTF-8 JSON of at most ``cap`` bytes.

    Raises:
        MetaError: not a dict, not JSON-serialisable, or longer than ``cap``.
    """
    if not isinstance(meta, dict):
        raise MetaError(f"meta must be a dict, got {type(meta).__name__}")
    try:
        raw = json.dumps(meta, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError, RecursionError) as exc:
        raise MetaError(f"meta is not JSON-serialisable: {exc}") from exc
    if len(raw) > cap:
        raise MetaError(f"meta of {len(raw)} bytes exceeds the cap of {cap}")
    return raw


def decode_meta(raw: bytes | bytearray | memoryview) -> dict[str, Any]:
    """Parse meta received from a peer; it must be a JSON object.

    Raises:
        MetaError: not UTF-8, not JSON, too deeply nested, or not an object.
    """
    if not raw:
        return {}
    try:
        value = json.loads(bytes(raw))
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError
        raise MetaError(f"meta is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise MetaError(f"meta must be a JSON object, got {type(value).__name__}")
    return value


def encode_frame(
    type: FrameType,
    req_id: int = 0,
    *,
    status: int = 0,
    meta: bytes = b"",
    size: int = 0,
) -> bytes:
    """Header plus already-encoded meta: a complete frame, or the head of a DATA frame."""
    if not 0 <= req_id <= _U64_MAX or not 0 <= size <= _U64_MAX or len(meta) > _U32_MAX:
        raise ValueError("frame field out of range")
    return encode_header(type, req_id, status=status, meta_len=len(meta), size=size) + meta
