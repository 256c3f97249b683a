"""Linking and remote transfers (issue 3): the contract, over every transport present.

Most tests link two ``LLMDataDist`` in one process (fast); the serving-framework flow and
the dead-peer test use a real second process (spawn).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import multiprocessing as mp
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import numpy as np
import peer_process
import pytest
import torch
from _helpers import Refusing
from _helpers import fill_randn
from _helpers import mixed_block_ops
from _helpers import raises
from _helpers import snapshot

from aiokv import BlocksCacheKey
from aiokv import Cache
from aiokv import CacheDesc
from aiokv import CacheKey
from aiokv import CacheKeyByIdAndIndex
from aiokv import CacheManager
from aiokv import DataType
from aiokv import LLMConfig
from aiokv import LLMDataDist
from aiokv import LLMException
from aiokv import LLMRole
from aiokv import LLMStatusCode
from aiokv import Placement
from aiokv import TransferConfig
from aiokv import TransferWithCacheKeyConfig
from aiokv._bench.nixl import ucx_over_tcp
from aiokv._layout import ByteLayout
from aiokv._layout import tensor_bytes
from aiokv._remote import _protocol as protocol
from aiokv.testing import cluster_info as info
from aiokv.testing import linked_pair
from aiokv.testing import make_config
from aiokv.testing import skip_unless_transport
from aiokv.transport import Grant
from aiokv.transport import PeerInfo
from aiokv.transport import get_transport
from aiokv.transport import transport_names

CODE = LLMStatusCode
BACKENDS = ["local", "nixl", "tcp"]  # every registered transport
# the transports that link separate processes; "nixl-tcp": nixl with UCX over TCP only
CROSS_PROCESS = ["tcp", "nixl", "nixl-tcp"]


def config(backend: str, **kw: Any) -> LLMConfig:
    """``make_config`` over ``backend``; ``"nixl-tcp"`` is nixl (its UCX set by the test)."""
    if backend.startswith("nixl"):
        skip_unless_transport("nixl")
        backend = "nixl"
    return make_config(backend, **({"sync_kv_timeout": 3000} | kw))


@pytest.fixture(params=BACKENDS)
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[tuple[LLMDataDist, LLMDataDist]]:
    """A prompt (cluster 1) and a decoder (cluster 2), D linked to P."""
    async with linked_pair(config(request.param)) as (p, d):
        yield p, d


def paged(layers: int = 3, blocks: int = 32, dtype: DataType = DataType.DT_BF16) -> CacheDesc:
    return CacheDesc(2 * layers, [blocks, 8, 2, 16], dtype)


async def settled(d: LLMDataDist, cluster_id: int = 1) -> None:
    """One refused round trip on the link: the owner has processed every earlier frame
    (read confirmations included), so its pins and keys are final."""
    probe = Cache.create_cpu_cache(
        CacheDesc(1, [1, 64], DataType.DT_UINT8, Placement.HOST),
        [torch.zeros(1, 64, dtype=torch.uint8)],
    )
    missing = BlocksCacheKey(cluster_id, 2**63)
    await raises(CODE.LLM_KV_CACHE_NOT_EXIST, d.cache_manager.pull_blocks(missing, probe, [0], [0]))


def linked(
    backend: str, p_cfg: dict[str, Any] | None = None, d_cfg: dict[str, Any] | None = None
) -> contextlib.AbstractAsyncContextManager[tuple[LLMDataDist, LLMDataDist]]:
    """Like the ``pair`` fixture, with extra configuration for either side."""
    return linked_pair(config(backend, **(p_cfg or {})), config(backend, **(d_cfg or {})))


# ---- links ------------------------------------------------------------------------------------
def test_every_transport_is_covered() -> None:
    assert sorted(BACKENDS) == transport_names()
    assert {b.partition("-")[0] for b in CROSS_PROCESS} <= set(BACKENDS)


async def test_link_codes(pair: tuple[LLMDataDist, LLMDataDist]) -> None:
    p, d = pair
    await settled(d)  # a round trip: the prompt's engine has filed the link it accepted
    assert d.linked_clusters() == [1] and p.linked_clusters() == [2]  # both directions
    code, codes = await d.link_clusters([info(1, p.listen_address)])
    assert code == CODE.LLM_ALREADY_LINK and codes == [CODE.LLM_ALREADY_LINK]
    many = [info(100 + i, p.listen_address) for i in range(17)]
    code, codes = await d.link_clusters(many)
    assert code == CODE.LLM_CLUSTER_NUM_EXCEED_LIMIT and set(codes) == {code}
    wrong = info(9, p.listen_address)  # P is cluster 1, not 9
    assert (await d.link_clusters([wrong]))[1] == [CODE.LLM_LINK_FAILED]
    code, codes = await d.unlink_clusters([info(1, p.listen_address), info(5, ("127.0.0.1", 1))])
    assert codes == [CODE.LLM_SUCCESS, CODE.LLM_SUCCESS]  # 5 was never linked: nothing to do
    assert d.linked_clusters() == []
    c = await d.cache_manager.allocate_blocks_cache(paged())
    await raises(CODE.LLM_NOT_YET_LINK, d.cache_manager.pull_blocks(BlocksCacheKey(1), c, [0], [0]))
    assert (await d.link_clusters([info(1, p.listen_address)]))[1] == [CODE.LLM_SUCCESS]  # relink
    with pytest.raises(TypeError):
        await d.link_clusters([1])  # type: ignore[list-item]
    await raises(CODE.LLM_PARAM_INVALID, d.link_clusters([], timeout=0))


@pytest.mark.parametrize("backend", BACKENDS)
async def test_link_to_nobody_fails_fast(backend: str) -> None:
    async with LLMDataDist(LLMRole.PROMPT, 1, config(backend)) as gone:
        assert gone.listen_address is not None
        port = gone.listen_address[1]
    # nothing listens there now
    async with LLMDataDist(LLMRole.DECODER, 2, config(backend, link_retry_count=3)) as d:
        t0 = time.monotonic()
        _, codes = await d.link_clusters([info(1, ("127.0.0.1", port))], timeout=2000)
        assert codes == [CODE.LLM_LINK_FAILED] and time.monotonic() - t0 < 2.5


@pytest.mark.parametrize("backend", BACKENDS)
async def test_link_secret(backend: str) -> None:
    async with (
        LLMDataDist(LLMRole.PROMPT, 1, config(backend, link_secret="right")) as p,
        LLMDataDist(LLMRole.DECODER, 2, config(backend, link_secret="wrong")) as bad,
        LLMDataDist(LLMRole.DECODER, 3, config(backend)) as none,
        LLMDataDist(LLMRole.DECODER, 4, config(backend, link_secret="right")) as good,
    ):
        assert (await bad.link_clusters([info(1, p.listen_address)]))[1] == [CODE.LLM_LINK_FAILED]
        assert (await none.link_clusters([info(1, p.listen_address)]))[1] == [CODE.LLM_LINK_FAILED]
        assert (await good.link_clusters([info(1, p.listen_address)]))[1] == [CODE.LLM_SUCCESS]


# ---- pulls and pushes ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [DataType.DT_BF16, DataType.DT_FLOAT16])
async def test_pull_blocks_exact(pair: tuple[LLMDataDist, LLMDataDist], dtype: DataType) -> None:
    p, d = pair
    src = await p.cache_manager.allocate_blocks_cache(paged(dtype=dtype), BlocksCacheKey(1, 0))
    dst = await d.cache_manager.allocate_blocks_cache(paged(dtype=dtype))
    fill_randn(src, 1)
    fill_randn(dst, 2)
    before = snapshot(dst)
    srcs, dsts = [3, 4, 5, 17, 31], [0, 1, 2, 30, 9]
    await d.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, srcs, dsts)  # positional
    for i, (td, ts) in enumerate(zip(dst.tensors, src.tensors, strict=True)):
        for b in range(32):
            want = ts[srcs[dsts.index(b)]] if b in dsts else before[i][b]
            assert torch.equal(td[b], want), (i, b)
    # a tail subset of layers, into other layers
    await d.cache_manager.pull_blocks(
        BlocksCacheKey(1, 0),
        dst,
        [6],
        [7],
        src_layer_range=range(1, 3),
        dst_layer_range=range(0, 2),
    )
    for k in range(4):
        assert torch.equal(dst.tensors[k][7], src.tensors[2 + k][6])
    assert torch.equal(dst.tensors[4][7], before[4][7])


async def test_block_lists_as_numpy_arrays(pair: tuple[LLMDataDist, LLMDataDist]) -> None:
    """Block lists given as integer numpy arrays (an engine's block table) move the same
    blocks as lists: a pull, a push and a layer-wise transfer."""
    p, d = pair
    src = await p.cache_manager.allocate_blocks_cache(paged(), BlocksCacheKey(1, 0))
    dst = await d.cache_manager.allocate_blocks_cache(paged(), BlocksCacheKey(2, 0))
    fill_randn(src, 11)
    table = np.array([[3, 0], [17, 1], [31, 2]], dtype=np.int32)  # (peer block, ours) rows
    await d.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, table[:, 0], table[:, 1])
    for td, ts in zip(dst.tensors, src.tensors, strict=True):
        assert torch.equal(td[[0, 1, 2]], ts[[3, 17, 31]])
    fill_randn(src, 12)
    srcs, dsts = np.array([5, 6], dtype=np.uint32), np.array([10, 11])
    await p.cache_manager.push_blocks(BlocksCacheKey(2, 0), src, srcs, dsts)
    for td, ts in zip(dst.tensors, src.tensors, strict=True):
        assert torch.equal(td[10:12], ts[5:7])
    fill_randn(src, 13)
    sync = Releaser(3)
    for e in sync.ready:
        e.set()
    config = TransferWithCacheKeyConfig(BlocksCacheKey(2, 0), range(0, 3), range(0, 3))
    task = p.cache_manager.transfer_cache_async(
        src, sync, [config], np.array([7, 8]), np.array([20, 21], dtype=np.int16)
    )
    assert await task.get_results() == [CODE.LLM_SUCCESS]
    for td, ts in zip(dst.tensors, src.tensors, strict=True):
        assert torch.equal(td[20:22], ts[7:9])
    with pytest.raises(TypeError, match="1-D integer numpy array"):
        await d.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, np.array([1.0]), np.array([1]))
    # 0-D: refused as a list would be, not with len()'s own error
    with pytest.raises(TypeError, match="1-D integer numpy array"):
        p.cache_manager.transfer_cache_async(src, sync, [config], np.array(7), np.array([20]))


async def test_single_tensor_cache_without_layer_ranges(
    pair: tuple[LLMDataDist, LLMDataDist],
) -> None:
    # regression: tensor_num_per_layer only matters when a layer range is given
    p, d = pair
    desc = CacheDesc(1, [8, 4096], DataType.DT_UINT8)
    src = await p.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(1, 0))
    fill_randn(src, 1)
    dst = await d.cache_manager.allocate_blocks_cache(desc)
    await d.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [3], [4])
    assert torch.equal(dst.tensors[0][4], src.tensors[0][3])


async def test_many_tensors_by_address_exact(pair: tuple[LLMDataDist, LLMDataDist]) -> None:
    """A cache of more tensors than a link moves as views (the serving side and the
    requester find every tensor's bytes by address): a pull and a push of some layers
    move exactly the blocks named, into exactly the tensors named."""
    p, d = pair
    desc = CacheDesc(40, [8, 64], DataType.DT_UINT8)  # 20 layers of K and V
    src = await p.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(1, 0))
    dst = await d.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(2, 0))
    fill_randn(src, 5)
    fill_randn(dst, 6)
    before = snapshot(dst)
    await d.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [5, 2], [1, 6])
    for i, (td, ts) in enumerate(zip(dst.tensors, src.tensors, strict=True)):
        assert torch.equal(td[1], ts[5]) and torch.equal(td[6], ts[2]), i
        assert torch.equal(td[[0, 2, 3, 4, 5, 7]], before[i][[0, 2, 3, 4, 5, 7]]), i
    pushed = snapshot(src)
    # layers 3..19 of src (tensors 6..39) into layers 1..17 of dst (tensors 2..35)
    layers = {"src_layer_range": range(3, 20), "dst_layer_range": range(1, 18)}
    await p.cache_manager.push_blocks(BlocksCacheKey(2, 0), src, [7], [0], **layers)
    for i, td in enumerate(dst.tensors):
        want = pushed[i + 4][7] if 2 <= i < 36 else before[i][0]
        assert torch.equal(td[0], want), i


async def test_two_models_and_push_blocks(pair: tuple[LLMDataDist, LLMDataDist]) -> None:
    p, d = pair
    m0 = await p.cache_manager.allocate_blocks_cache(paged(), BlocksCacheKey(1, 0))
    m1 = await p.cache_manager.allocate_blocks_cache(paged(), BlocksCacheKey(1, 1))
    fill_randn(m0, 3)
    fill_randn(m1, 4)
    dst = await d.cache_manager.allocate_blocks_cache(paged(), BlocksCacheKey(2, 0))
    await d.cache_manager.pull_blocks(BlocksCacheKey(1, 1), dst, [1], [1])
    await d.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [1], [2])
    assert torch.equal(dst.tensors[0][1], m1.tensors[0][1])
    assert torch.equal(dst.tensors[0][2], m0.tensors[0][1])
    # P pushes into D's cache over the link D opened
    await p.cache_manager.push_blocks(BlocksCacheKey(2, 0), m0, [10, 11, 12], [20, 21, 22])
    for td, ts in zip(dst.tensors, m0.tensors, strict=True):
        assert torch.equal(td[20:23], ts[10:13])


@pytest.mark.parametrize("backend", BACKENDS)
async def test_push_needs_remote_access(backend: str) -> None:
    async with (
        LLMDataDist(LLMRole.PROMPT, 1, config(backend, enable_remote_cache_accessible=False)) as p,
        LLMDataDist(LLMRole.DECODER, 2, config(backend)) as d,
    ):
        await d.link_clusters([info(1, p.listen_address)])
        tgt = await p.cache_manager.allocate_blocks_cache(paged(), BlocksCacheKey(1, 0))
        before = snapshot(tgt)
        src = await d.cache_manager.allocate_blocks_cache(paged())
        fill_randn(src, 5)
        await raises(
            CODE.LLM_FEATURE_NOT_ENABLED,
            d.cache_manager.push_blocks(BlocksCacheKey(1, 0), src, [0], [0]),
        )
        assert all(torch.equal(a, b) for a, b in zip(tgt.tensors, before, strict=True))


async def test_pull_cache_releases_the_key(pair: tuple[LLMDataDist, LLMDataDist]) -> None:
    p, d = pair
    desc = CacheDesc(4, [2, 1024], DataType.DT_FLOAT16)
    k0, k1 = CacheKey(1, req_id=10), CacheKey(1, req_id=11)
    src = await p.cache_manager.allocate_cache(desc, [k0, k1])
    fill_randn(src, 6)
    kept = list(src.tensors)  # its memory, read below while the keys hold it
    await p.cache_manager.deallocate_cache(src)
    held = p.cache_manager.get_pool_stats()
    assert held is not None and held.used > 0
    assert len(src.tensors) == 4  # the keys still hold its memory
    dst = await d.cache_manager.allocate_cache(CacheDesc(4, [3, 1024], DataType.DT_FLOAT16))
    await d.cache_manager.pull_cache(k1, dst, 2)
    assert all(torch.equal(td[2], ts[1]) for td, ts in zip(dst.tensors, kept, strict=True))
    await raises(CODE.LLM_KV_CACHE_NOT_EXIST, d.cache_manager.pull_cache(k1, dst, 0))
    # chunks of the contiguous slot into blocks; releases k0 -> memory goes back
    blocks = await d.cache_manager.allocate_blocks_cache(
        CacheDesc(4, [8, 256], DataType.DT_FLOAT16)
    )
    await d.cache_manager.pull_blocks(k0, blocks, dst_blocks=[5, 6, 7, 0])
    for tb, ts in zip(blocks.tensors, kept, strict=True):
        assert torch.equal(tb[[5, 6, 7, 0]].reshape(-1), ts[0])
    await raises(
        CODE.LLM_KV_CACHE_NOT_EXIST, d.cache_manager.pull_cache(k0, dst, 0)
    )  # a round trip
    after = p.cache_manager.get_pool_stats()
    assert after is not None and after.used == 0
    assert src.tensors == [] and src.tensor_addrs == []  # its memory is back in the pool


async def test_pull_and_push_by_id(pair: tuple[LLMDataDist, LLMDataDist]) -> None:
    p, d = pair
    desc = CacheDesc(4, [2, 512], DataType.DT_BF16)
    src = await p.cache_manager.allocate_cache(desc)
    fill_randn(src, 7)
    dst = await d.cache_manager.allocate_cache(desc)
    await d.cache_manager.pull_cache(CacheKeyByIdAndIndex(1, src.cache_id, 1), dst, 0)
    assert all(torch.equal(a[0], b[1]) for a, b in zip(dst.tensors, src.tensors, strict=True))
    fill_randn(dst, 8)
    await d.cache_manager.push_cache(
        CacheKeyByIdAndIndex(1, src.cache_id, 0), dst, 1, range(1, 2), range(0, 1)
    )
    assert torch.equal(src.tensors[0][0], dst.tensors[2][1])
    assert torch.equal(src.tensors[1][0], dst.tensors[3][1])
    await d.cache_manager.push_cache(CacheKeyByIdAndIndex(1, src.cache_id, 1), dst, 0, size=128)
    assert torch.equal(
        src.tensors[3][1].view(torch.uint8)[:128], dst.tensors[3][0].view(torch.uint8)[:128]
    )


async def test_remote_errors_change_nothing(pair: tuple[LLMDataDist, LLMDataDist]) -> None:
    p, d = pair
    src = await p.cache_manager.allocate_blocks_cache(paged(), BlocksCacheKey(1, 0))
    other = await p.cache_manager.allocate_blocks_cache(
        CacheDesc(6, [32, 4, 2, 16], DataType.DT_BF16), BlocksCacheKey(1, 2)
    )
    dst = await d.cache_manager.allocate_blocks_cache(paged())
    fill_randn(src, 1)
    fill_randn(dst, 2)
    bs, bd = snapshot(src), snapshot(dst)
    cm: CacheManager = d.cache_manager
    k = BlocksCacheKey(1, 0)
    P = CODE.LLM_PARAM_INVALID
    for code, coro in [
        (CODE.LLM_KV_CACHE_NOT_EXIST, cm.pull_blocks(BlocksCacheKey(1, 7), dst, [0], [0])),
        (
            CODE.LLM_KV_CACHE_NOT_EXIST,
            cm.pull_cache(
                CacheKey(1, 555), await cm.allocate_cache(CacheDesc(1, [1, 8], DataType.DT_BF16))
            ),
        ),
        (P, cm.pull_blocks(k, dst, [], [])),
        (P, cm.pull_blocks(k, dst, [0, 1], [0])),
        (P, cm.pull_blocks(k, dst, [32], [0])),  # out of range on the owner
        (P, cm.pull_blocks(k, dst, [0], [32])),  # out of range here
        (P, cm.pull_blocks(k, dst, [0, 1], [2, 2])),
        (P, cm.pull_blocks(k, dst, [0], [0], src_layer_range=range(2, 4))),  # owner has 3 layers
        (
            P,
            cm.pull_blocks(
                k, dst, [0], [0], src_layer_range=range(0, 1), dst_layer_range=range(0, 2)
            ),
        ),
        (P, cm.pull_blocks(k, dst, [0], [0], tensor_num_per_layer=4, src_layer_range=range(0, 1))),
        (P, cm.pull_blocks(k, dst, [0], [0], src_layer_range=range(0, 3, 2))),  # stepped
        (P, cm.push_blocks(k, dst, [0], [0], dst_layer_range=range(1, 1))),  # empty
        (P, cm.pull_blocks(BlocksCacheKey(1, 2), dst, [0], [0])),  # block sizes differ
    ]:
        await raises(code, coro)
    with pytest.raises(TypeError):
        await cm.pull_blocks(k, dst, [0.5], [0])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        await cm.pull_blocks(None, dst, [0], [0])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        await cm.push_cache(CacheKey(1, 1), dst)  # type: ignore[arg-type]
    assert all(torch.equal(a, b) for a, b in zip(src.tensors, bs, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(dst.tensors, bd, strict=True))
    await settled(d)
    assert p.cache_manager.statistics().pins == 0
    del other


class StalledPeer:
    """A fake prompt side (a bare transport): serves ``BlocksReq`` reads from its own
    tensors, but only once ``gate`` is set."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.gate = asyncio.Event()

    async def grant_read(self, peer: PeerInfo, meta: bytes) -> Grant:
        await self.gate.wait()
        req = protocol.decode(meta)
        assert isinstance(req, protocol.BlocksReq)
        blocks = protocol.blocks_of(req.blocks)
        assert blocks is not None
        layout = ByteLayout.of_blocks(blocks, req.block_bytes)
        return Grant(CODE.LLM_SUCCESS, layout.views([tensor_bytes(t) for t in self.tensors]))

    async def grant_write(self, peer: PeerInfo, meta: bytes, nbytes: int) -> Grant:
        return Grant(CODE.LLM_FEATURE_NOT_ENABLED)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_timeout_and_cancel_leave_link_usable(backend: str) -> None:
    src = [torch.randn(paged().shape).bfloat16() for _ in range(6)]
    peer = StalledPeer(src)
    async with (
        get_transport(backend)(1, peer) as fake,
        LLMDataDist(LLMRole.DECODER, 2, config(backend, sync_kv_timeout=200)) as d,
    ):
        address = await fake.listen("127.0.0.1", 0)
        assert (await d.link_clusters([info(1, address)]))[0] == CODE.LLM_SUCCESS
        dst = await d.cache_manager.allocate_blocks_cache(paged())
        key = BlocksCacheKey(1, 0)
        t0 = time.monotonic()
        await raises(CODE.LLM_TIMEOUT, d.cache_manager.pull_blocks(key, dst, [0], [0]))
        assert time.monotonic() - t0 < 1.5
        task = asyncio.create_task(d.cache_manager.pull_blocks(key, dst, [1], [1]))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        peer.gate.set()
        await d.cache_manager.pull_blocks(key, dst, [5], [5])
        assert all(torch.equal(dst.tensors[i][5], src[i][5]) for i in range(6))
        assert d.cache_manager.statistics().pins == 0


def _mutations(rng: random.Random, good: dict[str, Any], values: list[Any]) -> bytes | None:
    """``good`` (the raw msgpack form of a request) with 1-3 fields replaced at random."""
    req = copy.deepcopy(good)
    for _ in range(rng.randint(1, 3)):
        where = rng.choice(
            [d for d in (req, req.get("key"), req.get("tensors")) if isinstance(d, dict)]
        )
        field = rng.choice([*where, "type", "extra"])
        where[field] = rng.choice(values)
    try:
        return msgspec.msgpack.encode([protocol.PROTOCOL, req])
    except OverflowError:  # MessagePack cannot even say it
        return None


async def test_hostile_requests_never_touch_unregistered_memory(
    pair: tuple[LLMDataDist, LLMDataDist],
) -> None:
    p, d = pair
    target = await p.cache_manager.allocate_blocks_cache(paged(), BlocksCacheKey(1, 0))
    # off limits: memory nobody registered, and a cache registered as not remote accessible
    loose = torch.randn(64, 1024)
    sealed_t = [torch.randn(paged().shape).bfloat16() for _ in range(6)]
    sealed = await p.cache_manager.register_blocks_cache(
        paged(), sealed_t, BlocksCacheKey(1, 1), remote_accessible=False
    )
    fill_randn(target, 1)
    before_loose, before_sealed = loose.clone(), [t.clone() for t in sealed_t]
    rng = random.Random(7)
    good: dict[str, Any] = {
        "type": "blocks",
        "key": {"type": "blocks", "cluster_id": 1, "model_id": 0},
        "tensors": {"count": 6, "layers": None, "per_layer": 2},
        "blocks": protocol.pack_blocks(np.array([0], dtype=np.int64)),
        "block_bytes": target.block_bytes,
    }
    addrs = [target.tensor_addrs[0], sealed.tensor_addrs[0], loose.data_ptr()]
    values: list[Any] = [
        None, -1, 0, 1, 2, 6, 2**64 - 1, 2**63 - 1, 1.5, "x", b"", b"\x01" * 7, True, [], {},
        [0, 1], [-1, 2], [1, 2**40], "addrs", "slot", "chunks", "id", "req", "blocks",
        target.block_bytes, 4096, 10**9,
        protocol.pack_blocks(np.array([31, 0, 2**40], dtype=np.int64)),
        protocol.pack_blocks(np.array([5, 5], dtype=np.int64)),
        *[[a + off] for a in addrs for off in (-1, 0, 8)],
    ]  # fmt: skip
    refused = 0
    async with get_transport(p.config.transfer_backend)(3, Refusing()) as raw:
        assert p.listen_address is not None
        link = await raw.connect(*p.listen_address, timeout=5)
        for _ in range(600):
            meta = _mutations(rng, good, values)
            if meta is None:
                continue
            size = rng.choice([0, 1, 64, target.block_bytes, 6 * target.block_bytes, 4096])
            buf = memoryview(bytearray(size))
            try:
                if rng.random() < 0.5:
                    await link.read(meta, [buf], timeout=2)
                else:
                    await link.write(meta, [buf], timeout=2)
            except LLMException:
                refused += 1
    assert refused > 450
    assert torch.equal(loose, before_loose)
    assert all(torch.equal(a, b) for a, b in zip(sealed_t, before_sealed, strict=True))
    # the server still serves: reads by key are allowed, also of non-accessible memory
    dst = await d.cache_manager.allocate_blocks_cache(paged())
    await d.cache_manager.pull_blocks(BlocksCacheKey(1, 1), dst, [4], [4])
    assert torch.equal(dst.tensors[5][4], sealed_t[5][4])
    await settled(d)
    assert p.cache_manager.statistics().pins == 0


# ---- layer-wise --------------------------------------------------------------------------------
class Releaser:
    """A synchronizer whose layers are released one by one by the test ("compute")."""

    def __init__(self, layers: int, answer: dict[int, bool] | None = None) -> None:
        self.ready = [asyncio.Event() for _ in range(layers)]
        self.asked: list[int] = []
        self.answer = answer or {}

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        self.asked.append(layer_index)
        await self.ready[layer_index].wait()
        return self.answer.get(layer_index, True)


async def test_transfer_cache_async_layer_by_layer(pair: tuple[LLMDataDist, LLMDataDist]) -> None:
    p, d = pair
    layers = 4
    src = await p.cache_manager.allocate_blocks_cache(paged(layers))
    fill_randn(src, 9)
    dst_t = [torch.zeros(paged(layers).shape, dtype=torch.bfloat16) for _ in range(2 * layers)]
    dst = await d.cache_manager.register_blocks_cache(paged(layers), dst_t, BlocksCacheKey(2, 0))
    sync = Releaser(layers)
    srcs, dsts = [1, 2, 3, 8], [4, 5, 6, 0]
    task = p.cache_manager.transfer_cache_async(
        src, sync, [TransferConfig(2, dst.tensor_addrs)], srcs, dsts
    )
    assert await task.synchronize(timeout_in_millis=20) == CODE.LLM_TIMEOUT  # not cancelled
    assert sync.asked == [0]
    for layer in range(layers):
        sync.ready[layer].set()
        await asyncio.sleep(0)
    assert await task == [CODE.LLM_SUCCESS]
    assert await task.synchronize() == CODE.LLM_SUCCESS
    for td, ts in zip(dst_t, src.tensors, strict=True):
        assert torch.equal(td[dsts], ts[srcs])
        assert not bool(td[7].any())
    # by key, layers 1..2 only, and a synchronizer that refuses layer 2
    keyed = await d.cache_manager.allocate_blocks_cache(paged(layers), BlocksCacheKey(2, 1))
    sync2 = Releaser(layers, {2: False})
    for e in sync2.ready:
        e.set()
    task2 = p.cache_manager.transfer_cache_async(
        src,
        sync2,
        [
            TransferWithCacheKeyConfig(BlocksCacheKey(2, 1), range(0, 2), range(0, 2)),
            TransferWithCacheKeyConfig(BlocksCacheKey(2, 1), range(2, 4), range(2, 4)),
        ],
        [1],
        [1],
    )
    assert await task2.get_results() == [CODE.LLM_SUCCESS, CODE.LLM_PARAM_INVALID]
    assert await task2.synchronize() == CODE.LLM_PARAM_INVALID
    assert torch.equal(keyed.tensors[3][1], src.tensors[3][1])


async def test_transfer_cache_async_errors(pair: tuple[LLMDataDist, LLMDataDist]) -> None:
    p, d = pair
    p.config.sync_kv_timeout = 100  # read at each call
    src = await p.cache_manager.allocate_blocks_cache(paged(2))
    dst = await d.cache_manager.allocate_blocks_cache(paged(2))
    cm = p.cache_manager
    # layer 0 never released: waited for past sync_kv_timeout (llm_datadist passes None)
    task = cm.transfer_cache_async(
        src, Releaser(2), [TransferConfig(2, dst.tensor_addrs)], [0], [0]
    )
    assert await task.get_results(timeout_in_millis=300) == [CODE.LLM_TIMEOUT]
    assert not task.done()
    task.cancel()
    assert await task.get_results() == [None]
    # addresses the decoder never registered as accessible memory
    p.config.sync_kv_timeout = 5000  # nothing below may race a 100 ms limit
    sync = Releaser(2)
    for e in sync.ready:
        e.set()
    bogus = [a + (1 << 40) for a in dst.tensor_addrs]
    task = cm.transfer_cache_async(src, sync, [TransferConfig(2, bogus)], [0], [0])
    assert await task.get_results() == [CODE.LLM_PARAM_INVALID]

    # a plain (sync) synchronizer is accepted; cancelling reports None

    class Plain:
        def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
            return True

    task = cm.transfer_cache_async(src, Plain(), [TransferConfig(2, dst.tensor_addrs)], [2], [2])
    assert await task == [CODE.LLM_SUCCESS]
    slow = cm.transfer_cache_async(
        src, Releaser(2), [TransferConfig(2, dst.tensor_addrs)], [0], [0]
    )
    slow.cancel()
    assert await slow.get_results() == [None]
    for call in [
        lambda: cm.transfer_cache_async(
            src, Plain(), [TransferConfig(2, dst.tensor_addrs[:2])], [0], [0]
        ),
        lambda: cm.transfer_cache_async(
            src, Plain(), [TransferConfig(2, dst.tensor_addrs)], [0], None
        ),
        lambda: cm.transfer_cache_async(
            src, Plain(), [TransferConfig(2, dst.tensor_addrs)], [0], [0, 1]
        ),
        lambda: cm.transfer_cache_async(src, Plain(), [], [0], [0]),
        lambda: cm.transfer_cache_async(
            src, Plain(), [TransferConfig(2, dst.tensor_addrs, range(0, 3))], [0], [0]
        ),
    ]:
        with pytest.raises(LLMException) as ei:
            call()  # at once: a plain method
        assert ei.value.status_code == CODE.LLM_PARAM_INVALID
    with pytest.raises(LLMException) as ei:
        cm.transfer_cache_async(src, Plain(), [TransferConfig(8, dst.tensor_addrs)], [0], [0])
    assert ei.value.status_code == CODE.LLM_NOT_YET_LINK
    with pytest.raises(TypeError):
        cm.transfer_cache_async(src, object(), [TransferConfig(2, dst.tensor_addrs)], [0], [0])  # type: ignore[arg-type]
    assert p.cache_manager.statistics().pins == 0  # refused calls pin nothing


# ---- two real processes -----------------------------------------------------------------------
def start_peer(
    cluster_id: int, secret: str | None = None, backend: str = "tcp"
) -> tuple[Any, Any, int]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=peer_process.serve, args=(child, cluster_id, secret, backend), daemon=True
    )
    proc.start()
    if not parent.poll(60):
        proc.kill()
        raise RuntimeError("peer process did not start")
    return proc, parent, parent.recv()


async def ask(conn: Any, cmd: str) -> Any:
    conn.send(cmd)
    return await asyncio.to_thread(conn.recv)


@pytest.fixture
def over(backend: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The config backend of a CROSS_PROCESS name; "nixl-tcp" sets UCX to TCP only, here
    and in the peer processes started from here (spawn copies the environment)."""
    if backend == "nixl-tcp":
        for k, v in ucx_over_tcp().items():
            monkeypatch.setenv(k, v)
    config(backend)  # skips where the backend is missing
    return backend.partition("-")[0]


@pytest.mark.parametrize("backend", CROSS_PROCESS)
async def test_two_processes_serving_flow(over: str) -> None:
    backend = over
    proc, conn, port = await asyncio.to_thread(start_peer, 11, "s", backend)
    try:
        async with LLMDataDist(LLMRole.DECODER, 22, config(backend, link_secret="s")) as d:
            assert (await d.link_clusters([info(11, ("127.0.0.1", port))]))[1] == [CODE.LLM_SUCCESS]
            cm = d.cache_manager
            L = peer_process.LAYERS
            for model_id, dt in peer_process.DTYPES.items():
                dst = await cm.allocate_blocks_cache(CacheDesc(2 * L, peer_process.SHAPE, dt))
                srcs = [5, 6, 7, 40, 63]
                dsts = [0, 1, 2, 3, 4]
                await cm.pull_blocks(BlocksCacheKey(11, model_id), dst, srcs, dsts)
                for i, t in enumerate(dst.tensors):
                    want = peer_process.expected(model_id, i)
                    for s, b in zip(srcs, dsts, strict=True):
                        assert torch.equal(t[b], want[s]), (model_id, i, b)
                # tail subset of layers
                await cm.pull_blocks(
                    BlocksCacheKey(11, model_id),
                    dst,
                    [9],
                    [9],
                    src_layer_range=range(L - 1, L),
                    dst_layer_range=range(L - 1, L),
                )
                assert torch.equal(
                    dst.tensors[-1][9], peer_process.expected(model_id, 2 * L - 1)[9]
                )
                assert not bool(dst.tensors[0][9].any())
            if backend == "nixl":  # the pulls moved over NIXL, not the TCP fallback
                assert getattr(d._transport, "moved", 0) >= 4
            # push_blocks back into the peer's model-0 cache
            src = await cm.allocate_blocks_cache(
                CacheDesc(2 * L, peer_process.SHAPE, DataType.DT_BF16), BlocksCacheKey(22, 0)
            )
            fill_randn(src, 42)
            await cm.push_blocks(BlocksCacheKey(11, 0), src, [0, 1, 2, 3], [60, 61, 62, 63])
            pushed = await ask(conn, "pushed")
            for t, got in zip(src.tensors, pushed, strict=True):
                assert torch.equal(got, t[0:4])
            # the CacheKey flow: pull_cache releases the key on the owner
            used0, keys0 = await ask(conn, "stats")
            assert keys0 == 2  # CacheKeys 100 and 101
            cdesc = CacheDesc(2 * L, [1, 16 * 2 * 32 * 4], DataType.DT_BF16)
            mine = await cm.allocate_cache(cdesc)
            await cm.pull_cache(CacheKey(11, req_id=101), mine, 0)
            for i, t in enumerate(mine.tensors):
                assert torch.equal(t[0], peer_process.expected(0, i, [2, 16 * 2 * 32 * 4])[1])
            blocks = await cm.allocate_blocks_cache(
                CacheDesc(2 * L, [8, 16 * 2 * 32], DataType.DT_BF16)
            )
            await cm.pull_blocks(CacheKey(11, req_id=100), blocks, [], [7, 6, 5, 4])
            for i, t in enumerate(blocks.tensors):
                want = peer_process.expected(0, i, [2, 16 * 2 * 32 * 4])[0]
                assert torch.equal(t[[7, 6, 5, 4]].reshape(-1), want)
            await settled(d, 11)
            used1, keys1 = await ask(conn, "stats")
            assert keys1 == 0 and used1 < used0  # both keys released: memory back in the pool
    finally:
        conn.send("stop")
        await asyncio.to_thread(proc.join, 10)
        if proc.is_alive():
            proc.kill()


@pytest.mark.parametrize("backend", CROSS_PROCESS)
async def test_killed_peer_fails_fast_and_relinks(over: str) -> None:
    backend = over
    proc, _conn, port = await asyncio.to_thread(start_peer, 11, None, backend)
    proc2 = None
    try:
        async with LLMDataDist(LLMRole.DECODER, 22, config(backend, sync_kv_timeout=2000)) as d:
            await d.link_clusters([info(11, ("127.0.0.1", port))])
            cm = d.cache_manager
            dst = await cm.allocate_blocks_cache(
                CacheDesc(2 * peer_process.LAYERS, peer_process.SHAPE, DataType.DT_BF16)
            )
            await cm.pull_blocks(BlocksCacheKey(11, 0), dst, [1], [1])
            proc.kill()
            await asyncio.to_thread(proc.join, 10)
            t0 = time.monotonic()
            with pytest.raises(LLMException) as ei:
                await cm.pull_blocks(BlocksCacheKey(11, 0), dst, [2], [2])
            assert time.monotonic() - t0 < 2.5
            assert ei.value.status_code in (
                CODE.LLM_LINK_FAILED,
                CODE.LLM_NOT_YET_LINK,
                CODE.LLM_TIMEOUT,
            )
            assert 11 not in d.linked_clusters()
            proc2, conn2, port2 = await asyncio.to_thread(start_peer, 11, None, backend)
            assert (await d.link_clusters([info(11, ("127.0.0.1", port2))]))[1] == [
                CODE.LLM_SUCCESS
            ]
            await cm.pull_blocks(BlocksCacheKey(11, 0), dst, [2], [2])
            assert torch.equal(dst.tensors[0][2], peer_process.expected(0, 0)[2])
            conn2.send("stop")
    finally:
        for pr in (proc, proc2):
            if pr is not None:
                await asyncio.to_thread(pr.join, 10)
                if pr.is_alive():
                    pr.kill()


async def test_concurrent_mixed_ops_have_no_spurious_failures(
    pair: tuple[LLMDataDist, LLMDataDist],
) -> None:
    """Requester and peer agree on every outcome: with an honest peer and no faults, all of
    2,000 pulls and pushes (1-40 blocks each, 32 at a time) succeed with exact bytes."""
    p, d = pair
    # blocks of 16 KiB: a writer batch (chunks of several streams) then fills the socket
    # mid-way, so a stream's last byte can reach the peer before the batch's tail leaves
    desc = CacheDesc(2, [512, 16384], DataType.DT_UINT8)
    theirs = await p.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(1, 0))
    mine = await d.cache_manager.allocate_blocks_cache(desc)
    back = await d.cache_manager.allocate_blocks_cache(desc)
    for t in (*theirs.tensors, *mine.tensors):
        t.random_(0, 256)
    # disjoint block ranges: pulls read theirs[0:256] into back, pushes write
    # mine[256:512] into theirs[256:512]
    pulled, pushed = await mixed_block_ops(
        d.cache_manager,
        BlocksCacheKey(1, 0),
        back,
        mine,
        ops=2000,
        in_flight=32,
        rng=random.Random(11),
        seconds=120,
    )
    await settled(d)
    assert len(pulled) > 250 and len(pushed) > 250
    idx_pulled, idx_pushed = sorted(pulled), sorted(pushed)
    for t_back, t_theirs, t_mine in zip(back.tensors, theirs.tensors, mine.tensors, strict=True):
        assert torch.equal(t_back[idx_pulled], t_theirs[idx_pulled])
        assert torch.equal(t_theirs[idx_pushed], t_mine[idx_pushed])
    assert d.cache_manager.statistics().pins == 0
    assert p.cache_manager.statistics().pins == 0
