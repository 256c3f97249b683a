"""CacheRegistry on its own: key binding, blocks keys, pins, releases and statistics().

Each test drives a registry it creates, over a small CPU ``MemPool``, through the
registry's own methods.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from aiokv import BlocksCacheKey
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
from aiokv._registry import Entry
from aiokv._registry import RegistryStats
from aiokv._registry import key_id

PAGE_SHIFT = 10
PAGE = 1 << PAGE_SHIFT
HOLD = CacheKey(1, req_id=2**64 - 1)  # the placeholder key: binds nothing


@pytest.fixture
def pool() -> MemPool:
    return MemPool(torch.zeros(64 << PAGE_SHIFT, dtype=torch.uint8), PAGE_SHIFT, "test pool")


@pytest.fixture
def reg() -> CacheRegistry:
    return CacheRegistry()


def allocate(
    reg: CacheRegistry,
    pool: MemPool,
    batch: int = 1,
    *,
    keys: list[CacheKey] | None = None,
    blocks_key: BlocksCacheKey | None = None,
) -> Entry:
    """A one-tensor cache of ``batch`` one-page slots from ``pool``, added to ``reg``."""
    desc = CacheDesc(1, [batch, PAGE], DataType.DT_UINT8, Placement.HOST)
    span = pool.allocate(desc.size)
    tensor = pool.view(span).view(desc.shape)
    cache = Cache(desc, [tensor], is_blocks_cache=blocks_key is not None)
    spans: list[tuple[MemPool, Span]] = [(pool, span)]
    return reg.add(cache, spans, remote_accessible=False, keys=keys or (), blocks_key=blocks_key)


def register(
    reg: CacheRegistry,
    *,
    keys: list[CacheKey] | None = None,
    blocks_key: BlocksCacheKey | None = None,
) -> Entry:
    """A cache over user memory (no pool spans), added to ``reg``."""
    desc = CacheDesc(1, [2, 64], DataType.DT_UINT8, Placement.HOST)
    cache = Cache(desc, [torch.zeros(2, 64, dtype=torch.uint8)], is_blocks_cache=False)
    return reg.add(cache, [], remote_accessible=False, keys=keys or (), blocks_key=blocks_key)


def stats(reg: CacheRegistry) -> dict[str, int]:
    return dataclasses.asdict(reg.statistics())


NOTHING = dict.fromkeys((f.name for f in dataclasses.fields(RegistryStats)), 0)


# ---- keys ------------------------------------------------------------------------------------
def test_placeholder_skipped_and_last_duplicate_wins(reg: CacheRegistry, pool: MemPool) -> None:
    k = CacheKey(1, req_id=5)
    e = allocate(reg, pool, 3, keys=[HOLD, k, k])
    assert reg.by_key(k) == (e, 2)  # the last duplicate's slot
    assert reg.by_key(HOLD) is None
    assert e.keys == {key_id(k)}
    assert stats(reg)["keys"] == 1
    assert not reg.release_key(HOLD)  # never bound


def test_keys_bind_their_slots(reg: CacheRegistry, pool: MemPool) -> None:
    ks = [CacheKey(1, req_id=i) for i in range(3)]
    e = allocate(reg, pool, 3, keys=ks)
    assert [reg.by_key(k) for k in ks] == [(e, 0), (e, 1), (e, 2)]
    # found by (req_id, model_id): the cluster id only chose the link
    assert reg.by_key(CacheKey(2, req_id=0)) == (e, 0)
    assert reg.by_key(CacheKey(1, req_id=0, model_id=1)) is None


def test_key_bound_elsewhere_moves(
    reg: CacheRegistry, pool: MemPool, caplog: pytest.LogCaptureFixture
) -> None:
    k = CacheKey(1, req_id=7)
    a = allocate(reg, pool, keys=[k])
    reg.release_id(a)  # only k keeps a's memory now
    assert pool.stats().used == PAGE
    with caplog.at_level(logging.WARNING, logger="aiokv"):
        b = allocate(reg, pool, keys=[k])
    assert "now cache" in caplog.text
    assert reg.by_key(k) == (b, 0)
    assert not a.keys and a.freed  # losing its last key freed a
    assert pool.stats().used == PAGE  # b's page only
    assert stats(reg) == NOTHING | {"caches": 1, "allocated": 1, "keys": 1}


def test_memory_returns_when_last_reference_goes(reg: CacheRegistry, pool: MemPool) -> None:
    k1, k2 = CacheKey(1, req_id=1), CacheKey(1, req_id=2)
    e = allocate(reg, pool, 2, keys=[k1, k2])
    reg.release_id(e)
    assert reg.by_id(e.cache.cache_id) is None  # the id is gone ...
    assert reg.by_key(k1) == (e, 0) and pool.stats().used == 2 * PAGE  # ... the memory not
    assert reg.release_key(k1)
    assert not reg.release_key(k1)  # already unbound
    assert pool.stats().used == 2 * PAGE and not e.freed
    assert reg.release_key(k2)
    assert e.freed and pool.stats().used == 0
    assert reg.entries == {} and stats(reg) == NOTHING
    # keys first, then the id
    e2 = allocate(reg, pool, keys=[k1])
    assert reg.release_key(k1)
    assert reg.by_id(e2.cache.cache_id) is e2 and pool.stats().used == PAGE
    reg.release_id(e2)
    assert e2.freed and pool.stats().used == 0


def test_user_memory_keys_die_with_registration(reg: CacheRegistry) -> None:
    k = CacheKey(1, req_id=9)
    e = register(reg, keys=[k])
    assert not e.owned and reg.by_key(k) == (e, 0)
    reg.release_id(e)
    assert reg.by_key(k) is None and e.freed  # no key outlives user memory
    assert stats(reg) == NOTHING


# ---- blocks keys ------------------------------------------------------------------------------
def test_later_blocks_key_wins(reg: CacheRegistry, caplog: pytest.LogCaptureFixture) -> None:
    key = BlocksCacheKey(1, 0)
    a = register(reg, blocks_key=key)
    assert reg.by_blocks_key(key) is a
    with caplog.at_level(logging.WARNING, logger="aiokv"):
        b = register(reg, blocks_key=key)
    assert "now cache" in caplog.text
    assert reg.by_blocks_key(key) is b and reg.by_blocks_key(key) is reg.by_id(b.cache.cache_id)
    assert reg.by_model_id(0) is b and reg.by_model_id(1) is None  # what a peer names
    assert a.blocks_key is None and b.blocks_key == key
    reg.release_id(a)  # the loser's release leaves the winner's binding alone
    assert reg.by_blocks_key(key) is b
    reg.release_id(b)
    assert reg.by_blocks_key(key) is None
    assert stats(reg) == NOTHING


# ---- pins -------------------------------------------------------------------------------------
def test_pin_defers_free(reg: CacheRegistry, pool: MemPool) -> None:
    e = allocate(reg, pool)
    reg.pin(e)
    reg.pin(e)
    reg.release_id(e)
    assert not e.freed and pool.stats().used == PAGE  # an in-flight operation still uses it
    assert reg.by_id(e.cache.cache_id) is None
    reg.unpin(e)
    assert not e.freed and pool.stats().used == PAGE  # one pin left
    reg.unpin(e)
    assert e.freed and pool.stats().used == 0 and reg.entries == {}


def test_pin_of_a_live_cache_frees_nothing(reg: CacheRegistry, pool: MemPool) -> None:
    e = allocate(reg, pool)
    reg.pin(e)
    reg.unpin(e)
    assert reg.by_id(e.cache.cache_id) is e and not e.freed and pool.stats().used == PAGE


def test_hold_pins_and_makes_revocable_until_let_go(reg: CacheRegistry, pool: MemPool) -> None:
    """A served grant's hold: memory kept and the grant revocable as one step, both
    ended by let_go (the memory freed then if its last reference went meanwhile); a
    hold of released memory records nothing."""
    e = allocate(reg, pool)
    revoked: list[LLMStatusCode] = []
    token = object()
    reg.hold(token, revoked.append, e)
    reg.release_id(e)
    assert not e.freed and stats(reg)["pins"] == 1
    assert reg.revoke(e, LLMStatusCode.LLM_TIMEOUT) == 1 and revoked == [LLMStatusCode.LLM_TIMEOUT]
    reg.hold(token, revoked.append, e)  # a second grant, on memory still held
    reg.let_go(token, e)
    assert reg.revoke(e, LLMStatusCode.LLM_TIMEOUT) == 0  # no longer revocable
    assert not e.freed  # the first hold still pins it
    reg.let_go(object(), e)
    assert e.freed and pool.stats().used == 0 and stats(reg) == NOTHING
    with pytest.raises(LLMException) as caught:
        reg.hold(token, revoked.append, e)
    assert caught.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    assert e.pins == 0 and e.revokers == {}


def test_attach_makes_pinned_work_revocable_unless_released_meanwhile(reg: CacheRegistry) -> None:
    """Work pinned before it awaited (staging, the engine) becomes revocable by attach,
    which refuses registered memory whose unregistration began meanwhile (its revoke
    ran before the revoker existed): nothing recorded, the pin the caller's to end."""
    e = register(reg)
    revoked: list[LLMStatusCode] = []
    reg.pin(e)
    reg.attach("early", revoked.append, e)
    assert reg.revoke(e, LLMStatusCode.LLM_KV_CACHE_NOT_EXIST) == 1 and len(revoked) == 1
    reg.pin(e)
    reg.release_id(e)  # unregister_cache began (and revoked what it saw)
    with pytest.raises(LLMException) as caught:
        reg.attach("late", revoked.append, e)
    assert caught.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    assert e.revokers == {} and e.pins == 2 and not e.freed
    reg.unpin(e)
    reg.unpin(e)
    assert e.freed and stats(reg) == NOTHING


