"""The page allocator and the refcounts that return memory to it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle
from hypothesis.stateful import RuleBasedStateMachine
from hypothesis.stateful import invariant
from hypothesis.stateful import precondition
from hypothesis.stateful import rule

from aiokv import CacheDesc
from aiokv import CacheKey
from aiokv import DataType
from aiokv import LLMException
from aiokv import LLMStatusCode
from aiokv import Placement
from aiokv._cache import Cache
from aiokv._pool import MemPool
from aiokv._pool import Span
from aiokv._registry import CacheRegistry
from aiokv._registry import key_id

PAGE_SHIFT = 10
PAGES = 64


def make_pool(pages: int = PAGES) -> MemPool:
    return MemPool(torch.zeros(pages << PAGE_SHIFT, dtype=torch.uint8), PAGE_SHIFT, "test pool")


def test_rounding_coalescing_and_stats() -> None:
    pool = make_pool(8)
    a = pool.allocate(1)
    b = pool.allocate(1025)  # two pages
    c = pool.allocate(1024)
    s = pool.stats()
    assert (s.used, s.allocations, s.free) == (4 << 10, 3, 4 << 10)
    assert pool.view(b).numel() == 1025
    pool.free(b)
    pool.check()
    assert pool.stats().largest_free == 4 << 10  # the 2-page hole is not adjacent to the tail
    pool.free(c)  # b's hole, c and the tail coalesce
    pool.check()
    assert pool.stats().largest_free == 7 << 10
    pool.free(a)
    pool.check()
    assert pool.stats().largest_free == 8 << 10 and pool.stats().allocations == 0


def test_best_fit_and_exhaustion_changes_nothing() -> None:
    pool = make_pool(8)
    spans = [pool.allocate(1024) for _ in range(8)]
    pool.free(spans[1])
    pool.free(spans[4])
    pool.free(spans[5])
    before = pool.stats()
    with pytest.raises(LLMException) as ei:
        pool.allocate(3 << 10)
    assert ei.value.status_code == LLMStatusCode.LLM_OUT_OF_MEMORY
    assert pool.stats() == before
    pool.check()
    got = pool.allocate(1024)
    assert got.start == 1  # best fit: the 1-page hole, not the 2-page one
    with pytest.raises(ValueError):
        pool.free(got) or pool.free(got)
    with pytest.raises(ValueError):
        pool.allocate(0)


def test_views_do_not_overlap() -> None:
    pool = make_pool(16)
    spans = [pool.allocate(n) for n in (100, 3000, 1024, 5000)]
    for i, s in enumerate(spans):
        pool.view(s).fill_(i + 1)
    for i, s in enumerate(spans):
        assert bool((pool.view(s) == i + 1).all())


class RefcountMachine(RuleBasedStateMachine):
    """Random allocate / deallocate / key / pin operations against pool + registry.

    Invariants after every step: the allocator's structure is sound, used bytes equal what
    live caches hold, and a cache's memory is freed exactly when its last reference goes.
    """

    caches = Bundle("caches")
    keys = Bundle("keys")

    def __init__(self) -> None:
        super().__init__()
        self.pool = make_pool()
        self.reg = CacheRegistry()
        self.next_req = 0
        self.pinned: list[int] = []

    def _alloc(self, desc: CacheDesc) -> tuple[Cache, list[tuple[MemPool, Span]]] | None:
        spans: list[Span] = []
        try:
            for _ in range(desc.num_tensors):
                spans.append(self.pool.allocate(desc.size))
        except LLMException as exc:
            assert exc.status_code == LLMStatusCode.LLM_OUT_OF_MEMORY  # noqa: PT017
            for s in spans:
                self.pool.free(s)
            return None
        tensors = [self.pool.view(s).view(desc.torch_dtype).view(desc.shape) for s in spans]
        return Cache(desc, tensors, is_blocks_cache=False), [(self.pool, s) for s in spans]

    @rule(
        target=caches,
        ntensors=st.integers(1, 3),
        batch=st.integers(1, 4),
        row=st.integers(1, 3000),
        nkeys=st.integers(0, 4),
    )
    def allocate(self, ntensors: int, batch: int, row: int, nkeys: int) -> int:
        desc = CacheDesc(ntensors, [batch, row], DataType.DT_UINT8, Placement.HOST)
        before = self.pool.stats()
        got = self._alloc(desc)
        if got is None:
            assert self.pool.stats() == before
            return -1
        cache, spans = got
        keys = []
        for _ in range(min(nkeys, batch)):
            self.next_req += 1
            keys.append(CacheKey(1, self.next_req))
        self.reg.add(cache, spans, remote_accessible=False, keys=keys)
        return cache.cache_id

    @rule(cid=caches)
    def deallocate(self, cid: int) -> None:
        e = self.reg.by_id(cid)
        if e is not None:
            self.reg.release_id(e)

    @rule(cid=caches)
    def remove_one_key(self, cid: int) -> None:
        e = self.reg.entries.get(cid)
        if e is not None and e.keys:
            req, prefix, model = min(e.keys)  # a key id: (req_id, prefix_id, model_id)
            assert self.reg.release_key(CacheKey(1, req, model, prefix))

    @rule(cid=caches)
    def pin(self, cid: int) -> None:
        e = self.reg.entries.get(cid)
        if e is not None:
            self.reg.pin(e)
            self.pinned.append(cid)

    @precondition(lambda self: bool(self.pinned))
    @rule()
    def unpin(self) -> None:
        cid = self.pinned.pop()
        self.reg.unpin(self.reg.entries[cid])

    @rule(req=st.integers(0, 10**6))
    def remove_missing_key_is_noop(self, req: int) -> None:
        before = self.pool.stats()
        if key_id(CacheKey(1, 10**7 + req)) not in self.reg.keys:
            assert not self.reg.release_key(CacheKey(1, 10**7 + req))
        assert self.pool.stats() == before

    @invariant()
    def consistent(self) -> None:
        self.pool.check()
        held = sum(s.npages for e in self.reg.entries.values() for _, s in e.spans)
        assert self.pool.stats().used == held << PAGE_SHIFT
        for e in self.reg.entries.values():
            assert e.id_held or e.keys or e.pins, "an unreferenced cache still holds memory"
        for key, (cid, _) in self.reg.keys.items():
            assert key in self.reg.entries[cid].keys

    def teardown(self) -> None:
        while self.pinned:
            self.unpin()
        for e in list(self.reg.entries.values()):
            for req, prefix, model in list(e.keys):
                self.reg.release_key(CacheKey(1, req, model, prefix))
            if e.id_held:
                self.reg.release_id(e)
        assert self.pool.stats().used == 0 and self.pool.stats().allocations == 0
        self.pool.check()


TestRefcounts = RefcountMachine.TestCase
TestRefcounts.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
