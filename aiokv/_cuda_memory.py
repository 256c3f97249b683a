"""CUDA device memory named by address: checked with the CUDA driver, viewed as a tensor.

llm_datadist's ``register_cache`` / ``register_blocks_cache`` take the addresses of the
caller's device tensors (``tensor.data_ptr()``). On a CUDA device aiokv accepts them
too: each address must lie, with the cache tensor's whole size after it, inside ONE
allocation of device memory on the cache's device, as the driver reports it
(``cuPointerGetAttribute``: memory type, device ordinal, allocation range). Anything
else — host memory, another device, a range that runs past its allocation, a number the
driver does not know — is refused with ``LLM_PARAM_INVALID`` before anything is kept.
The memory stays the caller's: the tensor views it without a copy and never frees it.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any
from typing import Final

import torch

from ._checks import param_invalid

__all__ = ["cuda_memory"]

# CUpointer_attribute values (cuda.h)
_MEMORY_TYPE: Final = 2
_DEVICE_ORDINAL: Final = 9
_RANGE_START_ADDR: Final = 11
_RANGE_SIZE: Final = 12
_CU_MEMORYTYPE_DEVICE: Final = 2


@functools.cache
def _driver() -> ctypes.CDLL | None:
    """The CUDA driver library, or ``None`` where it cannot be loaded."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
    lib.cuPointerGetAttribute.restype = ctypes.c_int
    return lib


def _attribute(
    lib: ctypes.CDLL, attribute: int, addr: int, value: ctypes._SimpleCData[Any]
) -> bool:
    """Read one pointer attribute of ``addr`` into ``value``; False if the driver refuses."""
    return bool(lib.cuPointerGetAttribute(ctypes.byref(value), attribute, addr) == 0)


class _DeviceArray:
    """The ``__cuda_array_interface__`` of ``nbytes`` bytes at ``addr``: what
    ``torch.as_tensor`` views without a copy."""

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (addr, False),
            "strides": None,
            "version": 3,  # no "stream": the caller orders its own writes
        }


def cuda_memory(op: str, addr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A ``uint8`` tensor over the ``nbytes`` bytes of CUDA memory at ``addr`` on
    ``device`` (no copy; the memory stays the caller's and must outlive the cache).

    Raises:
        LLMException: ``LLM_PARAM_INVALID`` unless ``[addr, addr + nbytes)`` lies inside one
            device allocation on ``device`` (host memory, another device, an unknown
            address, a range past its allocation), or without CUDA and its driver.
    """
    lib = _driver() if torch.cuda.is_available() else None
    if lib is None:
        param_invalid(op, "device addresses need CUDA and its driver (libcuda.so.1)")
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.synchronize(index)  # the device's context current on this thread
    kind, ordinal = ctypes.c_uint(0), ctypes.c_int(-1)
    start, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    if not _attribute(lib, _MEMORY_TYPE, addr, kind) or kind.value != _CU_MEMORYTYPE_DEVICE:
        param_invalid(
            op,
            f"address {addr:#x} is not CUDA device memory; host memory is registered with "
            "device_type='cpu' (or a HOST placement), or pass the tensors themselves",
        )
    if not _attribute(lib, _DEVICE_ORDINAL, addr, ordinal) or ordinal.value != index:
        param_invalid(op, f"address {addr:#x} is memory of cuda:{ordinal.value}, not cuda:{index}")
    if not (
        _attribute(lib, _RANGE_START_ADDR, addr, start)
        and _attribute(lib, _RANGE_SIZE, addr, size)
        and addr + nbytes <= start.value + size.value
    ):
        param_invalid(
            op,
            f"{nbytes} bytes at {addr:#x} run past the end of its device allocation "
            f"({size.value} bytes at {start.value:#x})",
        )
    return torch.as_tensor(_DeviceArray(addr, nbytes), device=torch.device("cuda", index))
