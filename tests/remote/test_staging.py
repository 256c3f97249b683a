"""Device-resident caches over the byte transports, through pinned host staging (#10).

Every test runs on two routes: ``host-staged`` — CPU caches forced onto the staged path
(the ``AIOKV_TEST_STAGE_HOST`` testing knob, patched in-process), so CI on a machine
without an accelerator runs the whole pipeline — and ``cuda`` — real device caches,
skipped without a GPU. Both sides of each test are linked ``LLMDataDist`` s over TCP
(and the in-memory transport), moving more than one part so that the split, the
pipeline and the last-part key release all run. Each test asserts the bytes that
arrived and that no staging memory stays lent.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import torch
from _helpers import fill_bytes
from _helpers import pull_a_slot_by_key
from _helpers import pull_and_push_blocks
from _helpers import pull_every_other_block
from _helpers import raises
from _helpers import same_rows

from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import CacheKey
from aiokv import CacheKeyByIdAndIndex
from aiokv import DataType
from aiokv import LLMConfig
from aiokv import LLMDataDist
from aiokv import LLMRole
from aiokv import LLMStatusCode
from aiokv import Placement
from aiokv import TransferConfig
from aiokv import TransferWithCacheKeyConfig
from aiokv._copy import Stager
from aiokv._copy import _staging
from aiokv._layout import ByteLayout
from aiokv._remote import Transfer
from aiokv._remote import _client as client_mod
from aiokv._remote import _service as service_mod
from aiokv._remote._protocol import BlocksReq
from aiokv._remote._protocol import KeyByBlocks
from aiokv._remote._protocol import SlotReq
from aiokv._remote._protocol import Tensors
from aiokv._remote._protocol import blocks_of
from aiokv._remote._protocol import encode
from aiokv.testing import cluster_info
from aiokv.testing import make_config

CODE = LLMStatusCode
HAS_CUDA = torch.cuda.is_available()
MiB = 1 << 20


@pytest.fixture(params=["host-staged", "cuda"])
def route(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "cuda":
        if not HAS_CUDA:
            pytest.skip("no CUDA device")
    else:
        monkeypatch.setattr(_staging, "_STAGE_HOST", True)
    monkeypatch.setattr(client_mod, "PART_BYTES", 1 * MiB)  # many parts of small caches
    return str(request.param)


def config(route: str, backend: str, **kw: Any) -> LLMConfig:
    options = {"device_type": "cuda" if route == "cuda" else "cpu", "sync_kv_timeout": 20000}
    pools = {"pool": 64 << 20, "host_pool": 64 << 20, "page_shift": 16}
    return make_config(backend, **pools, **(options | kw))


@contextlib.asynccontextmanager
async def linked(route: str, backend: str) -> AsyncIterator[tuple[LLMDataDist, LLMDataDist]]:
    async with (
        LLMDataDist(LLMRole.PROMPT, 1, config(route, backend)) as p,
        LLMDataDist(LLMRole.DECODER, 2, config(route, backend)) as d,
    ):
        assert p.listen_address is not None
        info = cluster_info(1, p.listen_address)
        code, _ = await d.link_clusters([info])
        assert code == CODE.LLM_SUCCESS
        yield p, d
        # every host buffer back (a grant's room returns when its READ_DONE arrives,
        # which may be just after the puller's call returned)
        for _ in range(500):
            if stager(p).in_use == 0 and stager(d).in_use == 0:
                break
            await asyncio.sleep(0.01)
        assert stager(p).in_use == 0 and stager(d).in_use == 0


def stager(dd: LLMDataDist) -> Stager:
    return dd.cache_manager._client._stager  # type: ignore[attr-defined,no-any-return]


def paged(layers: int = 2, blocks: int = 96, placement: Placement = Placement.DEVICE) -> CacheDesc:
    return CacheDesc(2 * layers, [blocks, 8192], DataType.DT_FLOAT16, placement)  # 16 KiB blocks


BACKENDS = ["tcp", "local"]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_pull_and_push_blocks(route: str, backend: str) -> None:
    async with linked(route, backend) as (p, d):
        src = await p.cache_manager.allocate_blocks_cache(paged(), BlocksCacheKey(1, 0))
        dst = await d.cache_manager.allocate_blocks_cache(paged(), BlocksCacheKey(2, 0))
        await pull_and_push_blocks(p.cache_manager, d.cache_manager, src, dst)  # 5 MiB each way


@pytest.mark.parametrize("placements", [("device", "host"), ("host", "device")])
async def test_mixed_placements(route: str, placements: tuple[str, str]) -> None:
    """A device cache on one side, a host cache on the other (llm_datadist allows it)."""
    place = {"device": Placement.DEVICE, "host": Placement.HOST}
    async with linked(route, "tcp") as (p, d):
        src, dst = (paged(placement=place[name]) for name in placements)
        await pull_every_other_block(p.cache_manager, d.cache_manager, src, dst)


async def test_pull_by_cache_key_releases_after_the_last_part(route: str) -> None:
    """A contiguous source pulled in parts: the key goes only with the last part."""
    async with linked(route, "tcp") as (p, d):
        await pull_a_slot_by_key(p.cache_manager, d.cache_manager, paged())


async def test_slot_transfers_split_by_layer(route: str) -> None:
    async with linked(route, "tcp") as (p, d):
        desc = CacheDesc(8, [2, 64 * 8192], DataType.DT_FLOAT16)  # 1 MiB a slot a tensor
        src = await p.cache_manager.allocate_cache(desc, [CacheKey(1, req_id=1)])
        dst = await d.cache_manager.allocate_cache(desc, [])
        fill_bytes(src, 6)
        key = CacheKeyByIdAndIndex(1, src.cache_id, 1)
        await d.cache_manager.pull_cache(key, dst, batch_index=0)
        await same_rows(dst, 0, src, 1)
        fill_bytes(dst, 7)
        await d.cache_manager.push_cache(CacheKeyByIdAndIndex(1, src.cache_id, 0), dst, 1)
        await same_rows(src, 0, dst, 1)


class Ready:
    """Every layer is ready at once."""

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return True


async def test_layer_wise_push_from_device(route: str) -> None:
    async with linked(route, "tcp") as (p, d):
        layers = 3
        src = await p.cache_manager.allocate_blocks_cache(paged(layers))
        fill_bytes(src, 8)
        by_key = await d.cache_manager.allocate_blocks_cache(paged(layers), BlocksCacheKey(2, 0))
        by_addr = await d.cache_manager.allocate_blocks_cache(paged(layers), BlocksCacheKey(2, 1))
        srcs, dsts = list(range(10, 90)), list(range(80))
        task = p.cache_manager.transfer_cache_async(
            src,
            Ready(),
            [
                TransferWithCacheKeyConfig(BlocksCacheKey(2, 0)),
                TransferConfig(2, by_addr.tensor_addrs),
            ],
            srcs,
            dsts,
        )
        assert await task == [CODE.LLM_SUCCESS, CODE.LLM_SUCCESS]
        for dst in (by_key, by_addr):
            await same_rows(dst, dsts, src, srcs)


async def test_a_device_request_over_the_staging_cap_is_refused(
    route: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer's request into staged memory moves at most MAX_STAGED_BYTES: bigger ones
    are refused before any host memory is lent (a requester splits its own)."""
    monkeypatch.setattr(service_mod, "MAX_STAGED_BYTES", 1 * MiB)
    async with linked(route, "tcp") as (p, d):
        await p.cache_manager.allocate_blocks_cache(paged(), BlocksCacheKey(1, 0))
        link = d.cache_manager._client.link("pull_blocks", 1)  # type: ignore[attr-defined]
        blocks = np.arange(40, dtype="<i8")  # 4 tensors x 40 x 16 KiB = 2.5 MiB
        req = BlocksReq(KeyByBlocks(1, 0), Tensors(4), blocks.tobytes(), 16384)
        into = [memoryview(bytearray(40 * 4 * 16384))]
        engine = d._engine  # type: ignore[attr-defined]
        await raises(CODE.LLM_PARAM_INVALID, engine.run(link.read, encode(req), into, timeout=5.0))
        assert stager(p).in_use == 0
        # the same blocks through the API are split below the cap and arrive
        dst = await d.cache_manager.allocate_blocks_cache(paged())
        monkeypatch.setattr(client_mod, "MAX_STAGED_BYTES", 1 * MiB)
        await d.cache_manager.pull_blocks(
            BlocksCacheKey(1, 0), dst, list(range(40)), list(range(40))
        )


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_layer_over_the_staging_cap_moves_in_parts_of_its_tensors(
    route: str, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch slot whose one layer (K and V) is over what a peer stages per request (a
    long context): pulled and pushed by cache id in parts of single tensors; a cut
    transfer is still checked as a whole (a tensor count that differs is refused)."""
    for mod in (service_mod, client_mod):
        monkeypatch.setattr(mod, "MAX_STAGED_BYTES", 1 * MiB)
    place = Placement.DEVICE if route == "cuda" else Placement.HOST
    desc = CacheDesc(2, [2, 384 * 1024], DataType.DT_FLOAT16, place)  # 1.5 MiB a layer
    async with linked(route, backend) as (p, d):
        src = await p.cache_manager.allocate_cache(desc)
        fill_bytes(src, seed=3)
        dst = await d.cache_manager.allocate_cache(desc)
        await d.cache_manager.pull_cache(CacheKeyByIdAndIndex(1, src.cache_id, 1), dst, 0)
        for t in range(2):
            assert torch.equal(
                dst.tensors[t][0].cpu().view(torch.uint8), src.tensors[t][1].cpu().view(torch.uint8)
            )
        back = await p.cache_manager.allocate_cache(desc)
        await d.cache_manager.push_cache(CacheKeyByIdAndIndex(1, back.cache_id, 1), dst, 0)
        for t in range(2):
            assert torch.equal(
                back.tensors[t][1].cpu().view(torch.uint8),
                src.tensors[t][1].cpu().view(torch.uint8),
            )
        # 3 layers here, 4 there: a whole request is refused, and so is every part
        three = await d.cache_manager.allocate_cache(
            CacheDesc(6, [1, 128 * 1024], DataType.DT_FLOAT16, place)
        )
        four = await p.cache_manager.allocate_cache(
            CacheDesc(8, [1, 128 * 1024], DataType.DT_FLOAT16, place)
        )
        await raises(
            CODE.LLM_PARAM_INVALID,
            d.cache_manager.pull_cache(CacheKeyByIdAndIndex(1, four.cache_id, 0), three),
            "tensor counts differ: the requester's cache moves 6 tensors",
        )
        assert stager(p).in_use == 0 and stager(d).in_use == 0


# ---- pieces ------------------------------------------------------------------------------------
def test_parts_cover_the_transfer_once() -> None:
    """Cutting by layers and blocks: every (tensor, block) pair exactly once, the remote
    block list cut alongside the local one, ``release`` only on the last part."""
    local = np.arange(100, dtype=np.int64)[::-1].copy()
    remote = np.arange(100, 200, dtype=np.int64)
    pair = dict(zip(remote.tolist(), local.tolist(), strict=True))
    req = BlocksReq(KeyByBlocks(1, 0), Tensors(6, (1, 4), 2, 1), remote.tobytes(), 4096, True)
    job = Transfer.of_blocks(req, range(0, 6), local, remote, 4096)
    parts = list(job.parts(64 << 10))  # 2 tensors x 8 blocks x 4 KiB per part
    assert len(parts) == 3 * 13
    seen: set[tuple[int, int]] = set()
    for i, part in enumerate(parts):
        assert isinstance(part.request, BlocksReq)
        assert part.nbytes <= 64 << 10
        assert part.request.release == (i == len(parts) - 1)
        sel = part.request.tensors
        assert sel.layers is not None and sel.count == 2 * (sel.layers[1] - sel.layers[0])
        assert list(part.tensors) == list(range(2 * (sel.layers[0] - 1), 2 * (sel.layers[1] - 1)))
        rblocks = blocks_of(part.request.blocks)
        assert rblocks is not None
        want = ByteLayout.of_blocks(np.array([pair[r] for r in rblocks.tolist()]), 4096)
        assert (part.layout.starts, part.layout.ends) == (want.starts, want.ends)
        for t in part.tensors:
            for r in rblocks.tolist():
                assert (t, r) not in seen
                seen.add((t, r))
    assert len(seen) == 6 * 100
    whole = list(job.parts(1 << 30))
    assert len(whole) == 1 and whole[0].request is req


def test_slot_parts_cut_by_layer() -> None:
    req = SlotReq(KeyByBlocks(1, 0), Tensors(8), 1 << 20, exact=True, release=True)  # type: ignore[arg-type]
    job = Transfer.of_span(req, range(8), 0, 1 << 20)
    parts = list(job.parts(2 << 20))
    assert [p.tensors for p in parts] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert [p.request.tensors.layers for p in parts] == [(0, 1), (1, 2), (2, 3), (3, 4)]  # type: ignore[union-attr]
    assert [p.request.release for p in parts] == [False, False, False, True]  # type: ignore[union-attr]
    # a part of every tensor carries the whole transfer's count: the peer checks it
    assert {p.request.tensors.whole for p in parts} == {8}  # type: ignore[union-attr]


def test_a_layer_bigger_than_a_part_is_cut_into_its_tensors() -> None:
    """One layer's slot (2 tensors × 1 MiB) over the limit: single tensors, named as
    layers of one tensor, offset by the request's own layer range."""
    req = SlotReq(KeyByBlocks(1, 0), Tensors(4, (3, 5), 2, 1), 1 << 20, exact=True)  # type: ignore[arg-type]
    job = Transfer.of_span(req, range(4), 0, 1 << 20)
    parts = list(job.parts(1 << 20))
    assert [p.tensors for p in parts] == [range(i, i + 1) for i in range(4)]
    sels = [p.request.tensors for p in parts]  # type: ignore[union-attr]
    assert [(t.count, t.layers, t.per_layer, t.dtype) for t in sels] == [
        (1, (6 + i, 7 + i), 1, 1) for i in range(4)
    ]
    assert {t.whole for t in sels} == {None}  # a layer range: checked as such
    assert all(p.nbytes == 1 << 20 for p in parts)
    # blocks: one block of a layer (2 × 4 KiB) over the limit
    blocks = np.arange(3, dtype=np.int64)
    breq = BlocksReq(KeyByBlocks(1, 0), Tensors(2, None, 2), blocks.tobytes(), 4096)
    bparts = list(Transfer.of_blocks(breq, range(2), blocks, blocks, 4096).parts(4096))
    assert len(bparts) == 6 and all(p.nbytes == 4096 for p in bparts)
    assert {p.request.tensors.whole for p in bparts} == {2}  # type: ignore[union-attr]


async def test_stager_bounds_what_it_lends() -> None:
    from aiokv._copy import CopyScheduler

    sched = CopyScheduler(torch.device("cpu"))
    try:
        st = Stager(sched, limit=4 * MiB)
        cpu = torch.device("cpu")
        await raises(CODE.LLM_PARAM_INVALID, st.reserve(5 * MiB, cpu, 1.0))
        assert st.in_use == 0
        a = await st.reserve(3 * MiB, cpu, 1.0)
        # no room within the deadline
        await raises(CODE.LLM_TIMEOUT, st.reserve(2 * MiB, cpu, 0.05))
        assert st.in_use == 3 * MiB
        waiter = asyncio.ensure_future(st.reserve(2 * MiB, cpu, 5.0))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        a.release()
        a.release()  # idempotent
        b = await asyncio.wait_for(waiter, 5.0)
        assert st.in_use == 2 * MiB
        b.release()
        assert st.in_use == 0
        # gather / scatter of many runs (index path) and of few runs (copy path)
        bufs = [torch.arange(64 * 1024, dtype=torch.int32).view(torch.uint8) for _ in range(2)]
        for layout in (
            ByteLayout.of_blocks(np.array([5, 3, 9, 10, 11, 0, 60, 2, 7, 1]), 1024),
            ByteLayout.of_span(100, 3000),
        ):
            got = await st.gather(bufs, layout, 1.0)
            want = b"".join(bytes(v) for v in layout.views([memoryview(b.numpy()) for b in bufs]))
            assert bytes(got.view) == want
            out = [torch.zeros_like(b) for b in bufs]
            await st.scatter(got, out, layout)
            got.release()
            assert (
                bytes(
                    b"".join(bytes(v) for v in layout.views([memoryview(b.numpy()) for b in out]))
                )
                == want
            )
        assert st.in_use == 0
    finally:
        await sched.aclose()


async def test_a_staging_failure_reaches_the_requester_under_its_code(
    route: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The serving side's staging failing with host memory short (a ``MemoryError``, or
    torch's allocator's ``RuntimeError``) is refused to the requester as
    ``LLM_OUT_OF_MEMORY``, the code a local caller would see for it (SPEC §1.2), not
    ``LLM_FAILED``; nothing stays lent or pinned."""
    async with linked(route, "tcp") as (p, d):
        await p.cache_manager.allocate_blocks_cache(paged(), BlocksCacheKey(1, 0))
        dst = await d.cache_manager.allocate_blocks_cache(paged())

        async def short(*args: Any, **kwargs: Any) -> Any:
            raise MemoryError

        monkeypatch.setattr(stager(p), "gather", short)
        exc = await raises(
            CODE.LLM_OUT_OF_MEMORY,
            d.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [0, 1], [0, 1]),
        )
        assert "MemoryError" in str(exc)