# ---- lookups -----------------------------------------------------------------------------------
def test_entry_checks_owner_and_liveness(reg: CacheRegistry, pool: MemPool) -> None:
    e = allocate(reg, pool)
    assert reg.entry("op", e.cache) is e
    other = CacheRegistry()
    with pytest.raises(LLMException) as ei:
        other.entry("op", e.cache)
    assert ei.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    user = Cache.create_cpu_cache(
        CacheDesc(1, [4], DataType.DT_UINT8, Placement.HOST), [torch.zeros(4, dtype=torch.uint8)]
    )
    assert reg.entry("op", user) is None  # user-owned: nobody's bookkeeping
    reg.pin(e)
    reg.release_id(e)
    with pytest.raises(LLMException) as ei:
        reg.entry("op", e.cache)  # released, though pinned memory lives on
    assert ei.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    with pytest.raises(TypeError):
        reg.entry("op", "not a cache")
    reg.unpin(e)


def test_find_region(reg: CacheRegistry, pool: MemPool) -> None:
    e = allocate(reg, pool, 2)
    base = e.cache.tensors[0].data_ptr()
    assert reg.find_region(base, 2 * PAGE) == (e, 0, 0)
    assert reg.find_region(base + PAGE, 10) == (e, 0, PAGE)
    assert reg.find_region(base + 1, 2 * PAGE) is None  # runs past the tensor
    assert reg.find_region(base - 1, 1) is None
    assert reg.find_region(base, -1) is None
    reg.release_id(e)
    assert reg.find_region(base, 1) is None


