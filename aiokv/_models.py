"""Typed values of the API (pydantic v2): descriptors, keys, peers, transfer targets.

Every model accepts llm_datadist's positional form and keyword form. Validation
failures follow SPEC §1.2: a wrong type raises ``TypeError`` (``NoneArgumentError`` for
``None``), a bad value raises ``ValueError``; pydantic's ``ValidationError`` never
escapes bare.
"""

from __future__ import annotations

import ipaddress
import math
import socket
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any
from typing import ClassVar
from typing import NoReturn

import torch
from pydantic import BaseModel
from pydantic import ConfigDict
from pydantic import Field
from pydantic import PrivateAttr
from pydantic import ValidationError
from pydantic import ValidationInfo
from pydantic import field_validator
from pydantic import model_validator

from ._checks import MAX_LAYER
from ._checks import UINT64_MAX
from ._checks import check_int
from ._checks import param_invalid
from ._enums import DataType
from ._enums import LLMRole
from ._enums import LLMStatusCode
from ._enums import Memtype
from ._enums import Placement
from ._errors import LLMException
from ._errors import NoneArgumentError

__all__ = [
    "BlocksCacheKey",
    "CacheDesc",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "LLMClusterInfo",
    "MemInfo",
    "Model",
    "TransferConfig",
    "TransferWithCacheKeyConfig",
]


_TYPE_ERRORS = ("type", "parsing", "is_instance_of", "missing", "extra_forbidden", "arguments")


def _translate(model: str, exc: ValidationError, *, args_invalid: bool = False) -> Exception:
    """Map a pydantic ``ValidationError`` onto the SPEC's TypeError / ValueError split.

    With ``args_invalid`` (llm_datadist's key classes) a missing or unknown argument is
    ``LLMException(LLM_PARAM_INVALID)``, as those classes raise it upstream.
    """
    err = exc.errors(include_url=False)[0]
    loc = ".".join(str(p) for p in err["loc"]) or "value"
    msg = f"{model}: {loc}: {err['msg'].removeprefix('Value error, ')}"
    kind = err["type"]
    if args_invalid and kind in ("missing", "extra_forbidden"):
        return LLMException(msg, status_code=LLMStatusCode.LLM_PARAM_INVALID, op=model)
    if kind in ("no_such_attribute", "frozen_instance", "frozen_field"):
        # llm_datadist's fields are read-only properties: assigning one is an AttributeError
        return AttributeError(msg)
    if err.get("input", ...) is None and kind != "missing":
        return NoneArgumentError(f"{model}: {loc} must not be None")
    if any(t in kind for t in _TYPE_ERRORS) or kind == "bool_type":
        return TypeError(msg)
    return ValueError(msg)


class Model(BaseModel):
    """Base: strict types, positional construction, SPEC error translation."""

    # protected_namespaces=(): llm_datadist names fields ``model_id``; pydantic < 2.10
    # warns about every ``model_`` field at class creation (an ``import aiokv`` warning)
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, protected_namespaces=())
    _positional: ClassVar[tuple[str, ...]] = ()
    #: argument-count and unknown/missing-argument errors are LLM_PARAM_INVALID (keys)
    _args_invalid: ClassVar[bool] = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        name = type(self).__name__
        if len(args) > len(self._positional):
            if self._args_invalid:
                param_invalid(name, f"takes at most {len(self._positional)} arguments")
            raise TypeError(f"{name}: takes at most {len(self._positional)} positional arguments")
        for field, value in zip(self._positional, args, strict=False):
            if field in kwargs:
                raise TypeError(f"{name}: got multiple values for {field!r}")
            kwargs[field] = value
        try:
            super().__init__(**kwargs)
        except ValidationError as exc:
            raise _translate(name, exc, args_invalid=self._args_invalid) from None

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as exc:
            raise _translate(type(self).__name__, exc) from None


def _u64(v: int) -> int:
    if v < 0 or v > UINT64_MAX:
        raise ValueError(f"{v} is out of the uint64 range")
    return v


