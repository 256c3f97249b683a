"""Device resolution, the lazy torch_npu probe, host/device buffers, DeviceContext."""

from __future__ import annotations

import importlib.util
import subprocess
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from aiokv._copy import _device
from aiokv._copy._device import DeviceContext
from aiokv._copy._device import device_empty
from aiokv._copy._device import host_empty
from aiokv._copy._device import is_accelerator
from aiokv._copy._device import npu_device_count
from aiokv._copy._device import pre_touch
from aiokv._copy._device import resolve_device
from aiokv._copy._device import supports_pinning
from aiokv._enums import LLMStatusCode
from aiokv._errors import LLMException
from aiokv._errors import NoneArgumentError

HAS_CUDA = torch.cuda.is_available()
HAS_NPU = importlib.util.find_spec("torch_npu") is not None and npu_device_count() > 0
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")


@pytest.fixture
def fresh_probe() -> Iterator[None]:
    """Forget the cached NPU probe result before and after a test that fakes it."""
    npu_device_count.cache_clear()
    yield
    npu_device_count.cache_clear()


def test_cpu() -> None:
    assert resolve_device("cpu", 0) == torch.device("cpu")
    assert resolve_device(" CPU ", 3) == torch.device("cpu")  # id ignored for cpu


def test_auto_prefers_npu_then_cuda_then_cpu() -> None:
    want = "npu" if HAS_NPU else "cuda" if HAS_CUDA else "cpu"
    assert resolve_device("auto", 0).type == want


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-CUDA error")
def test_cuda_unavailable_is_param_invalid() -> None:
    with pytest.raises(LLMException, match="cuda") as info:
        resolve_device("cuda", 0)
    assert info.value.status_code is LLMStatusCode.LLM_PARAM_INVALID


@needs_cuda
def test_cuda_index() -> None:
    assert resolve_device("cuda", 0) == torch.device("cuda", 0)
    with pytest.raises(LLMException) as info:
        resolve_device("cuda", torch.cuda.device_count())
    assert info.value.status_code is LLMStatusCode.LLM_PARAM_INVALID


@pytest.mark.skipif(HAS_NPU, reason="checks the no-NPU error")
def test_npu_unavailable_is_param_invalid() -> None:
    with pytest.raises(LLMException) as info:
        resolve_device("npu", 0)
    assert info.value.status_code is LLMStatusCode.LLM_PARAM_INVALID


def test_bad_arguments() -> None:
    with pytest.raises(LLMException) as info:
        resolve_device("tpu", 0)
    assert info.value.status_code is LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(NoneArgumentError):
        resolve_device(None, 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        resolve_device(1, 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        resolve_device("cpu", True)
    with pytest.raises(ValueError, match="device_id"):
        resolve_device("cpu", -1)


# --------------------------------------------------------------------------- NPU probe


def test_probe_skipped_without_torch_npu(
    fresh_probe: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_subprocess(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("probe must not start a subprocess without torch_npu")

    fake_modules(monkeypatch, no_subprocess, installed=False)
    assert npu_device_count() == 0


def fake_modules(monkeypatch: pytest.MonkeyPatch, run: Any, installed: bool = True) -> list[str]:
    """Stand-ins for ``_device``'s importlib and subprocess; returns what it imported."""
    imported: list[str] = []
    fake_importlib = SimpleNamespace(
        util=SimpleNamespace(find_spec=lambda name: object() if installed else None),
        import_module=imported.append,
    )
    fake_subprocess = SimpleNamespace(
        run=run,
        SubprocessError=subprocess.SubprocessError,
        TimeoutExpired=subprocess.TimeoutExpired,
    )
    monkeypatch.setattr(_device, "importlib", fake_importlib)
    monkeypatch.setattr(_device, "subprocess", fake_subprocess)
    return imported


def test_probe_runs_isolated_and_imports_on_success(
    fresh_probe: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[dict[str, Any]] = []

    def run(cmd: list[str], **kwargs: Any) -> Any:
        calls.append(kwargs)
        return SimpleNamespace(returncode=0, stdout="some banner\n2\n")

    imported = fake_modules(monkeypatch, run)
    assert npu_device_count() == 2
    assert npu_device_count() == 2  # cached: one probe only
    assert len(calls) == 1
    assert calls[0]["env"]["TORCH_DEVICE_BACKEND_AUTOLOAD"] == "0"
    assert calls[0]["timeout"] > 0
    assert imported == ["torch_npu"]


@pytest.mark.parametrize(
    "outcome",
    [
        SimpleNamespace(returncode=1, stdout=""),  # torch_npu import failed (no CANN)
        SimpleNamespace(returncode=0, stdout="0\n"),  # imports, no devices
        SimpleNamespace(returncode=0, stdout="garbage\n"),
        subprocess.TimeoutExpired("python", 1.0),
        OSError("cannot spawn"),
    ],
)
def test_probe_failure_means_no_npu_and_no_import(
    fresh_probe: None, monkeypatch: pytest.MonkeyPatch, outcome: Any
) -> None:
    def run(cmd: list[str], **kwargs: Any) -> Any:
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    imported = fake_modules(monkeypatch, run)
    assert npu_device_count() == 0
    assert imported == []
    with pytest.raises(LLMException):
        resolve_device("npu", 0)


# --------------------------------------------------------------------------- buffers


def test_host_and_device_buffers_on_cpu() -> None:
    cpu = torch.device("cpu")
    assert not is_accelerator(cpu)
    assert not supports_pinning(cpu)
    h = host_empty(4096, cpu, pin=True)
    assert (h.dtype, h.numel(), h.device.type, h.is_pinned()) == (torch.uint8, 4096, "cpu", False)
    d = device_empty(1000, cpu)
    assert (d.dtype, d.numel(), d.device) == (torch.uint8, 1000, cpu)
    d.fill_(7)
    pre_touch(d)
    assert d.eq(0).all()


def test_cpu_context_is_synchronous() -> None:
    ctx = DeviceContext(torch.device("cpu"))
    assert not ctx.is_async
    with ctx.stream():
        t = torch.ones(4) * 2
    assert ctx.record() is None
    ctx.synchronize()
    assert t.eq(2).all()


@needs_cuda
def test_cuda_buffers_and_context() -> None:
    dev = torch.device("cuda", 0)
    assert supports_pinning(dev)
    h = host_empty(1 << 20, dev, pin=True)
    assert h.is_pinned()
    assert not host_empty(16, dev, pin=False).is_pinned()
    d = device_empty(1 << 20, dev)
    assert d.device == dev
    ctx = DeviceContext(dev)
    assert ctx.is_async
    h.fill_(3)
    with ctx.stream():
        d.copy_(h, non_blocking=True)
    ctx.synchronize()
    assert d.eq(3).all()
    assert ctx.record() is not None