def over(reg: CacheRegistry, memory: torch.Tensor) -> Entry:
    """A cache registered over ``memory`` (user memory, one tensor), added to ``reg``."""
    desc = CacheDesc(1, [1, memory.numel()], DataType.DT_UINT8, Placement.HOST)
    cache = Cache(desc, [memory.view(1, -1)], is_blocks_cache=False)
    return reg.add(cache, [], remote_accessible=True)


def test_find_region_of_memory_registered_twice_survives_either_going(
    reg: CacheRegistry,
) -> None:
    """The same memory registered twice: unregistering one leaves the other reachable
    (the second registration's region replaced the first's, and went with it)."""
    memory = torch.zeros(4 * PAGE, dtype=torch.uint8)
    base = memory.data_ptr()
    a, b = over(reg, memory), over(reg, memory)
    assert reg.find_region(base, PAGE) == (b, 0, 0)  # the latest wins
    reg.release_id(b)
    assert reg.find_region(base + PAGE, PAGE) == (a, 0, PAGE)
    b = over(reg, memory)
    reg.release_id(a)
    assert reg.find_region(base, 4 * PAGE) == (b, 0, 0)
    reg.release_id(b)
    assert reg.find_region(base, 1) is None


def test_find_region_inside_a_registration_within_another(reg: CacheRegistry) -> None:
    """A cache registered inside another's memory, at another start: addresses of the
    outer one past the inner one's start are still found (only the nearest start below
    an address was looked at)."""
    memory = torch.zeros(16 * PAGE, dtype=torch.uint8)
    base = memory.data_ptr()
    outer, inner = over(reg, memory), over(reg, memory[PAGE : 2 * PAGE])
    assert reg.find_region(base + PAGE, PAGE) == (inner, 0, 0)  # the nearest start wins
    assert reg.find_region(base + 4 * PAGE, PAGE) == (outer, 0, 4 * PAGE)
    assert reg.find_region(base + PAGE, 2 * PAGE) == (outer, 0, PAGE)  # past the inner one
    assert reg.find_region(base + 15 * PAGE, PAGE + 1) is None  # past the outer one
    reg.release_id(outer)
    assert reg.find_region(base + 4 * PAGE, PAGE) is None
    assert reg.find_region(base + PAGE, PAGE) == (inner, 0, 0)


