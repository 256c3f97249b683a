"""Issue #8 item 8: names, defaults, codes and error types as llm_datadist — keyword
names (today's kept), ``remote_accessible`` defaults, who may push, the wrong manager,
bad ``CacheDesc`` dims and key arguments, ``LLMException``'s constructor, ``str()`` of
enums, integer IPs, and the members llm_datadist has."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import pathlib
import pickle
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
from _helpers import not_listening
from _helpers import raises

import aiokv
import aiokv.sync
from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import CacheKey
from aiokv import CacheKeyByIdAndIndex
from aiokv import CacheManager
from aiokv import DataType
from aiokv import LLMClusterInfo
from aiokv import LLMConfig
from aiokv import LLMDataDist
from aiokv import LLMException
from aiokv import LLMRole
from aiokv import LLMStatusCode
from aiokv import MemInfo
from aiokv import Memtype
from aiokv import NoneArgumentError
from aiokv import Placement
from aiokv import Status
from aiokv.testing import cluster_info

CODE = LLMStatusCode


def config(**kw: Any) -> LLMConfig:
    """A participant that does not listen and refuses pushes unless told otherwise."""
    return not_listening(**({"pool": 1 << 20, "host_pool": 1 << 20} | kw))


def blocks(placement: Placement = Placement.DEVICE) -> CacheDesc:
    return CacheDesc(2, [4, 32], DataType.DT_UINT8, placement)


def state(cm: CacheManager) -> dict[str, Any]:
    return dataclasses.asdict(cm.statistics())


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@contextlib.asynccontextmanager
async def pusher_and_receiver(
    pusher_flag: bool,
) -> AsyncIterator[tuple[CacheManager, CacheManager]]:
    """A prompt (cluster 1) linked to a decoder (cluster 2) that accepts pushes."""
    async with (
        LLMDataDist(
            LLMRole.DECODER,
            2,
            config(listen_ip_info="127.0.0.1:0", enable_remote_cache_accessible=True),
        ) as d,
        LLMDataDist(LLMRole.PROMPT, 1, config(enable_remote_cache_accessible=pusher_flag)) as p,
    ):
        assert d.listen_address is not None
        peer = cluster_info(2, d.listen_address)
        assert (await p.link_clusters([peer]))[0] == CODE.LLM_SUCCESS
        yield p.cache_manager, d.cache_manager


# ---- keyword names --------------------------------------------------------------------
async def test_register_takes_addrs_and_todays_keyword() -> None:
    async with LLMDataDist(LLMRole.PROMPT, 1, config()) as dd:
        cm = dd.cache_manager
        mem = [torch.zeros(4, 32, dtype=torch.uint8) for _ in range(2)]
        a = await cm.register_cache(cache_desc=blocks(), addrs=mem)
        b = await cm.register_blocks_cache(blocks(), tensors_or_addrs=mem)
        c = await cm.register_blocks_cache(cache_desc=blocks(), addrs=mem, blocks_cache_key=None)
        assert a.tensor_addrs == b.tensor_addrs == c.tensor_addrs == [t.data_ptr() for t in mem]
        before = state(cm)
        with pytest.raises(TypeError, match="not both"):
            await cm.register_cache(blocks(), addrs=mem, tensors_or_addrs=mem)
        assert state(cm) == before
        for x in (a, b, c):
            await cm.unregister_cache(x.cache_id)


async def test_swap_blocks_keywords_old_and_new() -> None:
    async with LLMDataDist(LLMRole.DECODER, 1, config()) as dd:
        cm = dd.cache_manager
        dev = await cm.allocate_blocks_cache(blocks())
        host = await cm.allocate_blocks_cache(blocks(Placement.HOST))
        for i, t in enumerate(host.tensors):
            t.copy_(torch.arange(128, dtype=torch.uint8).view(4, 32) + i)
        await cm.swap_blocks(src_cache=host, dst_cache=dev, src_to_dst={0: 3})
        await cm.swap_blocks(src=host, dst=dev, src_to_dst={1: 2})  # KvCacheManager's names
        await cm.swap_blocks(host, dev, {2: 1})
        for h, d in zip(host.tensors, dev.tensors, strict=True):
            assert torch.equal(d[3], h[0]) and torch.equal(d[2], h[1]) and torch.equal(d[1], h[2])
        before = [t.clone() for t in dev.tensors]
        with pytest.raises(TypeError):
            await cm.swap_blocks(host, dev, {0: 0}, src_cache=host)  # type: ignore[misc]
        with pytest.raises(TypeError, match="not both"):
            await cm.swap_blocks(src=host, src_cache=host, dst_cache=dev, src_to_dst={0: 0})
        assert same(before, dev.tensors)


# ---- remote_accessible defaults, who may push ------------------------------------------
async def test_remote_accessible_default_by_placement_and_push_rules() -> None:
    async with pusher_and_receiver(pusher_flag=True) as (pm, dm):
        desc = CacheDesc(2, [2, 32], DataType.DT_UINT8)
        host_desc = CacheDesc(2, [2, 32], DataType.DT_UINT8, Placement.HOST)
        dev_mem = [torch.zeros(2, 32, dtype=torch.uint8) for _ in range(2)]
        host_mem = [torch.zeros(2, 32, dtype=torch.uint8) for _ in range(2)]
        off_mem = [torch.zeros(2, 32, dtype=torch.uint8) for _ in range(2)]
        on_dev = await dm.register_cache(desc, dev_mem)  # None: DEVICE → accessible
        on_host = await dm.register_cache(host_desc, host_mem)  # None: HOST → not
        off = await dm.register_cache(desc, off_mem, remote_accessible=False)
        src = await pm.allocate_cache(desc)
        for t in src.tensors:
            t.fill_(9)
        await pm.push_cache(CacheKeyByIdAndIndex(2, on_dev.cache_id, 1), src, 1)
        assert all(bool((t[1] == 9).all()) and bool((t[0] == 0).all()) for t in dev_mem)
        # the receiver refuses memory it did not register as accessible
        for refused in (on_host, off):
            key = CacheKeyByIdAndIndex(2, refused.cache_id, 0)
            await raises(CODE.LLM_FEATURE_NOT_ENABLED, pm.push_cache(key, src))
        assert all(bool((t == 0).all()) for t in host_mem + off_mem)
        # explicitly accessible host memory is accepted
        opened = await dm.register_cache(host_desc, host_mem, remote_accessible=True)
        await pm.push_cache(CacheKeyByIdAndIndex(2, opened.cache_id, 0), src)
        assert all(bool((t[0] == 9).all()) for t in host_mem)


async def test_pushing_needs_the_flag_on_the_sender() -> None:
    async with pusher_and_receiver(pusher_flag=False) as (pm, dm):
        desc = CacheDesc(2, [2, 32], DataType.DT_UINT8)
        dst = await dm.allocate_cache(desc)
        dst_blocks = await dm.allocate_blocks_cache(blocks(), BlocksCacheKey(2, 0))
        src = await pm.allocate_cache(desc)
        src_blocks = await pm.allocate_blocks_cache(blocks())
        for t in src.tensors + src_blocks.tensors:
            t.fill_(7)
        before = [t.clone() for t in dst.tensors + dst_blocks.tensors]
        await raises(
            CODE.LLM_PARAM_INVALID, pm.push_cache(CacheKeyByIdAndIndex(2, dst.cache_id, 0), src)
        )
        await raises(
            CODE.LLM_PARAM_INVALID,
            pm.push_blocks(BlocksCacheKey(2, 0), src_blocks, [0], [0]),
        )
        assert same(before, dst.tensors + dst_blocks.tensors)


# ---- the wrong manager ------------------------------------------------------------------
async def test_wrong_manager_is_param_invalid() -> None:
    async with LLMDataDist(LLMRole.PROMPT, 1, config()) as c:
        with pytest.raises(LLMException) as ei:
            _ = c.kv_cache_manager
        assert ei.value.status_code == CODE.LLM_PARAM_INVALID
    async with LLMDataDist(LLMRole.PROMPT, 1, config(enable_cache_manager=False)) as legacy:
        with pytest.raises(LLMException) as ei:
            _ = legacy.cache_manager
        assert ei.value.status_code == CODE.LLM_PARAM_INVALID
    with aiokv.sync.LLMDataDist(LLMRole.PROMPT, 1, config()) as s:
        with pytest.raises(LLMException) as ei:
            _ = s.kv_cache_manager
        assert ei.value.status_code == CODE.LLM_PARAM_INVALID


# ---- CacheDesc --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw",
    [
        {"batch_dim_index": -1},
        {"batch_dim_index": 2},
        {"seq_len_dim_index": -2},
        {"seq_len_dim_index": 2},
        {"data_type": DataType.DT_STRING},
        {"shape": []},
    ],
)
def test_bad_cache_desc_dims_are_param_invalid(kw: dict[str, Any]) -> None:
    args: dict[str, Any] = {"num_tensors": 1, "shape": [4, 8], "data_type": DataType.DT_FLOAT16}
    args.update(kw)
    with pytest.raises(LLMException) as ei:
        CacheDesc(**args)
    assert ei.value.status_code == CODE.LLM_PARAM_INVALID


def test_cache_desc_batch_dim_and_update_dim() -> None:
    d = CacheDesc(2, [4, 8], DataType.DT_FLOAT16, Placement.DEVICE, 1, 0)
    assert d.batch_dim == d.batch_dim_index == 1 and d.batch_size == 8
    assert CacheDesc(1, [4, 8], DataType.DT_FLOAT16, seq_len_dim_index=-1).seq_len_dim_index == -1
    d.update_dim(1, 16)
    assert d.shape == (4, 16) and d.batch_size == 16 and d.size == 4 * 16 * 2
    assert d == CacheDesc(2, [4, 16], DataType.DT_FLOAT16, Placement.DEVICE, 1, 0)
    for bad, exc in [((2, 1), LLMException), ((-1, 1), LLMException), ((0, 0), ValueError)]:
        with pytest.raises(exc):
            d.update_dim(*bad)
        assert d.shape == (4, 16)
    with pytest.raises(TypeError):
        d.update_dim(0, "3")  # type: ignore[arg-type]


async def test_update_dim_never_resizes_a_cache() -> None:
    async with LLMDataDist(LLMRole.PROMPT, 1, config()) as dd:
        cm = dd.cache_manager
        template = CacheDesc(1, [2, 16], DataType.DT_UINT8)
        a = await cm.allocate_cache(template)
        template.update_dim(1, 32)  # the template, for the next allocation
        b = await cm.allocate_cache(template)
        assert a.cache_desc.shape == (2, 16) and b.cache_desc.shape == (2, 32)
        with pytest.raises(LLMException) as ei:
            a.cache_desc.update_dim(1, 64)  # a cache's own descriptor
        assert ei.value.status_code == CODE.LLM_PARAM_INVALID
        assert a.cache_desc.shape == (2, 16) and tuple(a.tensors[0].shape) == (2, 16)


# ---- keys -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make",
    [
        lambda: CacheKey(1, 2, bogus=3),
        lambda: CacheKey(1, 2, 3, 4, 5),
        lambda: CacheKey(1),
        lambda: CacheKey(req_id=1),
        lambda: CacheKey(cluster_id=1, prompt_cluster_id=1, req_id=1),
        lambda: BlocksCacheKey(1, 2, 3),
        lambda: BlocksCacheKey(),
        lambda: BlocksCacheKey(model_id=1),
        lambda: BlocksCacheKey(1, extra=1),
    ],
)
def test_key_argument_errors_are_param_invalid(make: Any) -> None:
    with pytest.raises(LLMException) as ei:
        make()
    assert ei.value.status_code == CODE.LLM_PARAM_INVALID


def test_key_type_and_range_errors_stay_python_errors() -> None:
    with pytest.raises(TypeError):
        CacheKey(1, "2")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        BlocksCacheKey(-1)
    with pytest.raises(NoneArgumentError):
        CacheKey(None, 1)  # type: ignore[arg-type]


# ---- LLMException, Status, enums --------------------------------------------------------
def test_llm_exception_constructor_as_upstream() -> None:
    e = LLMException("why")
    assert e.status_code == CODE.LLM_SUCCESS and str(e) == "why"
    e = LLMException("why", status_code=CODE.LLM_TIMEOUT)
    assert e.status_code == CODE.LLM_TIMEOUT and e.args == ("why",)
    # a positional code is an argument like any other, as upstream
    e = LLMException("why", CODE.LLM_TIMEOUT)
    assert e.status_code == CODE.LLM_SUCCESS and e.args == ("why", CODE.LLM_TIMEOUT)
    back = pickle.loads(pickle.dumps(LLMException("x", status_code=CODE.LLM_LINK_BUSY, op="op")))
    assert back.status_code == CODE.LLM_LINK_BUSY and back.op == "op"
    assert isinstance(LLMException(), RuntimeError)


def test_no_positional_status_code_in_aiokv() -> None:
    """Every LLMException raised by aiokv names its code (a positional one would be lost)."""
    root = pathlib.Path(aiokv.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)
            if name == "LLMException" and (
                len(node.args) > 1 or not any(k.arg == "status_code" for k in node.keywords)
            ):
                offenders.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not offenders


def test_enums_print_as_upstream() -> None:
    assert str(CODE.LLM_SUCCESS) == "LLMStatusCode.LLM_SUCCESS"
    assert f"{CODE.LLM_TIMEOUT}" == "LLMStatusCode.LLM_TIMEOUT"
    assert str(DataType.DT_FLOAT16) == "DataType.DT_FLOAT16"
    assert str(Placement.HOST) == "Placement.HOST" and str(LLMRole.MIX) == "LLMRole.MIX"
    assert str(Memtype.MEM_TYPE_HOST) == "Memtype.MEM_TYPE_HOST"
    assert int(CODE.LLM_PARAM_INVALID) == 0x5010B005


def test_every_status_code_member() -> None:
    base = 0x5010B000
    expected = {
        "LLM_SUCCESS": 0,
        "LLM_FAILED": 0xFFFFFFFF,
        "LLM_PARAM_INVALID": base + 5,
        "LLM_WAIT_PROCESS_TIMEOUT": base + 1,
        "LLM_KV_CACHE_NOT_EXIST": base + 2,
        "LLM_REPEAT_REQUEST": base + 3,
        "LLM_REQUEST_ALREADY_COMPLETED": base + 4,
        "LLM_ENGINE_FINALIZED": base + 6,
        "LLM_NOT_YET_LINK": base + 7,
        "LLM_ALREADY_LINK": base + 8,
        "LLM_LINK_FAILED": base + 9,
        "LLM_UNLINK_FAILED": base + 10,
        "LLM_NOTIFY_PROMPT_UNLINK_FAILED": base + 11,
        "LLM_CLUSTER_NUM_EXCEED_LIMIT": base + 12,
        "LLM_PROCESSING_LINK": base + 13,
        "LLM_DEVICE_OUT_OF_MEMORY": base + 14,
        "LLM_PREFIX_ALREADY_EXIST": base + 15,
        "LLM_PREFIX_NOT_EXIST": base + 16,
        "LLM_SEQ_LENOVERLIMIT": base + 17,
        "LLM_NO_FREE_BLOCK": base + 18,
        "LLM_BLOCKS_OUT_OF_MEMORY": base + 19,
        "LLM_EXIST_LINK": base + 24,
        "LLM_FEATURE_NOT_ENABLED": base + 25,
        "LLM_TIMEOUT": base + 26,
        "LLM_LINK_BUSY": base + 27,
        "LLM_OUT_OF_MEMORY": base + 28,
        "LLM_DEVICE_MEM_ERROR": 507053,
        "LLM_SUSPECT_REMOTE_ERROR": 507057,
        "LLM_UNKNOWN_ERROR": -1,
    }
    assert {m.name: m.value for m in CODE} == expected


def test_missing_members() -> None:
    assert DataType.DT_STRING == 13
    with pytest.raises(ValueError):
        _ = DataType.DT_STRING.torch_dtype
    assert [m.value for m in Memtype] == [0, 1]
    info = MemInfo(Memtype.MEM_TYPE_DEVICE, 4096, 128)
    assert (info.mem_type, info.addr, info.size) == (Memtype.MEM_TYPE_DEVICE, 4096, 128)
    assert str(info) == "MemInfo(mem_type=Memtype.MEM_TYPE_DEVICE, addr=4096, size=128)"
    with pytest.raises(TypeError):
        MemInfo(0, 1, 1)  # type: ignore[arg-type]
    assert Status(CODE.LLM_SUCCESS).is_ok()
    assert not Status(CODE.LLM_TIMEOUT).is_ok()
    assert Status(CODE.LLM_TIMEOUT).status_code == CODE.LLM_TIMEOUT
    for name in ("MemInfo", "Memtype", "Status"):
        assert getattr(aiokv.sync, name) is getattr(aiokv, name)


async def test_remap_registered_memory_is_a_clear_refusal() -> None:
    async with LLMDataDist(LLMRole.PROMPT, 1, config()) as dd:
        cm = dd.cache_manager
        ok = MemInfo(Memtype.MEM_TYPE_DEVICE, 4096, 128)
        await raises(CODE.LLM_FEATURE_NOT_ENABLED, cm.remap_registered_memory(ok))
        await raises(CODE.LLM_FEATURE_NOT_ENABLED, cm.remap_registered_memory([ok, ok]))
        for bad in (
            [MemInfo(Memtype.MEM_TYPE_HOST, 4096, 128)],
            MemInfo(Memtype.MEM_TYPE_DEVICE, 0, 128),
            MemInfo(Memtype.MEM_TYPE_DEVICE, 4096, 0),
            [ok, 3],
            (ok,),
        ):
            await raises(CODE.LLM_PARAM_INVALID, cm.remap_registered_memory(bad))  # type: ignore[arg-type]
    with aiokv.sync.LLMDataDist(LLMRole.PROMPT, 1, config()) as s:
        with pytest.raises(LLMException) as ei:
            s.cache_manager.remap_registered_memory(ok)
        assert ei.value.status_code == CODE.LLM_FEATURE_NOT_ENABLED
        aiokv.sync.CacheManager.check_cache_key(CacheKey(1, 1))


# ---- LLMClusterInfo ---------------------------------------------------------------------
def test_cluster_info_as_upstream() -> None:
    info = LLMClusterInfo()
    assert info.remote_cluster_id is None and info.remote_role_type is None
    info.append_remote_ip_info(0x0100007F, 26000)  # llm_datadist's encoding of 127.0.0.1
    info.append_remote_ip_info("10.1.2.3", 1)
    info.append_local_ip_info("192.168.0.1", 0)
    assert info.remote_ip_info == [("127.0.0.1", 26000), ("10.1.2.3", 1)]
    assert info.remote_ip_info_list == [(0x0100007F, 26000), (0x0302010A, 1)]
    assert info.local_ip_info_list == [(0x0100A8C0, 0)]
    with pytest.raises(ValueError):
        info.append_remote_ip_info(1 << 32, 1)
    assert len(info.remote_ip_info) == 2
    info.remote_role_type = LLMRole.PROMPT
    info.remote_role_type = 2
    with pytest.raises(TypeError):
        info.remote_role_type = "PROMPT"  # type: ignore[assignment]
    assert info.remote_role_type == 2


async def test_linking_refuses_an_unset_cluster_id() -> None:
    async with LLMDataDist(LLMRole.DECODER, 2, config()) as d:
        info = LLMClusterInfo()
        info.append_remote_ip_info("127.0.0.1", 1)
        with pytest.raises(NoneArgumentError):
            await d.link_clusters([info])
        assert d.linked_clusters() == []