def _take_alias(cls: type, data: Any, alias: str, name: str) -> Any:
    """Accept ``alias`` for the field ``name`` (llm_datadist spells both); not both
    (``LLM_PARAM_INVALID``)."""
    if isinstance(data, dict) and alias in data:
        if name in data:
            param_invalid(cls.__name__, f"give {name} or {alias}, not both")
        data = dict(data)
        data[name] = data.pop(alias)
    return data


class CacheDesc(Model):
    """Describes a cache: ``num_tensors`` tensors, each of ``shape`` and ``data_type``.

    ``size`` is the byte size of ONE tensor. For a blocks (paged) cache ``shape[0]`` is the
    number of blocks and one block is ``size // shape[0]`` bytes of each tensor.

    As llm_datadist: ``batch_dim_index`` must be in ``[0, len(shape))`` and
    ``seq_len_dim_index`` ``-1`` or in ``[0, len(shape))``, else
    ``LLMException(LLM_PARAM_INVALID)`` (so is ``DT_STRING``, which has no element size).
    A value otherwise (equality and hash by fields), except that :meth:`update_dim`
    changes one dimension in place.
    """

    if TYPE_CHECKING:

        def __init__(
            self,
            num_tensors: int,
            shape: Sequence[int],
            data_type: DataType | torch.dtype,
            placement: Placement = ...,
            batch_dim_index: int = ...,
            seq_len_dim_index: int = ...,
            kv_tensor_format: str | None = ...,
        ) -> None: ...

    _positional = (
        "num_tensors",
        "shape",
        "data_type",
        "placement",
        "batch_dim_index",
        "seq_len_dim_index",
        "kv_tensor_format",
    )
    num_tensors: int = Field(ge=1, le=1 << 20)
    shape: tuple[int, ...]
    data_type: DataType
    placement: Placement = Placement.DEVICE
    batch_dim_index: int = 0
    seq_len_dim_index: int = -1
    kv_tensor_format: str | None = None
    # set on the copy a Cache keeps: its dims may no longer change
    _locked: bool = PrivateAttr(default=False)

    @field_validator("shape", mode="before")
    @classmethod
    def _shape(cls, v: Any) -> Any:
        if isinstance(v, list | torch.Size):
            v = tuple(v)
        if isinstance(v, tuple):
            for d in v:
                if isinstance(d, bool) or not isinstance(d, int):
                    raise TypeError(f"CacheDesc: shape entries must be int, got {d!r}")
                if d < 1 or d > 1 << 40:
                    raise ValueError(f"CacheDesc: shape entry {d} must be in [1, 2**40]")
        return v

    @field_validator("data_type", mode="before")
    @classmethod
    def _dtype(cls, v: Any) -> Any:
        return DataType.from_torch(v) if isinstance(v, torch.dtype) else v

    @model_validator(mode="after")
    def _dims(self) -> CacheDesc:
        op, n = "CacheDesc", len(self.shape)
        if not 0 <= self.batch_dim_index < n:
            param_invalid(op, f"batch_dim_index {self.batch_dim_index} out of range, [0, {n})")
        if self.seq_len_dim_index != -1 and not 0 <= self.seq_len_dim_index < n:
            param_invalid(
                op, f"seq_len_dim_index {self.seq_len_dim_index} is invalid, -1 or in [0, {n})"
            )
        if self.data_type == DataType.DT_STRING:
            param_invalid(op, "DT_STRING has no element size; a cache cannot hold it")
        if math.prod(self.shape) * self.data_type.item_size > 1 << 44:
            raise ValueError("tensor size exceeds 16 TiB")
        return self

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self.__dict__ == other.__dict__

    def __hash__(self) -> int:
        return hash((type(self), *self.__dict__.values()))

    @property
    def batch_dim(self) -> int:
        """llm_datadist's name of ``batch_dim_index``."""
        return self.batch_dim_index

    def update_dim(self, dim_index: int, dim_value: int) -> None:
        """Set ``shape[dim_index] = dim_value`` in place, as llm_datadist.

        Meant for a descriptor reused as a template between allocations. A cache keeps
        its own copy of the descriptor it was made with, so this never resizes a cache;
        calling it on that copy (``cache.cache_desc``) is refused.

        Raises:
            TypeError / ValueError: not ints; ``dim_value`` outside ``[1, 2**40]``.
            LLMException: ``LLM_PARAM_INVALID`` for ``dim_index`` outside
                ``[0, len(shape))`` or a cache's own descriptor.
        """
        op = "CacheDesc.update_dim"
        index = check_int(op, "dim_index", dim_index)
        check_int(op, "dim_value", dim_value)
        if self._locked:
            param_invalid(op, "this descriptor belongs to a cache; update a copy")
        if not 0 <= index < len(self.shape):
            param_invalid(op, f"dim_index {index} out of range, [0, {len(self.shape)})")
        shape = list(self.shape)
        shape[index] = dim_value
        checked = CacheDesc(**{**self.__dict__, "shape": shape})  # every rule, once more
        object.__setattr__(self, "shape", checked.shape)

    def locked_copy(self) -> CacheDesc:
        """A copy whose dims :meth:`update_dim` refuses to change (what a cache keeps)."""
        if self._locked:
            return self
        copy = self.model_copy()
        copy._locked = True
        return copy

    @property
    def size(self) -> int:
        """Bytes of one tensor."""
        return math.prod(self.shape) * self.data_type.item_size

    @property
    def batch_size(self) -> int:
        """Extent of the batch dimension."""
        return self.shape[self.batch_dim_index]

    @property
    def torch_dtype(self) -> torch.dtype:
        """The element type as a ``torch.dtype``."""
        return self.data_type.torch_dtype


