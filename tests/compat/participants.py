"""What the compat tests share: a CPU participant's config (``aiokv.testing.make_config``
with the llm_datadist defaults these tests assume) and a cluster to link to."""

from __future__ import annotations

from typing import Any

from aiokv import LLMConfig
from aiokv.testing import cluster_info as info
from aiokv.testing import make_config
from aiokv.testing import pool_option

__all__ = ["info", "participant", "pool"]


def pool(size: int) -> str:
    """A pool option of ``size`` bytes in 4 KiB pages."""
    return pool_option(size)


def participant(**overrides: Any) -> LLMConfig:
    """A CPU participant in cache-manager mode over TCP, listening on loopback (port 0),
    with a 4 MiB device pool, refusing pushes; ``overrides`` win."""
    return make_config(
        "tcp", pool=4 << 20, **({"enable_remote_cache_accessible": False} | overrides)
    )
