"""A synchronous, llm_datadist-style program on ``aiokv.sync``: the calls, arguments and
options of an llm_datadist client, blocking, with aiokv underneath.

Run: ``python -m aiokv.examples.sync_datadist``. A real deployment runs the prompt and
the decoder in two processes; here both live in one, over loopback TCP. Porting an
llm_datadist program is the import line (``import aiokv.sync as llm_datadist``) and,
on a machine without an NPU, the device the tensors live on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import aiokv.sync as llm_datadist  # was: import llm_datadist
from aiokv.sync import BlocksCacheKey
from aiokv.sync import CacheDesc
from aiokv.sync import DataType
from aiokv.sync import LLMClusterInfo
from aiokv.sync import LLMConfig
from aiokv.sync import LLMRole
from aiokv.sync import LLMStatusCode
from aiokv.sync import MemPoolConfig

PROMPT, DECODER = 1, 2
DESC = CacheDesc(4, [8, 16, 4, 64], DataType.DT_FLOAT16)  # 2 layers x (K, V), 8 blocks


def prompt_options() -> dict[str, str]:
    """llm_datadist's way: an ``LlmConfig`` assigned attribute by attribute, then its
    ``dict[str, str]`` form."""
    config = LLMConfig()
    config.device_id = 0
    config.enable_cache_manager = True
    config.listen_ip_info = "127.0.0.1:0"
    config.mem_pool_cfg = MemPoolConfig(8 << 20)  # or llm_datadist's JSON string
    config.device_type = "cpu"  # aiokv's own option; "auto" picks an NPU or GPU
    return config.generate_options()


def decoder_options() -> dict[str, str]:
    """The same options as a plain dict with llm_datadist's keys."""
    return {
        "ge.exec.deviceId": "0",
        "llm.EnableCacheManager": "1",
        "llm.SyncKvCacheWaitTime": "5000",
        "llm.MemPoolConfig": '{"memory_size": 8388608, "page_shift": 16}',
        "aiokv.deviceType": "cpu",
    }


def main(say: Callable[..., Any] = print) -> None:
    """Prompt fills a blocks cache; decoder links, pulls blocks 2..3, checks, cleans up."""
    say("prompt options:", prompt_options())
    prompt = llm_datadist.LLMDataDist(LLMRole.PROMPT, PROMPT)
    prompt.init(prompt_options())
    decoder = llm_datadist.LLMDataDist(LLMRole.DECODER, DECODER)
    decoder.init(decoder_options())
    # aiokv.sync generates the managers' blocking methods: typed as Any for mypy
    prompt_cm: Any = prompt.cache_manager
    decoder_cm: Any = decoder.cache_manager
    try:
        src = prompt_cm.allocate_blocks_cache(DESC, BlocksCacheKey(PROMPT))
        for i, t in enumerate(src.tensors):
            t.copy_(torch.full(t.shape, float(i)))

        cluster = LLMClusterInfo()
        cluster.remote_cluster_id = PROMPT
        assert prompt.listen_address is not None
        cluster.append_local_ip_info("127.0.0.1", 0)
        cluster.append_remote_ip_info(*prompt.listen_address)
        ret, rets = decoder.link_clusters([cluster], timeout=5000)
        if ret != LLMStatusCode.LLM_SUCCESS:
            raise RuntimeError(f"link_clusters: {ret} {rets}")

        dst = decoder_cm.allocate_blocks_cache(DESC)
        decoder_cm.pull_blocks(BlocksCacheKey(PROMPT), dst, [2, 3], [0, 1])
        ok = all(torch.equal(d[:2], s[2:4]) for d, s in zip(dst.tensors, src.tensors, strict=True))
        say(f"pull_blocks [2, 3] -> [0, 1]: bytes identical = {ok}")

        decoder.unlink_clusters([cluster], timeout=5000)
        decoder_cm.deallocate_blocks_cache(dst)
        prompt_cm.deallocate_blocks_cache(src)
        if not ok:
            raise RuntimeError("the decoder did not receive the prompt's blocks")
    finally:
        decoder.finalize()
        prompt.finalize()
    say("finalized; still initialized:", prompt.initialized or decoder.initialized)


if __name__ == "__main__":
    main()
