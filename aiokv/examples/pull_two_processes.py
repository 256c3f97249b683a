"""Pull KV blocks between two processes: a prefill process owns a blocks cache, a
decode process links to it over TCP and pulls some of its blocks.

Run: ``python -m aiokv.examples.pull_two_processes``. The prefill side is started as a
child process (``multiprocessing``, spawn); on two machines, run :func:`prefill` on one
with an address the other can reach and give :func:`main` that address.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import DataType
from aiokv import LLMClusterInfo
from aiokv import LLMConfig
from aiokv import LLMDataDist
from aiokv import LLMRole
from aiokv import LLMStatusCode

PREFILL, DECODE = 1, 2  # cluster ids
LAYERS, BLOCKS = 4, 32
DESC = CacheDesc(2 * LAYERS, [BLOCKS, 16, 4, 64], DataType.DT_FLOAT16)  # K and V per layer


def config() -> LLMConfig:
    """A 16 MiB device pool; ``device_type="auto"`` would pick an NPU or GPU when present."""
    return LLMConfig(
        device_type="cpu",
        enable_cache_manager=True,
        listen_ip_info="127.0.0.1:0",
        mem_pool_cfg='{"memory_size": 16777216, "page_shift": 16}',
        sync_kv_timeout=10_000,
    )


def content(index: int) -> torch.Tensor:
    """What the prefill writes into tensor ``index`` (both sides can compute it)."""
    g = torch.Generator().manual_seed(index)
    return torch.randn(DESC.shape, generator=g).to(torch.float16)


async def prefill(conn: Connection) -> None:
    """The prefill process: fill a blocks cache peers can pull by ``BlocksCacheKey(1)``,
    send the address it listens on, serve pulls until told to stop."""
    async with LLMDataDist(LLMRole.PROMPT, PREFILL, config()) as dd:
        cache = await dd.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(PREFILL))
        for i, t in enumerate(cache.tensors):  # the model's prefill would write these
            t.copy_(content(i))
        conn.send(dd.listen_address)
        await asyncio.to_thread(conn.recv)  # peers are served on the engine thread meanwhile


def _prefill_process(conn: Connection) -> None:
    asyncio.run(prefill(conn))


async def decode(address: tuple[str, int], say: Callable[..., Any] = print) -> bool:
    """The decode process: link to the prefill at ``address``, pull a request's blocks
    8..15 into blocks 0..7, check the bytes."""
    async with LLMDataDist(LLMRole.DECODER, DECODE, config()) as dd:
        cm = dd.cache_manager
        cache = await cm.allocate_blocks_cache(DESC)
        peer = LLMClusterInfo(
            remote_cluster_id=PREFILL, local_ip_info=[("127.0.0.1", 0)], remote_ip_info=[address]
        )
        code, _ = await dd.link_clusters([peer], timeout=10_000)
        if code != LLMStatusCode.LLM_SUCCESS:
            raise RuntimeError(f"link to {address} failed: {code}")
        src, dst = list(range(8, 16)), list(range(8))
        t0 = time.perf_counter()
        await cm.pull_blocks(BlocksCacheKey(PREFILL), cache, src, dst)
        dt = time.perf_counter() - t0
        moved = len(src) * cache.block_bytes * len(cache.tensors)
        say(
            f"pulled {len(src)} blocks x {len(cache.tensors)} tensors: "
            f"{moved / 2**20:.1f} MiB in {dt * 1e3:.1f} ms"
        )
        ok = all(torch.equal(t[:8], content(i)[8:16]) for i, t in enumerate(cache.tensors))
        say(f"decode holds the prefill's blocks: {ok}")
        await dd.unlink_clusters([peer], timeout=10_000)
        return ok


async def main(say: Callable[..., Any] = print) -> None:
    """Start the prefill process, decode from this one, stop the prefill."""
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_prefill_process, args=(there,), name="prefill")
    child.start()
    try:
        if not await asyncio.to_thread(here.poll, 60):
            raise RuntimeError("the prefill process did not start in 60 s")
        address = here.recv()
        say(f"prefill process {child.pid} listens on {address[0]}:{address[1]}")
        ok = await decode(address, say)
    finally:
        with contextlib.suppress(OSError):  # the prefill may have died already
            here.send("stop")
        await asyncio.to_thread(child.join, 30)
        if child.is_alive():
            child.kill()
    if not ok or child.exitcode != 0:
        raise RuntimeError(f"bytes identical: {ok}, prefill exit code {child.exitcode}")


if __name__ == "__main__":
    asyncio.run(main())
