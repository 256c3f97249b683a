"""A NIXL agent as the transport uses it: DRAM and VRAM over UCX, no NIXL threads.

NIXL's own progress thread spins (its poll delay is fixed at 0 by the Python API: a
whole core per agent, measured), and its listener thread would be a second, unauthen-
ticated control plane; both stay off. Progress is driven by aiokv instead, with back-off:
the initiator polls its transfers, the target polls notifications while it serves
(see :mod:`aiokv.transport.nixl._transport`). The agent is thread-safe
(``NIXL_THREAD_SYNC_STRICT``): owners register memory from their own threads.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any
from typing import Final

import numpy as np
import numpy.typing as npt

_log = logging.getLogger("aiokv.transport.nixl")


def _import_nixl() -> ModuleType:
    """NIXL's Python API: ``nixl_cu12`` (the ``aiokv[nixl]`` wheel), else ``nixl``."""
    for name in ("nixl_cu12._api", "nixl._api"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError(
        "the nixl transport needs NIXL: pip install 'aiokv[nixl]' "
        "(install torch==2.13.0 first, or pip pulls a CUDA build of torch)"
    )


#: NIXL's log level unless the user chose one: NIXL logs INFO lines to stdout (one per
#: agent and backend), which is the application's. Read when NIXL loads: set first.
DEFAULT_LOG_LEVEL: Final = "WARN"
os.environ.setdefault("NIXL_LOG_LEVEL", DEFAULT_LOG_LEVEL)
#: UCX modules not loaded unless the user chose (``UCX_MODULES``). ``uct_ib_efa``, the
#: one bundled UCX module linked against the *system's* ``libefa``, drags the system's
#: rdma-core ``libibverbs`` and ``libnl-route-3`` in beside the copies the ``nixl-cu12``
#: 1.5.1 wheel bundles; at exit the bundled ``libnl-route``'s destructor
#: (``rtnl_tc_unregister`` from ``_dl_fini``) then walks entries the system copy
#: registered and crashes: every process that created a NIXL agent died with SIGSEGV
#: (exit -11) on hosts with rdma-core's ``ibverbs-providers``. Read when UCX loads: set
#: first. Other InfiniBand modules (mlx5, verbs) load as before.
DEFAULT_UCX_MODULES: Final = "^efa"
os.environ.setdefault("UCX_MODULES", DEFAULT_UCX_MODULES)
#: UCX's CUDA IPC transport serves one-sided GETs (a NIXL READ of another process's
#: ``cuda`` memory) unless the user chose (``UCX_CUDA_IPC_ENABLE_GET_ZCOPY``). UCX's
#: ``auto`` turns them off on a GPU without NVLink links, and a READ of VRAM then falls
#: back to a TCP-emulated copy: 0.5 GB/s against 114 GB/s with ``y``, where a WRITE
#: always ran at ~126 GB/s (H200, 128 MiB; docs/nixl.md, "Device memory over NIXL").
#: Read when UCX loads: set first, and only where UCX can load its CUDA transports (a
#: CUDA driver library loads; nothing is initialised): elsewhere UCX warns on stderr of
#: every process that the variable is unused.
DEFAULT_CUDA_IPC_GET: Final = "y"


def _has_cuda_driver() -> bool:
    """Whether the CUDA driver library loads here (what UCX's CUDA module needs)."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


if _has_cuda_driver():
    os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", DEFAULT_CUDA_IPC_GET)
_nixl = _import_nixl()

__all__ = [
    "DEFAULT_CUDA_IPC_GET",
    "DEFAULT_LOG_LEVEL",
    "DEFAULT_UCX_MODULES",
    "Agent",
    "Descs",
    "Xfer",
]

#: how NIXL's agent metadata opens, before the agent's name (:meth:`Agent.named`)
_MD_HEAD: Final = b"nixlSerDes|Agent"
#: an opaque NIXL transfer handle
Xfer = Any
#: NIXL descriptor rows ``(address, length, device)``: an ``(n, 3)`` uint64 array, or a
#: list of tuples
Descs = npt.NDArray[np.uint64] | list[tuple[int, int, int]]


class Agent:
    """One NIXL agent named ``name`` with the UCX backend (blocking: ~0.25 s; run it off
    the event loop).

    Raises:
        RuntimeError: NIXL has no UCX backend here.
    """

    def __init__(self, name: str) -> None:
        conf = _nixl.nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            backends=["UCX"],
            sync_mode=_nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self._a = _nixl.nixl_agent(name, conf)
        if "UCX" not in self._a.backends:
            raise RuntimeError("NIXL has no UCX backend here")
        self.name = name

    def register(self, addr: int, nbytes: int, mem: str = "DRAM", dev: int = 0) -> Any:
        """Register memory of kind ``mem`` ("DRAM": host, "VRAM": CUDA device ``dev``);
        returns the handle :meth:`deregister` takes."""
        return self._a.register_memory([(addr, nbytes, dev, "")], mem)

    def deregister(self, handle: Any) -> None:
        self._a.deregister_memory(handle)

    def metadata(self) -> bytes:
        """This agent's metadata: its connection info and registered regions."""
        return bytes(self._a.get_agent_metadata())

    @staticmethod
    def named(metadata: bytes) -> str | None:
        """The agent name ``metadata`` (a peer's, untrusted) carries, read without loading
        it: NIXL's serialisation opens with ``nixlSerDes|Agent``, the name's length (8
        bytes, little-endian), the name and ``|``. None if it does not open so."""
        head = _MD_HEAD
        if not metadata.startswith(head) or len(metadata) < len(head) + 8:
            return None
        n = int.from_bytes(metadata[len(head) : len(head) + 8], "little")
        start = len(head) + 8
        if n > len(metadata) - start - 1 or metadata[start + n : start + n + 1] != b"|":
            return None
        try:
            return metadata[start : start + n].decode()
        except UnicodeDecodeError:
            return None

    def add_remote(self, metadata: bytes) -> str:
        """Load (or refresh) a peer agent's metadata; returns its name."""
        name = self._a.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_remote(self, name: str) -> None:
        self._a.remove_remote_agent(name)

    def xfer(
        self,
        kind: str,
        local: Descs,
        remote: Descs,
        peer: str,
        notif: bytes,
        mems: tuple[str, str] = ("DRAM", "DRAM"),
    ) -> Xfer:
        """A transfer request: ``kind`` "READ" (remote → local) or "WRITE"; ``local`` and
        ``remote``: ``(address, length, device)`` rows of the same lengths (numpy arrays
        go to NIXL without a Python loop: 0.03 ms for 1024 rows, 0.17 ms as tuples; a
        list of tuples costs less for a few rows) of the memory kinds ``mems`` (local,
        remote)."""
        a = self._a
        return a.initialize_xfer(
            kind, a.get_xfer_descs(local, mems[0]), a.get_xfer_descs(remote, mems[1]), peer, notif
        )

    def post(self, xfer: Xfer) -> str:
        """Start ``xfer``: "DONE", "PROC" or "ERR" (a NIXL error raised is "ERR")."""
        return _status(self._a.transfer, xfer, "NIXL refused to post a transfer")

    def state(self, xfer: Xfer) -> str:
        """ "DONE", "PROC" or "ERR" (a NIXL error raised is "ERR")."""
        return _status(self._a.check_xfer_state, xfer, "NIXL transfer failed")

    def in_flight(self, xfer: Xfer) -> bool:
        """Whether ``xfer`` was posted and is not over yet (progresses UCX; quiet: a
        transfer never posted, or failed, is not in flight)."""
        try:
            return str(self._a.check_xfer_state(xfer)) == "PROC"
        except Exception:
            return False

    def release(self, xfer: Xfer) -> bool:
        """Free ``xfer``; False if NIXL refused. Only once it is not :meth:`in_flight`:
        NIXL frees a transfer in flight without stopping its bytes (UCX)."""
        try:
            self._a.release_xfer_handle(xfer)
        except Exception:
            return False
        return True

    def notifs(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, by sending agent (progresses UCX)."""
        got = self._a.get_new_notifs()
        return {(k.decode() if isinstance(k, bytes) else str(k)): list(v) for k, v in got.items()}


def _status(call: Callable[[Xfer], object], xfer: Xfer, failed: str) -> str:
    """``call(xfer)``'s transfer state as text ("DONE", "PROC", "ERR"); a NIXL error it
    raises is logged (``failed: error``) and is "ERR"."""
    try:
        return str(call(xfer))
    except Exception as exc:
        _log.warning("%s: %s", failed, exc)
        return "ERR"
