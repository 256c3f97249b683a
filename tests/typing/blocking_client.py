"""A blocking llm_datadist-style program, type-checked by tests/test_sync_signatures.py
with ``mypy --strict`` (never run): what an llm_datadist client writes must check."""

from __future__ import annotations

import torch

import aiokv.sync as llm_datadist
from aiokv.sync import BlocksCacheKey
from aiokv.sync import CacheDesc
from aiokv.sync import CacheKey
from aiokv.sync import CacheKeyByIdAndIndex
from aiokv.sync import DataType
from aiokv.sync import LLMClusterInfo
from aiokv.sync import LLMConfig
from aiokv.sync import LLMRole
from aiokv.sync import LLMStatusCode
from aiokv.sync import Placement


def prompt() -> None:
    config = LLMConfig()
    config.device_id = 0
    config.enable_cache_manager = True
    config.listen_ip_info = "127.0.0.1:26000"
    config.mem_pool_cfg = '{"memory_size": 67108864, "page_shift": 16}'
    config.host_mem_pool_cfg = '{"memory_size": 67108864}'
    config.sync_kv_timeout = "1000"
    datadist = llm_datadist.LLMDataDist(LLMRole.PROMPT, 0)
    datadist.init(config.generate_options())
    cache_manager = datadist.cache_manager
    desc = CacheDesc(2, [4, 16], DataType.DT_FLOAT, Placement.DEVICE)
    kv = [torch.zeros(4, 16) for _ in range(2)]
    cache = cache_manager.register_blocks_cache(desc, [t.data_ptr() for t in kv], BlocksCacheKey(0))
    blocks = cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(0, 1))
    cache_manager.copy_blocks(blocks, {0: [1, 2]})
    keyed = cache_manager.allocate_cache(CacheDesc(1, [2, 8], DataType.DT_BF16), [CacheKey(0, 1)])
    cache_manager.deallocate_cache(keyed)
    cache_manager.deallocate_blocks_cache(blocks)
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()


class Synchronizer(llm_datadist.LayerSynchronizer):
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return True


def decoder() -> None:
    datadist = llm_datadist.LLMDataDist(LLMRole.DECODER, 1)
    datadist.init({"llm.EnableCacheManager": "1", "llm.SyncKvCacheWaitTime": "1000"})
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = 0
    cluster.append_local_ip_info("127.0.0.1", 0)
    cluster.append_remote_ip_info("127.0.0.1", 26000)
    ret, rets = datadist.link_clusters([cluster], 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        reason: str | None = datadist.link_failure(0)
        raise RuntimeError(f"link failed: {rets} {reason}")
    manager = datadist.cache_manager
    dst = manager.allocate_blocks_cache(CacheDesc(2, [4, 16], DataType.DT_FLOAT))
    manager.pull_blocks(BlocksCacheKey(0), dst, src_blocks=[0, 1], dst_blocks=[2, 3])
    manager.push_cache(CacheKeyByIdAndIndex(cluster_id=0, cache_id=1, batch_index=0), dst)
    manager.pull_cache(CacheKeyByIdAndIndex(0, 1, 0), dst, 0)
    task = manager.transfer_cache_async(dst, Synchronizer(), [])
    code: LLMStatusCode = task.synchronize()
    assert code == LLMStatusCode.LLM_SUCCESS
    comm_id: int = datadist.link("comm", {0: 0, 1: 1}, "{}")
    status: llm_datadist.RegisterMemStatus = datadist.query_register_mem_status(comm_id)
    assert status is not None
    datadist.unlink(comm_id)
    datadist.unlink_clusters([cluster], 5000, force=True)
    datadist.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": "127.0.0.1:26001"})
    datadist.finalize()
