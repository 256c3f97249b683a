"""Devices through torch: ``cpu`` always, ``cuda`` and ``npu`` through torch's generic API.

``torch_npu`` is imported lazily and only after a subprocess has shown that it imports
cleanly: where it is installed but CANN is absent, importing it can break torch in the
importing process. Streams and events use the device-generic ``torch.Stream`` /
``torch.Event`` so one code path serves CUDA and Ascend. CPU has neither; its copies are
synchronous.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from collections.abc import Iterator
from typing import cast

import torch

from .._checks import check_instance
from .._checks import check_int
from .._enums import LLMStatusCode
from .._errors import LLMException

__all__ = [
    "DeviceContext",
    "device_empty",
    "host_empty",
    "is_accelerator",
    "npu_device_count",
    "pre_touch",
    "resolve_device",
    "supports_pinning",
]

_ACCELERATORS = ("cuda", "npu")
_PROBE_TIMEOUT_S = 30.0
# Prints the NPU count; runs with backend autoload off so a broken torch_npu cannot take
# torch down with it before we get to catch the error.
_NPU_PROBE = (
    "import torch, torch_npu\nprint(torch.npu.device_count() if torch.npu.is_available() else 0)\n"
)


@functools.cache
def npu_device_count() -> int:
    """Number of usable Ascend NPUs; 0 where ``torch_npu`` is absent or broken.

    When ``torch_npu`` is not installed this returns at once (no subprocess). Otherwise a
    subprocess with ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` tries to import it and count
    devices; only if that succeeds with at least one device is ``torch_npu`` imported
    here. The result is cached for the life of the process.
    """
    if importlib.util.find_spec("torch_npu") is None:
        return 0
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _NPU_PROBE],
            env=env,
            capture_output=True,
            text=True,
            timeout=_PROBE_TIMEOUT_S,
            check=False,
        )
        count = int(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else 0
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return 0
    if count <= 0:
        return 0
    try:
        importlib.import_module("torch_npu")
    except Exception:
        return 0
    return count


def _cuda_device_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _device_count(device_type: str) -> int:
    if device_type == "cuda":
        return _cuda_device_count()
    if device_type == "npu":
        return npu_device_count()
    return 0


def resolve_device(device_type: str, device_id: int) -> torch.device:
    """The ``torch.device`` for a device type and index.

    Args:
        device_type: ``"cpu"``, ``"cuda"``, ``"npu"`` or ``"auto"`` (case-insensitive).
            ``"auto"`` picks NPU if present, else CUDA, else CPU.
        device_id: index of the accelerator; ignored for CPU.

    Raises:
        NoneArgumentError / TypeError / ValueError: bad argument types or a negative id.
        LLMException: ``LLM_PARAM_INVALID`` for an unknown type, an accelerator that is
            not available, or ``device_id`` out of range.
    """
    op = "resolve_device"
    kind = check_instance(op, "device_type", device_type, str).strip().lower()
    index = check_int(op, "device_id", device_id, 0)
    if kind == "auto":
        kind = next((k for k in ("npu", "cuda") if _device_count(k) > 0), "cpu")
    if kind == "cpu":
        return torch.device("cpu")
    if kind not in _ACCELERATORS:
        raise LLMException(
            f"{op}: unknown device_type {device_type!r} (cpu, cuda, npu or auto)",
            status_code=LLMStatusCode.LLM_PARAM_INVALID,
        )
    count = _device_count(kind)
    if index >= count:
        reason = "is not available" if count == 0 else f"has {count} device(s)"
        raise LLMException(
            f"{op}: {kind}:{index} requested but {kind} {reason}",
            status_code=LLMStatusCode.LLM_PARAM_INVALID,
        )
    return torch.device(kind, index)


def is_accelerator(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA or NPU device (streams, events, pinned host memory)."""
    return device.type in _ACCELERATORS


def supports_pinning(device: torch.device) -> bool:
    """Whether host memory can be page-locked for fast async copies to ``device``."""
    return is_accelerator(device) and _device_count(device.type) > 0


def host_empty(nbytes: int, device: torch.device, pin: bool = True) -> torch.Tensor:
    """An uninitialised ``uint8`` host buffer of ``nbytes``.

    Pinned when ``pin`` is true and ``device`` supports pinning; the caller owns it. An
    unpinned one of at least 2 MiB is advised to use transparent huge pages on Linux
    (``madvise(MADV_HUGEPAGE)``, before its first touch): copies between processes over
    shared memory / CMA ran ~1.7x faster on them (docs/benchmarks.md, NIXL).
    """
    pinned = pin and supports_pinning(device)
    buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    if not pinned and nbytes >= _HUGE_PAGE:
        _advise_huge_pages(buf.data_ptr(), nbytes)
    return buf


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise`` (Linux), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return cast("Callable[[int, int, int], int]", fn)


def _advise_huge_pages(addr: int, nbytes: int) -> None:
    """Advice only: where the kernel has no transparent huge pages it is ignored."""
    madvise = _madvise()
    page = os.sysconf("SC_PAGE_SIZE")
    start, end = -(-addr // page) * page, (addr + nbytes) // page * page
    if madvise is not None and end > start:
        madvise(start, end - start, _MADV_HUGEPAGE)


def device_empty(nbytes: int, device: torch.device) -> torch.Tensor:
    """An uninitialised ``uint8`` buffer of ``nbytes`` on ``device``; the caller owns it.
    On ``cpu`` it is host memory, advised as :func:`host_empty`'s."""
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if device.type == "cpu" and nbytes >= _HUGE_PAGE:
        _advise_huge_pages(buf.data_ptr(), nbytes)
    return buf


def pre_touch(t: torch.Tensor) -> None:
    """Zero ``t`` once so its pages are committed now rather than on first copy."""
    t.zero_()


class DeviceContext:
    """Where one worker thread issues copies for ``device``: a side stream, or CPU.

    Create and use it on one thread only. On an accelerator, :meth:`stream` makes a
    private stream current (after it has waited for work already queued on the device's
    current stream, so copies see finished data), and :meth:`synchronize` blocks the
    calling worker thread (never the event loop) until everything queued on it is done.
    On CPU both are no-ops because CPU copies finish before they return.
    """

    __slots__ = ("_stream", "device")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: torch.Stream | None = None
        if is_accelerator(device):
            if device.index is None:
                # One stream serves one device; pin the index now so events match it.
                idx = torch.accelerator.current_device_index()
                self.device = torch.device(device.type, idx)
            self._stream = torch.Stream(self.device)

    @property
    def is_async(self) -> bool:
        """Whether copies issued under :meth:`stream` may still be running on return."""
        return self._stream is not None

    @contextlib.contextmanager
    def stream(self) -> Iterator[None]:
        """Issue the enclosed work on this context's side stream (no-op on CPU)."""
        if self._stream is None:
            yield
            return
        with torch.accelerator.device_index(self.device.index):
            self._stream.wait_stream(torch.accelerator.current_stream(self.device))
            with self._stream:
                yield

    def record(self) -> torch.Event | None:
        """An event marking all work issued so far on the side stream; ``None`` on CPU."""
        if self._stream is None:
            return None
        event = torch.Event(self.device)
        event.record(self._stream)
        return event

    def synchronize(self) -> None:
        """Block this worker thread until the side stream's work has finished."""
        event = self.record()
        if event is not None:
            event.synchronize()
