"""Layer-wise transfer: send layer ``i`` while the model computes layer ``i + 1``.

``CacheManager.transfer_cache_async`` validates everything, then returns a
:class:`CacheTask` at once. The task walks the layers in order: it awaits
``layer_synchronizer.synchronize_layer(i, timeout)`` (the model saying "layer i is
written"), starts sending layer i to every destination, and moves on to wait for layer
i + 1 while those sends run. Each destination gets one result code.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Coroutine, Generator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ._enums import LLMStatusCode
from ._errors import LLMException

__all__ = ["CacheTask", "LayerJob", "LayerSynchronizer", "run_layers"]

Code = LLMStatusCode


@runtime_checkable
class LayerSynchronizer(Protocol):
    """Tells a layer-wise transfer when layer ``layer_index`` may be sent.

    Implement ``async def synchronize_layer(self, layer_index, timeout_in_millis) -> bool``
    (a plain ``def`` returning ``bool`` is accepted too). Return ``True`` once the layer's
    KV is complete; ``False`` fails the destinations that need that layer with
    ``LLM_PARAM_INVALID``. Taking longer than ``timeout_in_millis`` fails them with
    ``LLM_TIMEOUT``.
    """

    def synchronize_layer(
        self, layer_index: int, timeout_in_millis: int | None
    ) -> bool | Awaitable[bool]:
        """Wait until layer ``layer_index`` may be sent."""
        ...


@dataclass(slots=True)
class LayerJob:
    """One destination: which layers it needs and how to send one of them."""

    layers: range
    send: Callable[[int], Coroutine[Any, Any, None]]


async def _sync(sync: LayerSynchronizer, layer: int, timeout_ms: int) -> LLMStatusCode:
    try:
        async with asyncio.timeout(timeout_ms / 1000):
            got: Any = sync.synchronize_layer(layer, timeout_ms)
            if inspect.isawaitable(got):
                got = await got
    except TimeoutError:
        return Code.LLM_TIMEOUT
    except Exception:
        return Code.LLM_FAILED
    return Code.LLM_SUCCESS if got is True else Code.LLM_PARAM_INVALID


async def run_layers(
    sync: LayerSynchronizer, jobs: list[LayerJob], timeout_ms: int, results: list[Code | None]
) -> None:
    """Walk the layers in order, overlapping each layer's sends with the next wait.

    ``results[j]`` gets job j's code as soon as it is known (the first failure, or
    ``LLM_SUCCESS`` after its last layer landed).
    """
    last = max(job.layers.stop for job in jobs)
    first = min(job.layers.start for job in jobs)
    inflight: dict[int, list[asyncio.Task[None]]] = {j: [] for j in range(len(jobs))}

    async def settle(j: int) -> None:
        for t in inflight[j]:
            try:
                await t
            except LLMException as exc:
                if results[j] is None:
                    results[j] = exc.status_code
            except Exception:
                if results[j] is None:
                    results[j] = Code.LLM_FAILED
        inflight[j].clear()

    try:
        for layer in range(first, last):
            wanting = [
                j for j, job in enumerate(jobs) if layer in job.layers and results[j] is None
            ]
            if not wanting:
                continue
            code = await _sync(sync, layer, timeout_ms)
            for j in wanting:
                if code != Code.LLM_SUCCESS:
                    results[j] = code
                    continue
                inflight[j].append(asyncio.create_task(jobs[j].send(layer)))
        for j in range(len(jobs)):
            await settle(j)
            if results[j] is None:
                results[j] = Code.LLM_SUCCESS
    finally:
        pending = [t for ts in inflight.values() for t in ts if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)


class CacheTask:
    """A running layer-wise transfer (``transfer_cache_async``'s result).

    ``await task`` yields the per-destination results. ``synchronize`` and
    ``get_results`` take an optional timeout in ms; a timeout returns ``LLM_TIMEOUT``
    (per unfinished destination for ``get_results``) and does NOT cancel the transfer.
    ``cancel()`` cancels it; destinations not finished then report ``None``.
    """

    def __init__(self, task: asyncio.Task[None], results: list[Code | None]) -> None:
        self._task = task
        self._results = results

    async def _wait(self, timeout_in_millis: int | None) -> bool:
        if timeout_in_millis is not None and (
            isinstance(timeout_in_millis, bool) or not isinstance(timeout_in_millis, int)
        ):
            raise TypeError("timeout_in_millis must be int or None")
        if timeout_in_millis is not None and timeout_in_millis < 0:
            raise ValueError("timeout_in_millis must be >= 0")
        timeout = None if timeout_in_millis is None else timeout_in_millis / 1000
        done, _ = await asyncio.wait({self._task}, timeout=timeout)
        return bool(done)

    async def synchronize(self, timeout_in_millis: int | None = None) -> LLMStatusCode:
        """Wait for the transfer: ``LLM_SUCCESS`` if every destination succeeded, else the
        first failure code; ``LLM_TIMEOUT`` if still running after ``timeout_in_millis``."""
        if not await self._wait(timeout_in_millis):
            return Code.LLM_TIMEOUT
        for r in self._results:
            if r != Code.LLM_SUCCESS:
                return Code.LLM_FAILED if r is None else r
        return Code.LLM_SUCCESS

    async def get_results(self, timeout_in_millis: int | None = None) -> list[LLMStatusCode | None]:
        """Per-destination codes, in ``transfer_configs`` order (``LLM_TIMEOUT`` for those
        still running after the timeout; ``None`` for those cut short by ``cancel()``)."""
        finished = await self._wait(timeout_in_millis)
        if finished:
            return list(self._results)
        return [Code.LLM_TIMEOUT if r is None else r for r in self._results]

    def cancel(self) -> None:
        """Stop the transfer; in-flight sends are cancelled, the links stay usable."""
        self._task.cancel()

    def done(self) -> bool:
        """Whether the transfer finished (or was cancelled)."""
        return self._task.done()

    def __await__(self) -> Generator[Any, None, list[LLMStatusCode | None]]:
        return self.get_results().__await__()
