"""aiokv: asyncio-first KV-cache allocation, copy, swap and transfer.

The API follows Huawei Ascend's ``llm_datadist`` name for name; every operation is
awaitable. Everything public is importable from here; all other modules are private.
"""

import logging as _logging

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
from ._stats import (
    CopyStats,
    DataDistStats,
    Histogram,
    LinkStats,
    NotificationStats,
    OpStats,
    ServedStats,
)

__version__ = "0.1.0"

# Quiet by default: records of the "aiokv.*" loggers go nowhere (not even Python's
# last-resort stderr handler) unless the application configures logging.
_logging.getLogger("aiokv").addHandler(_logging.NullHandler())

__all__ = [
    "BlocksCacheKey",
    "Cache",
    "CacheDesc",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "CacheManager",
    "CacheTask",
    "CopyStats",
    "DataDistStats",
    "DataType",
    "Histogram",
    "KvCache",
    "KvCacheManager",
    "LLMClusterInfo",
    "LLMConfig",
    "LLMDataDist",
    "LLMException",
    "LLMRole",
    "LLMStatusCode",
    "LayerSynchronizer",
    "LinkStats",
    "LlmConfig",
    "MemInfo",
    "MemPoolConfig",
    "Memtype",
    "NoneArgumentError",
    "NotificationStats",
    "OpStats",
    "Placement",
    "PoolStats",
    "RegisterMemStatus",
    "ServedStats",
    "Status",
    "TransferConfig",
    "TransferWithCacheKeyConfig",
    "__version__",
]
