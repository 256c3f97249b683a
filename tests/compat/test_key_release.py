"""When a pull releases its key, as llm_datadist decides: llm_datadist user code run on
``aiokv.sync`` (found in review: aiokv released every key on any pull by it, and never
on a pull by id).

Each test is llm_datadist code (cache-manager mode, owner without
``enable_remote_cache_accessible``: pulls are served by request, as llm_datadist's
``SendState`` serves them) whose outcome on llm_datadist is stated in the test, with the
llm_datadist source it comes from (hicann/hixl 9ed283b2).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

import aiokv.sync as llm_datadist
from aiokv.sync import CacheDesc
from aiokv.sync import CacheKey
from aiokv.sync import CacheKeyByIdAndIndex
from aiokv.sync import DataType
from aiokv.sync import LLMClusterInfo
from aiokv.sync import LLMConfig
from aiokv.sync import LLMException
from aiokv.sync import LLMRole
from aiokv.sync import LLMStatusCode

UINT64_MAX = 2**64 - 1
Pair = tuple[llm_datadist.LLMDataDist, llm_datadist.LLMDataDist]


def _options() -> dict[str, str]:
    cfg = LLMConfig()
    cfg.device_type = "cpu"
    cfg.enable_cache_manager = True
    cfg.listen_ip_info = "127.0.0.1:0"
    cfg.mem_pool_cfg = '{"memory_size": 4194304, "page_shift": 12}'
    return cfg.generate_options()


@pytest.fixture
def pair() -> Iterator[Pair]:
    prompt = llm_datadist.LLMDataDist(LLMRole.PROMPT, 1)
    prompt.init(_options())
    decoder = llm_datadist.LLMDataDist(LLMRole.DECODER, 2)
    decoder.init(_options())
    try:
        info = LLMClusterInfo()
        info.remote_cluster_id = 1
        info.append_local_ip_info("127.0.0.1", 0)
        info.append_remote_ip_info(*prompt.listen_address)
        ret, _ = decoder.link_clusters([info], timeout=5000)
        assert ret == LLMStatusCode.LLM_SUCCESS
        yield prompt, decoder
    finally:
        decoder.finalize()
        prompt.finalize()


def until_released(owner: llm_datadist.LLMDataDist) -> None:
    """Wait (at most 5 s) until ``owner`` holds no key: a pull's release happens when
    the owner's side of it ends, a moment after the pull returned to the puller."""
    deadline = time.monotonic() + 5
    while owner.cache_manager.statistics().keys and time.monotonic() < deadline:
        time.sleep(0.01)
    assert owner.cache_manager.statistics().keys == 0


DESC = CacheDesc(4, [1, 64], DataType.DT_UINT8)  # 2 layers of K/V, one slot


def _fill(cache: llm_datadist.Cache) -> None:
    for i, t in enumerate(cache.tensors):
        t.fill_(i + 1)


def test_layerwise_pull_cache_keeps_the_key_until_every_layer_was_pulled(pair: Pair) -> None:
    """llm_datadist pulls KV layer by layer with ``src_layer_range`` (its documented
    "按层pull kv" use): a pull of some layers by ``CacheKey`` removes only those tensors
    from the key's pending set (send_state.cc ``GetLayerRangeTensorIndices`` ->
    cache_manager.cc ``RemoveCacheKey(..., tensor_indices)``); the key is released once
    every tensor was pulled (aiokv released it after the first layer)."""
    prompt, decoder = pair
    src = prompt.cache_manager.allocate_cache(DESC, [CacheKey(1, req_id=7)])
    _fill(src)
    prompt.cache_manager.deallocate_cache(src)  # the key keeps it alive, as upstream
    dst = decoder.cache_manager.allocate_cache(DESC)
    key = CacheKey(1, req_id=7)
    decoder.cache_manager.pull_cache(
        key, dst, src_layer_range=range(0, 1), dst_layer_range=range(0, 1)
    )
    # layer 1: on llm_datadist the key is still bound (tensors 2, 3 not pulled yet)
    decoder.cache_manager.pull_cache(
        key, dst, src_layer_range=range(1, 2), dst_layer_range=range(1, 2)
    )
    assert [int(t[0, 0]) for t in dst.tensors] == [1, 2, 3, 4]
    # now every tensor was pulled: the key is released, as on llm_datadist, once the
    # owner's side of the pull ended (a moment after the pull returned here)
    until_released(prompt)
    with pytest.raises(LLMException) as e:
        decoder.cache_manager.pull_cache(key, dst)
    assert e.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST


