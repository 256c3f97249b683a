"""The state every part of ``CacheManager`` shares, and the checks they all make.

:class:`ManagerBase` declares what ``CacheManager.__init__`` sets (typed, for each part:
:mod:`._bookkeeping`, :mod:`._local`, :mod:`._remote`, :mod:`._layers`) and holds what
every operation does first: refuse a call after ``finalize`` or past the role gates,
refuse a malformed ``CacheKey``, find the caches it names and pin them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any
from typing import ClassVar

import torch

from .._checks import UINT64_MAX
from .._checks import check_instance
from .._checks import param_invalid
from .._config import LLMConfig
from .._copy import CopyScheduler
from .._engine import Engine
from .._enums import LLMRole
from .._enums import LLMStatusCode
from .._enums import Placement
from .._errors import LLMException
from .._models import CacheKey
from .._pool import MemPool
from .._registry import CacheRegistry
from .._registry import Entry
from .._remote import RemoteClient

__all__ = ["ManagerBase"]


class ManagerBase:
    """The shared state of ``CacheManager``'s parts, set by ``CacheManager.__init__``."""

    #: operation → roles allowed to call it (empty here; llm_datadist's legacy gates in
    #: :class:`KvCacheManager`).
    _GATES: ClassVar[Mapping[str, tuple[LLMRole, ...]]] = {}

    _role: LLMRole
    _engine: Engine
    _config: LLMConfig
    _device: torch.device
    _scheduler: CopyScheduler
    _registry: CacheRegistry
    _client: RemoteClient
    _pools: dict[Placement, MemPool | None]
    _closed: bool
    _tasks: set[asyncio.Task[None]]  # layer-wise transfers, owned here

    @staticmethod
    def check_cache_key(cache_key: CacheKey) -> None:
        """Refuse a ``CacheKey`` naming neither or both of a request and a prefix, as
        llm_datadist: exactly one of ``req_id`` / ``prefix_id`` must be below ``2**64-1``.

        Raises:
            TypeError / NoneArgumentError: not a ``CacheKey``.
            LLMException: ``LLM_PARAM_INVALID`` otherwise.
        """
        op = "check_cache_key"
        check_instance(op, "cache_key", cache_key, CacheKey)
        req, prefix = cache_key.req_id != UINT64_MAX, cache_key.prefix_id != UINT64_MAX
        if req == prefix:
            which = "only one" if req else "one"
            param_invalid(
                op,
                f"{which} of req id and prefix id should contain a valid value [0, 2**64-1), "
                f"req id: {cache_key.req_id}, prefix id: {cache_key.prefix_id}",
            )

    def _check_open(self, op: str) -> None:
        """Refuse calls after ``finalize`` and calls the role gates forbid."""
        if self._closed:
            raise RuntimeError(f"{op}: the LLMDataDist was finalized")
        roles = self._GATES.get(op)
        if roles is not None and self._role not in roles:
            raise LLMException(
                f"{op}: not allowed for role {self._role.name}",
                status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                op=op,
            )

    def _pinned(self, *entries: Entry | None) -> _Pinned:
        """``with`` it: ``entries`` (those not None) pinned inside the block."""
        return _Pinned(self._registry, [e for e in entries if e is not None])

    def _blocks_entry(self, op: str, cache: Any, name: str) -> Entry | None:
        entry = self._registry.entry(op, cache, name)
        if not cache.is_blocks_cache:
            param_invalid(op, f"{name} {cache.cache_id} is not a blocks cache")
        return entry


class _Pinned:
    """:meth:`ManagerBase._pinned`: pins on entry, unpins on exit (a plain context
    manager: a generator-based one costs a few µs more per operation)."""

    __slots__ = ("_entries", "_registry")

    def __init__(self, registry: CacheRegistry, entries: list[Entry]) -> None:
        self._registry = registry
        self._entries = entries

    def __enter__(self) -> None:
        self._registry.pin(*self._entries)

    def __exit__(self, *exc: object) -> None:
        self._registry.unpin(*self._entries)
