"""``aiokv info``: what this machine offers aiokv — devices, transports (and why one is
not available), versions, the event loop.

:func:`collect` gathers it as plain JSON-able values (``aiokv info --json`` prints
them); :func:`render` prints them as tables. Nothing here changes the process beyond
importing what it reports on: ``torch_npu`` only after a subprocess has shown that it
imports cleanly (:func:`aiokv._copy.npu_device_count`), NIXL without creating an agent.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from . import __version__
from ._copy import npu_device_count
from ._errors import LLMException
from .transport import get_transport

__all__ = ["collect", "render"]

_NIXL_DISTS = ("nixl-cu12", "nixl-cu13", "nixl")


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _versions() -> dict[str, str | None]:
    return {
        "aiokv": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pydantic": _dist_version("pydantic"),
        "msgspec": _dist_version("msgspec"),
        "typer": _dist_version("typer"),
        "rich": _dist_version("rich"),
        "numpy": _dist_version("numpy"),
    }


def _cuda() -> dict[str, Any]:
    if torch.version.cuda is None:
        return {"available": False, "count": 0, "why": f"torch {torch.__version__} has no CUDA"}
    if not torch.cuda.is_available():
        return {"available": False, "count": 0, "why": "no CUDA device visible (driver?)"}
    n = torch.cuda.device_count()
    return {
        "available": True,
        "count": n,
        "names": [torch.cuda.get_device_name(i) for i in range(n)],
        "cuda": torch.version.cuda,
    }


def _npu() -> dict[str, Any]:
    if importlib.util.find_spec("torch_npu") is None:
        return {"available": False, "count": 0, "why": "torch_npu not installed (aiokv[npu])"}
    n = npu_device_count()
    if n == 0:
        return {
            "available": False,
            "count": 0,
            "why": "torch_npu does not import cleanly or sees no NPU (CANN set up?)",
        }
    return {"available": True, "count": n, "torch_npu": _dist_version("torch_npu", "torch-npu")}


def _devices() -> dict[str, dict[str, Any]]:
    return {
        "cpu": {"available": True, "count": os.cpu_count() or 1, "arch": platform.machine()},
        "cuda": _cuda(),
        "npu": _npu(),
    }


def _ucx_version() -> str | None:
    """The UCX version NIXL loads: the copy its wheel bundles, else the system's."""
    spec = importlib.util.find_spec("nixl_cu12")
    candidates: list[str] = []
    if spec is not None and spec.origin is not None:
        libs = Path(spec.origin).parent.parent / "nixl_cu12.libs"
        candidates += [str(p) for p in sorted(libs.glob("libucp*.so*"))]
    if (system := ctypes.util.find_library("ucp")) is not None:
        candidates.append(system)
    for path in candidates:
        try:
            fn = ctypes.CDLL(path).ucp_get_version_string
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_char_p
        raw = fn()
        return raw.decode() if isinstance(raw, bytes) else None
    return None


def _transports() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {
        "tcp": {"available": True, "detail": "built in"},
    }
    try:
        import ssl

        out["tls"] = {
            "available": bool(ssl.HAS_TLSv1_3),
            "detail": ssl.OPENSSL_VERSION,
            **({} if ssl.HAS_TLSv1_3 else {"why": "this OpenSSL has no TLS 1.3"}),
        }
    except ImportError as exc:
        out["tls"] = {"available": False, "why": f"no ssl module: {exc}"}
    try:
        get_transport("nixl")
    except LLMException as exc:
        cause = exc.__cause__ or exc
        out["nixl"] = {
            "available": False,
            "why": str(cause),
            "install": "pip install 'aiokv[nixl]'",
        }
    else:
        out["nixl"] = {
            "available": True,
            "version": _dist_version(*_NIXL_DISTS),
            "ucx": _ucx_version(),
        }
    return out


def _event_loop() -> dict[str, Any]:
    version = _dist_version("uvloop")
    if version is None or importlib.util.find_spec("uvloop") is None:
        return {"uvloop": None, "why": "not installed (aiokv[uvloop]); asyncio's loop is used"}
    return {"uvloop": version}


def collect() -> dict[str, Any]:
    """Everything ``aiokv info`` reports, as JSON-able values."""
    return {
        "versions": _versions(),
        "platform": platform.platform(),
        "executable": sys.executable,
        "devices": _devices(),
        "transports": _transports(),
        "event_loop": _event_loop(),
    }


def _detail(entry: dict[str, Any]) -> str:
    """An entry's fields but ``available`` as one line; an ``install`` hint that its
    ``why`` already gives is not said twice."""
    return ", ".join(
        f"{k}: {', '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in entry.items()
        if k != "available" and not (k == "install" and v in str(entry.get("why", "")))
    )


def render(info: dict[str, Any], console: Console | None = None) -> None:
    """Print ``info`` (:func:`collect`'s) as tables."""
    console = console or Console(width=None if sys.stdout.isatty() else 140)
    versions = Table(title="versions")
    for name in info["versions"]:
        versions.add_column(name)
    versions.add_row(*(str(v) for v in info["versions"].values()))
    console.print(versions)
    for title in ("devices", "transports"):
        table = Table(title=title)
        for column in ("name", "available", "detail"):
            table.add_column(column)
        for name, entry in info[title].items():
            ok = "[green]yes[/]" if entry["available"] else "[red]no[/]"
            table.add_row(name, ok, escape(_detail(entry)))
        console.print(table)
    loop = info["event_loop"]
    # text, not markup: "aiokv[uvloop]" must print as it is
    console.print(
        escape(
            f"event loop: uvloop {loop['uvloop']}"
            if loop["uvloop"]
            else f"event loop: asyncio ({loop['why']})"
        )
    )
    console.print(escape(f"platform: {info['platform']}; python: {info['executable']}"))
