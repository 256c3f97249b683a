"""Value classes held to llm_datadist's source (``hicann/hixl``,
``src/python/llm_datadist/llm_datadist/v2/llm_types.py`` and ``status.py``): what they
accept, what they read back and what they raise, where docs/compat.md calls them the same."""

from __future__ import annotations

import pytest

from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import CacheKey
from aiokv import CacheKeyByIdAndIndex
from aiokv import DataType
from aiokv import LLMClusterInfo
from aiokv import LLMException
from aiokv import LLMStatusCode
from aiokv import MemInfo
from aiokv import Memtype
from aiokv import TransferConfig
from aiokv import TransferWithCacheKeyConfig


@pytest.mark.parametrize(
    ("value", "field"),
    [
        (CacheDesc(2, [4, 8], DataType.DT_FLOAT16), "num_tensors"),
        (CacheKey(1, 2), "req_id"),
        (BlocksCacheKey(1), "model_id"),
        (CacheKeyByIdAndIndex(1, 2), "cache_id"),
        (MemInfo(Memtype.MEM_TYPE_DEVICE, 4096, 64), "size"),
    ],
)
def test_read_only_fields_refuse_assignment_with_attribute_error(value: object, field: str) -> None:
    """llm_datadist's fields here are properties without setters: ``AttributeError``."""
    before = getattr(value, field)
    with pytest.raises(AttributeError):
        setattr(value, field, 3)
    assert getattr(value, field) == before


def test_cache_key_by_id_ranges_are_llm_datadist_s() -> None:
    """``batch_index`` is a uint32 and ``cache_id`` at most an int64, as there."""
    assert CacheKeyByIdAndIndex(1, 2**63 - 1, 2**32 - 1).batch_index == 2**32 - 1
    with pytest.raises(ValueError, match="batch_index"):
        CacheKeyByIdAndIndex(1, 1, 2**32)
    with pytest.raises(ValueError, match="cache_id"):
        CacheKeyByIdAndIndex(1, 2**63)


def test_transfer_configs_have_llm_datadist_s_derived_attributes() -> None:
    key = CacheKeyByIdAndIndex(7, 1)
    assert TransferWithCacheKeyConfig(key, range(0, 1), range(0, 1)).dst_cluster_id == 7
    assert TransferWithCacheKeyConfig(BlocksCacheKey(9)).dst_cluster_id == 9
    assert TransferConfig(3, [4096, 8192]).dst_layer_range is None


def test_llm_exception_keeps_a_code_llm_datadist_does_not_name() -> None:
    """``LLMException(status_code=...)`` stores what it is given, as upstream; a known
    code reads back as the ``LLMStatusCode`` member."""
    assert LLMException("x", status_code=5).status_code == 5  # type: ignore[arg-type]
    code = int(LLMStatusCode.LLM_PARAM_INVALID)
    known = LLMException("x", status_code=code).status_code  # type: ignore[arg-type]
    assert known is LLMStatusCode.LLM_PARAM_INVALID
    assert LLMException("x").status_code is LLMStatusCode.LLM_SUCCESS


def test_llm_exception_status_code_is_read_only() -> None:
    exc = LLMException("x", status_code=LLMStatusCode.LLM_FAILED)
    with pytest.raises(AttributeError):
        exc.status_code = LLMStatusCode.LLM_SUCCESS  # type: ignore[misc]
    assert exc.status_code is LLMStatusCode.LLM_FAILED


def test_transfer_configs_are_assignable_and_checked_as_llm_datadist_s_setters() -> None:
    cfg = TransferConfig(1, [4096, 8192])
    cfg.src_batch_index = 3
    cfg.src_layer_range = range(0, 1)
    cfg.dst_addrs = [1, 2]
    assert (cfg.src_batch_index, cfg.src_layer_range, tuple(cfg.dst_addrs)) == (
        3,
        range(0, 1),
        (1, 2),
    )
    with pytest.raises(ValueError):
        cfg.src_layer_range = range(0, 4, 2)
    with pytest.raises(ValueError):
        cfg.dst_cluster_id = -1
    assert cfg.src_layer_range == range(0, 1) and cfg.dst_cluster_id == 1  # refused: unchanged
    key = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(1, 2), range(0, 1), range(0, 1))
    key.cache_key = BlocksCacheKey(5)
    key.dst_layer_range = range(1, 2)
    assert key.dst_cluster_id == 5 and key.dst_layer_range == range(1, 2)
    with pytest.raises(TypeError):
        key.cache_key = 5  # type: ignore[assignment]
    assert key.cache_key == BlocksCacheKey(5)


def test_a_bad_ip_raises_llm_datadist_s_runtime_error_too() -> None:
    """llm_datadist: ``RuntimeError("Can not parse ip str:...")``; aiokv's error is that
    (an ``LLMException(LLM_PARAM_INVALID)``) and a ``ValueError``."""
    info = LLMClusterInfo()
    for append in (info.append_local_ip_info, info.append_remote_ip_info):
        with pytest.raises(RuntimeError) as caught:
            append("localhost", 26000)
        assert isinstance(caught.value, ValueError)
        assert isinstance(caught.value, LLMException)
        assert caught.value.status_code is LLMStatusCode.LLM_PARAM_INVALID
    assert info.local_ip_info_list == [] and info.remote_ip_info_list == []


def test_enums_iterate_in_llm_datadist_s_order() -> None:
    """The order of llm_datadist's declarations (``status.py``, ``data_type.py``)."""
    assert [m.name for m in DataType] == [
        "DT_FLOAT", "DT_FLOAT16", "DT_BF16", "DT_INT8", "DT_INT16", "DT_UINT16", "DT_UINT8",
        "DT_INT32", "DT_INT64", "DT_UINT32", "DT_UINT64", "DT_BOOL", "DT_DOUBLE", "DT_STRING",
    ]  # fmt: skip
    assert [m.name for m in LLMStatusCode][:5] == [
        "LLM_SUCCESS", "LLM_FAILED", "LLM_PARAM_INVALID", "LLM_WAIT_PROCESS_TIMEOUT",
        "LLM_KV_CACHE_NOT_EXIST",
    ]  # fmt: skip
