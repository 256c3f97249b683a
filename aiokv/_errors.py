"""The one error contract (SPEC §1.2): the exception tree and foreign-error mapping.

Exception tree::

    RuntimeError
      └── LLMException            .status_code, .op, .context
    TypeError
      └── NoneArgumentError       (also an AttributeError: llm_datadist documents it)

Foreign errors (torch, sockets, transports) are translated at the boundary with
:func:`map_errors`, the original chained. Where an exception becomes a bare status code
(layer-wise results, link codes) :func:`status_of` logs it with its traceback first, so
no failure disappears silently. The argument checks live in :mod:`aiokv._checks`.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import sysconfig
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any

from ._enums import LLMStatusCode

__all__ = ["LLMException", "NoneArgumentError", "Status", "map_errors", "status_of", "warn"]


_CODES = frozenset(LLMStatusCode)


class LLMException(RuntimeError):
    """An operation failed; ``status_code`` says why.

    Constructed as llm_datadist's: ``LLMException(*args, status_code=...)``, the code
    keyword-only and ``LLM_SUCCESS`` when not given (``LLMException("msg", code)`` makes
    the code part of ``args``, as upstream).

    Attributes:
        op: the public operation that failed, once known (``None`` while the error is
            still inside a lower layer, e.g. a transport).
        context: what the operation was about (peer cluster, key, ...), set with ``op``.
    """

    def __init__(
        self,
        *args: object,
        status_code: LLMStatusCode = LLMStatusCode.LLM_SUCCESS,
        op: str | None = None,
        context: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(*args)
        # a code llm_datadist does not name is kept as the int given, as there
        self._status_code = LLMStatusCode(status_code) if status_code in _CODES else status_code
        self.op = op
        self.context: Mapping[str, Any] = dict(context or {})

    @property
    def status_code(self) -> LLMStatusCode:
        """The llm_datadist code (read-only, as there)."""
        return self._status_code

    def in_context(self, op: str, **context: Any) -> LLMException:
        """This error as seen by the public operation ``op``; added once, by one layer.

        An error that already names its operation is returned unchanged; otherwise a new
        ``LLMException`` with the same code, ``op`` and ``context`` set, and the message
        prefixed with them (``self`` becomes its ``__cause__`` when raised ``from``).
        """
        if self.op is not None:
            return self
        about = ", ".join(f"{k}={v!r}" for k, v in context.items())
        prefix = f"{op} ({about})" if about else op
        return LLMException(
            f"{prefix}: {self}", status_code=self.status_code, op=op, context=context
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (str(self), self.status_code, self.op, dict(self.context)))

    def __repr__(self) -> str:
        return f"LLMException({str(self)!r}, status_code={self.status_code})"


def _rebuild(
    message: str, code: LLMStatusCode, op: str | None, context: dict[str, Any]
) -> LLMException:
    return LLMException(message, status_code=code, op=op, context=context)


class Status:
    """A status code as llm_datadist wraps it: ``Status(code).is_ok()``.

    Attributes:
        status_code: the wrapped code.
    """

    __slots__ = ("_status_code",)

    def __init__(self, status: LLMStatusCode) -> None:
        self._status_code = status

    @property
    def status_code(self) -> LLMStatusCode:
        """The wrapped code."""
        return self._status_code

    def is_ok(self) -> bool:
        """Whether the code is ``LLM_SUCCESS``."""
        return bool(self._status_code == LLMStatusCode.LLM_SUCCESS)

    def __repr__(self) -> str:
        return f"Status({self._status_code})"


#: files whose frames a warning is not attributed to: aiokv's own, and pydantic's (it
#: calls aiokv's validators from the user's ``LLMConfig(...)``)
_INSIDE = (os.path.dirname(__file__) + os.sep,)
_PYDANTIC = (f"{os.sep}pydantic{os.sep}", f"{os.sep}pydantic_settings{os.sep}")
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep


def _in_stdlib(filename: str) -> bool:
    """Whether ``filename`` is the standard library's (a thread's start, a loop's run),
    not a package installed beside it in ``site-packages``."""
    return filename.startswith(_STDLIB) and "site-packages" not in filename


def warn(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` attributed to the caller's own line: the first frame of this
    thread outside aiokv (and pydantic), so that a filter by module and the printed
    ``file:line`` name the user's code. Where this thread has no such frame (an aiokv
    thread: the engine's, a lane's), or only the standard library's, it names aiokv's
    line that warns."""
    frame: FrameType | None = sys._getframe(1)
    level = 2
    while frame is not None and (
        frame.f_code.co_filename.startswith(_INSIDE)
        or any(p in frame.f_code.co_filename for p in _PYDANTIC)
    ):
        frame, level = frame.f_back, level + 1
    if frame is None or _in_stdlib(frame.f_code.co_filename):
        level = 2
    warnings.warn(message, category, stacklevel=level)


class NoneArgumentError(TypeError, AttributeError):
    """``None`` passed where an object is required; a ``TypeError`` and ``AttributeError``."""


