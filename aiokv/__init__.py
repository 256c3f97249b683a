"""aiokv: asyncio-first KV-cache allocation, copy, swap and transfer.

The API follows Huawei Ascend's ``llm_datadist`` name for name; every operation is
awaitable. Everything public is importable from here; all other modules are private.

The names load on first use (PEP 562 ``__getattr__``): ``import aiokv`` alone imports
neither torch nor the rest of the package, so ``aiokv --version``, ``aiokv --help`` and
the pytest plugin's registration start at the speed of a bare interpreter.
"""

import importlib as _importlib
import logging as _logging
import typing as _typing

if _typing.TYPE_CHECKING:
    from ._cache import Cache
    from ._cache import KvCache
    from ._config import LLMConfig
    from ._config import LlmConfig
    from ._config import MemPoolConfig
    from ._datadist import LLMDataDist
    from ._enums import DataType
    from ._enums import LLMRole
    from ._enums import LLMStatusCode
    from ._enums import Memtype
    from ._enums import Placement
    from ._enums import RegisterMemStatus
    from ._errors import LLMException
    from ._errors import NoneArgumentError
    from ._errors import Status
    from ._layerwise import CacheTask
    from ._layerwise import LayerSynchronizer
    from ._manager import CacheManager
    from ._manager import KvCacheManager
    from ._models import BlocksCacheKey
    from ._models import CacheDesc
    from ._models import CacheKey
    from ._models import CacheKeyByIdAndIndex
    from ._models import LLMClusterInfo
    from ._models import MemInfo
    from ._models import TransferConfig
    from ._models import TransferWithCacheKeyConfig
    from ._pool import PoolStats
    from ._stats import CopyStats
    from ._stats import DataDistStats
    from ._stats import Histogram
    from ._stats import LinkStats
    from ._stats import NotificationStats
    from ._stats import OpStats
    from ._stats import ServedStats

__version__ = "0.1.0"

# Quiet by default: records of the "aiokv.*" loggers go nowhere (not even Python's
# last-resort stderr handler) unless the application configures logging.
_logging.getLogger("aiokv").addHandler(_logging.NullHandler())

#: public name -> the private module that defines it (kept in step with the imports above)
_HOME: dict[str, str] = {
    **dict.fromkeys(("Cache", "KvCache"), "_cache"),
    **dict.fromkeys(("LLMConfig", "LlmConfig", "MemPoolConfig"), "_config"),
    "LLMDataDist": "_datadist",
    **dict.fromkeys(
        ("DataType", "LLMRole", "LLMStatusCode", "Memtype", "Placement", "RegisterMemStatus"),
        "_enums",
    ),
    **dict.fromkeys(("LLMException", "NoneArgumentError", "Status"), "_errors"),
    **dict.fromkeys(("CacheTask", "LayerSynchronizer"), "_layerwise"),
    **dict.fromkeys(("CacheManager", "KvCacheManager"), "_manager"),
    **dict.fromkeys(
        (
            "BlocksCacheKey",
            "CacheDesc",
            "CacheKey",
            "CacheKeyByIdAndIndex",
            "LLMClusterInfo",
            "MemInfo",
            "TransferConfig",
            "TransferWithCacheKeyConfig",
        ),
        "_models",
    ),
    "PoolStats": "_pool",
    **dict.fromkeys(
        (
            "CopyStats",
            "DataDistStats",
            "Histogram",
            "LinkStats",
            "NotificationStats",
            "OpStats",
            "ServedStats",
        ),
        "_stats",
    ),
}


if not _typing.TYPE_CHECKING:  # mypy sees the imports above, and no catch-all attribute

    def __getattr__(name: str) -> object:
        """Import the module that defines public ``name`` on first use, then keep it."""
        home = _HOME.get(name)
        if home is None:
            raise AttributeError(f"module 'aiokv' has no attribute {name!r}")
        value = getattr(_importlib.import_module(f".{home}", __name__), name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    """The module's names, the ones not loaded yet included."""
    return sorted(set(globals()) | set(__all__))


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
