"""Leases (issue #10): a blocks cache's memory lent by address over NIXL, so that repeated
pulls and pushes of its blocks move with one one-sided transfer and no request.

What a user relies on: the bytes that arrive are the cache's bytes as they are now
(never a copy from when the lease began, never another cache's), deallocating a lent
cache takes the lease back before it returns (memory back in the pool, the key free),
a transfer the lease does not cover gets the peer's error as before, and a holder that
does not give a lease back loses its link instead of holding the memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from _helpers import fill_randn
from _helpers import raises
from _helpers import until

from aiokv import BlocksCacheKey
from aiokv import Cache
from aiokv import CacheDesc
from aiokv import DataType
from aiokv import LLMConfig
from aiokv import LLMDataDist
from aiokv import LLMException
from aiokv import LLMRole
from aiokv import LLMStatusCode
from aiokv._remote import _leases
from aiokv._remote import _protocol as protocol
from aiokv._remote._leases import Held
from aiokv._remote._leases import decode_reply
from aiokv._remote._leases import encode_reply
from aiokv._remote._leases import paired_rows
from aiokv._remote._leases import reply_size
from aiokv.testing import cluster_info
from aiokv.testing import linked_pair
from aiokv.testing import make_config
from aiokv.testing import requires_transport
from aiokv.transport import Grant
from aiokv.transport import PeerInfo
from aiokv.transport import get_transport

CODE = LLMStatusCode

needs_nixl = requires_transport("nixl")


# ------------------------------------------------------------------------- the reply


def test_the_reply_round_trips_and_malformed_ones_are_refused() -> None:
    raw = encode_reply(7, 32, "cuda:1", True, [4096, 8192])
    assert len(raw) == reply_size(2)
    lease, blocks, device, writable, bases = decode_reply(raw, 2)  # type: ignore[misc]
    assert (lease, blocks, device, writable, bases.tolist()) == (
        7,
        32,
        "cuda:1",
        True,
        [4096, 8192],
    )
    assert decode_reply(encode_reply(7, 32, "cpu", False, [1]), 1)[2:4] == ("cpu", False)  # type: ignore[index]
    assert decode_reply(raw, 3) is None  # another tensor count
    words = np.frombuffer(raw, dtype="<u8").copy()
    for i, bad in ((1, 0), (3, 2), (2, 1 << 20)):  # no blocks, unknown flag, absurd device
        w = words.copy()
        w[i] = bad
        assert decode_reply(w.tobytes(), 2) is None
    with pytest.raises(ValueError, match="npu"):
        encode_reply(1, 1, "npu:0", False, [1])


def test_the_holder_checks_every_transfer_against_the_lease() -> None:
    held = Held(1, None, "cpu", np.array([1 << 20, 1 << 30], dtype=np.uint64), 8, 64, False)  # type: ignore[arg-type]
    mine = np.array([5 << 20, 6 << 20], dtype=np.uint64)

    def rows(blocks: list[int], write: bool, local: list[int] | None = None) -> object:
        theirs = np.array(blocks, dtype=np.int64)
        here = theirs if local is None else np.array(local, dtype=np.int64)
        return held.rows(theirs, here, mine, write=write)

    got = held.rows(np.array([3, 1]), np.array([0, 7]), mine, write=False)
    assert got is not None
    base = [1 << 20, 1 << 30]
    assert got[1].tolist() == [[b + off, 64] for b in base for off in (192, 64)]
    assert got[0].tolist() == [[b + off, 64] for b in (5 << 20, 6 << 20) for off in (0, 448)]
    many = [i % 8 for i in range(40)]  # long lists alike: out of range either way
    for bad in (8, 9, -1, -(2**62)):
        assert rows([*many, bad], False, [0] * 41) is None
    for blocks, write in (([8], False), ([0, 9], False), ([-1], False), ([], False), ([1], True)):
        assert rows(blocks, write) is None
    assert rows([1, 2], False, [1]) is None  # not as many blocks on both sides
    held.writable = True
    assert rows([1, 2], True) is not None
    assert rows([2, 2], True) is None  # a block twice
    held.dead = True
    assert rows([1], False) is None


def test_leased_descriptors_merge_blocks_consecutive_on_both_sides() -> None:
    """One row per run of blocks that follow each other here *and* there, the same
    length on both sides, buffer by buffer: what NIXL pairs descriptor by descriptor."""
    a_bases = np.array([1000, 9000], dtype=np.uint64)
    b_bases = np.array([50000], dtype=np.uint64).repeat(2) + np.array([0, 4000], dtype=np.uint64)
    a = np.array([0, 1, 2, 5, 6, 9], dtype=np.int64)  # runs here: 0-2, 5-6, 9
    b = np.array([4, 5, 7, 8, 9, 1], dtype=np.int64)  # runs there: 4-5, 7-9, 1
    mine, theirs = paired_rows(a_bases, a, b_bases, b, 10)
    cut = [(0, 2), (2, 1), (5, 2), (9, 1)]  # (first block here, count): both sides' runs
    there = [4, 7, 8, 1]
    assert mine.tolist() == [[ab + 10 * f, 10 * n] for ab in (1000, 9000) for f, n in cut]
    assert theirs.tolist() == [
        [bb + 10 * t, 10 * n] for bb in (50000, 54000) for t, (_, n) in zip(there, cut, strict=True)
    ]
    one, other = paired_rows(a_bases[:1], a[:1], b_bases[:1], b[:1], 10)
    assert one.tolist() == [[1000, 10]] and other.tolist() == [[50040, 10]]


@pytest.mark.parametrize("seed", range(8))
def test_leased_descriptors_of_a_few_blocks_are_the_numpy_path_s(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A few rows are built from Python ints (no ~20 numpy calls); they are the rows the
    numpy path builds for the same blocks, row for row, as uint64 arrays."""
    rng = np.random.default_rng(seed)
    for _ in range(200):
        tensors = int(rng.integers(1, 5))
        count = int(rng.integers(1, 32 // tensors + 1))
        # runs of neighbours on either side, and some scattered blocks
        a = np.cumsum(rng.choice([1, 1, 2, 5], size=count)).astype(np.int64)
        b = np.cumsum(rng.choice([1, 1, 3], size=count)).astype(np.int64)
        rng.shuffle(b[: count // 3])
        a_bases = rng.integers(1 << 20, 1 << 40, size=tensors).astype(np.uint64)
        b_bases = rng.integers(1 << 20, 1 << 40, size=tensors).astype(np.uint64)
        block = int(rng.choice([2, 4096, 65536]))
        assert a.size * a_bases.size <= _leases._FEW_ROWS
        few = paired_rows(a_bases, a, b_bases, b, block)
        with monkeypatch.context() as m:
            m.setattr(_leases, "_FEW_ROWS", 0)  # every transfer by numpy
            many = paired_rows(a_bases, a, b_bases, b, block)
        for got, want in zip(few, many, strict=True):
            assert got.dtype == want.dtype == np.uint64
            assert got.shape == want.shape and got.tolist() == want.tolist()


class _FakeLink:
    """What the holder's bookkeeping looks at of a link."""

    def __init__(self) -> None:
        self.peer = PeerInfo(1, ("127.0.0.1", 1))
        self.broken = False


async def test_a_revocation_that_overtakes_its_lease_voids_it() -> None:
    """The granter may revoke a lease before the holder has read its reply (the reply is
    still on the way when the revocation is handled): the holder must never start using
    it; it asks again later instead."""
    from aiokv._config import LLMConfig as Config
    from aiokv._registry import CacheRegistry
    from aiokv._remote._leases import LeaseKey
    from aiokv._remote._leases import Leases

    leases = Leases(CacheRegistry(), Config())
    link: Any = _FakeLink()
    leases.on_link(link)
    key = LeaseKey(protocol.KeyByBlocks(1, 0), protocol.Tensors(count=1), 64, False)

    async def ask(revoke_first: bool) -> bytes:
        if revoke_first:
            await leases.release(link.peer, 7)  # not adopted yet: unknown to the holder
        return encode_reply(7, 8, "cpu", False, [1 << 20])

    leases.want(link, key, ask(True), 1)
    await until(lambda: not leases._tasks)  # type: ignore[attr-defined]
    assert leases.held(link, key) is None and leases.holding() == 0
    leases.want(link, key, ask(False), 1)  # refused just now: not asked again yet
    assert not leases._tasks  # type: ignore[attr-defined]
    leases._asked.clear()  # type: ignore[attr-defined]  # as after RETRY_S
    leases.want(link, key, ask(False), 1)
    await until(lambda: leases.holding() == 1)
    held = leases.held(link, key)
    assert held is not None and held.lease == 7
    await leases.release(link.peer, 7)
    assert leases.held(link, key) is None and held.dead


# ------------------------------------------------------------------------ over NIXL


def config(**kw: Any) -> LLMConfig:
    return make_config("nixl", pool=16 << 20, page_shift=16, **({"sync_kv_timeout": 10000} | kw))


def desc(blocks: int = 32) -> CacheDesc:
    return CacheDesc(4, [blocks, 4, 64], DataType.DT_FLOAT16)


def same_blocks(a: Cache, a_blocks: list[int], b: Cache, b_blocks: list[int]) -> bool:
    return all(
        torch.equal(x[a_blocks], y[b_blocks]) for x, y in zip(a.tensors, b.tensors, strict=True)
    )


def lent(p: LLMDataDist) -> int:
    return p.cache_manager.statistics().leases


def holding(d: LLMDataDist) -> int:
    return d.cache_manager._client.leases.holding()  # type: ignore[attr-defined,no-any-return]


def served(p: LLMDataDist, peer: int = 2) -> int:
    return p.statistics().links[peer].served.granted


def moved_bytes(d: LLMDataDist) -> int:
    return int(d._transport.moved_bytes)  # type: ignore[attr-defined]


def linked(
    decoder: dict[str, Any] | None = None, **p_cfg: Any
) -> contextlib.AbstractAsyncContextManager[tuple[LLMDataDist, LLMDataDist]]:
    """A prompt (options ``p_cfg``) and a decoder (options ``decoder``) linked."""
    return linked_pair(config(**p_cfg), config(**(decoder or {})))


@contextlib.asynccontextmanager
async def keyed_caches(
    **dst_desc: int,
) -> AsyncIterator[tuple[LLMDataDist, LLMDataDist, BlocksCacheKey, Cache, Cache]]:
    """``linked()``, the prompt's cache under ``BlocksCacheKey(1, 0)`` and a cache of the
    decoder's (``desc(**dst_desc)``): ``(p, d, key, src, dst)``."""
    async with linked() as (p, d):
        key = BlocksCacheKey(1, 0)
        src = await p.cache_manager.allocate_blocks_cache(desc(), key)
        dst = await d.cache_manager.allocate_blocks_cache(desc(**dst_desc))
        yield p, d, key, src, dst


@needs_nixl
async def test_pulls_and_pushes_move_under_a_lease_with_todays_bytes() -> None:
    async with keyed_caches() as (p, d, key, src, dst):
        fill_randn(src, 1)
        await d.cache_manager.pull_blocks(key, dst, [5, 2], [0, 9])  # by request; asks for a lease
        await until(lambda: lent(p) == 1 and holding(d) == 1)
        asked = served(p)
        for seed, srcs, dsts in ((2, [7, 1, 30], [3, 4, 5]), (3, [31], [31]), (4, [0, 1], [1, 0])):
            # the lease lends memory, not a copy: each pull sees today's bytes
            fill_randn(src, seed)
            before = moved_bytes(d)
            await d.cache_manager.pull_blocks(key, dst, srcs, dsts)
            assert same_blocks(src, srcs, dst, dsts)
            assert moved_bytes(d) - before == len(srcs) * src.block_bytes * 4
        assert served(p) == asked  # no request reached the peer
        # pushes get a lease of their own (a push needs what remote access allows)
        fill_randn(dst, 5)
        await d.cache_manager.push_blocks(key, dst, [1, 2], [10, 11])
        await until(lambda: lent(p) == 2 and holding(d) == 2)
        asked = served(p)
        fill_randn(dst, 6)
        await d.cache_manager.push_blocks(key, dst, [3, 4, 8], [12, 20, 13])
        assert same_blocks(dst, [3, 4, 8], src, [12, 20, 13])
        assert served(p) == asked
        # another selection of tensors (one layer): a lease of its own, on those tensors
        one = {"src_layer_range": range(1, 2), "dst_layer_range": range(1, 2)}
        await d.cache_manager.pull_blocks(key, dst, [6], [6], **one)
        await until(lambda: lent(p) == 3 and holding(d) == 3)
        fill_randn(src, 7)
        asked = served(p)
        await d.cache_manager.pull_blocks(key, dst, [6, 8], [6, 8], **one)
        assert served(p) == asked
        assert all(torch.equal(src.tensors[t][[6, 8]], dst.tensors[t][[6, 8]]) for t in (2, 3))
        assert not torch.equal(src.tensors[0][[6, 8]], dst.tensors[0][[6, 8]])  # not moved


@needs_nixl
async def test_deallocate_takes_the_lease_back_before_it_returns() -> None:
    async with keyed_caches() as (p, d, key, src, dst):
        fill_randn(src, 1)
        await d.cache_manager.pull_blocks(key, dst, [1], [1])
        await until(lambda: holding(d) == 1)
        await p.cache_manager.deallocate_blocks_cache(src)
        stats = p.cache_manager.statistics()
        assert (stats.caches, stats.pins, stats.leases) == (0, 0, 0)  # memory back in the pool
        assert holding(d) == 0
        await raises(CODE.LLM_KV_CACHE_NOT_EXIST, d.cache_manager.pull_blocks(key, dst, [1], [1]))
        # the key bound to a new cache: a pull reads the new cache, never the old memory
        again = await p.cache_manager.allocate_blocks_cache(desc(), key)
        fill_randn(again, 9)
        await d.cache_manager.pull_blocks(key, dst, [1, 2], [1, 2])
        assert same_blocks(again, [1, 2], dst, [1, 2])


@needs_nixl
async def test_what_a_lease_does_not_cover_gets_the_peers_error() -> None:
    async with keyed_caches(blocks=64) as (p, d, key, src, dst):
        await d.cache_manager.pull_blocks(key, dst, [1], [1])
        await d.cache_manager.push_blocks(key, dst, [1], [1])
        await until(lambda: holding(d) == 2)
        before = snapshot = [t.clone() for t in src.tensors]
        asked = served(p)
        cm = d.cache_manager
        # the peer has 32 blocks
        await raises(CODE.LLM_PARAM_INVALID, cm.pull_blocks(key, dst, [40], [40]), "out of range")
        # a block twice
        await raises(CODE.LLM_PARAM_INVALID, cm.push_blocks(key, dst, [1, 2], [3, 3]))
        assert served(p) == asked  # refusals are counted as refused, not granted
        assert all(torch.equal(a, b) for a, b in zip(src.tensors, snapshot, strict=True))
        del before


@needs_nixl
async def test_a_lease_nixl_refuses_is_dropped_and_the_transfer_goes_by_request() -> None:
    """A lease naming memory NIXL does not know (here: forged on the holder's side, as a
    lying granter could) moves nothing: the transfer goes by request, with the right
    bytes, and the holder stops using that lease."""
    async with keyed_caches() as (p, d, key, src, dst):
        await d.cache_manager.pull_blocks(key, dst, [1], [1])
        await until(lambda: holding(d) == 1)
        leases = d.cache_manager._client.leases  # type: ignore[attr-defined]
        (held,) = [h for m in leases._held.values() for h in m.values()]
        held.bases = np.full_like(held.bases, 1 << 12)  # no memory the granter registered
        fill_randn(src, 5)
        asked = served(p)
        await d.cache_manager.pull_blocks(key, dst, [2, 3], [2, 3])
        assert same_blocks(src, [2, 3], dst, [2, 3])
        assert served(p) > asked and held.dead  # by request; the forged lease is dropped
        await until(lambda: holding(d) == 1 and lent(p) == 2)


@needs_nixl
async def test_a_lost_link_ends_the_leases_on_both_sides() -> None:
    async with keyed_caches() as (p, d, key, src, dst):
        await d.cache_manager.pull_blocks(key, dst, [1], [1])
        await until(lambda: lent(p) == 1 and holding(d) == 1)
        info = cluster_info(1, p.listen_address)
        await d.unlink_clusters([info])
        await until(lambda: lent(p) == 0)
        assert holding(d) == 0
        t0 = time.monotonic()
        await p.cache_manager.deallocate_blocks_cache(src)  # nothing to take back
        assert time.monotonic() - t0 < 1.0
        assert p.cache_manager.statistics().caches == 0


@needs_nixl
async def test_leases_are_only_lent_where_a_transfer_would_be(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Lease requests are checked as transfers are: the key, remote access, the block
    size; a write lease needs what a push needs; at most ``MAX_LEASES`` per link; never
    over TCP."""
    async with linked(enable_remote_cache_accessible=False) as (p, _d):
        key = BlocksCacheKey(1, 0)
        src = await p.cache_manager.allocate_blocks_cache(desc(), key)
        sel = protocol.Tensors(count=4)
        bb = src.block_bytes
        cases = [
            (
                protocol.LeaseReq(protocol.KeyByBlocks(1, 0), sel, bb, write=True),
                CODE.LLM_FEATURE_NOT_ENABLED,
            ),
            (  # only blocks caches named by BlocksCacheKey are lent
                protocol.LeaseReq(protocol.KeyById(1, src.cache_id, 0), sel, bb),  # type: ignore[arg-type]
                CODE.LLM_PARAM_INVALID,
            ),
            (protocol.LeaseReq(protocol.KeyByBlocks(1, 5), sel, bb), CODE.LLM_KV_CACHE_NOT_EXIST),
            (protocol.LeaseReq(protocol.KeyByBlocks(1, 0), sel, bb * 2), CODE.LLM_PARAM_INVALID),
            (
                protocol.LeaseReq(protocol.KeyByBlocks(1, 0), protocol.Tensors(count=3), bb),
                CODE.LLM_PARAM_INVALID,
            ),
        ]
        async with get_transport("nixl")(3, _Silent()) as raw:
            assert p.listen_address is not None
            link = await raw.connect(*p.listen_address, timeout=5)
            await until(lambda: link.one_sided)
            for req, code in cases:
                with pytest.raises(LLMException) as ei:
                    await link.read(
                        protocol.encode(req),
                        [memoryview(bytearray(reply_size(req.tensors.count)))],
                        timeout=5,
                    )
                assert ei.value.status_code == code, (req, ei.value)
            ok = protocol.LeaseReq(protocol.KeyByBlocks(1, 0), sel, bb)
            # a lease is asked for with a read
            await raises(
                CODE.LLM_PARAM_INVALID,
                link.write(protocol.encode(ok), [memoryview(bytearray(reply_size(4)))], timeout=5),
            )
            # and revoked with a write
            await raises(
                CODE.LLM_PARAM_INVALID,
                link.read(
                    protocol.encode(protocol.RevokeReq(1)), [memoryview(bytearray(8))], timeout=5
                ),
            )
            assert p.cache_manager.statistics().leases == 0
            # a holder asking for more than MAX_LEASES is refused; nothing more is pinned
            monkeypatch.setattr(_leases, "MAX_LEASES", 2)
            for _ in range(2):
                await link.read(
                    protocol.encode(ok), [memoryview(bytearray(reply_size(4)))], timeout=5
                )
            await raises(
                CODE.LLM_LINK_BUSY,
                link.read(protocol.encode(ok), [memoryview(bytearray(reply_size(4)))], timeout=5),
                "at most 2 leases per link",
            )
            assert p.cache_manager.statistics().leases == 2
        await until(lambda: p.cache_manager.statistics().leases == 0)  # ended with the link
    tcp = config(transfer_backend="tcp")
    async with LLMDataDist(LLMRole.PROMPT, 1, tcp) as p:
        src = await p.cache_manager.allocate_blocks_cache(desc(), BlocksCacheKey(1, 0))
        async with get_transport("tcp")(3, _Silent()) as raw:
            assert p.listen_address is not None
            link = await raw.connect(*p.listen_address, timeout=5)
            req = protocol.LeaseReq(
                protocol.KeyByBlocks(1, 0), protocol.Tensors(count=4), src.block_bytes
            )
            await raises(
                CODE.LLM_FEATURE_NOT_ENABLED,
                link.read(protocol.encode(req), [memoryview(bytearray(reply_size(4)))], timeout=5),
            )


class _Silent:
    """A holder that never answers a revocation (nor anything else)."""

    async def grant_read(self, peer: PeerInfo, meta: bytes) -> Grant:
        await asyncio.sleep(3600)
        raise AssertionError

    async def grant_write(self, peer: PeerInfo, meta: bytes, nbytes: int) -> Grant:
        await asyncio.sleep(3600)
        raise AssertionError


@contextlib.asynccontextmanager
async def leased_by_a_silent_holder() -> AsyncIterator[tuple[LLMDataDist, Cache, Any, bytearray]]:
    """A prompt (``sync_kv_timeout`` 1 s) with a filled blocks cache (4 tensors, keyed
    ``BlocksCacheKey(1, 0)``) that a bare NIXL transport, which never answers a request,
    asked a lease on: yields the prompt, its cache, the holder's link and the lease
    reply's bytes."""
    async with LLMDataDist(LLMRole.PROMPT, 1, config(sync_kv_timeout=1000)) as p:
        src = await p.cache_manager.allocate_blocks_cache(desc(), BlocksCacheKey(1, 0))
        fill_randn(src, 3)
        async with get_transport("nixl")(3, _Silent()) as raw:
            assert p.listen_address is not None
            link = await raw.connect(*p.listen_address, timeout=5)
            await until(lambda: link.one_sided)
            keyed = protocol.KeyByBlocks(1, 0)
            req = protocol.LeaseReq(keyed, protocol.Tensors(count=4), src.block_bytes)
            buf = bytearray(reply_size(4))
            await link.read(protocol.encode(req), [memoryview(buf)], timeout=5)
            yield p, src, link, buf


async def holder_cut_and_all_released(p: LLMDataDist, link: Any) -> None:
    """The silent holder's ``link`` breaks, and ``p`` keeps no cache, pin or lease."""
    await until(lambda: link.broken)
    stats = p.cache_manager.statistics()
    assert (stats.caches, stats.pins, stats.leases) == (0, 0, 0)


@needs_nixl
async def test_a_holder_that_keeps_the_lease_loses_its_link() -> None:
    async with leased_by_a_silent_holder() as (p, src, link, buf):
        got = decode_reply(buf, 4)
        assert got is not None and got[1] == 32 and got[2] == "cpu"
        assert got[4].tolist() == src.tensor_addrs and p.cache_manager.statistics().leases == 1
        t0 = time.monotonic()
        await p.cache_manager.deallocate_blocks_cache(src)  # the revocation goes unanswered
        waited = time.monotonic() - t0
        assert 0.9 < waited < 3.0  # the revoke timeout: sync_kv_timeout, at least 0.5 s
        await holder_cut_and_all_released(p, link)


@needs_nixl
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_a_device_cache_moves_under_a_lease_of_host_memory_in_stream_order() -> None:
    """The holder's cache on ``cuda:0`` (VRAM), the owner's in host memory: a lease, and
    each transfer waits for the work queued on the holder's stream first (no
    ``synchronize()`` of the caller's). A cache in device memory is never lent: its
    owner must wait for its own queued work before each transfer."""
    async with linked(decoder={"device_type": "cuda"}) as (p, d):
        key = BlocksCacheKey(1, 0)
        src = await p.cache_manager.allocate_blocks_cache(desc(), key)
        dst = await d.cache_manager.allocate_blocks_cache(desc())
        assert not src.tensors[0].is_cuda and dst.tensors[0].is_cuda
        fill_randn(src, 1)
        await d.cache_manager.pull_blocks(key, dst, [3, 9], [4, 5])
        await d.cache_manager.push_blocks(key, dst, [4], [20])
        await until(lambda: lent(p) == 2 and holding(d) == 2)
        asked = served(p)
        fill_randn(src, 2)
        await d.cache_manager.pull_blocks(key, dst, [7, 1, 30], [0, 1, 2])
        assert all(
            torch.equal(s[[7, 1, 30]], t[[0, 1, 2]].cpu())
            for s, t in zip(src.tensors, dst.tensors, strict=True)
        )
        torch.cuda._sleep(200_000_000)  # GPU time queued on the current stream, then:
        for t in dst.tensors:
            t.fill_(3.0)  # written after it, on the same stream
        await d.cache_manager.push_blocks(key, dst, [6, 8], [11, 12])  # no synchronize()
        assert all(bool((s[[11, 12]] == 3.0).all()) for s in src.tensors)
        assert served(p) == asked
    async with linked(decoder={"device_type": "cuda"}, device_type="cuda") as (p, d):
        key = BlocksCacheKey(1, 0)
        src = await p.cache_manager.allocate_blocks_cache(desc(), key)
        dst = await d.cache_manager.allocate_blocks_cache(desc())
        fill_randn(src, 4)
        for _ in range(3):
            await d.cache_manager.pull_blocks(key, dst, [2], [3])
        await asyncio.sleep(0.2)
        assert lent(p) == 0 and holding(d) == 0  # device memory goes by request
        assert all(torch.equal(s[2], t[3]) for s, t in zip(src.tensors, dst.tensors, strict=True))


# ----------------------------------------------------- a key that moves ends its leases


async def _lease_both_ways(p: LLMDataDist, d: LLMDataDist, key: BlocksCacheKey, dst: Cache) -> None:
    """The decoder pulls and pushes by ``key`` until it holds a read and a write lease."""
    await d.cache_manager.pull_blocks(key, dst, [1], [1])
    await d.cache_manager.push_blocks(key, dst, [2], [2])
    await until(lambda: lent(p) == 2 and holding(d) == 2)


@needs_nixl
@pytest.mark.parametrize("how", ["allocate", "register"])
async def test_a_key_bound_to_another_cache_ends_the_leases_on_the_old_one(how: str) -> None:
    """Prompt binds BlocksCacheKey(1, 0) to cache A; the decoder pulls and pushes by it
    (a read and a write lease); the prompt binds the key to cache B while A stays
    allocated. The decoder's next pull reads B and its next push lands in B: A is
    untouched."""
    async with keyed_caches() as (p, d, key, a, dst):
        fill_randn(a, 1)
        await _lease_both_ways(p, d, key, dst)
        if how == "allocate":
            b = await p.cache_manager.allocate_blocks_cache(desc(), key)
        else:
            memory = [torch.zeros(32, 4, 64, dtype=torch.float16) for _ in range(4)]
            b = await p.cache_manager.register_blocks_cache(desc(), memory, key)
        # before the call returned, the old leases were taken back
        assert (lent(p), holding(d)) == (0, 0)
        fill_randn(b, 2)
        a_before = [t.clone() for t in a.tensors]
        await d.cache_manager.pull_blocks(key, dst, [3, 4], [3, 4])
        assert same_blocks(b, [3, 4], dst, [3, 4])
        fill_randn(dst, 3)
        await d.cache_manager.push_blocks(key, dst, [5, 6], [7, 8])
        assert same_blocks(dst, [5, 6], b, [7, 8])
        assert all(torch.equal(x, y) for x, y in zip(a.tensors, a_before, strict=True))
        # and again once leases on B are held (they name B)
        await until(lambda: lent(p) >= 1, seconds=15)  # a lease on the new cache
        fill_randn(b, 4)
        await d.cache_manager.pull_blocks(key, dst, [9], [9])
        assert same_blocks(b, [9], dst, [9])
        assert all(torch.equal(x, y) for x, y in zip(a.tensors, a_before, strict=True))
        await p.cache_manager.deallocate_blocks_cache(a)
        if how == "register":
            await p.cache_manager.unregister_cache(b.cache_id)


@needs_nixl
async def test_a_cancelled_deallocate_still_takes_the_lease_back() -> None:
    """Cancelling ``deallocate_blocks_cache`` while it waits for a holder does not cut
    the revocation short (the memory would go back to the pool while the holder may
    still write to it): the holder that never answers loses its link, then the call
    returns (it completed: the cache was released)."""
    async with leased_by_a_silent_holder() as (p, src, link, _):
        assert lent(p) == 1
        task = asyncio.create_task(p.cache_manager.deallocate_blocks_cache(src))
        await asyncio.sleep(0.1)
        task.cancel()
        await task  # completed (the revocation ran to its end): no CancelledError
        await holder_cut_and_all_released(p, link)


@needs_nixl
@pytest.mark.parametrize("side", ["granter", "holder"])
async def test_unlink_ends_the_leases_on_the_link_before_it_returns(side: str) -> None:
    """Unlinking changes what the peer may reach: the leases on the link end before the
    call returns, on the side that unlinks, while the link still works (the granter
    takes its leases back from the holder; the holder stops using its leases), so no
    one-sided transfer under them crosses afterwards, whatever the other side then does
    with that memory."""
    async with keyed_caches() as (p, d, key, src, dst):
        await _lease_both_ways(p, d, key, dst)
        if side == "granter":
            peer = cluster_info(2, d.listen_address)
            # the holder is slow to notice the link end (its loop busy for 0.3 s): only
            # being told, before the link closes, makes it drop its leases in time
            d._engine.loop.call_soon_threadsafe(time.sleep, 0.3)  # type: ignore[union-attr]
            assert (await p.unlink_clusters([peer]))[0] == CODE.LLM_SUCCESS
            assert (lent(p), holding(d)) == (0, 0)  # the holder was told, and answered
        else:
            peer = cluster_info(1, p.listen_address)
            assert (await d.unlink_clusters([peer]))[0] == CODE.LLM_SUCCESS
            assert holding(d) == 0
            await until(lambda: lent(p) == 0)
        await p.cache_manager.deallocate_blocks_cache(src)
        assert p.cache_manager.statistics().caches == 0


@needs_nixl
async def test_pulls_during_a_key_move_see_the_old_cache_then_only_the_new_one() -> None:
    """A decoder pulls by key in a loop (under its lease, or by request once it is
    taken back) while the prompt binds the key to another cache: the pulls read the old
    cache, then the new one, never the old one again, and every pull that starts after
    the call returned reads the new one."""
    async with keyed_caches() as (p, d, key, a, dst):
        await _lease_both_ways(p, d, key, dst)
        for t in a.tensors:
            t.fill_(1.0)
        seen: list[tuple[float, bool]] = []  # (value read, started after the move)
        moved = False
        stop = asyncio.Event()

        async def puller() -> None:
            while not stop.is_set():
                after = moved
                await d.cache_manager.pull_blocks(key, dst, [4], [4])
                seen.append((float(dst.tensors[0][4].float().mean()), after))

        task = asyncio.create_task(puller())
        await until(lambda: len(seen) >= 5)
        memory = [torch.full((32, 4, 64), 2.0, dtype=torch.float16) for _ in range(4)]
        b = await p.cache_manager.register_blocks_cache(desc(), memory, key)
        moved = True
        n = len(seen)
        await until(lambda: len(seen) >= n + 10)
        stop.set()
        await task
        values = [v for v, _ in seen]
        assert set(values) <= {1.0, 2.0}
        first_new = values.index(2.0)
        assert all(v == 2.0 for v in values[first_new:]), values  # never the old one again
        assert all(v == 2.0 for v, after in seen if after)
        assert all(bool((t == 1.0).all()) for t in a.tensors)  # A untouched
        await p.cache_manager.deallocate_blocks_cache(a)
        await p.cache_manager.unregister_cache(b.cache_id)


@needs_nixl
async def test_a_deallocate_cancelled_before_its_revocation_started_still_revokes() -> None:
    """The cancellation reaches the engine before the revocation's task ran (the engine
    is busy): the cache was released already, so its leases are still taken back and
    the call returns; nothing stays lent."""
    async with keyed_caches() as (p, d, key, src, dst):
        await _lease_both_ways(p, d, key, dst)
        p._engine.loop.call_soon_threadsafe(time.sleep, 0.3)  # type: ignore[union-attr]
        task = asyncio.create_task(p.cache_manager.deallocate_blocks_cache(src))
        await asyncio.sleep(0.05)  # it waits for the engine, which has not started it
        task.cancel()
        await task  # the release happened: it returns
        assert (lent(p), holding(d)) == (0, 0)
        stats = p.cache_manager.statistics()
        assert (stats.caches, stats.pins, stats.leases) == (0, 0, 0)


@needs_nixl
async def test_finalize_ends_the_leases_before_the_memory_goes() -> None:
    """A granter that finalizes takes its leases back first (its links still up), so no
    holder writes into its memory once it is gone, however slow the holder is to see
    the link end."""
    async with LLMDataDist(LLMRole.DECODER, 2, config()) as d:
        p = LLMDataDist(LLMRole.PROMPT, 1, config())
        await p.init(config())
        info = cluster_info(1, p.listen_address)
        assert (await d.link_clusters([info]))[0] == CODE.LLM_SUCCESS
        key = BlocksCacheKey(1, 0)
        await p.cache_manager.allocate_blocks_cache(desc(), key)
        dst = await d.cache_manager.allocate_blocks_cache(desc())
        await _lease_both_ways(p, d, key, dst)
        d._engine.loop.call_soon_threadsafe(time.sleep, 0.3)  # type: ignore[union-attr]
        await p.finalize()
        assert holding(d) == 0  # told, and answered, before the granter's memory went


# ------------------------------------------------------- leased moves on the caller's loop


class _Stall:
    """The decoder's NIXL agent made to leave its transfers in flight: each post reports
    "PROC" (nothing moves) and each poll reports :attr:`state` until a test changes it."""

    def __init__(self, d: LLMDataDist) -> None:
        self.agent: Any = d._transport.agent  # type: ignore[attr-defined]
        self.state = "PROC"
        self.posted = 0

    def __enter__(self) -> _Stall:
        def post(_xfer: object) -> str:
            self.posted += 1
            return "PROC"

        self.agent.post = post
        self.agent.state = lambda _xfer: self.state
        return self

    def __exit__(self, *exc: object) -> None:
        del self.agent.post, self.agent.state


def xfers(d: LLMDataDist) -> int:
    return int(d._transport.xfers)  # type: ignore[attr-defined]


def the_lease(d: LLMDataDist) -> Any:
    leases = d.cache_manager._client.leases  # type: ignore[attr-defined]
    (held,) = [h for m in leases._held.values() for h in m.values()]
    return held


@contextlib.contextmanager
def engine_hops(dd: LLMDataDist) -> Iterator[list[str]]:
    """The names of the functions ``dd``'s callers hand to its engine meanwhile."""
    engine: Any = dd._engine
    hops: list[str] = []
    run = engine.run

    async def counting(fn: Any, *args: Any, **kwargs: Any) -> Any:
        hops.append(getattr(fn, "__name__", repr(fn)))
        return await run(fn, *args, **kwargs)

    engine.run = counting
    try:
        yield hops
    finally:
        del engine.run


@needs_nixl
async def test_a_leased_transfer_from_an_asyncio_caller_runs_on_its_loop() -> None:
    """Under a lease, pulls and pushes from an asyncio task move on the caller's own loop:
    no hand-off to the engine thread and back (the bytes are today's, no request)."""
    async with keyed_caches() as (p, d, key, src, dst):
        await _lease_both_ways(p, d, key, dst)
        asked = served(p)
        with engine_hops(d) as hops:
            fill_randn(src, 2)
            await d.cache_manager.pull_blocks(key, dst, [7, 1, 30], [3, 4, 5])
            assert same_blocks(src, [7, 1, 30], dst, [3, 4, 5])
            fill_randn(dst, 3)
            await d.cache_manager.push_blocks(key, dst, [3, 4], [12, 20])
            assert same_blocks(dst, [3, 4], src, [12, 20])
        assert hops == [] and served(p) == asked


@needs_nixl
async def test_a_leased_pull_cancelled_mid_transfer_is_over_when_the_caller_sees_it() -> None:
    """Cancelled while its NIXL transfer is in flight, a leased pull on the caller's loop
    releases (aborts) the transfer before the cancellation reaches the caller; the lease
    is kept and the next pull moves under it."""
    async with keyed_caches() as (p, d, key, src, dst):
        await d.cache_manager.pull_blocks(key, dst, [1], [1])
        await until(lambda: holding(d) == 1)
        held = the_lease(d)
        with _Stall(d) as stall:
            task = asyncio.create_task(d.cache_manager.pull_blocks(key, dst, [5], [5]))
            await until(lambda: stall.posted == 1)
            await asyncio.sleep(0.05)  # polled a few times, still in flight
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert xfers(d) == 0  # released before the caller saw the cancellation
        assert holding(d) == 1 and held.busy == 0 and not held.dead
        asked = served(p)
        fill_randn(src, 4)
        await d.cache_manager.pull_blocks(key, dst, [5, 6], [5, 6])
        assert same_blocks(src, [5, 6], dst, [5, 6]) and served(p) == asked


@needs_nixl
async def test_a_leased_pull_on_the_callers_loop_is_bounded_by_sync_kv_timeout() -> None:
    async with linked(decoder={"sync_kv_timeout": 300}) as (p, d):
        key = BlocksCacheKey(1, 0)
        src = await p.cache_manager.allocate_blocks_cache(desc(), key)
        dst = await d.cache_manager.allocate_blocks_cache(desc())
        await d.cache_manager.pull_blocks(key, dst, [1], [1])
        await until(lambda: holding(d) == 1)
        with _Stall(d), engine_hops(d) as hops:
            t0 = time.monotonic()
            await raises(CODE.LLM_TIMEOUT, d.cache_manager.pull_blocks(key, dst, [2], [2]))
            assert time.monotonic() - t0 < 3
            assert xfers(d) == 0 and hops == []
        assert holding(d) == 0  # a lease whose transfer failed is not used again
        fill_randn(src, 5)
        await d.cache_manager.pull_blocks(key, dst, [2], [2])  # by request
        assert same_blocks(src, [2], dst, [2])


@needs_nixl
async def test_a_revocation_waits_for_a_leased_move_on_the_callers_loop() -> None:
    """The granter deallocates while the holder's leased pull (on the holder's caller
    loop, another thread than the holder's engine, which answers the revocation) is in
    flight: the deallocation returns only once that transfer is over, and the next pull
    gets the granter's error."""
    async with keyed_caches() as (p, d, key, src, dst):
        await d.cache_manager.pull_blocks(key, dst, [1], [1])
        await until(lambda: holding(d) == 1)
        with _Stall(d) as stall:
            pull = asyncio.create_task(d.cache_manager.pull_blocks(key, dst, [3], [3]))
            await until(lambda: stall.posted == 1)
            gone = asyncio.create_task(p.cache_manager.deallocate_blocks_cache(src))
            await asyncio.sleep(0.3)
            assert not gone.done() and not pull.done()  # the revocation waits for the pull
            stall.state = "DONE"
            await pull
            await asyncio.wait_for(gone, 5)
        assert (lent(p), holding(d), xfers(d)) == (0, 0, 0)
        await raises(CODE.LLM_KV_CACHE_NOT_EXIST, d.cache_manager.pull_blocks(key, dst, [1], [1]))


@needs_nixl
async def test_a_failed_leased_move_changes_engine_state_on_the_engine_only() -> None:
    """A leased transfer on the caller's loop that NIXL fails breaks the link and drops
    the lease: both are the holder's engine's state, changed on its thread; the link is
    broken by the time the caller sees the failure."""
    async with keyed_caches() as (_p, d, key, _src, dst):
        await d.cache_manager.pull_blocks(key, dst, [1], [1])
        await until(lambda: holding(d) == 1)
        engine: Any = d._engine
        leases: Any = d.cache_manager._client.leases  # type: ignore[attr-defined]
        threads: dict[str, threading.Thread] = {}

        def on(name: str, fn: Any) -> Any:
            def wrapper(*args: Any) -> Any:
                threads[name] = threading.current_thread()
                return fn(*args)

            return wrapper

        (link,) = d._transport.links()  # type: ignore[attr-defined]
        link._break = on("break", link._break)
        leases._drop = on("drop", leases._drop)
        with _Stall(d) as stall, engine_hops(d) as hops:
            stall.state = "ERR"
            await raises(CODE.LLM_LINK_FAILED, d.cache_manager.pull_blocks(key, dst, [2], [2]))
            assert hops == []
            # broken before the caller heard of the failure: no longer listed as linked
            assert link.broken and "break" in threads
            assert link.peer.cluster_id not in d.linked_clusters()
        await until(lambda: len(threads) == 2)
        assert threads == {"break": engine.thread, "drop": engine.thread}
        assert xfers(d) == 0 and holding(d) == 0