_OS_CODES: dict[int, LLMStatusCode] = {
    errno.ECONNREFUSED: LLMStatusCode.LLM_LINK_FAILED,
    errno.ECONNRESET: LLMStatusCode.LLM_LINK_FAILED,
    errno.EPIPE: LLMStatusCode.LLM_LINK_FAILED,
    errno.ETIMEDOUT: LLMStatusCode.LLM_TIMEOUT,
    errno.ENOMEM: LLMStatusCode.LLM_OUT_OF_MEMORY,
}


def _is_device_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is an accelerator allocator's out-of-memory error."""
    import torch  # already imported by every caller; kept lazy to keep this module light

    if isinstance(exc, torch.OutOfMemoryError):
        return True
    # torch_npu raises a plain RuntimeError for NPU OOM (no dedicated class as of 2.x):
    # the message is the only signal there, so it is the documented fallback.
    return type(exc) is RuntimeError and "NPU out of memory" in str(exc)


#: what torch's host (CPU) allocator says when an allocation fails: a plain
#: ``RuntimeError`` (``c10::Error``), no class of its own (torch 2.x, POSIX and Windows)
_HOST_OOM = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory")


def _is_host_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's host allocator failing to allocate (out of memory)."""
    return type(exc) is RuntimeError and any(m in str(exc) for m in _HOST_OOM)


def map_errors(op: str, default: LLMStatusCode = LLMStatusCode.LLM_FAILED) -> _MapErrors:
    """Translate foreign exceptions raised inside the ``with`` block into ``LLMException``.

    Our own errors (``LLMException``, ``TypeError``, ``ValueError``) and cancellation pass
    through untouched. ``TimeoutError`` → ``LLM_TIMEOUT``; ``MemoryError`` and torch's
    host allocator failing → ``LLM_OUT_OF_MEMORY``; a device allocator's out-of-memory error →
    ``LLM_DEVICE_OUT_OF_MEMORY``; connection errors → ``LLM_LINK_FAILED``; anything
    else → ``default``. (A class, not a generator: it is on every request's path.)
    """
    return _MapErrors(op, default)


@dataclass(slots=True)
class _MapErrors:
    op: str
    default: LLMStatusCode

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ: object, exc: BaseException | None, tb: object) -> None:
        if exc is None or not isinstance(exc, Exception):  # cancellation passes too
            return
        if isinstance(exc, LLMException | TypeError | ValueError):
            return
        raise _translated(exc, self.op, self.default) from exc


def _translated(exc: Exception, op: str, default: LLMStatusCode) -> LLMException:
    """The ``LLMException`` that :func:`map_errors` raises for ``exc``."""
    if isinstance(exc, TimeoutError):
        return LLMException(f"{op}: timed out", status_code=LLMStatusCode.LLM_TIMEOUT, op=op)
    if isinstance(exc, MemoryError):
        return LLMException(
            f"{op}: out of memory", status_code=LLMStatusCode.LLM_OUT_OF_MEMORY, op=op
        )
    if _is_host_oom(exc):  # the message says how much was asked for
        return LLMException(
            f"{op}: host out of memory: {exc}", status_code=LLMStatusCode.LLM_OUT_OF_MEMORY, op=op
        )
    if isinstance(exc, OSError):
        code = _OS_CODES.get(exc.errno or 0, default)
        if isinstance(exc, ConnectionError):
            code = LLMStatusCode.LLM_LINK_FAILED
        return LLMException(f"{op}: {exc}", status_code=code, op=op)
    if _is_device_oom(exc):
        return LLMException(
            f"{op}: device out of memory",
            status_code=LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY,
            op=op,
        )
    return LLMException(f"{op}: {type(exc).__name__}: {exc}", status_code=default, op=op)


def code_of_failure(exc: BaseException) -> LLMStatusCode:
    """The code a caller sees for ``exc`` raised by an operation: an ``LLMException``'s
    own, else what :func:`map_errors` translates it to (``LLM_FAILED`` by default, and
    for what it passes through untranslated: ``TypeError``, ``ValueError``)."""
    if isinstance(exc, LLMException):
        return exc.status_code
    if not isinstance(exc, Exception) or isinstance(exc, TypeError | ValueError):
        return LLMStatusCode.LLM_FAILED
    return _translated(exc, "", LLMStatusCode.LLM_FAILED).status_code


def status_of(exc: BaseException, log: logging.Logger, what: str) -> LLMStatusCode:
    """The status code that reports ``exc``, after logging it with its traceback.

    An ``LLMException`` is an expected failure (logged at INFO) and keeps its code;
    anything else is a bug or a foreign failure (logged at ERROR) and becomes
    ``LLM_FAILED``.
    """
    if isinstance(exc, LLMException):
        log.info("%s: %s", what, exc, exc_info=exc)
        return exc.status_code
    log.error("%s: unexpected %s", what, type(exc).__name__, exc_info=exc)
    return LLMStatusCode.LLM_FAILED
