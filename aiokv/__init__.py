"""aiokv: asyncio-first KV-cache allocation, copy, swap and transfer.

The API follows Huawei Ascend's ``llm_datadist`` name for name; every operation is
awaitable. Everything public is importable from here; all other modules are private.
"""

from ._cache import Cache, KvCache
from ._config import LLMConfig, LlmConfig, MemPoolConfig
from ._datadist import LLMDataDist
from ._enums import DataType, LLMRole, LLMStatusCode, Memtype, Placement, RegisterMemStatus
from ._errors import LLMException, NoneArgumentError, Status
from ._layerwise import CacheTask, LayerSynchronizer
from ._manager import CacheManager, KvCacheManager
from ._models import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    LLMClusterInfo,
    MemInfo,
    TransferConfig,
    TransferWithCacheKeyConfig,
)
from ._pool import PoolStats

__version__ = "0.1.0"

__all__ = [
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
    "LlmConfig",
    "MemInfo",
    "MemPoolConfig",
    "Memtype",
    "NoneArgumentError",
    "Placement",
    "PoolStats",
    "RegisterMemStatus",
    "Status",
    "TransferConfig",
    "TransferWithCacheKeyConfig",
    "__version__",
]