# ---- statistics --------------------------------------------------------------------------------
def test_statistics_track_every_transition(reg: CacheRegistry, pool: MemPool) -> None:
    want = dict(NOTHING)
    assert stats(reg) == want

    def expect(**delta: int) -> None:
        for name, d in delta.items():
            want[name] += d
        assert stats(reg) == want

    k1, k2, k3 = (CacheKey(1, req_id=i) for i in (1, 2, 3))
    a = allocate(reg, pool, 2, keys=[k1, k2])
    expect(caches=1, allocated=1, keys=2)
    b = allocate(reg, pool, blocks_key=BlocksCacheKey(1, 0))
    expect(caches=1, allocated=1, blocks_keys=1)
    u = register(reg, keys=[k3], blocks_key=BlocksCacheKey(1, 1))
    expect(caches=1, registered=1, keys=1, blocks_keys=1)
    reg.pin(a, b)
    expect(pins=2)
    reg.pin(a)
    expect(pins=1)
    reg.release_id(a)  # keys and pins keep it
    expect(released=1)
    assert reg.release_key(k1)
    expect(keys=-1)
    reg.unpin(a)
    expect(pins=-1)
    reg.unpin(a)
    expect(pins=-1)
    assert reg.release_key(k2)  # the last reference: freed
    expect(caches=-1, allocated=-1, released=-1, keys=-1)
    reg.release_id(b)  # b is pinned: its blocks key goes, its memory stays
    expect(released=1, blocks_keys=-1)
    reg.unpin(b)
    expect(caches=-1, allocated=-1, released=-1, pins=-1)
    reg.release_id(u)  # user memory: its key and blocks key go with it
    expect(caches=-1, registered=-1, keys=-1, blocks_keys=-1)
    assert want == NOTHING and pool.stats().used == 0


def test_a_lease_pin_holds_memory_and_is_counted_apart(reg: CacheRegistry, pool: MemPool) -> None:
    """A lease (issue #10) pins its cache like an operation, but ``statistics()`` counts
    it under ``leases``, not ``pins``; the memory goes back when the lease ends."""
    e = allocate(reg, pool, 2)
    reg.pin(e, lease=True)
    reg.pin(e)
    assert (stats(reg)["pins"], stats(reg)["leases"]) == (1, 1)
    reg.release_id(e)
    reg.unpin(e)
    assert stats(reg)["caches"] == 1 and not e.freed  # the lease still holds it
    reg.unpin(e, lease=True)
    assert e.freed and stats(reg) == NOTHING
