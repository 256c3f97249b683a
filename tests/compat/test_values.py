"""Value classes held to llm_datadist's source (``hicann/hixl``,
``src/python/llm_datadist/llm_datadist/v2/llm_types.py`` and ``status.py``): what they
accept, what they read back and what they raise, where docs/compat.md calls them the same."""

from __future__ import annotations

import pytest

from aiokv import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMException,
    LLMStatusCode,
    MemInfo,
    Memtype,
    TransferConfig,
    TransferWithCacheKeyConfig,
)


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
    assert LLMException("x", status_code=5).status_code == 5
    known = LLMException("x", status_code=int(LLMStatusCode.LLM_PARAM_INVALID)).status_code
    assert known is LLMStatusCode.LLM_PARAM_INVALID
    assert LLMException("x").status_code is LLMStatusCode.LLM_SUCCESS
