"""``aiokv.sync``: llm_datadist's blocking API over the same engine (issue #7).

The main test runs a purely synchronous script (no ``async`` anywhere) in a fresh
interpreter, as a vLLM or MindIE worker would.
"""

from __future__ import annotations

import inspect
import textwrap

from _helpers import run_code

import aiokv
import aiokv.sync as llm_datadist

SCRIPT = textwrap.dedent(
    """
    import threading
    import torch
    import aiokv.sync as llm_datadist
    from aiokv.sync import (BlocksCacheKey, CacheDesc, DataType, LLMClusterInfo, LLMConfig,
                            LLMRole, LLMStatusCode, TransferWithCacheKeyConfig)

    def options():
        cfg = LLMConfig()
        cfg.device_type = "cpu"
        cfg.enable_cache_manager = True
        cfg.listen_ip_info = "127.0.0.1:0"
        cfg.mem_pool_cfg = '{"memory_size": 33554432, "page_shift": 12}'
        cfg.enable_remote_cache_accessible = True
        return cfg.generate_options()

    prompt = llm_datadist.LLMDataDist(LLMRole.PROMPT, 1)
    prompt.init(options())
    decoder = llm_datadist.LLMDataDist(LLMRole.DECODER, 2)
    decoder.init(options())
    info = LLMClusterInfo()
    info.remote_cluster_id = 1
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info(*prompt.listen_address)
    code, codes = decoder.link_clusters([info], timeout=5000)
    assert code == LLMStatusCode.LLM_SUCCESS, (code, codes)

    desc = CacheDesc(4, [64, 4096], DataType.DT_UINT8)
    src = prompt.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(1, 0))
    g = torch.Generator().manual_seed(5)
    for t in src.tensors:
        t.copy_(torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8))
    dst = decoder.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(2, 0))

    def pull(i):  # four threads, disjoint blocks, at once
        blocks = list(range(16 * i, 16 * (i + 1)))
        decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, blocks, blocks)

    threads = [threading.Thread(target=pull, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(torch.equal(a, b) for a, b in zip(src.tensors, dst.tensors))

    # layer-wise, prompt -> decoder, with a plain blocking synchronizer
    class Ready:
        def synchronize_layer(self, layer_index, timeout_in_millis):
            return True

    for t in dst.tensors:
        t.zero_()
    assert prompt.linked_clusters() == [2]  # the decoder's link serves both directions
    task = prompt.cache_manager.transfer_cache_async(
        src, Ready(), [TransferWithCacheKeyConfig(BlocksCacheKey(2, 0))],
        list(range(64)), list(range(64)))
    assert task.synchronize() == LLMStatusCode.LLM_SUCCESS
    assert task.get_results() == [LLMStatusCode.LLM_SUCCESS]
    assert all(torch.equal(a, b) for a, b in zip(src.tensors, dst.tensors))

    assert decoder.unlink_clusters([info])[0] == LLMStatusCode.LLM_SUCCESS
    decoder.finalize()
    prompt.finalize()
    left = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    assert left == [], left
    print("OK")
    """
)


def test_a_purely_synchronous_program() -> None:
    out = run_code(SCRIPT, timeout=120)
    assert out.stdout.strip().endswith("OK")


def test_every_public_name_is_there() -> None:
    assert set(llm_datadist.__all__) == set(aiokv.__all__) - {"__version__"}
    for name in llm_datadist.__all__:
        assert hasattr(llm_datadist, name), name


def test_the_operations_block() -> None:
    for cls, async_cls in [
        (llm_datadist.CacheManager, aiokv.CacheManager),
        (llm_datadist.CacheTask, aiokv.CacheTask),
        (llm_datadist.LLMDataDist, aiokv.LLMDataDist),
    ]:
        for name, _ in inspect.getmembers(async_cls, inspect.iscoroutinefunction):
            if name.startswith("_"):
                continue
            blocking = getattr(cls, name)
            assert not inspect.iscoroutinefunction(blocking), f"{cls.__name__}.{name}"
            assert inspect.getdoc(blocking), f"{cls.__name__}.{name}"


def test_a_forgotten_instance_is_finalized_at_exit() -> None:
    script = textwrap.dedent(
        """
        import aiokv.sync as llm_datadist
        from aiokv.sync import LLMConfig, LLMRole
        dd = llm_datadist.LLMDataDist(LLMRole.PROMPT, 1)
        dd.init(LLMConfig(device_type="cpu", listen_ip_info="127.0.0.1:0"))
        print(dd.listen_address[1])
        """  # exits without finalize: the atexit hook must stop it (and not hang)
    )
    out = run_code(script)
    assert "finalized" not in out.stderr or "failed" not in out.stderr
