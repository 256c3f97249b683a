"""A synchronous, multi-threaded engine on ``aiokv.sync``: worker threads pull KV blocks
for their requests at the same time, through one blocking ``LLMDataDist``.

Run: ``python examples/threaded_engine.py``. The prefill peer lives in this process and
is reached over loopback TCP; in production it is another process or machine.

What it shows:

* ``aiokv.sync`` is the blocking form of every operation, safe to call from many
  threads at once: the work runs on the instance's own engine thread, and each call
  blocks only its caller — no asyncio anywhere in this program;
* the engine's block manager is shared by the threads, so it takes a lock (a plain
  ``threading.Lock``: bookkeeping only, never held across a transfer);
* a failing call raises ``LLMException`` with a status code (here: a block index out
  of range), and the engine keeps serving.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

import aiokv.sync as aiokv_sync
from aiokv.sync import BlocksCacheKey
from aiokv.sync import CacheDesc
from aiokv.sync import DataType
from aiokv.sync import LLMClusterInfo
from aiokv.sync import LLMConfig
from aiokv.sync import LLMException
from aiokv.sync import LLMRole
from aiokv.sync import LLMStatusCode

PREFILL, DECODE = 1, 2
LAYERS, BLOCKS = 4, 128
DESC = CacheDesc(2 * LAYERS, [BLOCKS, 16, 4, 32], DataType.DT_FLOAT16)
THREADS, REQUESTS = 8, 48


def config() -> LLMConfig:
    """A 16 MiB pool on the CPU (``device_type="auto"`` picks an NPU or a GPU)."""
    return LLMConfig(
        device_type="cpu",
        enable_cache_manager=True,
        listen_ip_info="127.0.0.1:0",
        mem_pool_cfg='{"memory_size": 16777216, "page_shift": 16}',
        sync_kv_timeout=10_000,
    )


class BlockManager:
    """Free blocks shared by the worker threads (the lock guards bookkeeping only)."""

    def __init__(self, blocks: int) -> None:
        self._free = list(range(blocks))
        self._lock = threading.Lock()

    def take(self, n: int) -> list[int]:
        """``n`` free blocks (raises ``RuntimeError`` when there are fewer)."""
        with self._lock:
            if n > len(self._free):
                raise RuntimeError(f"{n} blocks wanted, {len(self._free)} free")
            taken, self._free = self._free[-n:], self._free[:-n]
            return taken

    def give_back(self, blocks: list[int]) -> None:
        """Return blocks taken by :meth:`take`."""
        with self._lock:
            self._free.extend(blocks)

    @property
    def free(self) -> int:
        """Blocks not held."""
        with self._lock:
            return len(self._free)


def main(say: Callable[..., Any] = print) -> None:
    """Serve ``REQUESTS`` pulls from ``THREADS`` threads; one request names a block the
    prefill does not have and fails alone."""
    prefill = aiokv_sync.LLMDataDist(LLMRole.PROMPT, PREFILL)
    prefill.init(config())
    decode = aiokv_sync.LLMDataDist(LLMRole.DECODER, DECODE)
    decode.init(config())
    # aiokv.sync generates the managers' blocking methods: typed as Any for mypy
    p_cm: Any = prefill.cache_manager
    d_cm: Any = decode.cache_manager
    try:
        src = p_cm.allocate_blocks_cache(DESC, BlocksCacheKey(PREFILL))
        for i, t in enumerate(src.tensors):  # block b of tensor i holds i * BLOCKS + b
            t.copy_(torch.arange(BLOCKS).view(-1, 1, 1, 1).expand_as(t) + i * BLOCKS)
        assert prefill.listen_address is not None
        peer = LLMClusterInfo(
            remote_cluster_id=PREFILL,
            remote_ip_info=[prefill.listen_address],
            local_ip_info=[("127.0.0.1", 0)],  # this side's address (llm_datadist requires one)
        )
        code, _ = decode.link_clusters([peer], timeout=10_000)
        if code != LLMStatusCode.LLM_SUCCESS:
            raise RuntimeError(f"link_clusters: {code}")
        dst = d_cm.allocate_blocks_cache(DESC)
        blocks = BlockManager(BLOCKS)
        threads_used: set[str] = set()

        def serve(rid: int) -> str:
            """One request on a worker thread: take blocks, pull, check, give back."""
            threads_used.add(threading.current_thread().name)
            wanted = [(rid * 5 + k) % BLOCKS for k in range(4)]
            if rid == 13:
                wanted[-1] = BLOCKS + 1  # a block the prefill does not have
            mine = blocks.take(len(wanted))
            try:
                d_cm.pull_blocks(BlocksCacheKey(PREFILL), dst, wanted, mine)
                for s, d in zip(wanted, mine, strict=True):
                    if int(dst.tensors[1][d, 0, 0, 0]) != BLOCKS + s:
                        raise RuntimeError(f"request {rid}: wrong bytes in block {d}")
                return "ok"
            except LLMException as exc:
                return exc.status_code.name
            finally:
                blocks.give_back(mine)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(THREADS, thread_name_prefix="engine") as pool:
            results = list(pool.map(serve, range(REQUESTS)))
        took = time.perf_counter() - t0
        say(
            f"{REQUESTS} requests on {len(threads_used)} threads in {took * 1e3:.0f} ms: "
            f"{results.count('ok')} ok"
        )
        say(f"request 13 failed alone: {results[13]}")
        say(f"every block back: {blocks.free == BLOCKS}")
        if results.count("ok") != REQUESTS - 1 or blocks.free != BLOCKS:
            raise RuntimeError(f"unexpected results: {results}")
        decode.unlink_clusters([peer], timeout=10_000)
    finally:
        decode.finalize()
        prefill.finalize()


if __name__ == "__main__":
    main()
