"""Transports: move raw bytes between processes on request; they know nothing of caches.

The interface lives in :mod:`aiokv.transport._base`; implementations are found by name
with :func:`get_transport` and imported only when asked for, so an optional backend
costs nothing where it is not installed. ``tcp`` links processes; ``nixl`` links them
too, moving payload over NIXL (the ``aiokv[nixl]`` extra); ``local`` links transports
of one process and event loop (tests, single-process set-ups).
"""

from __future__ import annotations

import importlib

from .._enums import LLMStatusCode
from .._errors import LLMException
from . import _base
from ._base import BY_ADDRESS as BY_ADDRESS
from ._base import DIRECT_REFUSED as DIRECT_REFUSED
from ._base import ONE_SIDED as ONE_SIDED
from ._base import ByAddress as ByAddress
from ._base import Capability as Capability
from ._base import DeviceRuns as DeviceRuns
from ._base import DirectCheck as DirectCheck
from ._base import Grant as Grant
from ._base import Link as Link
from ._base import LinkCallback as LinkCallback
from ._base import OneSided as OneSided
from ._base import Payload as Payload
from ._base import PeerInfo as PeerInfo
from ._base import RequestHandler as RequestHandler
from ._base import Transport as Transport
from ._tls import TlsContexts
from ._tls import load_tls

__all__ = ["TlsContexts", "get_transport", "load_tls", "transport_names"]
__all__ += _base.__all__  # the interface: what _base exports, this package exports

# name -> "module:class", imported lazily. Add a backend by adding a line here.
_REGISTRY: dict[str, str] = {
    "local": "aiokv.transport._local:LocalTransport",
    "nixl": "aiokv.transport.nixl:NixlTransport",
    "tcp": "aiokv.transport.tcp:TcpTransport",
}


def transport_names() -> list[str]:
    """The names :func:`get_transport` knows, whether or not their backend is installed."""
    return sorted(_REGISTRY)


def get_transport(name: str) -> type[Transport]:
    """The :class:`Transport` class registered under ``name`` (e.g. ``"tcp"``).

    Raises:
        TypeError: ``name`` is not a string.
        LLMException: ``LLM_PARAM_INVALID`` for an unknown name;
            ``LLM_FEATURE_NOT_ENABLED`` when the backend cannot be imported (its
            optional dependency is missing), the import error chained.
    """
    if not isinstance(name, str):
        raise TypeError(f"get_transport: name must be str, got {type(name).__name__}")
    try:
        target = _REGISTRY[name]
    except KeyError:
        known = ", ".join(transport_names())
        raise LLMException(
            f"get_transport: unknown transport {name!r} (known: {known})",
            status_code=LLMStatusCode.LLM_PARAM_INVALID,
        ) from None
    module_name, _, attr = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise LLMException(
            f"get_transport: transport {name!r} is not available: {exc}",
            status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise LLMException(
            f"get_transport: {target} is not a Transport",
            status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
        )
    return cls
