"""The public surface: everything in ``__all__`` is importable, public, and nothing drifts."""

from __future__ import annotations

import inspect

import aiokv

EXPECTED = {
    "BlocksCacheKey",
    "Cache",
    "CacheDesc",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "CacheManager",
    "CacheTask",
    "DataType",
    "KvCache",
    "KvCacheManager",
    "LLMClusterInfo",
    "LLMConfig",
    "LLMDataDist",
    "LLMException",
    "LLMRole",
    "LLMStatusCode",
    "LayerSynchronizer",
    "MemPoolConfig",
    "NoneArgumentError",
    "Placement",
    "PoolStats",
    "TransferConfig",
    "TransferWithCacheKeyConfig",
    "__version__",
}


def test_all_is_the_public_surface() -> None:
    assert set(aiokv.__all__) == EXPECTED
    for name in aiokv.__all__:
        assert hasattr(aiokv, name), name
    public = {n for n in vars(aiokv) if not n.startswith("_")} - {"transport", "cli", "examples"}
    assert public <= EXPECTED, f"unexported public names: {public - EXPECTED}"


def test_manager_operations_are_async() -> None:
    ops = [
        "allocate_cache",
        "deallocate_cache",
        "remove_cache_key",
        "allocate_blocks_cache",
        "deallocate_blocks_cache",
        "copy_cache",
        "copy_blocks",
        "copy_kv_blocks",
        "swap_blocks",
        "register_cache",
        "register_blocks_cache",
        "unregister_cache",
        "pull_cache",
        "pull_blocks",
        "push_cache",
        "push_blocks",
        "transfer_cache_async",
    ]
    for cls in (aiokv.CacheManager, aiokv.KvCacheManager):
        for op in ops:
            assert inspect.iscoroutinefunction(getattr(cls, op)), f"{cls.__name__}.{op}"
    for op in ("init", "finalize", "link_clusters", "unlink_clusters"):
        assert inspect.iscoroutinefunction(getattr(aiokv.LLMDataDist, op)), op


def test_kv_cache_alias_and_exception_shape() -> None:
    assert aiokv.KvCache is aiokv.Cache
    exc = aiokv.LLMException("op: why", aiokv.LLMStatusCode.LLM_TIMEOUT)
    assert isinstance(exc, RuntimeError) and exc.status_code == 0x5010B000 + 26
    assert issubclass(aiokv.NoneArgumentError, TypeError)
    assert issubclass(aiokv.NoneArgumentError, AttributeError)