class CacheKey(Model):
    """Names one batch slot of a cache on the prompt side (``req_id=2**64-1`` is a placeholder).

    Accepts ``prompt_cluster_id`` or its alias ``cluster_id``. A cache is found by
    ``(req_id or prefix_id, model_id)``: ``cluster_id`` only chooses the link. Too many
    arguments, unknown or missing ones: ``LLMException(LLM_PARAM_INVALID)``, as
    llm_datadist.
    """

    if TYPE_CHECKING:

        def __init__(
            self,
            prompt_cluster_id: int = ...,
            req_id: int = ...,
            model_id: int = ...,
            prefix_id: int = ...,
            *,
            cluster_id: int = ...,
        ) -> None: ...

    _positional = ("prompt_cluster_id", "req_id", "model_id", "prefix_id")
    _args_invalid = True
    prompt_cluster_id: int
    req_id: int
    model_id: int = 0
    prefix_id: int = UINT64_MAX

    @model_validator(mode="before")
    @classmethod
    def _alias(cls, data: Any) -> Any:
        return _take_alias(cls, data, "cluster_id", "prompt_cluster_id")

    _ranges = field_validator("prompt_cluster_id", "req_id", "model_id", "prefix_id")(
        classmethod(lambda cls, v: _u64(v))
    )

    @property
    def cluster_id(self) -> int:
        """Alias of ``prompt_cluster_id``."""
        return self.prompt_cluster_id


class BlocksCacheKey(Model):
    """Names a blocks (paged) cache: ``(cluster_id, model_id)``.

    Accepts ``cluster_id`` or its alias ``prompt_cluster_id``. A cache is found by
    ``model_id``: ``cluster_id`` only chooses the link. Argument errors as
    :class:`CacheKey`.
    """

    if TYPE_CHECKING:

        def __init__(
            self, cluster_id: int = ..., model_id: int = ..., *, prompt_cluster_id: int = ...
        ) -> None: ...

    _positional = ("cluster_id", "model_id")
    _args_invalid = True
    cluster_id: int
    model_id: int = 0

    @model_validator(mode="before")
    @classmethod
    def _alias(cls, data: Any) -> Any:
        return _take_alias(cls, data, "prompt_cluster_id", "cluster_id")

    _ranges = field_validator("cluster_id", "model_id")(classmethod(lambda cls, v: _u64(v)))

    @property
    def prompt_cluster_id(self) -> int:
        """Alias of ``cluster_id``."""
        return self.cluster_id


