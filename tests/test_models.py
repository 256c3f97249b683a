"""Typed models: positional/keyword forms, aliases, validation errors per SPEC §1.2/§1.3."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import CacheKey
from aiokv import CacheKeyByIdAndIndex
from aiokv import DataType
from aiokv import LLMClusterInfo
from aiokv import LLMConfig
from aiokv import LLMException
from aiokv import MemPoolConfig
from aiokv import NoneArgumentError
from aiokv import Placement
from aiokv import TransferConfig
from aiokv import TransferWithCacheKeyConfig


def test_datatype_values_and_torch_mapping() -> None:
    assert DataType.DT_BF16 == 27 and DataType.DT_FLOAT16 == 1 and DataType.DT_BOOL == 12
    for dt in DataType:
        if dt is DataType.DT_STRING:  # llm_datadist's, with no torch type
            continue
        assert DataType.from_torch(dt.torch_dtype) is dt
        assert dt.item_size == torch.empty(0, dtype=dt.torch_dtype).element_size()
    with pytest.raises(ValueError, match="complex64"):
        DataType.from_torch(torch.complex64)
    with pytest.raises(TypeError):
        DataType.from_torch("float16")  # type: ignore[arg-type]


def test_cache_desc_forms_and_sizes() -> None:
    d = CacheDesc(2, [4, 16, 8], DataType.DT_BF16)
    assert d.shape == (4, 16, 8) and d.placement == Placement.DEVICE
    assert d.size == 4 * 16 * 8 * 2 and d.batch_size == 4
    k = CacheDesc(num_tensors=2, shape=(4, 16, 8), data_type=torch.bfloat16)
    assert k == d
    h = CacheDesc(1, [3, 5], DataType.DT_FLOAT, Placement.HOST, batch_dim_index=1)
    assert h.batch_size == 5
    with pytest.raises(Exception, match="frozen"):
        d.num_tensors = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "exc"),
    [
        ({"num_tensors": "2"}, TypeError),
        ({"num_tensors": None}, NoneArgumentError),
        ({"num_tensors": 0}, ValueError),
        ({"num_tensors": True}, TypeError),
        ({"shape": [0, 4]}, ValueError),
        ({"shape": [1.5]}, TypeError),
        ({"shape": "abc"}, TypeError),
        ({"data_type": 27}, TypeError),
        ({"data_type": None}, NoneArgumentError),
        ({"placement": 3}, TypeError),
        ({"batch_dim_index": 5}, LLMException),
        ({"bogus": 1}, TypeError),
    ],
)
def test_cache_desc_rejects(kwargs: dict[str, Any], exc: type[Exception]) -> None:
    base: dict[str, Any] = {"num_tensors": 1, "shape": [2, 4], "data_type": DataType.DT_FLOAT16}
    base.update(kwargs)
    with pytest.raises(exc):
        CacheDesc(**base)


def test_none_error_is_type_and_attribute_error() -> None:
    with pytest.raises(TypeError):
        CacheKey(1, None)
    with pytest.raises(AttributeError):
        CacheKey(1, None)


def test_keys_positional_keyword_aliases_hashable() -> None:
    a = CacheKey(1, 2)
    b = CacheKey(cluster_id=1, req_id=2)
    c = CacheKey(prompt_cluster_id=1, req_id=2, model_id=0)
    assert a == b == c and len({a, b, c}) == 1
    assert a.cluster_id == 1 and a.prefix_id == 2**64 - 1
    assert BlocksCacheKey(3) == BlocksCacheKey(prompt_cluster_id=3, model_id=0)
    assert BlocksCacheKey(3, 1).prompt_cluster_id == 3
    assert CacheKeyByIdAndIndex(1, 7, 2).batch_index == 2
    for bad, exc in [
        (lambda: CacheKey(-1, 2), ValueError),
        (lambda: CacheKey(1, 2**64), ValueError),
        (lambda: CacheKey(1), LLMException),
        (lambda: CacheKey(1, True), TypeError),
        (lambda: CacheKey(1, 2, cluster_id=1), LLMException),  # both spellings
        (lambda: BlocksCacheKey("1"), TypeError),
        (lambda: CacheKeyByIdAndIndex(1, 2, -1), ValueError),
        (lambda: CacheKey(1, 2, 3, 4, 5), LLMException),
    ]:
        with pytest.raises(exc):
            bad()
    # the other models: a TypeError, as a Python call with the same mistake
    with pytest.raises(TypeError, match="TransferConfig: takes at most 4 positional arguments"):
        TransferConfig(2, [1, 2], None, 0, 5)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="got multiple values for 'dst_cluster_id'"):
        TransferConfig(2, [1, 2], dst_cluster_id=3)  # type: ignore[misc]


def test_mem_pool_config_json_form() -> None:
    cfg = MemPoolConfig.parse('{"memory_size": 1073741824, "page_shift": 16}')
    assert cfg.memory_size == 1 << 30 and cfg.page_size == 65536
    assert MemPoolConfig.parse(cfg.to_json()) == cfg
    assert MemPoolConfig(1 << 20).page_shift == 16
    for bad, exc in [
        ("{bad json", ValueError),
        ('{"memory_size": 65536, "x": 1}', ValueError),
        ('{"memory_size": "65536"}', TypeError),
        ('{"memory_size": 65536, "page_shift": 31}', ValueError),
        ('{"memory_size": 65536, "page_shift": 9}', ValueError),
        ('{"memory_size": 0}', ValueError),
        ('{"page_shift": 12}', TypeError),
        ("[1, 2]", ValueError),
        (12, TypeError),
        (None, NoneArgumentError),
    ]:
        with pytest.raises(exc):
            MemPoolConfig.parse(bad)


def test_llm_config_assignment_validates_at_once() -> None:
    cfg = LLMConfig()
    cfg.sync_kv_timeout = 5000
    cfg.mem_pool_cfg = '{"memory_size": 1048576, "page_shift": 12}'  # type: ignore[assignment]
    cfg.listen_ip_info = "127.0.0.1:0"
    cfg.transfer_backend = "local"
    assert isinstance(cfg.mem_pool_cfg, MemPoolConfig) and cfg.listen_address == ("127.0.0.1", 0)
    for field, value, exc in [
        ("sync_kv_timeout", "5s", ValueError),  # a digit string is accepted, as llm_datadist
        ("sync_kv_timeout", 5.0, TypeError),
        ("sync_kv_timeout", 0, ValueError),
        ("host_mem_pool_cfg", '{"memory_size": 22000000000}', ValueError),
        ("listen_ip_info", "nowhere", ValueError),
        ("listen_ip_info", "127.0.0.1:70000", ValueError),
        ("link_retry_count", 0, ValueError),
        ("link_retry_count", 101, ValueError),
        ("device_type", "tpu", ValueError),
        ("transfer_backend", "rdma", ValueError),
        ("transfer_backend", "rdma", ValueError),  # not a registered transport
        ("enable_cache_manager", 1, TypeError),
        ("no_such_field", 1, AttributeError),
    ]:
        with pytest.raises(exc):
            setattr(cfg, field, value)
    assert cfg.sync_kv_timeout == 5000  # failed assignments changed nothing


def test_llm_config_options_round_trip() -> None:
    cfg = LLMConfig(
        device_type="cpu",
        enable_cache_manager=True,
        host_mem_pool_cfg='{"memory_size": 65536, "page_shift": 10}',  # type: ignore[arg-type]
        link_secret="s3cret",
    )
    opts = cfg.generate_options(reveal_secrets=True)  # the secret too (masked otherwise)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in opts.items())
    assert opts["llm.EnableCacheManager"] == "1"
    assert LLMConfig.from_options(opts) == cfg
    with pytest.raises(ValueError, match="unknown option"):
        LLMConfig.from_options({"llm.Nope": "1"})
    with pytest.raises(ValueError):
        LLMConfig.from_options({"llm.SyncKvCacheWaitTime": "soon"})
    with pytest.raises(TypeError):
        LLMConfig.from_options({"llm.SyncKvCacheWaitTime": 5})  # type: ignore[dict-item]


def test_cluster_info_llm_datadist_style() -> None:
    info = LLMClusterInfo()
    info.remote_cluster_id = 2
    info.append_remote_ip_info("127.0.0.1", 26000)
    info.append_local_ip_info(0x0100007F, 0)  # llm_datadist's int form of 127.0.0.1
    assert info.remote_ip_info == [("127.0.0.1", 26000)]
    assert info.local_ip_info == [("127.0.0.1", 0)]
    kw = LLMClusterInfo(remote_cluster_id=2, remote_ip_info=[("127.0.0.1", 26000)])
    assert kw.remote_ip_info == info.remote_ip_info
    with pytest.raises(ValueError):
        info.append_remote_ip_info("not-an-ip", 1)
    with pytest.raises(ValueError):
        info.append_remote_ip_info("127.0.0.1", 70000)
    with pytest.raises(TypeError):
        info.append_remote_ip_info("127.0.0.1", "1")  # type: ignore[arg-type]
    assert len(info.remote_ip_info) == 1
    # the listen_address of an LLMDataDist that does not listen: say so
    with pytest.raises(NoneArgumentError, match=r"remote_ip_info is None.*give it listen_ip_info"):
        LLMClusterInfo(remote_cluster_id=2, remote_ip_info=[None])  # type: ignore[list-item]
    with pytest.raises(NoneArgumentError, match="local_ip_info is None"):
        info.local_ip_info = [None]  # type: ignore[list-item]


def test_transfer_configs() -> None:
    tc = TransferConfig(2, [1, 2, 3, 4], range(0, 2))
    assert tc.dst_addrs == (1, 2, 3, 4) and tc.src_batch_index == 0
    with pytest.raises(ValueError):
        TransferConfig(2, [1], range(0, 4, 2))
    with pytest.raises(TypeError):
        TransferConfig(2, [1.0])
    with pytest.raises(TypeError):
        TransferConfig(2, [1], [0, 1])
    wk = TransferWithCacheKeyConfig(CacheKey(1, 2), range(0, 1), range(0, 1))
    assert wk.src_layer_range == range(0, 1)


def test_ip_info_lists_take_appends_as_llm_datadist_and_refuse_other_changes() -> None:
    """llm_datadist's ``*_ip_info_list`` is the object's own list: an append adds an
    address. Ours writes append/extend through; any other change raises (never lost)."""
    info = LLMClusterInfo(remote_cluster_id=1)
    info.remote_ip_info_list.append(("127.0.0.1", 26000))
    info.remote_ip_info_list.append((16777343, 26001))  # llm_datadist's int form
    info.local_ip_info_list.extend([("10.0.0.1", 0)])
    assert info.remote_ip_info == [("127.0.0.1", 26000), ("127.0.0.1", 26001)]
    assert info.local_ip_info == [("10.0.0.1", 0)]
    assert info.remote_ip_info_list == [(16777343, 26000), (16777343, 26001)]
    with pytest.raises(ValueError, match="not an IP address"):
        info.remote_ip_info_list.append(("999.1.1.1", 1))
    with pytest.raises(TypeError, match=r"an \(ip, port\) tuple"):
        info.remote_ip_info_list.append("127.0.0.1:1")  # type: ignore[arg-type]
    for change in (
        lambda lst: lst.pop(),
        lambda lst: lst.clear(),
        lambda lst: lst.insert(0, ("127.0.0.1", 1)),
        lambda lst: lst.__setitem__(0, ("127.0.0.1", 1)),
    ):
        with pytest.raises(TypeError, match="only append and extend change it"):
            change(info.remote_ip_info_list)
    assert info.remote_ip_info == [("127.0.0.1", 26000), ("127.0.0.1", 26001)]  # unchanged
