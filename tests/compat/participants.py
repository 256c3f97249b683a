"""What the compat tests share: a CPU participant's config and a cluster to link to."""

from __future__ import annotations

from typing import Any

from aiokv import LLMClusterInfo, LLMConfig
from aiokv.testing import cluster_info


def pool(size: int) -> str:
    """A pool option of ``size`` bytes in 4 KiB pages."""
    return f'{{"memory_size": {size}, "page_shift": 12}}'


def participant(**overrides: Any) -> LLMConfig:
    """A CPU participant in cache-manager mode listening on loopback (port 0), with a
    4 MiB device pool and a 5 s ``sync_kv_timeout``; ``overrides`` win."""
    options: dict[str, Any] = {
        "device_type": "cpu",
        "enable_cache_manager": True,
        "listen_ip_info": "127.0.0.1:0",
        "mem_pool_cfg": pool(4 << 20),
        "sync_kv_timeout": 5000,
    }
    options.update(overrides)
    return LLMConfig(**options)


def info(cluster_id: int, address: tuple[str, int] | None) -> LLMClusterInfo:
    """The cluster ``cluster_id`` listening at ``address``."""
    assert address is not None
    return cluster_info(cluster_id, address)