class CacheKeyByIdAndIndex(Model):
    """Names one batch slot of a cache by the owner's ``cache_id``."""

    if TYPE_CHECKING:

        def __init__(self, cluster_id: int, cache_id: int, batch_index: int = ...) -> None: ...

    _positional = ("cluster_id", "cache_id", "batch_index")
    cluster_id: int
    cache_id: int
    batch_index: int = 0

    _ranges = field_validator("cluster_id")(classmethod(lambda cls, v: _u64(v)))

    @field_validator("cache_id")
    @classmethod
    def _cache_id(cls, v: int) -> int:
        if not 0 <= v < 1 << 63:  # llm_datadist: an int64; aiokv's ids are >= 1
            raise ValueError(f"cache_id {v} is out of range [0, 2**63-1]")
        return v

    @field_validator("batch_index")
    @classmethod
    def _batch_index(cls, v: int) -> int:
        if not 0 <= v < 1 << 32:  # a uint32, as llm_datadist
            raise ValueError(f"batch_index {v} is not a uint32 value")
        return v


class AddressError(LLMException, ValueError):
    """An IP that is not an address: ``LLMException(LLM_PARAM_INVALID)``, so the
    ``RuntimeError`` llm_datadist raises, and the ``ValueError`` SPEC §1.2 names."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status_code=LLMStatusCode.LLM_PARAM_INVALID, op="LLMClusterInfo")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self),))


class LLMClusterInfo(Model):
    """A peer to link with: its cluster id and its ``(ip, port)`` addresses.

    Used like llm_datadist (``info.remote_cluster_id = 1;
    info.append_remote_ip_info("127.0.0.1", 26000)``) or by keyword.
    ``remote_cluster_id`` is ``None`` until set (linking refuses it then);
    ``remote_role_type`` is kept for llm_datadist compatibility. An integer IP is
    llm_datadist's encoding: the four address bytes read little-endian
    (``127.0.0.1`` is ``0x0100007F``). ``local_ip_info`` / ``remote_ip_info`` hold
    ``(str, port)``; ``local_ip_info_list`` / ``remote_ip_info_list`` are llm_datadist's
    ``(int, port)`` form of the same addresses.
    """

    if TYPE_CHECKING:

        def __init__(
            self,
            remote_cluster_id: int | None = ...,
            *,
            remote_role_type: LLMRole | int | None = ...,
            local_ip_info: Sequence[tuple[str | int, int]] = ...,
            remote_ip_info: Sequence[tuple[str | int, int]] = ...,
        ) -> None: ...

    model_config = ConfigDict(strict=True, extra="forbid", frozen=False, validate_assignment=True)
    _positional = ("remote_cluster_id",)
    remote_cluster_id: int | None = None
    remote_role_type: LLMRole | int | None = None
    local_ip_info: list[tuple[str, int]] = Field(default_factory=list)
    remote_ip_info: list[tuple[str, int]] = Field(default_factory=list)

    _ranges = field_validator("remote_cluster_id")(
        classmethod(lambda cls, v: v if v is None else _u64(v))
    )

    @field_validator("local_ip_info", "remote_ip_info", mode="before")
    @classmethod
    def _addrs(cls, v: Any, info: ValidationInfo) -> Any:
        if isinstance(v, list | tuple):
            if any(a is None for a in v):
                raise NoneArgumentError(
                    f"LLMClusterInfo: an entry of {info.field_name} is None (an "
                    "LLMDataDist's listen_address is None unless it listens: give it "
                    "listen_ip_info)"
                )
            return [cls._addr(*a) if isinstance(a, list | tuple) else a for a in v]
        return v

    @staticmethod
    def _addr(ip: Any, port: Any) -> tuple[str, int]:
        if isinstance(ip, int) and not isinstance(ip, bool):
            if not 0 <= ip < 1 << 32:
                raise ValueError(f"LLMClusterInfo: integer ip {ip} is not a 32-bit address")
            ip = socket.inet_ntoa(ip.to_bytes(4, "little"))
        if not isinstance(ip, str):
            raise TypeError(f"LLMClusterInfo: ip must be str or int, got {type(ip).__name__}")
        if isinstance(port, bool) or not isinstance(port, int):
            raise TypeError(f"LLMClusterInfo: port must be int, got {type(port).__name__}")
        try:
            ipaddress.ip_address(ip)
        except ValueError:
            raise AddressError(f"LLMClusterInfo: {ip!r} is not an IP address") from None
        if not 0 <= port <= 65535:
            raise ValueError(f"LLMClusterInfo: port {port} out of range [0, 65535]")
        return (ip, port)

    def append_local_ip_info(self, ip: str | int, port: int) -> None:
        """Add a local address (kept for llm_datadist compatibility; TCP picks its own)."""
        self.local_ip_info = [*self.local_ip_info, self._addr(ip, port)]

    def append_remote_ip_info(self, ip: str | int, port: int) -> None:
        """Add an address the peer listens on."""
        self.remote_ip_info = [*self.remote_ip_info, self._addr(ip, port)]

    @property
    def local_ip_info_list(self) -> list[tuple[int | str, int]]:
        """``local_ip_info`` in llm_datadist's form (IPv4 as its integer encoding).

        As in llm_datadist, ``append`` / ``extend`` on it add addresses (through
        :meth:`append_local_ip_info`); other changes raise ``TypeError``."""
        return _IpInfoList(self.local_ip_info, self.append_local_ip_info, "local")

    @property
    def remote_ip_info_list(self) -> list[tuple[int | str, int]]:
        """``remote_ip_info`` in llm_datadist's form (IPv4 as its integer encoding).

        As in llm_datadist, ``append`` / ``extend`` on it add addresses (through
        :meth:`append_remote_ip_info`); other changes raise ``TypeError``."""
        return _IpInfoList(self.remote_ip_info, self.append_remote_ip_info, "remote")


class _IpInfoList(list[tuple[int | str, int]]):
    """A ``*_ip_info_list`` view: ``append`` and ``extend`` write through to the
    ``LLMClusterInfo`` (llm_datadist's list is the object's own); any other change
    would be lost, so it raises instead of being silently ignored."""

    def __init__(
        self,
        info: list[tuple[str, int]],
        add: Callable[[str | int, int], None],
        side: str,
    ) -> None:
        super().__init__((_ip_int(ip), port) for ip, port in info)
        self._add = add
        self._side = side

    def append(self, item: tuple[int | str, int]) -> None:
        ip, port = _ip_pair(item, self._side)
        self._add(ip, port)  # checked there; nothing changes when it raises
        super().append((_ip_int(ip) if isinstance(ip, str) else ip, port))

    def extend(self, items: Iterable[tuple[int | str, int]]) -> None:
        """Add every address, or (one is bad) none: each is checked before any is added."""
        pairs = [_ip_pair(item, self._side) for item in list(items)]
        for ip, port in pairs:
            LLMClusterInfo._addr(ip, port)  # raises before anything changed
        for pair in pairs:
            self.append(pair)

    def _refuse(self, *_: Any, **__: Any) -> NoReturn:
        raise TypeError(
            f"LLMClusterInfo.{self._side}_ip_info_list: only append and extend change it; "
            f"to set the addresses, assign {self._side}_ip_info=[(ip, port), ...]"
        )

    insert = remove = pop = clear = sort = reverse = _refuse
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse


def _ip_pair(item: Any, side: str) -> tuple[str | int, int]:
    if not isinstance(item, tuple) or len(item) != 2:
        raise TypeError(
            f"LLMClusterInfo.{side}_ip_info_list.append: an (ip, port) tuple, got {item!r:.60}"
        )
    return item[0], item[1]


def _ip_int(ip: str) -> int | str:
    """llm_datadist's integer form of an IPv4 address (an IPv6 one stays a string)."""
    try:
        return int.from_bytes(socket.inet_aton(ip), "little")
    except OSError:
        return ip