def test_pull_by_prefix_key_does_not_release_it(pair: Pair) -> None:
    """A prefix cache (``CacheKey(..., prefix_id=p)``, ``req_id`` the placeholder) is
    shared: llm_datadist never releases a prefix key on a pull (send_state.cc
    ``QueryCacheEntryAndOffset``: ``if (!is_prefix && cache_entry.is_owned ...)
    SetCacheKeyToRemove``), so every decoder can pull it; only ``remove_cache_key``
    releases it (aiokv released it on the first pull)."""
    prompt, decoder = pair
    prefix = CacheKey(1, req_id=UINT64_MAX, prefix_id=5)
    src = prompt.cache_manager.allocate_cache(DESC, [prefix])
    _fill(src)
    dst = decoder.cache_manager.allocate_cache(DESC)
    decoder.cache_manager.pull_cache(prefix, dst)
    decoder.cache_manager.pull_cache(prefix, dst)  # a second request sharing the prefix
    assert [int(t[0, 0]) for t in dst.tensors] == [1, 2, 3, 4]


def test_pull_by_key_of_registered_cache_does_not_release_it(pair: Pair) -> None:
    """Keys bound to memory the caller registered are not released by pulls on
    llm_datadist (same condition: ``cache_entry.is_owned`` is false for
    ``register_cache``; ``RemoveCacheKey`` also returns at once for such a cache)
    (aiokv released the key on the first pull)."""
    prompt, decoder = pair
    kv = [torch.full((1, 64), i + 1, dtype=torch.uint8) for i in range(4)]
    prompt.cache_manager.register_cache(DESC, [t.data_ptr() for t in kv], [CacheKey(1, req_id=9)])
    dst = decoder.cache_manager.allocate_cache(DESC)
    decoder.cache_manager.pull_cache(CacheKey(1, req_id=9), dst)
    decoder.cache_manager.pull_cache(CacheKey(1, req_id=9), dst)
    assert [int(t[0, 0]) for t in dst.tensors] == [1, 2, 3, 4]


def test_pull_by_id_of_a_keyed_slot_releases_its_key(pair: Pair) -> None:
    """On llm_datadist a pull by ``CacheKeyByIdAndIndex`` of a slot that a ``CacheKey``
    is bound to goes through that key (send_state.cc ``GetCacheKey``: ``(cache_id,
    batch_index)`` -> the bound key, then ``SetCacheKeyToRemove``) and releases it like
    a pull by the key: once the prompt deallocates, the memory is back in the pool (on
    aiokv the key stayed bound: the slot's memory was held until ``remove_cache_key``)."""
    prompt, decoder = pair
    cm = prompt.cache_manager
    used_before = cm.get_pool_stats().used
    src = cm.allocate_cache(DESC, [CacheKey(1, req_id=11)])
    _fill(src)
    dst = decoder.cache_manager.allocate_cache(DESC)
    decoder.cache_manager.pull_cache(CacheKeyByIdAndIndex(1, src.cache_id, 0), dst)
    assert [int(t[0, 0]) for t in dst.tensors] == [1, 2, 3, 4]
    until_released(prompt)  # once the owner's side of the pull ended, as by the key
    cm.deallocate_cache(src)
    assert cm.get_pool_stats().used == used_before  # the key went with the pull
