"""The one error contract (SPEC §1.2) and the argument checks every public call uses.

Exception tree::

    RuntimeError
      └── LLMException            .status_code: LLMStatusCode
    TypeError
      └── NoneArgumentError       (also an AttributeError: llm_datadist documents it)

Wrong type → ``TypeError``; int out of range → ``ValueError``; ``None`` where an object
is required → ``NoneArgumentError``; well-typed but semantically invalid →
``LLMException(LLM_PARAM_INVALID)``. Foreign errors (torch, sockets, transports) are
translated at the boundary with :func:`map_errors`, the original chained.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator
from typing import Any, NoReturn, TypeVar

from ._enums import LLMStatusCode

__all__ = [
    "LLMException",
    "NoneArgumentError",
    "check_index",
    "check_instance",
    "check_int",
    "map_errors",
    "param_invalid",
]

T = TypeVar("T")

UINT64_MAX = 2**64 - 1


class LLMException(RuntimeError):
    """An operation failed; ``status_code`` says why.

    The message names the operation and the reason.
    """

    def __init__(self, message: str, status_code: LLMStatusCode = LLMStatusCode.LLM_FAILED):
        super().__init__(message)
        self.status_code = LLMStatusCode(status_code)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.status_code))

    def __repr__(self) -> str:
        return f"LLMException({str(self)!r}, {self.status_code.name})"


class NoneArgumentError(TypeError, AttributeError):
    """``None`` passed where an object is required; a ``TypeError`` and ``AttributeError``."""


def param_invalid(op: str, reason: str) -> NoReturn:
    """Raise ``LLMException(LLM_PARAM_INVALID)`` naming ``op`` and ``reason``."""
    raise LLMException(f"{op}: {reason}", LLMStatusCode.LLM_PARAM_INVALID)


def check_instance(op: str, name: str, value: Any, expected: type[T] | tuple[type, ...]) -> T:
    """Return ``value`` if it is an instance of ``expected``.

    Raises:
        NoneArgumentError: ``value`` is ``None``.
        TypeError: ``value`` has another type.
    """
    if value is None:
        raise NoneArgumentError(f"{op}: {name} must not be None")
    if not isinstance(value, expected):
        want = (
            expected.__name__
            if isinstance(expected, type)
            else " | ".join(t.__name__ for t in expected)
        )
        raise TypeError(f"{op}: {name} must be {want}, got {type(value).__name__}")
    return value  # type: ignore[return-value]


def check_int(op: str, name: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    """Return ``value`` if it is an ``int`` (not ``bool``) within ``[lo, hi]``.

    Raises:
        NoneArgumentError: ``value`` is ``None``.
        TypeError: not an int.
        ValueError: outside ``[lo, hi]``.
    """
    if value is None:
        raise NoneArgumentError(f"{op}: {name} must not be None")
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{op}: {name} must be int, got {type(value).__name__}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"{op}: {name}={value} is out of range [{lo}, {hi}]")
    return int(value)


def check_index(op: str, name: str, value: Any, length: int) -> int:
    """Return ``value`` if it is a valid index into ``length`` items.

    A well-typed index out of ``[0, length)`` is a semantically invalid request.

    Raises:
        TypeError / NoneArgumentError: as :func:`check_int`.
        ValueError: negative.
        LLMException: ``LLM_PARAM_INVALID`` when ``value >= length``.
    """
    v = check_int(op, name, value, 0, UINT64_MAX)
    if v >= length:
        param_invalid(op, f"{name}={v} is out of range [0, {length})")
    return v


_OS_CODES: dict[int, LLMStatusCode] = {
    errno.ECONNREFUSED: LLMStatusCode.LLM_LINK_FAILED,
    errno.ECONNRESET: LLMStatusCode.LLM_LINK_FAILED,
    errno.EPIPE: LLMStatusCode.LLM_LINK_FAILED,
    errno.ETIMEDOUT: LLMStatusCode.LLM_TIMEOUT,
    errno.ENOMEM: LLMStatusCode.LLM_OUT_OF_MEMORY,
}


@contextlib.contextmanager
def map_errors(op: str, default: LLMStatusCode = LLMStatusCode.LLM_FAILED) -> Iterator[None]:
    """Translate foreign exceptions raised inside the block into ``LLMException``.

    Our own errors (``LLMException``, ``TypeError``, ``ValueError``) and cancellation pass
    through untouched. ``TimeoutError`` → ``LLM_TIMEOUT``; ``MemoryError`` and torch
    out-of-memory → ``LLM_OUT_OF_MEMORY`` / ``LLM_DEVICE_OUT_OF_MEMORY``; connection
    errors → ``LLM_LINK_FAILED``; anything else → ``default``.
    """
    try:
        yield
    except (LLMException, TypeError, ValueError):
        raise
    except TimeoutError as exc:
        raise LLMException(f"{op}: timed out", LLMStatusCode.LLM_TIMEOUT) from exc
    except MemoryError as exc:
        raise LLMException(f"{op}: out of memory", LLMStatusCode.LLM_OUT_OF_MEMORY) from exc
    except OSError as exc:
        code = _OS_CODES.get(exc.errno or 0, default)
        if isinstance(exc, ConnectionError):
            code = LLMStatusCode.LLM_LINK_FAILED
        raise LLMException(f"{op}: {exc}", code) from exc
    except Exception as exc:
        if "out of memory" in str(exc).lower():
            raise LLMException(
                f"{op}: device out of memory", LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY
            ) from exc
        raise LLMException(f"{op}: {type(exc).__name__}: {exc}", default) from exc
