"""The TCP wire format: round trips, and rejection of anything malformed."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiokv._enums import LLMStatusCode
from aiokv.transport import _wire as wire
from aiokv.transport._wire import FrameType
from aiokv.transport._wire import MetaError
from aiokv.transport._wire import WireError

U64 = st.integers(0, 2**64 - 1)


def raw_header(
    *,
    magic: bytes = wire.MAGIC,
    version: int = wire.VERSION,
    ftype: int = FrameType.DATA,
    status: int = 0,
    meta_len: int = 0,
    req_id: int = 0,
    size: int = 0,
) -> bytes:
    return wire.HEADER.pack(magic, version, ftype, status, meta_len, req_id, size)


def test_header_is_30_bytes() -> None:
    assert wire.HEADER_SIZE == 30


@given(ftype=st.sampled_from(list(FrameType)), req_id=U64, status=st.integers(0, 2**32 - 1))
def test_header_round_trip(ftype: FrameType, req_id: int, status: int) -> None:
    size = 1234 if ftype is FrameType.DATA else 0
    h = wire.decode_header(wire.encode_header(ftype, req_id, status=status, size=size))
    assert (h.type, h.req_id, h.status, h.meta_len, h.size) == (ftype, req_id, status, 0, size)


def test_frame_carries_meta_and_totals() -> None:
    meta = wire.encode_meta({"keys": [1, 2, 3], "name": "kv"}, 1 << 20)
    frame = wire.encode_frame(FrameType.READ_REQ, 7, meta=meta, size=1 << 40)
    h = wire.decode_header(frame[: wire.HEADER_SIZE])
    assert (h.type, h.req_id, h.size, h.meta_len) == (FrameType.READ_REQ, 7, 1 << 40, len(meta))
    assert wire.decode_meta(frame[wire.HEADER_SIZE :]) == {"keys": [1, 2, 3], "name": "kv"}


def test_reply_status_travels() -> None:
    frame = wire.encode_frame(FrameType.READ_RESP, 3, status=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
    assert wire.decode_header(frame).status == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"magic": b"HTTP"}, "magic"),
        ({"version": wire.VERSION - 1}, "version"),
        ({"version": wire.VERSION + 1}, "version"),
        ({"ftype": 0}, "frame type"),
        ({"ftype": 200}, "frame type"),
        ({"ftype": FrameType.DATA, "size": wire.MAX_CHUNK + 1}, "not within"),
        ({"ftype": FrameType.DATA, "size": 0}, "DATA chunk of 0 bytes"),  # none sends it
        ({"ftype": FrameType.DATA, "meta_len": 1}, "meta"),
        ({"ftype": FrameType.READ_RESP, "meta_len": wire.REASON_CAP + 1}, "exceeds"),
        ({"ftype": FrameType.WRITE_GRANT, "meta_len": wire.REASON_CAP + 1}, "exceeds"),
        ({"ftype": FrameType.WRITE_DONE, "meta_len": wire.REASON_CAP + 1}, "exceeds"),
        ({"ftype": FrameType.READ_DONE, "meta_len": 1}, "meta"),
        ({"ftype": FrameType.CANCEL_ACK, "meta_len": 1}, "meta"),
        ({"ftype": FrameType.HELLO, "meta_len": wire.HANDSHAKE_META_CAP + 1}, "exceeds"),
    ],
)
def test_malformed_header_rejected(fields: dict[str, int | bytes], match: str) -> None:
    with pytest.raises(WireError, match=match):
        wire.decode_header(raw_header(**fields))  # type: ignore[arg-type]


def test_version_is_8_since_plane_writes_are_checked() -> None:
    # 4: refusals carry reasons; 5: memory kinds in grants; 6: generic plane frames;
    # 7: plane reads are confirmed; 8: the writer reports a plane write (PLANE_WRITE_CHECK)
    assert wire.VERSION == 8
    assert wire.REASON_CAP == 512


def test_a_peer_of_an_older_version_is_refused() -> None:
    with pytest.raises(WireError, match="unsupported protocol version 7"):
        wire.decode_header(raw_header(version=7))


@pytest.mark.parametrize(
    "ftype", [FrameType.READ_RESP, FrameType.WRITE_GRANT, FrameType.WRITE_DONE]
)
def test_refusal_reason_travels_up_to_the_cap(ftype: FrameType) -> None:
    reason = b"block sizes differ (4096 vs 8192 bytes)"
    frame = wire.encode_frame(ftype, 5, status=LLMStatusCode.LLM_PARAM_INVALID, meta=reason)
    h = wire.decode_header(frame[: wire.HEADER_SIZE])
    status = LLMStatusCode.LLM_PARAM_INVALID
    assert (h.type, h.req_id, h.status, h.meta_len) == (ftype, 5, status, len(reason))
    assert frame[wire.HEADER_SIZE :] == reason
    full = wire.decode_header(raw_header(ftype=ftype, meta_len=wire.REASON_CAP))
    assert full.meta_len == wire.REASON_CAP


def test_request_meta_length_is_left_to_the_reader() -> None:
    # An oversized request meta is answered (LLM_PARAM_INVALID), not fatal: not checked here.
    h = wire.decode_header(raw_header(ftype=FrameType.WRITE_REQ, meta_len=2**32 - 1))
    assert h.meta_len == 2**32 - 1


@pytest.mark.parametrize("n", [0, 1, 31, 33])
def test_header_of_wrong_length_rejected(n: int) -> None:
    with pytest.raises(WireError):
        wire.decode_header(b"\0" * n)


@given(st.binary(min_size=wire.HEADER_SIZE, max_size=wire.HEADER_SIZE))
def test_random_headers_decode_or_raise_wire_error(buf: bytes) -> None:
    try:
        h = wire.decode_header(buf)
    except WireError:
        return
    assert h.type in FrameType


@pytest.mark.parametrize(
    "raw",
    [b"\xff\xfe", b"{", b"[1, 2]", b'"text"', b"null", b"1e999999", b"[" * 100_000],
)
def test_bad_meta_rejected(raw: bytes) -> None:
    with pytest.raises(MetaError):
        wire.decode_meta(raw)


def test_empty_meta_is_empty_dict() -> None:
    assert wire.decode_meta(b"") == {}


def test_meta_cap_and_serialisability() -> None:
    big = {"k": "x" * 100}
    assert json.loads(wire.encode_meta(big, 200)) == big
    with pytest.raises(MetaError, match="exceeds"):
        wire.encode_meta(big, 50)
    with pytest.raises(MetaError, match="JSON"):
        wire.encode_meta({"k": object()}, 1 << 20)
    with pytest.raises(MetaError, match="JSON"):
        wire.encode_meta({"k": float("nan")}, 1 << 20)
    with pytest.raises(MetaError, match="dict"):
        wire.encode_meta([1], 1 << 20)  # type: ignore[arg-type]


def test_field_overflow_refused_on_encode() -> None:
    with pytest.raises(ValueError, match="range"):
        wire.encode_frame(FrameType.DATA, 2**64)
    with pytest.raises(struct.error):
        wire.encode_header(FrameType.DATA, status=2**32)