class MemInfo(Model):
    """A memory range, as llm_datadist's ``MemInfo(mem_type, addr, size)`` (the argument
    of ``CacheManager.remap_registered_memory``)."""

    if TYPE_CHECKING:

        def __init__(self, mem_type: Memtype, addr: int, size: int) -> None: ...

    _positional = ("mem_type", "addr", "size")
    mem_type: Memtype
    addr: int
    size: int

    def __str__(self) -> str:
        return f"MemInfo(mem_type={self.mem_type}, addr={self.addr}, size={self.size})"


def _check_range(model: str, v: Any, info: ValidationInfo) -> Any:
    """A layer range field's value: ``None`` or a non-empty ``range`` with step 1 from
    >= 0. A ``TypeError`` leaves pydantic as it is, so it names the model and field
    itself; the ``ValueError`` is wrapped with them (:func:`_translate`)."""
    if v is not None:
        name = f"{model}: {info.field_name}"
        if not isinstance(v, range):
            raise TypeError(f"{name} must be a range or None, got {type(v).__name__}")
        # ``not v``, not ``len(v)``: len() of a range past 2**63 raises OverflowError
        if v.step != 1 or v.start < 0 or not v or v.stop > MAX_LAYER:
            raise ValueError(
                f"layer range {v} must be non-empty, non-negative, step 1, stop <= {MAX_LAYER}"
            )
    return v


