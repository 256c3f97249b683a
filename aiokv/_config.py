"""Configuration values: ``MemPoolConfig``, ``LLMConfig`` and the option-key table.

One definition per option: its field (type, range, default) on :class:`LLMConfig` and
its option key in ``_OPTION_KEYS`` (llm_datadist's key where it has one), from which
``generate_options()`` and ``LLMConfig.from_options`` are both derived. Validation
follows SPEC §1.2 through the shared model base of :mod:`aiokv._models`; a value out of
range is also what llm_datadist raises, ``LLMException(LLM_PARAM_INVALID)``
(:class:`InvalidOptionError` is both).
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import ipaddress
import math
import os
import re
import types
from collections.abc import Iterator
from typing import TYPE_CHECKING
from typing import Any
from typing import Final
from typing import Generic
from typing import Literal
from typing import TypeVar
from typing import Union
from typing import get_args
from typing import get_origin

from pydantic import ConfigDict
from pydantic import Field
from pydantic import PrivateAttr
from pydantic import SecretStr
from pydantic import field_validator
from pydantic import model_validator
from pydantic_settings import BaseSettings
from pydantic_settings import SettingsConfigDict

from ._checks import parse_json
from ._enums import LLMStatusCode
from ._errors import LLMException
from ._errors import NoneArgumentError
from ._errors import warn
from ._models import Model
from ._pool_config import MemPoolConfig
from ._pool_config import unknown_name

__all__ = [
    "ENV_PREFIX",
    "HOST_POOL_LIMIT",
    "SECRET_MASK",
    "InvalidOptionError",
    "InvalidOptionTypeError",
    "LLMConfig",
    "LlmConfig",
    "MemPoolConfig",
]

HOST_POOL_LIMIT = 20 << 30
#: longest ``link_secret`` (characters)
_SECRET_MAX = 4096
#: ``AIOKV_<FIELD>`` environment variables supply ``LLMConfig`` defaults
ENV_PREFIX = "AIOKV_"
#: ``AIOKV_*`` variables that are not ``LLMConfig`` fields but mean something elsewhere
#: (the rank table's device port, the CLI's debug switch, the test and CI knobs)
OTHER_ENV: Final = frozenset(
    {"DEVICE_PORT", "DEBUG", "TEST_STAGE_HOST", "FUZZ_SEED", "FLOORS_VENV"}
)
#: what ``generate_options()`` shows for a secret unless ``reveal_secrets=True``
SECRET_MASK = "**********"


if TYPE_CHECKING:
    _Read = TypeVar("_Read")
    _Write = TypeVar("_Write")

    class _Assignable(Generic[_Read, _Write]):
        """For type checkers only: a field that reads as ``_Read`` and accepts the wider
        ``_Write`` (what llm_datadist programs assign; validation converts it)."""

        def __get__(self, obj: object, owner: object = None) -> _Read: ...
        def __set__(self, obj: object, value: _Write) -> None: ...


class InvalidOptionError(LLMException, ValueError):
    """A configuration value out of its range: ``LLMException(LLM_PARAM_INVALID)``, as
    llm_datadist raises, and a ``ValueError``, as SPEC §1.2 asks."""

    def __init__(self, message: str, op: str = "LLMConfig") -> None:
        super().__init__(message, status_code=LLMStatusCode.LLM_PARAM_INVALID, op=op)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.op or "LLMConfig"))


class InvalidOptionTypeError(InvalidOptionError, TypeError):
    """A configuration value of the wrong kind (``"64MiB"`` for a byte count), or an
    unknown option: the same :class:`InvalidOptionError` (``LLM_PARAM_INVALID``) as any
    other bad value, and still the ``TypeError`` SPEC §1.2 names for a wrong type."""


@contextlib.contextmanager
def _param_invalid(op: str) -> Iterator[None]:
    """Re-raise a plain ``ValueError`` / ``TypeError`` from the block as
    :class:`InvalidOptionError` / :class:`InvalidOptionTypeError` (``None`` stays a
    ``NoneArgumentError``)."""
    try:
        yield
    except (InvalidOptionError, NoneArgumentError):
        raise
    except ValueError as exc:
        raise InvalidOptionError(str(exc), op) from None
    except TypeError as exc:
        raise InvalidOptionTypeError(str(exc), op) from None


def _ip_port(value: str) -> tuple[str, int]:
    """``"ip:port"`` (an IPv6 address in brackets, ``"[::1]:26000"``) as ``(ip, port)``.

    Raises:
        ValueError: another form: no port, a port that is not ASCII digits, an IPv6
            address without brackets (``"::1:5"`` reads either way), a bad address.
    """
    host, sep, port = value.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()):
        raise ValueError(f"expected 'ip:port', got {value!r}")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise ValueError(f"expected '[ipv6]:port' for an IPv6 address, got {value!r}")
    ipaddress.ip_address(host.strip("[]"))
    p = int(port)
    if p > 65535:
        raise ValueError(f"port {p} out of range [0, 65535]")
    return host.strip("[]"), p


_INT_RE = re.compile(r"-?[0-9]+")

#: field -> its key in the ``dict[str, str]`` form (llm_datadist's key where it has one)
_OPTION_KEYS: dict[str, str] = {
    "device_id": "ge.exec.deviceId",
    "sync_kv_timeout": "llm.SyncKvCacheWaitTime",
    "buf_pool_cfg": "llm.BufPoolCfg",
    "mem_pool_cfg": "llm.MemPoolConfig",
    "host_mem_pool_cfg": "llm.HostMemPoolConfig",
    "enable_cache_manager": "llm.EnableCacheManager",
    "enable_remote_cache_accessible": "llm.EnableRemoteCacheAccessible",
    "listen_ip_info": "llm.listenIpInfo",
    "link_total_time": "llm.LinkTotalTime",
    "link_retry_count": "llm.LinkRetryCount",
    "rdma_traffic_class": "llm.RdmaTrafficClass",
    "rdma_service_level": "llm.RdmaServiceLevel",
    "local_comm_res": "llm.LocalCommRes",
    "transfer_backend": "llm.TransferBackend",
    "enable_switch_role": "llm.EnableSwitchRole",
    "mem_utilization": "llm.MemoryUtilization",
    "deploy_res_path": "llm.deployResPath",
    "output_max_size": "llm.OutputMaxSize",
    "cluster_info": "llm.ClusterInfo",
    "global_resource_config": "llm.GlobalResourceConfig",
    "device_type": "aiokv.deviceType",
    "link_secret": "aiokv.linkSecret",
    "handshake_timeout": "aiokv.handshakeTimeout",
    "tls_cert_file": "aiokv.tlsCertFile",
    "tls_key_file": "aiokv.tlsKeyFile",
    "tls_ca_file": "aiokv.tlsCaFile",
    "tls_check_hostname": "aiokv.tlsCheckHostname",
    "swap_out_threads": "aiokv.swapOutThreads",
    "swap_in_buffers": "aiokv.swapInBuffers",
    "restrict_reads_by_id": "aiokv.restrictReadsById",
    "engine_thread": "aiokv.engineThread",
}
#: earlier aiokv spellings, still read
_OLD_KEYS: dict[str, str] = {"aiokv.transferBackend": "transfer_backend"}
#: llm_datadist's keys with no field here (offline-mode and engine-internal ones): kept in
#: ``ge_options`` like every ``ge.*`` key, passed through, not acted on
_PASSTHROUGH_KEYS = frozenset(
    {
        "llm.Role",
        "llm.ListenIp",
        "llm.ListenPort",
        "llm.kvTensorFormat",
    }
)
#: fields stored and echoed by ``generate_options()`` that aiokv's transports do not use
_IGNORED_FIELDS = (
    "buf_pool_cfg",
    "rdma_traffic_class",
    "rdma_service_level",
    "mem_utilization",
    "enable_switch_role",
    "local_comm_res",  # its content; setting it implies cache-manager mode (see LLMConfig)
    "deploy_res_path",  # llm_datadist's offline-mode (graph deployment) options
    "output_max_size",
    "cluster_info",
    "global_resource_config",
)
#: llm_datadist's ``None``: assigned (or given) it, these fields go back to unset
_NONE_UNSETS = frozenset(
    {
        "enable_cache_manager",
        "enable_remote_cache_accessible",
        "enable_switch_role",
        "transfer_backend",
        "local_comm_res",
        "global_resource_config",
    }
)
#: fields llm_datadist's ``generate_options()`` leaves out while they are false (``""``,
#: ``False``), set or not; the others are emitted once set, ``""`` / ``0`` / ``False`` too
_EMITTED_WHEN_TRUE = frozenset(
    {
        "listen_ip_info",
        "deploy_res_path",
        "buf_pool_cfg",
        "cluster_info",
        "mem_pool_cfg",
        "host_mem_pool_cfg",
        "enable_switch_role",
    }
)
#: fields whose value is a secret (``SecretStr``): masked in ``generate_options()``
_SECRET_FIELDS = frozenset({"link_secret"})
#: the option keys of those fields: masked where ``ge_options`` carries them
_SECRET_KEYS = frozenset(_OPTION_KEYS[f] for f in _SECRET_FIELDS)
#: llm_datadist's transfer-backend names -> the aiokv transport that stands in for them
_BACKEND_ALIASES: dict[str, str] = {"hixl": "tcp"}  # tcp: the best backend between processes
#: the ``transfer_backend`` values besides the aliases (the field's ``Literal``)
_BACKENDS: Final = ("tcp", "local", "nixl")


def _base_type(annotation: Any) -> Any:
    """``int`` for ``int | None``; the annotation itself otherwise."""
    if get_origin(annotation) in (Union, types.UnionType):
        return next(a for a in get_args(annotation) if a is not type(None))
    return annotation


class LLMConfig(Model):
    """Configuration of an ``LLMDataDist``, assignable attribute by attribute like llm_datadist.

    Every assignment validates at once and a failed one changes nothing: a wrong type
    raises ``TypeError``; a value out of range raises :class:`InvalidOptionError`, which
    is both ``LLMException(LLM_PARAM_INVALID)`` and ``ValueError``. ``mem_pool_cfg`` /
    ``host_mem_pool_cfg`` accept the JSON string form, ``sync_kv_timeout`` a digit string.
    ``generate_options()`` gives the ``dict[str, str]`` form of the options that were set;
    ``LLMConfig.from_options`` reads it back. ``LlmConfig`` is the same class.

    Environment: an ``AIOKV_<FIELD>`` variable (``AIOKV_DEVICE_ID=1``,
    ``AIOKV_LINK_SECRET=...``; the option-string form, as ``from_options`` reads it; empty
    counts as unset) supplies the default of every field but ``ge_options``, in every
    ``LLMConfig`` made (``from_options`` and ``LLMDataDist.init`` with a dict included).
    Arguments and assignments win; such defaults are not "set" options, so
    ``generate_options()`` leaves them out. A bad value raises :class:`InvalidOptionError`
    naming the variable.

    Attributes:
        device_id: device ordinal.
        device_type: ``"auto"`` (npu, then cuda, then cpu), ``"cpu"``, ``"cuda"`` or ``"npu"``.
        sync_kv_timeout: per-transfer timeout in milliseconds.
        mem_pool_cfg: device memory pool; ``None`` disables device allocation.
        host_mem_pool_cfg: host memory pool (≤ 20 GiB); ``None`` disables host allocation.
        listen_ip_info: ``"ip:port"`` to accept links on (port 0 picks a free port).
        enable_cache_manager: ``True`` → ``LLMDataDist.cache_manager``; ``False`` (legacy,
            llm_datadist's default) → ``LLMDataDist.kv_cache_manager`` with role gates.
            Unless set, it follows ``local_comm_res`` (set → ``True``).
        enable_remote_cache_accessible: allow peers to push into and read by id from us.
            Unless set, it follows ``local_comm_res`` (set → ``True``).
        link_total_time: seconds a link attempt may take in total, 0..2**32-1 (0: the
            call's timeout).
        link_retry_count: connection attempts per link, 1..100.
        transfer_backend: ``"tcp"`` (between processes), ``"nixl"`` (between processes,
            payload over NIXL; needs the ``aiokv[nixl]`` extra) or ``"local"`` (in memory:
            links only ``LLMDataDist`` instances of one process and event loop); llm_datadist's
            ``"hixl"`` is read as the best backend between processes (``"tcp"``).
        local_comm_res: llm_datadist's local communication resources (a rank-table JSON).
            Its content is not used; setting it implies ``enable_cache_manager`` and
            ``enable_remote_cache_accessible`` where those are not set (setting it with
            ``enable_cache_manager=False`` is invalid, as in llm_datadist).
        ge_options: ``dict[str, str]`` of GE (``ge.*``) and other llm_datadist keys
            aiokv does not act on: stored, passed through ``generate_options()``, logged
            at debug by ``init``.
        enable_switch_role, rdma_traffic_class, rdma_service_level, buf_pool_cfg: these,
            mem_utilization (0..1), and the offline-mode deploy_res_path, output_max_size,
            cluster_info (JSON), global_resource_config: llm_datadist's, validated as
            there, stored and echoed; no meaning on aiokv's transports (``init`` logs them
            at debug).
        link_secret: shared secret (a ``SecretStr``: ``repr``, logs and
            ``generate_options()`` show ``**********``; ``link_secret.get_secret_value()``
            reads it); when set, links need mutual challenge-response auth.
        handshake_timeout: milliseconds an incoming connection gets to complete the link
            handshake (authentication included) before it is dropped, 1..2**31-1.
        tls_cert_file, tls_key_file, tls_ca_file: TLS for every link (``"tcp"`` only):
            this side's certificate chain and private key (PEM; the key may be inside the
            certificate file, then ``tls_key_file`` stays ``None``), and the CA every
            peer's certificate must chain to. Both sides present a certificate. Set
            ``tls_cert_file`` and ``tls_ca_file`` (or none of the three); the files are
            read at ``init`` (a bad one: ``LLM_PARAM_INVALID``).
        tls_check_hostname: with TLS, the connecting side also checks that the listener's
            certificate names the host it dialled.
        swap_out_threads: worker threads for device→host swaps.
        swap_in_buffers: block-sized staging buffers for host→device swaps.
        restrict_reads_by_id: aiokv's stricter rule, off by default: peers may read a
            cache by its id (``CacheKeyByIdAndIndex``) only where they may push into it
            (``enable_remote_cache_accessible`` and a ``remote_accessible`` cache), in
            every mode. Off, llm_datadist's rules hold: legacy mode and instances
            without ``enable_remote_cache_accessible`` serve reads by id to any linked
            peer; with it, the cache must be ``remote_accessible``.
        engine_thread: where the engine runs (aiokv's own, default ``True``): on a
            thread of its own, or (``False``) inline on the asyncio loop that awaits
            ``init``, with no hop between threads per operation; that loop must not
            block (the listener and links serve on it) and must run until
            ``finalize`` has returned. Not for ``aiokv.sync`` or trio.
    """

    if TYPE_CHECKING:

        def __init__(
            self,
            *,
            device_id: int = ...,
            device_type: Literal["auto", "cpu", "cuda", "npu"] = ...,
            engine_thread: bool = ...,
            sync_kv_timeout: int | str = ...,
            mem_pool_cfg: MemPoolConfig | str | None = ...,
            host_mem_pool_cfg: MemPoolConfig | str | None = ...,
            listen_ip_info: str | None = ...,
            enable_cache_manager: bool | None = ...,
            enable_remote_cache_accessible: bool | None = ...,
            link_total_time: int = ...,
            link_retry_count: int = ...,
            transfer_backend: Literal["tcp", "local", "nixl", "hixl"] | None = ...,
            local_comm_res: str | None = ...,
            ge_options: dict[str, str] = ...,
            enable_switch_role: bool | None = ...,
            rdma_traffic_class: int | None = ...,
            rdma_service_level: int | None = ...,
            buf_pool_cfg: str | None = ...,
            mem_utilization: float = ...,
            deploy_res_path: str | None = ...,
            output_max_size: int | None = ...,
            cluster_info: str = ...,
            global_resource_config: str | None = ...,
            link_secret: str | SecretStr | None = ...,
            handshake_timeout: int = ...,
            tls_cert_file: str | None = ...,
            tls_key_file: str | None = ...,
            tls_ca_file: str | None = ...,
            tls_check_hostname: bool = ...,
            swap_out_threads: int = ...,
            swap_in_buffers: int = ...,
            restrict_reads_by_id: bool = ...,
        ) -> None: ...

    else:

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            with _param_invalid(type(self).__name__):
                for name in kwargs:
                    if name not in type(self).model_fields:
                        raise TypeError(
                            f"LLMConfig: {unknown_name('option', name, type(self).model_fields)}"
                        )
                kwargs = {k: v for k, v in kwargs.items() if not (v is None and k in _NONE_UNSETS)}
                env = {} if _CHECKING_ENV.get() else _env_defaults()
                super().__init__(*args, **(env | kwargs))
            if env:  # defaults from the environment are not options that were set
                unset = env.keys() - kwargs.keys()
                object.__setattr__(self, "__pydantic_fields_set__", self.model_fields_set - unset)

    model_config = ConfigDict(strict=True, extra="forbid", frozen=False, validate_assignment=True)
    device_id: int = Field(default=0, ge=0, le=1 << 16)
    device_type: Literal["auto", "cpu", "cuda", "npu"] = "auto"
    engine_thread: bool = True
    if not TYPE_CHECKING:
        sync_kv_timeout: int = Field(default=1000, gt=0, le=2**31 - 1)
        mem_pool_cfg: MemPoolConfig | None = None
        host_mem_pool_cfg: MemPoolConfig | None = None
    else:  # what llm_datadist programs assign: digit and JSON strings too
        sync_kv_timeout: _Assignable[int, int | str]
        mem_pool_cfg: _Assignable[MemPoolConfig | None, MemPoolConfig | str | None]
        host_mem_pool_cfg: _Assignable[MemPoolConfig | None, MemPoolConfig | str | None]
    listen_ip_info: str | None = ""
    if not TYPE_CHECKING:
        enable_cache_manager: bool = False
    else:  # llm_datadist's None (back to unset) is assignable too
        enable_cache_manager: _Assignable[bool, bool | None]
    if not TYPE_CHECKING:
        enable_remote_cache_accessible: bool = False
    else:  # llm_datadist's None (back to unset) is assignable too
        enable_remote_cache_accessible: _Assignable[bool, bool | None]
    link_total_time: int = Field(default=0, ge=0, le=2**32 - 1)
    link_retry_count: int = Field(default=1, ge=1, le=100)
    if not TYPE_CHECKING:
        transfer_backend: Literal["tcp", "local", "nixl"] = "tcp"
    else:  # llm_datadist's None (back to unset) is assignable too
        transfer_backend: _Assignable[
            Literal["tcp", "local", "nixl"], Literal["tcp", "local", "nixl", "hixl"] | None
        ]
    local_comm_res: str | None = None
    ge_options: dict[str, str] = Field(default_factory=dict)
    if not TYPE_CHECKING:
        enable_switch_role: bool = False
    else:  # llm_datadist's None (back to unset) is assignable too
        enable_switch_role: _Assignable[bool, bool | None]
    rdma_traffic_class: int | None = Field(default=None, ge=0, le=2**32 - 1)
    rdma_service_level: int | None = Field(default=None, ge=0, le=2**32 - 1)
    buf_pool_cfg: str | None = ""
    mem_utilization: float = Field(default=0.95, ge=0.0, le=1.0)
    deploy_res_path: str | None = ""
    output_max_size: int | None = Field(default=None, ge=0, le=2**63 - 1)
    cluster_info: str = ""
    if not TYPE_CHECKING:
        global_resource_config: str = ""
    else:  # llm_datadist's None (back to unset) is assignable too
        global_resource_config: _Assignable[str, str | None]
    link_secret: SecretStr | None = Field(default=None, min_length=1, max_length=_SECRET_MAX)
    handshake_timeout: int = Field(default=10000, gt=0, le=2**31 - 1)
    tls_cert_file: str | None = Field(default=None, min_length=1, max_length=4096)
    tls_key_file: str | None = Field(default=None, min_length=1, max_length=4096)
    tls_ca_file: str | None = Field(default=None, min_length=1, max_length=4096)
    tls_check_hostname: bool = False
    swap_out_threads: int = Field(default=4, ge=1, le=64)
    swap_in_buffers: int = Field(default=4, ge=1, le=64)
    # secret values ``ge_options`` carried (by option key); ``ge_options`` shows the mask
    _ge_secrets: dict[str, SecretStr] = PrivateAttr(default_factory=dict)
    restrict_reads_by_id: bool = False

    def __setattr__(self, name: str, value: Any) -> None:
        # pydantic leaves a value that its model check refused in place: put it back
        if name not in type(self).model_fields and not name.startswith("_"):
            raise AttributeError(
                f"LLMConfig: {unknown_name('attribute', name, type(self).model_fields)}"
            )
        if value is None and name in _NONE_UNSETS:
            self._unset(name)
            return
        saved, fields_set = dict(self.__dict__), set(self.__pydantic_fields_set__)
        ge_secrets = self._ge_secrets
        try:
            with _param_invalid(type(self).__name__):
                super().__setattr__(name, value)
        except BaseException:
            self.__dict__.clear()
            self.__dict__.update(saved)
            object.__setattr__(self, "__pydantic_fields_set__", fields_set)
            self.__pydantic_private__["_ge_secrets"] = ge_secrets  # type: ignore[index]
            raise

    def _unset(self, name: str) -> None:
        """Back to unset, as llm_datadist's ``None``: the default value, left out of
        ``generate_options()``; the ``enable_*`` fields follow ``local_comm_res`` again."""
        self.__pydantic_fields_set__.discard(name)
        self.__dict__[name] = type(self).model_fields[name].get_default(call_default_factory=True)
        implied = self.local_comm_res is not None
        for field in ("enable_cache_manager", "enable_remote_cache_accessible"):
            if field not in self.__pydantic_fields_set__:
                self.__dict__[field] = implied

    @field_validator("sync_kv_timeout", mode="before")
    @classmethod
    def _digits(cls, v: Any) -> Any:
        if isinstance(v, str):  # llm_datadist accepts a digit string here
            if not (v.isascii() and v.isdigit()):
                raise ValueError(f"sync_kv_timeout must be digit, got {v!r}")
            return int(v)
        return v

    @field_validator("transfer_backend", mode="before")
    @classmethod
    def _backend(cls, v: Any) -> Any:
        if v is not None and not isinstance(v, str):
            raise TypeError(f"LLMConfig: transfer_backend must be str, got {type(v).__name__}")
        if isinstance(v, str) and v not in _BACKENDS and v not in _BACKEND_ALIASES:
            raise ValueError(unknown_name("transfer_backend", v, [*_BACKENDS, *_BACKEND_ALIASES]))
        return _BACKEND_ALIASES.get(v, v) if isinstance(v, str) else v

    @field_validator("cluster_info")
    @classmethod
    def _json(cls, v: str) -> str:
        parse_json(v)  # a ValueError when it is not JSON ("" too), as upstream
        return v

    @field_validator("mem_utilization")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError(f"mem_utilization must be in range [0,1], got {v}")
        return v

    @field_validator("mem_pool_cfg", "host_mem_pool_cfg", mode="before")
    @classmethod
    def _pool(cls, v: Any) -> Any:
        return None if v is None or v == "" else MemPoolConfig.parse(v)  # "": no pool, as there

    @field_validator("host_mem_pool_cfg")
    @classmethod
    def _host_limit(cls, v: MemPoolConfig | None) -> MemPoolConfig | None:
        if v is not None and v.memory_size > HOST_POOL_LIMIT:
            raise ValueError(f"host pool of {v.memory_size} bytes exceeds the 20 GiB limit")
        return v

    @field_validator("listen_ip_info")
    @classmethod
    def _listen(cls, v: str | None) -> str | None:
        if v:  # "" and None: not set, as in llm_datadist
            _ip_port(v)
        return v

    @field_validator("ge_options")
    @classmethod
    def _ge_keys(cls, v: dict[str, str]) -> dict[str, str]:
        """What ``init`` would refuse is refused now: a key that is neither ``ge.*``,
        one of llm_datadist's nor an option's, and a bad value of a key that names an
        option (checked as that option; a secret's by :meth:`_mask_ge_secrets`)."""
        op = "ge_options"
        by_key = {k: f for f, k in _OPTION_KEYS.items()} | _OLD_KEYS
        for key, raw in v.items():
            field = by_key.get(key)
            try:
                if field is None:
                    _passed_through(op, key, raw, v)
                elif field not in _SECRET_FIELDS:
                    cls._parse_alone(op, field, key, raw)
            except InvalidOptionError as exc:  # named "LLMConfig: ge_options: ..." there
                raise ValueError(str(exc).removeprefix(f"{op}: ")) from None
        return v

    @model_validator(mode="after")
    def _mask_ge_secrets(self) -> LLMConfig:
        """A secret option given through ``ge_options`` (``aiokv.linkSecret``) is kept
        aside as a ``SecretStr`` and ``ge_options`` shows :data:`SECRET_MASK` in its
        place, so no output (``repr``, ``generate_options()``, dumps) holds it. A value
        that is the mask itself keeps the secret already held for that key, if any."""
        ge = self.ge_options
        found = _SECRET_KEYS.intersection(ge)
        if not found:
            if self._ge_secrets:
                self._ge_secrets = {}
            return self
        held = dict(self._ge_secrets)
        kept: dict[str, SecretStr] = {}
        for key in found:
            raw = ge[key]
            if raw == SECRET_MASK:
                if key in held:
                    kept[key] = held[key]
                continue
            if not 1 <= len(raw) <= _SECRET_MAX:
                raise ValueError(
                    f"ge_options[{key!r}]: a secret of {len(raw)} characters is out of "
                    f"range [1, {_SECRET_MAX}]"
                )
            kept[key] = SecretStr(raw)
        self.__dict__["ge_options"] = {k: SECRET_MASK if k in found else v for k, v in ge.items()}
        self._ge_secrets = kept
        return self

    @model_validator(mode="after")
    def _local_comm_res(self) -> LLMConfig:
        """llm_datadist: ``local_comm_res`` implies cache-manager mode and remote access."""
        implied = self.local_comm_res is not None
        chosen = self.model_fields_set
        if implied and "enable_cache_manager" in chosen and not self.enable_cache_manager:
            raise ValueError("local_comm_res is not supported when enable_cache_manager is False")
        for field in ("enable_cache_manager", "enable_remote_cache_accessible"):
            if field not in chosen:
                self.__dict__[field] = implied
        return self

    @property
    def listen_address(self) -> tuple[str, int] | None:
        """``listen_ip_info`` as ``(host, port)``."""
        return _ip_port(self.listen_ip_info) if self.listen_ip_info else None

    def generate_options(self, *, reveal_secrets: bool = False) -> dict[str, str]:
        """The ``dict[str, str]`` form accepted by ``LLMDataDist.init``: only the options
        that were set (by keyword or assignment), ``ge_options`` first, as llm_datadist.

        A secret (``link_secret``, also where ``ge_options`` carries it as
        ``aiokv.linkSecret``) shows as ``**********`` unless ``reveal_secrets=True``;
        ``from_options`` (and so ``init``) refuses that mask, naming this argument."""
        out = dict(self.ge_options)
        if reveal_secrets:
            out.update((k, v.get_secret_value()) for k, v in self._ge_secrets.items())
        for field, key in _OPTION_KEYS.items():
            value = getattr(self, field)
            if field not in self.model_fields_set or value is None:
                continue
            if not value and field in _EMITTED_WHEN_TRUE:
                continue
            if isinstance(value, SecretStr):
                out[key] = value.get_secret_value() if reveal_secrets else SECRET_MASK
            elif isinstance(value, MemPoolConfig):
                out[key] = value.to_json()
            elif isinstance(value, bool):
                out[key] = "1" if value else "0"
            else:
                out[key] = str(value)
            if field == "device_id":
                out["ge.session_device_id"] = out[key]
        return out

    def gen_options(self) -> dict[str, str]:
        """llm_datadist's other name of :meth:`generate_options`."""
        return self.generate_options()

    @property
    def options(self) -> dict[str, str]:
        """llm_datadist's ``options``: what :meth:`generate_options` gives (a new dict)."""
        return self.generate_options()

    def ignored_options(self) -> dict[str, str]:
        """The entries of ``generate_options()`` that were set and that aiokv accepts but
        does not act on (``ge_options`` and llm_datadist's transport tuning)."""
        keys = set(self.ge_options) | {_OPTION_KEYS[f] for f in _IGNORED_FIELDS}
        return {k: v for k, v in self.generate_options().items() if k in keys}

    @classmethod
    def from_options(cls, options: dict[str, str]) -> LLMConfig:
        """Parse the ``dict[str, str]`` form: aiokv's keys, and llm_datadist's own (what its
        ``generate_options()`` emits included). ``ge.*`` keys and llm_datadist keys with no
        field here go to ``ge_options``; ``ge.session_device_id`` (derived from
        ``ge.exec.deviceId``) is dropped. Numbers are digit strings, booleans ``0``/``1``.

        Raises:
            TypeError: not a ``dict[str, str]``.
            InvalidOptionError: unknown key, bad value (``LLM_PARAM_INVALID``, a ValueError).
        """
        return cls._from_options_in("LLMConfig.from_options", options)

    @classmethod
    def _from_options_in(cls, op: str, options: dict[str, str]) -> LLMConfig:
        """:meth:`from_options` for the public operation ``op`` (``init``,
        ``switch_role``), which its errors name."""
        if options is None:
            raise NoneArgumentError(f"{op}: options must not be None")
        if not isinstance(options, dict):
            raise TypeError(f"{op}: expected dict, got {type(options).__name__}")
        by_key = {v: k for k, v in _OPTION_KEYS.items()} | _OLD_KEYS
        kwargs: dict[str, Any] = {}
        passthrough: dict[str, str] = {}
        for key, raw in options.items():
            _check_option_item(op, key, raw)
            field = by_key.get(key)
            if field is None:
                if _passed_through(op, key, raw, options):
                    passthrough[key] = raw
            elif field in kwargs:
                raise InvalidOptionError(f"{op}: {key} given twice (also as another key)", op)
            else:
                kwargs[field] = cls._parse_alone(op, field, key, raw)
        if passthrough:
            kwargs["ge_options"] = passthrough
        with _param_invalid(op):
            return cls(**kwargs)

    @classmethod
    def _read_in(cls, op: str, options: LLMConfig | dict[str, str]) -> LLMConfig:
        """What ``init`` (or ``op``) reads from ``options``: a dict as :meth:`from_options`;
        an ``LLMConfig`` through its revealed dict form, as llm_datadist (``ge_options``'
        option keys meet the fields there), keeping the values it set that the dict form
        leaves out (``""``, ``None``, ``False``): an argument or assignment wins over an
        ``AIOKV_*`` default at ``init`` too, as it does in the ``LLMConfig`` itself.

        Raises:
            TypeError / InvalidOptionError: as :meth:`from_options`.
        """
        if not isinstance(options, LLMConfig):
            return cls._from_options_in(op, options)
        out = cls._from_options_in(op, options.generate_options(reveal_secrets=True))
        for field in sorted(options.model_fields_set - out.model_fields_set - {"ge_options"}):
            with _param_invalid(op):
                setattr(out, field, getattr(options, field))
        return out

    @classmethod
    def _parse_alone(cls, op: str, field: str, key: str, raw: str) -> Any:
        """One option's value, parsed and checked alone first, so that an error names
        the key (never showing a secret's value)."""
        if raw == SECRET_MASK and field in _SECRET_FIELDS:
            raise InvalidOptionError(
                f"{op}: {key} is the mask that generate_options() shows for a secret: "
                "pass generate_options(reveal_secrets=True), or the LLMConfig itself",
                op,
            )
        value = cls._parse(op, field, key, raw)
        try:
            cls(**{field: value})
        except InvalidOptionError as exc:
            shown = SECRET_MASK if key in _SECRET_KEYS else repr(raw)
            raise InvalidOptionError(f"{op}: {key}={shown}: {exc}", op) from None
        return value

    @classmethod
    def _parse(cls, op: str, field: str, key: str, raw: str) -> Any:
        """One option's string value as its field's type."""
        kind = _base_type(cls.model_fields[field].annotation)
        if kind is bool:
            if raw.lower() not in ("0", "1", "true", "false"):
                raise InvalidOptionError(f"{op}: {key}={raw!r} is not a bool (0 or 1)", op)
            return raw.lower() in ("1", "true")
        if kind is int:
            if field == "device_id" and ";" in raw:
                raise InvalidOptionError(
                    f"{op}: {key}={raw!r}: aiokv drives one device per LLMDataDist", op
                )
            if not _INT_RE.fullmatch(raw):
                raise InvalidOptionError(f"{op}: {key}={raw!r} is not an integer", op)
            return int(raw)
        if kind is float:
            try:
                return float(raw)
            except ValueError:
                raise InvalidOptionError(f"{op}: {key}={raw!r} is not a number", op) from None
        return raw


def _check_option_item(op: str, key: Any, raw: Any) -> None:
    """Raise ``TypeError`` unless an option's key and value are both ``str`` (never
    showing a secret's value)."""
    if not isinstance(key, str) or not isinstance(raw, str):
        what = f"{type(raw).__name__} value" if key in _SECRET_KEYS else repr(raw)
        raise TypeError(f"{op}: keys and values must be str, got {key!r}: {what}")


def _passed_through(op: str, key: str, raw: str, options: dict[str, str]) -> bool:
    """Whether an option with no field goes to ``ge_options`` (``False``: it is dropped,
    as ``ge.session_device_id`` beside ``ge.exec.deviceId``).

    Raises:
        InvalidOptionError: an unknown key, or a bad ``ge.flowGraphMemMaxSize``.
    """
    if key == "ge.session_device_id" and "ge.exec.deviceId" in options:
        return False
    if not (key.startswith("ge.") or key in _PASSTHROUGH_KEYS):
        known = {*_OPTION_KEYS.values(), *_PASSTHROUGH_KEYS}
        raise InvalidOptionError(f"{op}: {unknown_name('option', key, known)}", op)
    if key == "ge.flowGraphMemMaxSize" and not (raw.isascii() and raw.isdigit()):
        raise InvalidOptionError(f"{op}: {key} must be digit, got {raw!r}", op)
    return True


#: set while ``_env_defaults`` checks a value by building an ``LLMConfig`` from it
_CHECKING_ENV: contextvars.ContextVar[bool] = contextvars.ContextVar("aiokv_env", default=False)


class _Environment(BaseSettings):
    """The ``AIOKV_<FIELD>`` variables, as strings (read by pydantic-settings)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")
    # one field per option (the option-string form, parsed as ``from_options`` does)
    __annotations__ = {field: str | None for field in _OPTION_KEYS}
    locals().update(dict.fromkeys(_OPTION_KEYS))


def _env_defaults() -> dict[str, Any]:
    """The fields the environment sets (``AIOKV_<FIELD>``, non-empty), each checked alone.

    Raises:
        InvalidOptionError: a value that is not its field's type or is out of range,
            naming the variable (never showing a secret's value).
    """
    op = "LLMConfig (environment)"
    out: dict[str, Any] = {}
    if not any(name[:6].upper() == ENV_PREFIX for name in os.environ):
        return out  # the common case, without pydantic-settings' ~3 ms
    _warn_misspelt()
    for field, raw in _Environment().model_dump(exclude_none=True).items():
        if raw == "":
            continue
        name = ENV_PREFIX + field.upper()
        shown = SECRET_MASK if field in _SECRET_FIELDS else repr(raw)
        value = LLMConfig._parse(op, field, name, raw)
        token = _CHECKING_ENV.set(True)  # the check below builds an LLMConfig: no env there
        try:
            LLMConfig(**{field: value})
        except (InvalidOptionError, TypeError) as exc:
            msg = str(exc).rsplit(": ", 1)[-1]  # pydantic's message: never the value
            raise InvalidOptionError(f"{op}: {name}={shown}: {msg}", op) from None
        finally:
            _CHECKING_ENV.reset(token)
        out[field] = value
    return out


#: misspelt variables already warned of (once each per process)
_WARNED: set[str] = set()


def _warn_misspelt() -> None:
    """Warn, once per variable, of an ``AIOKV_*`` variable that nothing reads but that is
    within a typo of one that is (``AIOKV_DEVICEID`` for ``AIOKV_DEVICE_ID``): it would
    otherwise be ignored without a word. Other unknown names (a deployment's own
    ``AIOKV_HOME``) stay silent."""
    known = {ENV_PREFIX + name for name in (*(f.upper() for f in _OPTION_KEYS), *OTHER_ENV)}
    for name in os.environ:
        upper = name.upper()
        if upper[:6] != ENV_PREFIX or upper in known or name in _WARNED:
            continue
        near = difflib.get_close_matches(upper, sorted(known), n=1, cutoff=0.85)
        if near:
            _WARNED.add(name)
            warn(
                f"environment variable {name} is not read by aiokv and is ignored; "
                f"did you mean {near[0]}?",
                UserWarning,
            )


#: llm_datadist's spelling of the class name
LlmConfig = LLMConfig
