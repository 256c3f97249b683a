"""Caches registered by address on a CUDA device: device addresses checked with the CUDA
driver, viewed without a copy; anything else refused before anything is kept."""

from __future__ import annotations

import pytest
import torch

from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import DataType
from aiokv import LLMException
from aiokv import LLMStatusCode
from aiokv._cache import wrap_memory
from aiokv.testing import linked_pair
from aiokv.testing import make_config

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
DESC = CacheDesc(2, [8, 1024], DataType.DT_FLOAT16)  # 2 tensors of 8 blocks of 2 KiB


def _host_addresses() -> tuple[list[torch.Tensor], list[int]]:
    kept = [torch.zeros(8, 1024, dtype=torch.float16) for _ in range(2)]
    return kept, [t.data_ptr() for t in kept]


def test_addresses_on_an_accelerator_but_cuda_are_refused_saying_to_pass_tensors() -> None:
    _, addrs = _host_addresses()
    # "meta" stands for an npu (which needs torch_npu): any device type but cpu and cuda
    with pytest.raises(LLMException, match="on meta, pass tensors") as info:
        wrap_memory("register_blocks_cache", DESC, addrs, torch.device("meta"))
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-CUDA error")
def test_device_addresses_without_cuda_are_refused() -> None:
    _, addrs = _host_addresses()
    with pytest.raises(LLMException, match="need CUDA") as info:
        wrap_memory("register_blocks_cache", DESC, addrs, torch.device("cuda", 0))
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


@needs_cuda
@pytest.mark.parametrize(
    "case",
    ["host memory", "past the allocation", "unknown address"],
)
def test_a_bad_device_address_is_refused_and_nothing_is_kept(case: str) -> None:
    dev = torch.device("cuda", 0)
    small = torch.zeros(1024, dtype=torch.float16, device=dev)  # 2 KiB: one block, not 8
    kept, host = _host_addresses()  # kept alive while their addresses are used
    addrs = {
        "host memory": host,
        "past the allocation": [small.data_ptr(), small.data_ptr()],
        "unknown address": [0x10, 0x20],
    }[case]
    # the caching allocator rounds allocations up: make "past" certain by the range size
    if case == "past the allocation":
        big = CacheDesc(2, [1 << 16, 1 << 16], DataType.DT_FLOAT16)  # 8 GiB per tensor
        with pytest.raises(LLMException, match="past the end") as info:
            wrap_memory("register_blocks_cache", big, addrs, dev)
    else:
        with pytest.raises(LLMException, match="not CUDA device memory") as info:
            wrap_memory("register_blocks_cache", DESC, addrs, dev)
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    del kept


@needs_cuda
async def test_device_addresses_register_without_a_copy_and_carry_a_pull() -> None:
    """A decoder on cuda:0 registers its KV tensors by address (as llm_datadist code
    does) and pulls blocks from a host-memory prompt into them: the bytes land in the
    caller's own tensors, and only in the blocks named."""
    dev = torch.device("cuda", 0)
    kv = [torch.zeros(8, 1024, dtype=torch.float16, device=dev) for _ in range(2)]
    src = [torch.randn(8, 1024).to(torch.float16) for _ in range(2)]
    prompt_config = make_config("tcp")
    decoder_config = make_config("tcp", device_type="cuda", pool=None)
    async with linked_pair(prompt_config, decoder_config) as (prompt, decoder):
        await prompt.cache_manager.register_blocks_cache(
            DESC, [t.data_ptr() for t in src], BlocksCacheKey(1, 0)
        )
        cache = await decoder.cache_manager.register_blocks_cache(
            DESC, [t.data_ptr() for t in kv], BlocksCacheKey(2, 0)
        )
        assert all(t.is_cuda for t in cache.tensors)
        assert [t.data_ptr() for t in cache.tensors] == [t.data_ptr() for t in kv]
        await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 0), cache, [5, 1], [0, 7])
        torch.cuda.synchronize(dev)
        for mine, theirs in zip(kv, src, strict=True):
            assert torch.equal(mine[0].cpu(), theirs[5])
            assert torch.equal(mine[7].cpu(), theirs[1])
            assert not mine[1:7].any()
        await decoder.cache_manager.unregister_cache(cache.cache_id)
