"""Configuration values: ``MemPoolConfig``, ``LLMConfig`` and the option-key table.

One definition per option: its field (type, range, default) on :class:`LLMConfig` and
its llm_datadist option key in ``_OPTION_KEYS``, from which ``generate_options()`` and
``LLMConfig.from_options`` are both derived. Validation follows SPEC §1.2 through the
shared model base of :mod:`aiokv._models`.
"""

from __future__ import annotations

import ipaddress
import json
from typing import TYPE_CHECKING, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from ._errors import NoneArgumentError
from ._models import Model

__all__ = ["HOST_POOL_LIMIT", "LLMConfig", "MemPoolConfig"]

HOST_POOL_LIMIT = 20 << 30


class MemPoolConfig(Model):
    """A memory pool: ``memory_size`` bytes served in pages of ``1 << page_shift`` bytes.

    ``MemPoolConfig.parse('{"memory_size": 1073741824, "page_shift": 16}')`` accepts
    llm_datadist's JSON string form.
    """

    if TYPE_CHECKING:

        def __init__(self, memory_size: int, page_shift: int = ...) -> None: ...

    _positional = ("memory_size", "page_shift")
    memory_size: int = Field(gt=0, le=1 << 48)
    page_shift: int = Field(default=16, ge=10, lt=31)

    @model_validator(mode="after")
    def _fits(self) -> MemPoolConfig:
        if self.memory_size < self.page_size:
            raise ValueError(
                f"memory_size {self.memory_size} is smaller than one page ({self.page_size})"
            )
        return self

    @property
    def page_size(self) -> int:
        """Bytes per page."""
        return 1 << self.page_shift

    @classmethod
    def parse(cls, value: Any) -> MemPoolConfig:
        """Build from a ``MemPoolConfig``, a dict, or llm_datadist's JSON string.

        Raises:
            TypeError: wrong type (of the value or of a field).
            ValueError: bad JSON, unknown keys, or values out of range.
        """
        if isinstance(value, MemPoolConfig):
            return value
        if value is None:
            raise NoneArgumentError("MemPoolConfig: value must not be None")
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"MemPoolConfig: invalid JSON: {exc}") from None
            if not isinstance(value, dict):
                raise ValueError("MemPoolConfig: JSON must be an object")
        if not isinstance(value, dict):
            raise TypeError(f"MemPoolConfig: expected str, dict or MemPoolConfig, got {value!r}")
        unknown = set(value) - {"memory_size", "page_shift"}
        if unknown:
            raise ValueError(f"MemPoolConfig: unknown keys {sorted(unknown)}")
        return cls(**value)

    def to_json(self) -> str:
        """llm_datadist's JSON string form."""
        return json.dumps({"memory_size": self.memory_size, "page_shift": self.page_shift})


