"""Where a layer-wise transfer overlapped with compute loses time: each layer's grant.

``PYTHONPATH=. python scripts/trace_layerwise.py`` (repository root): the overlap
scenario of ``aiokv bench layerwise`` (32 layers x K,V x 32 blocks of 64 KiB, pushed by
raw addresses to the spawned prompt peer over TCP), timed at each layer's
``TcpLink._writing`` (request posted → ``WRITE_GRANT`` → payload sent and confirmed):

* ``alone``: every layer released at once (the bench's transfer-alone figure);
* then three times ``together``: layer i released after i + 1 compute steps, each one
  layer's share of ``alone`` (the bench's overlap figure), with the medians of each
  layer's wait for its grant and of its stream (grant to end), and how late the sender
  asks the synchronizer for a layer (after it was ready: the sender is behind).

docs/benchmarks.md ("Why the overlap figure stays at 1.2–1.3") reads these figures.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import aiokv.transport.tcp._link as link_mod
from aiokv import LLMDataDist
from aiokv._bench import layerwise
from aiokv._bench._harness import KIB
from aiokv._bench._harness import PromptPeer
from aiokv._bench._harness import run_remote

LAYERS, COUNT, BLOCK = 32, 32, 64 * KIB
#: per write: (request posted, granted, over), perf_counter seconds
writes: list[tuple[float, float, float]] = []
#: per synchronizer call: seconds after the layer was ready that it returned
late: list[float] = []


def _wrap() -> None:
    writing = link_mod.TcpLink._writing

    async def traced(self: Any, op: Any, views: Any) -> None:
        posted = time.perf_counter()  # the request frame was posted just before
        await op.until_granted_or_over()
        granted = time.perf_counter()
        await writing(self, op, views)
        writes.append((posted, granted, time.perf_counter()))

    link_mod.TcpLink._writing = traced  # type: ignore[method-assign]


class _Late(layerwise._Compute):
    async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        ready = await super().synchronize_layer(layer_index, timeout_in_millis)
        due = self._start + (layer_index + 1) * self._step
        late.append(self._loop.time() - due)
        return ready


def _ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.2f} ms"


async def _main(peer: PromptPeer, decoder: LLMDataDist) -> None:
    cm = decoder.cache_manager
    src, cfgs, idx = await layerwise.overlap_setup(
        cm, peer, layers=LAYERS, block=BLOCK, count=COUNT
    )
    try:
        for _ in range(2):  # warm-up
            await layerwise._layerwise(cm, src, layerwise.ReleaseAll(), cfgs, idx, idx)
        writes.clear()
        t0 = time.perf_counter()
        await layerwise._layerwise(cm, src, layerwise.ReleaseAll(), cfgs, idx, idx)
        alone = time.perf_counter() - t0
        print(f"alone {alone * 1e3:.1f} ms; grant wait {_ms([g - p for p, g, _ in writes])}")
        for _ in range(3):
            writes.clear()
            late.clear()
            t0 = time.perf_counter()
            sync = _Late(alone / LAYERS)
            await layerwise._layerwise(cm, src, sync, cfgs, idx, idx)
            total = time.perf_counter() - t0
            print(
                f"together {total * 1e3:.1f} ms ({total / alone:.2f} x alone); grant wait "
                f"{_ms([g - p for p, g, _ in writes])}, stream {_ms([e - g for _, g, e in writes])}"
                f", synchronizer asked {_ms(late)} after the layer was ready"
            )
    finally:
        await cm.deallocate_blocks_cache(src)


if __name__ == "__main__":
    _wrap()
    run_remote(_main, pool_bytes=1 << 28)
