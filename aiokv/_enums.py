"""Enumerations of the llm_datadist API: data types, placements, roles, status codes."""

from __future__ import annotations

import enum

import torch

__all__ = ["DataType", "LLMRole", "LLMStatusCode", "Memtype", "Placement", "RegisterMemStatus"]


class _Named(enum.IntEnum):
    """An int enum whose ``str()`` is ``Class.MEMBER``, as llm_datadist prints its enums."""

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class DataType(_Named):
    """Element types, with llm_datadist's numeric values.

    ``DataType.from_torch(dtype)`` and ``dt.torch_dtype`` map to and from torch;
    ``dt.item_size`` is the size of one element in bytes. ``DT_STRING`` exists for
    llm_datadist compatibility; it has no torch type and no fixed size, so no cache
    can hold it.
    """

    # llm_datadist's order (iteration follows it); the values are GE's
    DT_FLOAT = 0
    DT_FLOAT16 = 1
    DT_BF16 = 27
    DT_INT8 = 2
    DT_INT16 = 6
    DT_UINT16 = 7
    DT_UINT8 = 4
    DT_INT32 = 3
    DT_INT64 = 9
    DT_UINT32 = 8
    DT_UINT64 = 10
    DT_BOOL = 12
    DT_DOUBLE = 11
    DT_STRING = 13

    @property
    def torch_dtype(self) -> torch.dtype:
        """The matching ``torch.dtype``.

        Raises:
            ValueError: ``DT_STRING`` (no torch counterpart).
        """
        try:
            return _TO_TORCH[self]
        except KeyError:
            raise ValueError(f"{self} has no torch dtype") from None

    @property
    def item_size(self) -> int:
        """Bytes per element (``ValueError`` for ``DT_STRING``)."""
        return self.torch_dtype.itemsize

    @classmethod
    def from_torch(cls, dtype: torch.dtype) -> DataType:
        """The ``DataType`` of a ``torch.dtype``.

        Raises:
            TypeError: ``dtype`` is not a ``torch.dtype``.
            ValueError: torch type with no llm_datadist counterpart.
        """
        if not isinstance(dtype, torch.dtype):
            raise TypeError(
                f"DataType.from_torch: expected torch.dtype, got {type(dtype).__name__}"
            )
        try:
            return _FROM_TORCH[dtype]
        except KeyError:
            raise ValueError(f"DataType.from_torch: {dtype} has no llm_datadist DataType") from None


_TO_TORCH: dict[DataType, torch.dtype] = {
    DataType.DT_FLOAT: torch.float32,
    DataType.DT_FLOAT16: torch.float16,
    DataType.DT_INT8: torch.int8,
    DataType.DT_INT32: torch.int32,
    DataType.DT_UINT8: torch.uint8,
    DataType.DT_INT16: torch.int16,
    DataType.DT_UINT16: torch.uint16,
    DataType.DT_UINT32: torch.uint32,
    DataType.DT_INT64: torch.int64,
    DataType.DT_UINT64: torch.uint64,
    DataType.DT_DOUBLE: torch.float64,
    DataType.DT_BOOL: torch.bool,
    DataType.DT_BF16: torch.bfloat16,
}
_FROM_TORCH: dict[torch.dtype, DataType] = {v: k for k, v in _TO_TORCH.items()}


class Placement(_Named):
    """Where a cache lives: host memory or the device."""

    HOST = 0
    DEVICE = 1


class LLMRole(_Named):
    """Role of an ``LLMDataDist`` instance."""

    PROMPT = 1
    DECODER = 2
    MIX = 3


_BASE = 0x5010B000


class LLMStatusCode(_Named):
    """Status codes: every member of llm_datadist's, with its native value.

    ``0x5010B000 + n`` are the GE ``LLM_*`` codes (``llm_error_codes.h``);
    ``LLM_DEVICE_MEM_ERROR`` and ``LLM_SUSPECT_REMOTE_ERROR`` are the ACL runtime's
    ``ACL_ERROR_RT_DEVICE_MEM_ERROR`` (507053) and ``ACL_ERROR_RT_SUSPECT_REMOTE_ERROR``
    (507057). ``LLM_SEQ_LENOVERLIMIT`` keeps llm_datadist's spelling.
    """

    LLM_SUCCESS = 0  # llm_datadist's order (iteration follows it)
    LLM_FAILED = 0xFFFFFFFF
    LLM_PARAM_INVALID = _BASE + 5
    LLM_WAIT_PROCESS_TIMEOUT = _BASE + 1
    LLM_KV_CACHE_NOT_EXIST = _BASE + 2
    LLM_REPEAT_REQUEST = _BASE + 3
    LLM_REQUEST_ALREADY_COMPLETED = _BASE + 4
    LLM_ENGINE_FINALIZED = _BASE + 6
    LLM_NOT_YET_LINK = _BASE + 7
    LLM_ALREADY_LINK = _BASE + 8
    LLM_LINK_FAILED = _BASE + 9
    LLM_UNLINK_FAILED = _BASE + 10
    LLM_NOTIFY_PROMPT_UNLINK_FAILED = _BASE + 11
    LLM_CLUSTER_NUM_EXCEED_LIMIT = _BASE + 12
    LLM_PROCESSING_LINK = _BASE + 13
    LLM_DEVICE_OUT_OF_MEMORY = _BASE + 14
    LLM_PREFIX_ALREADY_EXIST = _BASE + 15
    LLM_PREFIX_NOT_EXIST = _BASE + 16
    LLM_SEQ_LENOVERLIMIT = _BASE + 17
    LLM_NO_FREE_BLOCK = _BASE + 18
    LLM_BLOCKS_OUT_OF_MEMORY = _BASE + 19
    LLM_EXIST_LINK = _BASE + 24
    LLM_FEATURE_NOT_ENABLED = _BASE + 25
    LLM_TIMEOUT = _BASE + 26
    LLM_LINK_BUSY = _BASE + 27
    LLM_OUT_OF_MEMORY = _BASE + 28
    LLM_DEVICE_MEM_ERROR = 507053
    LLM_SUSPECT_REMOTE_ERROR = 507057
    LLM_UNKNOWN_ERROR = -1


class Memtype(enum.Enum):
    """Kind of memory a :class:`~aiokv.MemInfo` names, with llm_datadist's values."""

    MEM_TYPE_DEVICE = 0
    MEM_TYPE_HOST = 1


class RegisterMemStatus(enum.Enum):
    """State of a two-sided ``link`` (``LLMDataDist.query_register_mem_status``), with
    llm_datadist's values: ``PREPARING`` while the parties connect, ``OK`` once every
    link of the communicator is up (transfers may start), ``FAILED`` when it could not
    be completed in time."""

    OK = 0
    PREPARING = 1
    FAILED = 2