def _ip_port(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected 'ip:port', got {value!r}")
    ipaddress.ip_address(host.strip("[]"))
    p = int(port)
    if p > 65535:
        raise ValueError(f"port {p} out of range [0, 65535]")
    return host.strip("[]"), p


_OPTION_KEYS: dict[str, str] = {
    "device_id": "ge.exec.deviceId",
    "device_type": "aiokv.deviceType",
    "sync_kv_timeout": "llm.SyncKvCacheWaitTime",
    "mem_pool_cfg": "llm.MemPoolConfig",
    "host_mem_pool_cfg": "llm.HostMemPoolConfig",
    "listen_ip_info": "llm.listenIpInfo",
    "enable_cache_manager": "llm.EnableCacheManager",
    "enable_remote_cache_accessible": "llm.EnableRemoteCacheAccessible",
    "link_total_time": "llm.LinkTotalTime",
    "link_retry_count": "llm.LinkRetryCount",
    "transfer_backend": "aiokv.transferBackend",
    "link_secret": "aiokv.linkSecret",
    "swap_out_threads": "aiokv.swapOutThreads",
    "swap_in_buffers": "aiokv.swapInBuffers",
}


class LLMConfig(Model):
    """Configuration of an ``LLMDataDist``, assignable attribute by attribute like llm_datadist.

    Every assignment validates at once (``cfg.sync_kv_timeout = "x"`` raises ``TypeError``).
    ``mem_pool_cfg`` / ``host_mem_pool_cfg`` accept the JSON string form.
    ``generate_options()`` gives the ``dict[str, str]`` form; ``LLMConfig.from_options``
    reads it back.

    Attributes:
        device_id: device ordinal.
        device_type: ``"auto"`` (npu, then cuda, then cpu), ``"cpu"``, ``"cuda"`` or ``"npu"``.
        sync_kv_timeout: per-transfer timeout in milliseconds.
        mem_pool_cfg: device memory pool; ``None`` disables device allocation.
        host_mem_pool_cfg: host memory pool (≤ 20 GiB); ``None`` disables host allocation.
        listen_ip_info: ``"ip:port"`` to accept links on (port 0 picks a free port).
        enable_cache_manager: ``True`` → ``LLMDataDist.cache_manager``; ``False`` (legacy,
            llm_datadist's default) → ``LLMDataDist.kv_cache_manager`` with role gates.
        enable_remote_cache_accessible: allow peers to push into and read by id from us.
        link_total_time: seconds a link attempt may take in total (0: the call's timeout).
        link_retry_count: connection attempts per link, 1..100.
        transfer_backend: ``"tcp"`` (between processes) or ``"local"`` (in memory: links
            only ``LLMDataDist`` instances of one process and event loop).
        link_secret: shared secret; when set, links need mutual challenge-response auth.
        swap_out_threads: worker threads for device→host swaps.
        swap_in_buffers: block-sized staging buffers for host→device swaps.
    """

    if TYPE_CHECKING:

        def __init__(
            self,
            *,
            device_id: int = ...,
            device_type: Literal["auto", "cpu", "cuda", "npu"] = ...,
            sync_kv_timeout: int = ...,
            mem_pool_cfg: MemPoolConfig | str | None = ...,
            host_mem_pool_cfg: MemPoolConfig | str | None = ...,
            listen_ip_info: str | None = ...,
            enable_cache_manager: bool = ...,
            enable_remote_cache_accessible: bool = ...,
            link_total_time: int = ...,
            link_retry_count: int = ...,
            transfer_backend: Literal["tcp", "local"] = ...,
            link_secret: str | None = ...,
            swap_out_threads: int = ...,
            swap_in_buffers: int = ...,
        ) -> None: ...

    model_config = ConfigDict(strict=True, extra="forbid", frozen=False, validate_assignment=True)
    device_id: int = Field(default=0, ge=0, le=1 << 16)
    device_type: Literal["auto", "cpu", "cuda", "npu"] = "auto"
    sync_kv_timeout: int = Field(default=1000, gt=0, le=1 << 31)
    mem_pool_cfg: MemPoolConfig | None = None
    host_mem_pool_cfg: MemPoolConfig | None = None
    listen_ip_info: str | None = None
    enable_cache_manager: bool = False
    enable_remote_cache_accessible: bool = False
    link_total_time: int = Field(default=0, ge=0, le=3600)
    link_retry_count: int = Field(default=1, ge=1, le=100)
    transfer_backend: Literal["tcp", "local"] = "tcp"
    link_secret: str | None = Field(default=None, min_length=1, max_length=4096)
    swap_out_threads: int = Field(default=4, ge=1, le=64)
    swap_in_buffers: int = Field(default=4, ge=1, le=64)

    @field_validator("mem_pool_cfg", "host_mem_pool_cfg", mode="before")
    @classmethod
    def _pool(cls, v: Any) -> Any:
        return None if v is None else MemPoolConfig.parse(v)

    @field_validator("host_mem_pool_cfg")
    @classmethod
    def _host_limit(cls, v: MemPoolConfig | None) -> MemPoolConfig | None:
        if v is not None and v.memory_size > HOST_POOL_LIMIT:
            raise ValueError(f"host pool of {v.memory_size} bytes exceeds the 20 GiB limit")
        return v

    @field_validator("listen_ip_info")
    @classmethod
    def _listen(cls, v: str | None) -> str | None:
        if v is not None:
            _ip_port(v)
        return v

    @property
    def listen_address(self) -> tuple[str, int] | None:
        """``listen_ip_info`` as ``(host, port)``."""
        return None if self.listen_ip_info is None else _ip_port(self.listen_ip_info)

    def generate_options(self) -> dict[str, str]:
        """The ``dict[str, str]`` form accepted by ``LLMDataDist.init`` (unset fields left out)."""
        out: dict[str, str] = {}
        for field, key in _OPTION_KEYS.items():
            value = getattr(self, field)
            if value is None:
                continue
            if isinstance(value, MemPoolConfig):
                out[key] = value.to_json()
            elif isinstance(value, bool):
                out[key] = "1" if value else "0"
            else:
                out[key] = str(value)
        return out

    @classmethod
    def from_options(cls, options: dict[str, str]) -> LLMConfig:
        """Parse the ``dict[str, str]`` form.

        Raises:
            TypeError: not a ``dict[str, str]``.
            ValueError: unknown key or bad value.
        """
        if options is None:
            raise NoneArgumentError("LLMConfig.from_options: options must not be None")
        if not isinstance(options, dict):
            raise TypeError(f"LLMConfig.from_options: expected dict, got {type(options).__name__}")
        by_key = {v: k for k, v in _OPTION_KEYS.items()}
        kwargs: dict[str, Any] = {}
        for key, raw in options.items():
            if not isinstance(key, str) or not isinstance(raw, str):
                raise TypeError("LLMConfig.from_options: keys and values must be str")
            field = by_key.get(key)
            if field is None:
                raise ValueError(f"LLMConfig.from_options: unknown option {key!r}")
            annotation = cls.model_fields[field].annotation
            if annotation is bool:
                if raw.lower() not in ("0", "1", "true", "false"):
                    raise ValueError(f"LLMConfig.from_options: {key}={raw!r} is not a bool")
                kwargs[field] = raw.lower() in ("1", "true")
            elif annotation is int:
                try:
                    kwargs[field] = int(raw)
                except ValueError:
                    raise ValueError(
                        f"LLMConfig.from_options: {key}={raw!r} is not an int"
                    ) from None
            else:
                kwargs[field] = raw
        return cls(**kwargs)
