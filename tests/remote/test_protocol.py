"""The peer protocol: round trips, and every malformed request refused at decode time."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from aiokv import BlocksCacheKey
from aiokv import CacheKey
from aiokv import CacheKeyByIdAndIndex
from aiokv._remote._protocol import FOLD_MIN
from aiokv._remote._protocol import MAX_BLOCKS
from aiokv._remote._protocol import PROTOCOL
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
    PROTOCOL,
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
        lambda m: m.__setitem__(0, 1),  # protocol version 1: block lists without runs
        lambda m: m.__setitem__(0, 3),
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


def test_another_protocol_version_is_refused_with_what_to_do() -> None:
    meta = GOOD.copy()
    meta[0] = PROTOCOL - 1
    with pytest.raises(msgspec.ValidationError, match=r"request protocol version 1; this side"):
        decode(_raw(meta))
    meta[0] = True  # not a version at all: msgspec's own words
    with pytest.raises(msgspec.ValidationError, match=r"\$\[0\]"):
        decode(_raw(meta))


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xc1",
        b"\x92\x01",
        b"junk" * 10,
        _raw({"v": 2}),
        b"\x92\x02\x81\xa4type\xa4sl\xfft",  # a tag that is not UTF-8
    ],
)
def test_garbage_is_refused(raw: bytes) -> None:
    with pytest.raises(BAD):
        decode(raw)


def _i64(xs: list[int]) -> bytes:
    return np.array(xs, dtype="<i8").tobytes()


N = FOLD_MIN
TOP = 2**63 - 1


@pytest.mark.parametrize(
    ("blocks", "wire"),
    [
        ([], []),
        ([7], [7]),
        ([7, 8], [7, 8]),  # shorter than FOLD_MIN: sent as it is
        ([*range(N - 1)], [*range(N - 1)]),
        ([*range(N)], [0, -(N - 1)]),
        ([*range(4096)], [0, -4095]),
        ([*range(0, 2 * N, 2)], [*range(0, 2 * N, 2)]),  # no run: as it is
        ([*range(5000, 5000 + N), 3, *range(10, 10 + N)], [5000, -(N - 1), 3, 10, -(N - 1)]),
        ([*range(TOP - N + 1, TOP + 1)], [TOP - N + 1, -(N - 1)]),
    ],
)
def test_long_block_lists_fold_runs_on_the_wire_and_unfold_exactly(
    blocks: list[int], wire: list[int]
) -> None:
    raw = pack_blocks(np.array(blocks, dtype=np.int64))
    assert raw == _i64(wire)
    out = blocks_of(raw)
    assert out.dtype == np.int64 and out.tolist() == blocks


@pytest.mark.parametrize(
    ("wire", "blocks"),
    [
        ([7, -1], [7, 8]),
        ([9, 3, -2, 0, -1, 8], [9, 3, 4, 5, 0, 1, 8]),
        ([TOP - 2, -2], [TOP - 2, TOP - 1, TOP]),
    ],
)
def test_any_folded_list_unfolds_whatever_its_length(wire: list[int], blocks: list[int]) -> None:
    assert blocks_of(_i64(wire)).tolist() == blocks


def test_random_block_lists_round_trip_and_never_grow() -> None:
    rng = np.random.default_rng(0)
    for n in (1, 2, 63, N - 1, N, N + 1, 3 * N):
        for _ in range(20):
            starts = rng.integers(0, 10_000, n // 4 + 1)
            runs = np.concatenate([np.arange(s, s + rng.integers(1, 9)) for s in starts])[:n]
            for blocks in (rng.permutation(n), runs, rng.integers(0, 50, n)):
                raw = pack_blocks(blocks.astype(np.int64))
                assert len(raw) <= 8 * blocks.size
                assert blocks_of(raw).tolist() == blocks.tolist()


@pytest.mark.parametrize(
    ("wire", "most", "why"),
    [
        ([-1], MAX_BLOCKS, "does not follow a block"),
        ([3, -1, -1], MAX_BLOCKS, "does not follow a block"),
        ([3, -(2**63)], MAX_BLOCKS, f"run of more than {MAX_BLOCKS}"),
        ([3, -(MAX_BLOCKS + 1)], MAX_BLOCKS, f"run of more than {MAX_BLOCKS}"),
        ([3, -8], 8, "names 9 blocks; at most 8"),
        ([3, -4, 9, -3], 8, "names 9 blocks; at most 8"),
        ([1, 2, 3], 2, "names 3 entries; at most 2"),
        ([2**63 - 2, -2], MAX_BLOCKS, "past the int64 range"),
        ([0, 2**63 - 2, -2], MAX_BLOCKS, "past the int64 range"),
    ],
)
def test_malformed_block_lists_are_refused_before_they_unfold(
    wire: list[int], most: int, why: str
) -> None:
    with pytest.raises(ValueError, match=why):
        blocks_of(_i64(wire), most)


def test_a_block_list_must_be_whole_int64s() -> None:
    with pytest.raises(ValueError, match="not a list of int64"):
        blocks_of(b"\0" * 7)
    assert blocks_of(b"").tolist() == []
    assert blocks_of(_i64([3, -2]), 3).tolist() == [3, 4, 5]  # exactly at the cap
