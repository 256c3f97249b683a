"""The peer protocol: round trips, and every malformed request refused at decode time."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from aiokv import BlocksCacheKey
from aiokv import CacheKey
from aiokv import CacheKeyByIdAndIndex
from aiokv._remote._protocol import AddrsReq
from aiokv._remote._protocol import BlocksReq
from aiokv._remote._protocol import ChunksReq
from aiokv._remote._protocol import KeyByBlocks
from aiokv._remote._protocol import KeyById
from aiokv._remote._protocol import KeyByReq
from aiokv._remote._protocol import SlotReq
from aiokv._remote._protocol import Tensors
from aiokv._remote._protocol import blocks_of
from aiokv._remote._protocol import decode
from aiokv._remote._protocol import encode
from aiokv._remote._protocol import pack_blocks
from aiokv._remote._protocol import wire_key

BAD = (msgspec.ValidationError, msgspec.DecodeError)


def test_round_trip_every_request() -> None:
    blocks = pack_blocks(np.array([5, 1, 2**40], dtype=np.int64))
    reqs = [
        BlocksReq(KeyByBlocks(1, 0), Tensors(4), blocks, 256),
        BlocksReq(KeyByBlocks(1, 3), Tensors(2, (1, 2), 2), blocks, 256, release=False),
        ChunksReq(KeyByReq(1, 2, 3, 2**64 - 1), Tensors(2), blocks, 64, release=True),
        SlotReq(KeyById(1, 7, 0), Tensors(6, (0, 3), 2), 4096, exact=True),
        AddrsReq([2**63, 4096], 256, 512, blocks),
        AddrsReq([4096], 1024, 1024),
    ]
    for req in reqs:
        assert decode(encode(req)) == req
    assert blocks_of(reqs[0].blocks).tolist() == [5, 1, 2**40]  # type: ignore[union-attr]


def test_wire_keys() -> None:
    assert wire_key(BlocksCacheKey(3, 4)) == KeyByBlocks(3, 4)
    assert wire_key(CacheKey(1, 2, 3)) == KeyByReq(1, 2, 3, 2**64 - 1)
    assert wire_key(CacheKeyByIdAndIndex(1, 9, 2)) == KeyById(1, 9, 2)


def _raw(obj: object) -> bytes:
    return msgspec.msgpack.encode(obj)


GOOD = [
    1,
    {
        "type": "blocks",
        "key": {"type": "blocks", "cluster_id": 1, "model_id": 0},
        "tensors": {"count": 2},
        "blocks": b"\0" * 8,
        "block_bytes": 64,
    },
]


@pytest.mark.parametrize(
    "mutate",
    [
        lambda m: m.__setitem__(0, 2),  # protocol version
        lambda m: m.__setitem__(0, True),
        lambda m: m.__setitem__(0, 1.0),
        lambda m: m[1].__setitem__("type", "nope"),
        lambda m: m[1]["key"].__setitem__("cluster_id", -1),
        lambda m: m[1]["key"].__setitem__("cluster_id", 2.0**64),  # msgpack cannot say 2**64
        lambda m: m[1]["key"].__setitem__("model_id", "0"),
        lambda m: m[1]["key"].__setitem__("model_id", True),
        lambda m: m[1].__setitem__("block_bytes", 0),
        lambda m: m[1].__setitem__("block_bytes", 1.5),
        lambda m: m[1].__setitem__("blocks", [0]),
        lambda m: m[1].__setitem__("blocks", b"\0" * (8 * (1 << 20) + 8)),
        lambda m: m[1]["tensors"].__setitem__("count", 0),
        lambda m: m[1]["tensors"].__setitem__("layers", [1]),
        lambda m: m[1]["tensors"].__setitem__("per_layer", 1 << 17),
        lambda m: m[1].__setitem__("release", 1),
        lambda m: m[1].pop("key"),
    ],
)
def test_malformed_requests_are_refused(mutate: object) -> None:
    import copy

    meta = copy.deepcopy(GOOD)
    decode(_raw(meta))  # the unmutated form is valid
    mutate(meta)  # type: ignore[operator]
    with pytest.raises(BAD):
        decode(_raw(meta))


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xc1",
        b"\x92\x01",
        b"junk" * 10,
        _raw({"v": 1}),
        b"\x92\x01\x81\xa4type\xa4sl\xfft",  # a tag that is not UTF-8
    ],
)
def test_garbage_is_refused(raw: bytes) -> None:
    with pytest.raises(BAD):
        decode(raw)


def test_blocks_of_rejects_bad_lengths_and_negatives() -> None:
    assert blocks_of(b"\0" * 7) is None
    assert blocks_of(pack_blocks(np.array([-1], dtype=np.int64))) is None
    assert blocks_of(b"").tolist() == []  # type: ignore[union-attr]
