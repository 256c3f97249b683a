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
    from ._cache import Cache as Cache
    from ._cache import KvCache as KvCache
    from ._config import LLMConfig as LLMConfig
    from ._config import LlmConfig as LlmConfig
    from ._config import MemPoolConfig as MemPoolConfig
    from ._datadist import LLMDataDist as LLMDataDist
    from ._enums import DataType as DataType
    from ._enums import LLMRole as LLMRole
    from ._enums import LLMStatusCode as LLMStatusCode
    from ._enums import Memtype as Memtype
    from ._enums import Placement as Placement
    from ._enums import RegisterMemStatus as RegisterMemStatus
    from ._errors import LLMException as LLMException
    from ._errors import NoneArgumentError as NoneArgumentError
    from ._errors import Status as Status
    from ._layerwise import CacheTask as CacheTask
    from ._layerwise import LayerSynchronizer as LayerSynchronizer
    from ._manager import CacheManager as CacheManager
    from ._manager import KvCacheManager as KvCacheManager
    from ._models import BlocksCacheKey as BlocksCacheKey
    from ._models import CacheDesc as CacheDesc
    from ._models import CacheKey as CacheKey
    from ._models import CacheKeyByIdAndIndex as CacheKeyByIdAndIndex
    from ._models import LLMClusterInfo as LLMClusterInfo
    from ._models import MemInfo as MemInfo
    from ._models import TransferConfig as TransferConfig
    from ._models import TransferWithCacheKeyConfig as TransferWithCacheKeyConfig
    from ._pool import PoolStats as PoolStats
    from ._stats import CopyStats as CopyStats
    from ._stats import DataDistStats as DataDistStats
    from ._stats import Histogram as Histogram
    from ._stats import LinkStats as LinkStats
    from ._stats import NotificationStats as NotificationStats
    from ._stats import OpStats as OpStats
    from ._stats import ServedStats as ServedStats

__version__ = "0.1.0"

# Quiet by default: records of the "aiokv.*" loggers go nowhere (not even Python's
# last-resort stderr handler) unless the application configures logging.
_logging.getLogger("aiokv").addHandler(_logging.NullHandler())

#: private module -> the public names it defines (kept in step with the imports above,
#: which re-export them for type checkers)
_NAMES: dict[str, tuple[str, ...]] = {
    "_cache": ("Cache", "KvCache"),
    "_config": ("LLMConfig", "LlmConfig", "MemPoolConfig"),
    "_datadist": ("LLMDataDist",),
    "_enums": ("DataType", "LLMRole", "LLMStatusCode", "Memtype", "Placement", "RegisterMemStatus"),
    "_errors": ("LLMException", "NoneArgumentError", "Status"),
    "_layerwise": ("CacheTask", "LayerSynchronizer"),
    "_manager": ("CacheManager", "KvCacheManager"),
    "_models": (
        "BlocksCacheKey", "CacheDesc", "CacheKey", "CacheKeyByIdAndIndex", "LLMClusterInfo",
        "MemInfo", "TransferConfig", "TransferWithCacheKeyConfig",
    ),
    "_pool": ("PoolStats",),
    "_stats": (
        "CopyStats", "DataDistStats", "Histogram", "LinkStats", "NotificationStats", "OpStats",
        "ServedStats",
    ),
}  # fmt: skip
#: public name -> the private module that defines it
_HOME: dict[str, str] = {name: home for home, names in _NAMES.items() for name in names}

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


__all__ = [*sorted(_HOME), "__version__"]