#: the transfer configs' settings: assignable and checked, as llm_datadist's setters
_SETTABLE = ConfigDict(
    strict=True,
    extra="forbid",
    frozen=False,
    validate_assignment=True,
    arbitrary_types_allowed=True,
)


class TransferConfig(Model):
    """One destination of ``transfer_cache_async``: raw addresses registered on the peer.

    ``dst_addrs[i]`` is the address of the peer's tensor i (validated by the receiver
    against the memory it registered).
    """

    if TYPE_CHECKING:

        def __init__(
            self,
            dst_cluster_id: int,
            dst_addrs: Sequence[int],
            src_layer_range: range | None = ...,
            src_batch_index: int = ...,
        ) -> None: ...

    model_config = _SETTABLE
    _positional = ("dst_cluster_id", "dst_addrs", "src_layer_range", "src_batch_index")
    dst_cluster_id: int
    if TYPE_CHECKING:  # a list is assignable too, as llm_datadist's setter takes it

        @property
        def dst_addrs(self) -> tuple[int, ...]: ...
        @dst_addrs.setter
        def dst_addrs(self, value: Sequence[int]) -> None: ...

    else:
        dst_addrs: tuple[int, ...]
    src_layer_range: range | None = None
    src_batch_index: int = Field(default=0, ge=0)

    _ranges = field_validator("dst_cluster_id")(classmethod(lambda cls, v: _u64(v)))

    @field_validator("dst_addrs", mode="before")
    @classmethod
    def _addrs(cls, v: Any) -> Any:
        if isinstance(v, list):
            v = tuple(v)
        if isinstance(v, tuple):
            for a in v:
                if isinstance(a, bool) or not isinstance(a, int):
                    raise TypeError(f"TransferConfig: dst_addrs entries must be int, got {a!r}")
                _u64(a)
        return v

    _layers = field_validator("src_layer_range", mode="before")(
        classmethod(lambda cls, v, info: _check_range(cls.__name__, v, info))
    )

    @property
    def dst_layer_range(self) -> None:
        """``None``, as llm_datadist's attribute: the layers land where they leave."""
        return None


class TransferWithCacheKeyConfig(Model):
    """One destination of ``transfer_cache_async`` named by a key on the peer."""

    if TYPE_CHECKING:

        def __init__(
            self,
            cache_key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey,
            src_layer_range: range | None = ...,
            dst_layer_range: range | None = ...,
            src_batch_index: int = ...,
        ) -> None: ...

    model_config = _SETTABLE
    _positional = ("cache_key", "src_layer_range", "dst_layer_range", "src_batch_index")
    cache_key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey
    src_layer_range: range | None = None
    dst_layer_range: range | None = None
    src_batch_index: int = Field(default=0, ge=0)

    _layers = field_validator("src_layer_range", "dst_layer_range", mode="before")(
        classmethod(lambda cls, v, info: _check_range(cls.__name__, v, info))
    )

    @property
    def dst_cluster_id(self) -> int:
        """The cluster of ``cache_key``, as llm_datadist's attribute."""
        return self.cache_key.cluster_id
